"""What the artifact store costs as it grows: bytes per artifact, record, query and CLI lineage times.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/store.py [--n 3000]

Records `--n` artifacts as a long run of stages would (each the parent of the next, distinct metrics, one shared
dependency lock: this repository's ``requirements.lock`` via `collect_deps_lock`, as every trial of a sweep on one
machine records the same), then measures the file's bytes per artifact (after a WAL checkpoint), the mean time of
one ``record`` (each its own transaction and fsync), ``query()`` of all of them, and ``pipekit-train artifacts
lineage`` of the last one (in-process: the CLI's parsing, the recursive query, the digest checks and the printing;
the lineage of a chain stops at 1000 generations). Prints one JSON line. Times depend on the disk and the load.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sqlite3
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="artifacts to record (default 3000)")
    parser.add_argument("--lock-dir", default=None, help="where to look for the lock file (default: this repository)")
    args = parser.parse_args()

    from pipekit_train.cli._artifacts import main as artifacts_main
    from pipekit_train.provenance import ArtifactStore, TrainingArtifact
    from pipekit_train.provenance._artifact import collect_deps_lock

    lock = collect_deps_lock(Path(args.lock_dir or Path(__file__).resolve().parent.parent))
    yaml = "pipekit: 1\ntype: TrainingLoop\nmax_steps: 300\nbatch_size: 32\n"
    with tempfile.TemporaryDirectory() as tmp:
        store = ArtifactStore(Path(tmp) / "artifacts.sqlite")
        len(store)  # create the schema outside the timed records
        record_s = 0.0
        parent: tuple[str, ...] = ()
        for i in range(args.n):
            artifact = TrainingArtifact(
                artifact_id=f"a{i:07d}",
                run_id="long-run",
                stage=f"stage{i}",
                parent_ids=parent,
                training_pipeline_yaml=yaml,
                dataset_hash="sha256:" + "d1" * 32,
                backend="equinox",
                deps_lock=lock,
                started_at=f"2026-05-01T12:00:00.{i:06d}+00:00",
                final_metrics={"train/loss": 1.0 / (i + 1), "validate/loss": 1.0 / (i + 2)},
                seed=i,
            )
            t0 = time.perf_counter()
            store.record(artifact)
            record_s += time.perf_counter() - t0
            parent = (artifact.artifact_id,)
        with sqlite3.connect(store.path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = store.path.stat().st_size
        t0 = time.perf_counter()
        found = store.query()
        query_s = time.perf_counter() - t0
        assert len(found) == args.n
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = artifacts_main(["artifacts", "lineage", parent[0], "--store", str(store.path)])
        lineage_s = time.perf_counter() - t0
        assert code == 0
    print(
        json.dumps(
            {
                "artifacts": args.n,
                "lock_json_bytes": len(json.dumps(lock, sort_keys=True)),
                "store_bytes": size,
                "bytes_per_artifact": round(size / args.n),
                "record_ms": round(1000 * record_s / args.n, 3),
                "query_all_s": round(query_s, 3),
                "cli_lineage_s": round(lineage_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
