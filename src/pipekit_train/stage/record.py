"""Recording a trained (or stopped) stage: its final weights in the run's registry, its `TrainingArtifact`,
``final.json`` (which marks it finished) and the artifact store, then the carry-state the next stage starts from.
The stage flow's last hop (``design/overview.md``)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import pipekit

from .._jsonio import DamagedFileError, read_json, write_json
from ..engine._protocol import NonFiniteWeightsError, first_nonfinite
from ..scale._distributed import barrier, is_primary
from .carry import handoff
from .loop import RunInfo, TrainerCarryState, TrainingLoop, TrainingResult
from .settings import RunSettings

__all__ = [
    "FINAL_FILE",
    "TrainingInterrupted",
    "absolute_model_uri",
    "drop_deps_lock",
    "finish",
    "prefetch_deps_lock",
    "read_final",
    "record_in_store",
    "write_final",
    "write_run_meta",
]


class TrainingInterrupted(KeyboardInterrupt):
    """A stage stopped on SIGINT/SIGTERM after writing a committed checkpoint; later stages did not run.

    Attributes:
        reason: ``"SIGINT"`` or ``"SIGTERM"``.
        artifact: The stopped stage's artifact (status ``stopped: <reason>``).
        signum: The signal number (the CLI exits with ``128 + signum``).
    """

    def __init__(self, reason: str, artifact: Any, signum: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.artifact = artifact
        self.signum = signum


FINAL_FILE = "final.json"


def finish(
    loop: TrainingLoop, result: Any, info: RunInfo, settings: RunSettings, hooks: Any
) -> tuple[TrainingResult, TrainerCarryState]:
    """Record a trained (or stopped) stage: the final weights in the run's registry, the artifact, ``final.json``,
    the store; the carry-state the next stage starts from."""
    run_id, run_dir, stage_index = info.run_id, info.run_dir, info.stage_index
    # A warm start (`init_from`) names the stage that wrote those weights as another parent.
    info = replace(info, parent_ids=tuple(dict.fromkeys(info.parent_ids + hooks.parent_ids)))
    interrupted = hooks.interrupted
    if loop.stop_on_nonfinite:
        bad = first_nonfinite(result.model.weights())
        if bad is not None:
            raise NonFiniteWeightsError(
                f"stage {info.stage!r}: the final weights at {bad} are not finite (step {result.step}); they were not "
                "registered and the stage is not marked finished. Lower the learning rate or set grad_clip_norm"
            )
    model_uri = None if interrupted is not None or not is_primary() else _keep_final_model(info, result)
    artifact = _build_artifact(loop, result, info, settings, model_uri, forced=hooks.forced, fork=hooks.fork)
    if interrupted is not None:
        record_in_store(artifact, settings, info)
        raise TrainingInterrupted(interrupted[0], artifact, interrupted[1])
    # final.json marks the stage finished: written before the store insert, so a crash between the two leaves one
    # artifact, which a resume finds in artifact.json and records (it never trains or records the stage again).
    if model_uri is not None:  # process 0 (or the only process) writes what the run keeps
        write_final(info, result.step, result.epoch, artifact.artifact_id, model_uri)
    record_in_store(artifact, settings, info)
    barrier("stage-end")  # several processes: none goes on before process 0 has recorded the stage
    pending = hooks.pending_signal
    if pending is not None:  # a signal came as the stage ended: it is recorded, and the pipeline stops here
        raise TrainingInterrupted(pending[0], artifact, pending[1])
    new_state = TrainerCarryState(
        model=result.model,
        opt_state=result.opt_state,
        step=result.step,
        epoch=result.epoch,
        metrics=result.metrics,
        rng=result.rng,
        run_id=run_id,
        run_dir=run_dir,
        stage_index=stage_index + 1,
        artifact_id=artifact.artifact_id,
        **handoff(loop, info.stage_dir),
    )
    return TrainingResult(result.model, artifact), new_state


def _keep_final_model(info: RunInfo, result: Any) -> str:
    """Store the stage's final weights in the run (content-addressed, no pickle); return a loadable URI."""
    from ..provenance._model_registry import LocalModelRegistry

    registry = LocalModelRegistry(os.path.abspath(os.path.join(info.run_dir, "models")))
    return registry.locator(registry.put(result.model))


def absolute_model_uri(model_uri: str, run_dir: str) -> str:
    """A ``final.json`` URI whose registry root is relative to the run directory, made loadable from here."""
    from ..provenance._model_registry import parse_model_uri

    digest, query = parse_model_uri(model_uri)
    root = query.get("root")
    if root is None or os.path.isabs(root):
        return model_uri
    return f"pipekit-model:sha256:{digest}?root=" + quote(os.path.abspath(os.path.join(run_dir, root)), safe="/")


def write_final(info: RunInfo, step: int, epoch: int, artifact_id: str, model_uri: str) -> None:
    """Mark the stage finished, so a resume of this run skips it and takes these weights.

    The registry root is written relative to the run directory, so a moved run directory still resumes.
    """
    from ..provenance._model_registry import parse_model_uri

    digest, query = parse_model_uri(model_uri)
    root = query.get("root")
    if root is not None and os.path.isabs(root):
        relative = os.path.relpath(root, os.path.abspath(info.run_dir))
        model_uri = f"pipekit-model:sha256:{digest}?root=" + quote(relative, safe="/")
    final: dict[str, Any] = {
        "model_uri": model_uri,
        "step": step,
        "epoch": epoch,
        "artifact_id": artifact_id,
    }
    final["digest"] = _final_digest(final)
    write_json(os.path.join(info.stage_dir, FINAL_FILE), final)


_FINAL_FIELDS = ("model_uri", "step", "epoch", "artifact_id")


def _final_digest(fields: dict[str, Any]) -> str:
    """``"sha256:<hex>"`` of `final.json`'s fields (canonical JSON): any changed byte of a field is noticed."""
    canonical = json.dumps({k: fields.get(k) for k in _FINAL_FIELDS}, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def read_final(path: str, stage: str, redo: str) -> dict[str, Any]:
    """`final.json`'s fields, each checked: every damaged field is a `DamagedFileError` naming the file.

    The digest pins every field (a flipped digit of the model's hash or of the step is still valid JSON); a file
    written before the digest existed has its fields checked one by one.
    """
    from ..provenance._model_registry import ModelRegistryError, parse_model_uri

    what = f"stage {stage!r}'s record of its final weights"
    final = read_json(path, what=what, required=("model_uri", "step", "artifact_id"), remedy=redo)

    def damaged(reason: str) -> DamagedFileError:
        return DamagedFileError(f"{path}: {what} is damaged ({reason}); {redo}", path=path)

    unknown = sorted(set(final) - {*_FINAL_FIELDS, "digest"})
    if unknown:
        raise damaged(f"unknown field {unknown[0]!r}")
    if "digest" in final and final["digest"] != _final_digest(final):
        raise damaged("its fields do not match their digest")
    for key in ("step", "epoch"):
        value = final.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise damaged(f"{key} is {value!r}, not a step count")
    if not isinstance(final["artifact_id"], str) or not final["artifact_id"]:
        raise damaged(f"artifact_id is {final['artifact_id']!r}")
    try:
        parse_model_uri(final["model_uri"])
    except ModelRegistryError:
        raise damaged(f"model_uri is {final['model_uri']!r}, not a pipekit-model:sha256:<64 hex digits> URI") from None
    return final


#: Stage directory -> the future of its `collect_deps_lock()`, started when the stage starts (`_prefetch_deps_lock`).
_DEPS_LOCKS: dict[str, Any] = {}


def prefetch_deps_lock(info: RunInfo) -> None:
    """Start the artifact's dependency lock (a scan of every installed distribution's metadata when no lock file is
    found: about a second) on a background thread, so that it overlaps with compiling and training instead of
    adding to the end of the stage. `_deps_lock` joins it when the artifact is built."""
    import threading
    from concurrent.futures import Future
    from pathlib import Path

    from ..provenance._artifact import collect_deps_lock

    future: Future[dict[str, Any]] = Future()
    cwd = Path.cwd()  # what a call at the end would have looked under: the working directory now

    def collect() -> None:
        try:
            future.set_result(collect_deps_lock(cwd))
        except BaseException as e:  # raised again where the artifact is built, as without the thread
            future.set_exception(e)

    _DEPS_LOCKS[info.stage_dir] = future
    threading.Thread(target=collect, name="pipekit-deps-lock", daemon=True).start()


def drop_deps_lock(info: RunInfo) -> None:
    """Forget the stage's prefetched lock (a stage that failed or was refused before its artifact)."""
    _DEPS_LOCKS.pop(info.stage_dir, None)


def _deps_lock(info: RunInfo, collect: Any) -> dict[str, Any]:
    """The stage's prefetched dependency lock, or `collect()` now when none was started."""
    future = _DEPS_LOCKS.pop(info.stage_dir, None)
    return dict(future.result()) if future is not None else dict(collect())


def write_run_meta(run_dir: str, run_id: str, settings: RunSettings) -> None:
    path = os.path.join(run_dir, "run.json")
    if os.path.exists(path):
        return
    meta: dict[str, Any] = {"run_id": run_id}
    if settings.pipeline is not None:
        meta["pipeline_yaml"] = pipekit.dumps(settings.pipeline, strict=False)
    write_json(path, meta)


def _build_artifact(
    loop: TrainingLoop,
    result: Any,
    info: RunInfo,
    settings: RunSettings,
    model_uri: str | None,
    forced: str | None = None,
    fork: dict[str, Any] | None = None,
) -> Any:
    from ..provenance._artifact import TrainingArtifact, collect_deps_lock, git_state, new_artifact_id
    from .presets import preset_record

    yaml_text = pipekit.dumps(loop, strict=False)
    fields = dict(result.artifact_fields)
    model_hash = fields.pop("trained_model_hash", None) or result.model.weights_hash()
    artifact = TrainingArtifact(
        artifact_id=new_artifact_id(),
        run_id=info.run_id,
        stage=info.stage,
        parent_ids=info.parent_ids,
        training_pipeline_yaml=yaml_text,
        pipeline_hash="sha256:" + hashlib.sha256(yaml_text.encode()).hexdigest(),
        dataset_hash=loop.dataset.content_hash(),
        backend=str(loop.backend),
        backend_info=_with_topology(loop, result.backend_info),
        deps_lock=_deps_lock(info, collect_deps_lock),
        tracker_run_id=fields.pop("tracker_run_id", None),
        model_registry_uri=fields.pop("model_registry_uri", None) or model_uri,
        trained_model_hash=model_hash,
        started_at=result.started_at,
        ended_at=result.ended_at,
        final_metrics=result.metrics,
        seed=loop.seed,
        git=git_state(os.getcwd()),
        status=result.status,
        run_dir=info.stage_dir,
        imports=settings.imports,
        forced_resume=forced,
        model_summary=fields.pop("model_summary", None),
        data_statistics=fields.pop("data_statistics", None),
        source_statistics=fields.pop("source_statistics", None),
        preset=preset_record(loop),
        code=settings.code.record if settings.code is not None else None,
        fork=fork,
        restored=result.restored,
        user=fields or None,  # every other key a callback set: kept, never dropped
        sweep=settings.sweep,
    )
    # The stage's own record first: a store that fails later loses nothing (`artifacts import` records it).
    if is_primary():
        write_json(os.path.join(info.stage_dir, "artifact.json"), artifact.to_dict())
    return artifact


def _with_topology(loop: TrainingLoop, backend_info: dict[str, Any]) -> dict[str, Any]:
    """`backend_info` naming the topology the stage trained on (``num_devices``, ``num_processes``) for every
    backend: an adapter without a mesh trains on one device of one process. ``devices`` lists the devices that
    trained (``available_devices`` every one JAX saw, when they differ)."""
    from ..scale._mesh import describe, used_devices

    topology = describe(loop)
    out = {**backend_info, **{k: v for k, v in topology.items() if k not in backend_info}}
    used = used_devices(loop)
    listed = out.get("devices")
    if used is not None and isinstance(listed, list) and listed != used and set(used) <= set(listed):
        # An adapter lists every device JAX sees; the artifact says which ones trained (mesh: {devices: 1}).
        # A backend that lists devices of its own framework (torch's "cpu") keeps its list.
        out["devices"], out["available_devices"] = used, listed
    return out


def record_in_store(artifact: Any, settings: RunSettings, info: RunInfo) -> None:
    """Add the stage's artifact to the store (process 0 of several); a failure names the store and how to record
    it afterwards."""
    if settings.store is False or not is_primary():
        return
    import sqlite3

    from ..provenance._store import ArtifactStore, ArtifactStoreError

    store = ArtifactStore(settings.store or None)
    try:
        with store:
            store.record(artifact, blobs=settings.code.blobs if settings.code is not None else None)
    except (sqlite3.Error, OSError, ArtifactStoreError) as e:
        raise ArtifactStoreError(
            f"stage {info.stage!r} finished (its weights, final.json and artifact.json are in {info.stage_dir}) but "
            f"the artifact store {store.path} could not record it ({e}); record it afterwards with "
            f"pipekit-train artifacts import {info.run_dir} --store {store.path}"
        ) from None
