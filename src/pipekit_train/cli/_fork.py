"""``pipekit-train reproduce ID``: train the stages that led to an artifact again, oldest first, and say whether
the weights match; for a fork (`checkpoint._fork`), the parent first, then the fork from the parent's checkpoint at
the recorded step, bitwise.

A fork's artifact names its parent stage's artifact and the step (`TrainingArtifact.fork`). Reproducing it trains
the parent's recorded pipeline again (itself a fork, recursively) into its own run directory (``RUN_DIR.parent``
with ``--run-dir RUN_DIR``, else a new ``runs/<run id>``), then the fork's stages with ``--fork`` pointing at the
new parent's checkpoint of that step. Both are recorded in the store, the reproduced fork as a fork of the
reproduced parent.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from pipekit_train.cli._common import EXIT_OK, CommandError

__all__ = ["reproduce_recorded"]


def _retrain(store: Any, artifact_id: str, run_dir: str | None, settings: dict[str, Any]) -> Any:
    """Train the stages leading to `artifact_id` again (the parent of a fork first); the last stage's artifact."""
    from pipekit import Sequential
    from pipekit_train.engine._fork import resolve_fork
    from pipekit_train.provenance._reproduce import check_data_unchanged, pipeline_of
    from pipekit_train.stage.driver import run_pipeline
    from pipekit_train.stage.settings import RunSettings

    pipeline, chain = pipeline_of(artifact_id, store)
    forks = [i for i, a in enumerate(chain) if a.fork]
    fork = None
    if forks:
        i = forks[-1]
        edge = chain[i].fork
        if not edge.get("parent_artifact"):
            raise CommandError(
                f"artifact {chain[i].artifact_id[:12]} was forked from {edge['run_dir']}/{edge['stage']}@"
                f"{edge['step']} before that stage had finished, so no recorded pipeline rebuilds its parent; it "
                "cannot be reproduced"
            )
        parent_dir = f"{run_dir}.parent" if run_dir else None
        print(f"reproducing the parent {edge['parent_artifact'][:12]} of fork {chain[i].artifact_id[:12]} first")
        parent = _retrain(store, edge["parent_artifact"], parent_dir, settings)
        fork = resolve_fork(f"{os.path.dirname(parent.run_dir)}/{parent.stage}@{edge['step']}", None)
        pipeline, chain = Sequential(list(pipeline.stages[i:])), chain[i:]
    check_data_unchanged(pipeline, chain)
    print(f"reproducing {chain[-1].artifact_id[:12]}: {len(chain)} stage(s): {', '.join(a.stage for a in chain)}")
    from pipekit_train._lock import run_dir_lock

    # One writer per run directory for the whole pipeline, as for `run` (each stage also takes it).
    lock = run_dir_lock(run_dir) if run_dir and os.path.exists(run_dir) else contextlib.nullcontext()
    with lock:
        _, artifact = run_pipeline(pipeline, RunSettings(run_dir=run_dir, pipeline=pipeline, fork=fork, **settings))
    return artifact


def reproduce_recorded(args: argparse.Namespace, imports: Any, code: Any) -> int:
    """``reproduce ID`` (see the module docstring): `imports` are the re-imported modules' records, `code` the
    `CodeSnapshot` this run records."""
    from pipekit_train.cli._main import _print_summary
    from pipekit_train.provenance._store import ArtifactStore

    with ArtifactStore(args.store) as store:
        target = store.get(args.artifact)
        artifact = _retrain(
            store, target.artifact_id, args.run_dir, {"store": args.store, "imports": imports, "code": code}
        )
    _print_summary(artifact, args.store)
    same = artifact.trained_model_hash == target.trained_model_hash
    print(f"trained weights {'match' if same else 'differ from'} the recorded ones ({artifact.trained_model_hash})")
    return EXIT_OK
