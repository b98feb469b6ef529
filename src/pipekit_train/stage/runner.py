"""Running a `TrainingLoop` stage, end to end: the stage flow of ``design/overview.md``.

`run_stage` names the run and the stage, skips a stage that already finished (``resume: auto``), pre-flights it
once (`stage.preflight.check`, or the plan ``pipekit-train run`` made before any stage trained), claims the run
directory, decides where the model starts (`stage.start.starting_model`), hands the stage to the backend
(`Backend.start`, the one call into the adapter), lets the `Engine` train it, and `finish` records it: the final
weights in the run's registry, the artifact, ``final.json``, the store and the next stage's carry-state.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import quote

import pipekit

from .._jsonio import DamagedFileError, read_json, write_json
from .._lock import DirectoryNotWritableError, check_writable, run_dir_lock
from .._signals import note_run_dir, phase
from ..engine._protocol import NonFiniteWeightsError, first_nonfinite
from ..scale._distributed import allgather, barrier, initialize_distributed, is_primary, primary_holds
from .carry import handoff, take_carried
from .loop import RunInfo, TrainerCarryState, TrainingLoop, TrainingResult
from .preflight import StagePlan, check


@dataclass(frozen=True)
class RunSettings:
    """Where a pipeline run writes, set for a block of code with `run_settings`.

    Attributes:
        run_dir: The run's directory; default ``runs/<run_id>`` under the working directory.
        store: Path of the artifact store (SQLite); ``None`` means `ArtifactStore`'s default; ``False``: record
            nothing.
        resume: ``"never"`` starts fresh; ``"auto"`` continues the run found in `run_dir` exactly.
        force_resume: With ``resume="auto"``, continue a checkpoint written under another configuration (warned
            about and recorded in the artifact) instead of refusing.
        pipeline: The whole pipeline being run (recorded with each stage's artifact for `reproduce`).
        imports: The user modules imported before the pipeline was read (``--import``, ``$PIPEKIT_IMPORT``), each
            ``{"module": name, "file": path or None, "sha256": hex digest of the file or None}``; recorded in
            every stage's artifact (`TrainingArtifact.imports`).
        plans: `StagePlan`s of stages already pre-flighted (`plan_pipeline`): such a stage is not checked again
            and starts from the model its plan built.
        code: The `provenance._code.CodeSnapshot` taken when the command started (patch, imported modules,
            pipeline file): its record goes in every stage's artifact (`TrainingArtifact.code`), its blobs into the
            store. ``None``: no code is stored.
        fork: A `checkpoint._fork.ForkPoint` (``--fork``): the run's first stage starts from that checkpoint of
            another run, and its artifact records the edge (`TrainingArtifact.fork`).
        sweep: The sweep trial this run is, ``{"name", "trial", "params", "key"}`` (`pipekit_train.sweep`);
            recorded in every stage's artifact (`TrainingArtifact.sweep`).
        extension: The finished stage the stage being run continues (`stage.extension.Extension`, set by
            `stage.extension.extend`): it starts from that stage's final checkpoint and records it in its artifact.
    """

    run_dir: str | None = None
    store: str | Literal[False] | None = None
    resume: Literal["never", "auto"] = "never"
    force_resume: bool = False
    pipeline: Any = None
    imports: tuple[dict[str, Any], ...] = ()
    plans: tuple[Any, ...] = ()
    code: Any = None
    fork: Any = None
    sweep: dict[str, Any] | None = None
    extension: Any = None


_DEFAULT_SETTINGS = RunSettings()
_SETTINGS: contextvars.ContextVar[RunSettings] = contextvars.ContextVar(
    "pipekit_train_run",
    default=_DEFAULT_SETTINGS,  # a frozen dataclass: safe to share
)


@contextlib.contextmanager
def run_settings(**kwargs: Any) -> Iterator[RunSettings]:
    """Set where runs inside the block write: ``with run_settings(run_dir="runs/a", store=False): op.run()``."""
    settings = replace(_SETTINGS.get(), **kwargs)
    token = _SETTINGS.set(settings)
    try:
        yield settings
    finally:
        _SETTINGS.reset(token)


def current_settings() -> RunSettings:
    return _SETTINGS.get()


def _run_identity(settings: RunSettings, state: TrainerCarryState | None) -> tuple[str, str, int]:
    """(run id, run dir, stage index): from the previous stage, from the run directory, or new."""
    from ..provenance._artifact import new_run_id

    if state is not None and state.run_id is not None:
        return state.run_id, state.run_dir or os.path.join("runs", state.run_id), state.stage_index
    run_dir = settings.run_dir
    existing = existing_run(run_dir, settings.resume)
    if existing is not None:
        return existing, str(run_dir), 0
    run_id = new_run_id()
    return run_id, run_dir or os.path.join("runs", run_id), 0


def existing_run(run_dir: str | None, resume: str) -> str | None:
    """The id of the run `run_dir` already holds (``None``: none); refused unless `resume` is ``"auto"``.

    Needs no JAX: ``pipekit-train run`` asks before pre-flight, so a reused directory is refused at once.
    """
    from pipekit import ConfigError

    meta_path = os.path.join(run_dir, "run.json") if run_dir else None
    if not meta_path or not os.path.exists(meta_path):
        return None
    existing = read_json(
        meta_path,
        what="the run's metadata",
        required=("run_id",),
        remedy="start a new run in another directory, warm-starting from its checkpoints with init_from",
    )
    if resume != "auto":
        raise ConfigError(
            f"run directory {run_dir} already holds run {existing.get('run_id')!r}; continue it with "
            "resume='auto' (`--resume auto`) or choose another run directory"
        )
    return str(existing["run_id"])


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


def _finished_stage(info: RunInfo, loop: TrainingLoop) -> tuple[TrainingResult, TrainerCarryState] | None:
    """A stage that already finished in this run directory: its model and artifact, without training again."""
    from ..provenance._artifact import TrainingArtifact
    from .recorded import take_back

    path = os.path.join(info.stage_dir, FINAL_FILE)
    redo = f"delete {info.stage_dir} to train stage {info.stage!r} again"
    exists, damaged = os.path.exists(path), None
    if exists:
        try:
            final = _read_final(path, info.stage, redo)
        except DamagedFileError as e:
            damaged = e
    barrier("final-read")  # several processes: each has read final.json before process 0 may restore it
    # A lost final.json (deleted or damaged) of a stage whose artifact is recorded: restored from that artifact, or
    # refused; never trained and recorded a second time.
    if not exists or damaged is not None:
        if not take_back(info, loop, damaged):
            return None
        final = _read_final(path, info.stage, redo)
    record = read_json(
        os.path.join(info.stage_dir, "artifact.json"),
        what=f"stage {info.stage!r}'s artifact",
        required=("artifact_id",),
        remedy=redo,
    )
    try:
        artifact = TrainingArtifact.from_dict(record)
    except (KeyError, TypeError, ValueError) as e:
        raise DamagedFileError(
            f"{os.path.join(info.stage_dir, 'artifact.json')}: stage {info.stage!r}'s artifact is damaged ({e}); "
            f"{redo}",
            path=os.path.join(info.stage_dir, "artifact.json"),
        ) from None
    if final["artifact_id"] != artifact.artifact_id:
        raise DamagedFileError(
            f"{path}: stage {info.stage!r}'s record of its final weights names artifact {final['artifact_id']!r} "
            f"but {os.path.join(info.stage_dir, 'artifact.json')} is artifact {artifact.artifact_id!r}; {redo}",
            path=path,
        )
    from ..provenance._model_registry import load_model

    model = load_model(_absolute(final["model_uri"], info.run_dir))
    settings = current_settings()
    changed = model != loop.model_op or artifact.training_pipeline_yaml != pipekit.dumps(loop, strict=False)
    if changed and _changed_since_finished(info, loop, artifact, int(final["step"]), settings):
        return None  # resume its last checkpoint, whose fingerprint refuses a changed configuration
    _record_in_store(artifact, settings, info)  # a no-op when it is there; the crash window after final.json
    state = TrainerCarryState(
        model=model,
        step=int(final["step"]),
        epoch=int(final.get("epoch", 0)),
        metrics=artifact.final_metrics,
        run_id=info.run_id,
        run_dir=info.run_dir,
        stage_index=info.stage_index + 1,
        artifact_id=artifact.artifact_id,
        **handoff(loop, info.stage_dir),
    )
    return TrainingResult(model, artifact), state


def _changed_since_finished(info: RunInfo, loop: TrainingLoop, artifact: Any, step: int, settings: RunSettings) -> bool:
    """A finished stage whose YAML changed since: ``True`` to run it, which resumes its last checkpoint (and that
    checkpoint's fingerprint refuses a changed configuration with its diff, or ``--force-resume`` continues it).
    Without a checkpoint to resume, ``False`` (take it as it is) when nothing that changes its result changed (the
    same fingerprint), else refused with the fingerprint's diff: it is never trained again from scratch."""
    from ..checkpoint._errors import CheckpointMismatchError
    from ..engine._hooks import _diff, fingerprint

    directory = loop.checkpoint_directory(info.stage_dir)
    if loop.checkpoint_settings is not None and os.path.isdir(directory) and any(os.scandir(directory)):
        return True
    try:
        then = pipekit.loads(artifact.training_pipeline_yaml)
        saved, now = {**fingerprint(then), "dataset_hash": artifact.dataset_hash}, fingerprint(loop)
        diff = _diff(saved, now, then="finished stage") if saved != now else ""
    except pipekit.PipekitError:  # its file names a type not registered now: compare the files themselves
        import difflib

        old, new = artifact.training_pipeline_yaml.splitlines(), pipekit.dumps(loop, strict=False).splitlines()
        diff = "\n".join(difflib.unified_diff(old, new, "finished stage", "this run", lineterm="", n=1))
    if not diff:
        return False
    raise CheckpointMismatchError(
        f"refusing to resume stage {info.stage!r}: it finished at step {step} in {info.stage_dir} under another "
        f"configuration and has no checkpoint to continue from:\n{diff}\nResume with the original configuration, "
        f"delete {info.stage_dir} to train the stage again, or start a new run in another --run-dir"
    )


def _keep_final_model(info: RunInfo, result: Any) -> str:
    """Store the stage's final weights in the run (content-addressed, no pickle); return a loadable URI."""
    from ..provenance._model_registry import LocalModelRegistry

    registry = LocalModelRegistry(os.path.abspath(os.path.join(info.run_dir, "models")))
    return registry.locator(registry.put(result.model))


def _absolute(model_uri: str, run_dir: str) -> str:
    """A ``final.json`` URI whose registry root is relative to the run directory, made loadable from here."""
    from ..provenance._model_registry import parse_model_uri

    digest, query = parse_model_uri(model_uri)
    root = query.get("root")
    if root is None or os.path.isabs(root):
        return model_uri
    return f"pipekit-model:sha256:{digest}?root=" + quote(os.path.abspath(os.path.join(run_dir, root)), safe="/")


def _write_final(info: RunInfo, step: int, epoch: int, artifact_id: str, model_uri: str) -> None:
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


def _read_final(path: str, stage: str, redo: str) -> dict[str, Any]:
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


def run_stage(loop: TrainingLoop, state: TrainerCarryState | None) -> tuple[TrainingResult, TrainerCarryState]:
    """Train one stage. `state` is what the previous stage of a `Sequential` returned (or ``None``)."""
    initialize_distributed()  # a multi-process environment ($PIPEKIT_NUM_PROCESSES, ...): connect once, first
    settings = current_settings()
    if loop.resume == "auto" and settings.resume != "auto":
        settings = replace(settings, resume="auto")
    # Several processes: process 0 names the run (or finds it in the run directory) and tells the others.
    identity = _run_identity(settings, state) if is_primary() else None
    run_id, run_dir, stage_index = allgather("run-identity", identity)[0]
    stage = loop.name or f"stage{stage_index}"
    parents: tuple[str, ...] = ()
    if state is not None and state.artifact_id:
        parents = (state.artifact_id,)
    info = RunInfo(
        run_id=run_id,
        run_dir=run_dir,
        stage=stage,
        stage_index=stage_index,
        parent_ids=parents,
        stage_dir=os.path.join(run_dir, stage),
    )
    if settings.resume == "auto":
        done = _finished_stage(info, loop)
        if done is not None:
            return done
    # Everything that can be checked before training is checked before the run directory is created or claimed.
    plan = next((p for p in settings.plans if p.loop is loop and p.stage == info.stage), None)
    if plan is None:
        if settings.resume == "auto":  # another device count that cannot continue the checkpoint: said as such
            from ..checkpoint._elastic import check_resume_topology

            check_resume_topology(loop, info.stage_dir, info.stage)
        plan = check(loop, state, info.stage)
    _check_store(settings)
    _check_targets(loop, info)
    if is_primary():
        note_run_dir(run_dir)  # a signal before training removes it if this process began it and kept nothing
    # One writer per run directory: a second run is refused, naming the one that holds it. Several processes of one
    # run (jax.distributed): process 0 holds the lock, the others wait until it does (or fail with its refusal).
    with primary_holds("run-dir", lambda: run_dir_lock(run_dir)):
        return _run_locked(plan, state, info, settings)


def _run_locked(
    plan: StagePlan, state: TrainerCarryState | None, info: RunInfo, settings: RunSettings
) -> tuple[TrainingResult, TrainerCarryState]:
    loop = plan.loop
    os.makedirs(info.stage_dir, exist_ok=True)
    if is_primary():
        _write_run_meta(info.run_dir, info.run_id, settings)
    from ..engine._hooks import make_hooks
    from .start import starting_model

    hooks = make_hooks(loop, info, settings)
    # A stage recorded as finished that runs again (its configuration changed) continues its last checkpoint as the
    # new configuration says, even past a callback's stop; only a stage stopped but never recorded ends there again.
    hooks.keep_callback_stop = not os.path.exists(os.path.join(info.stage_dir, FINAL_FILE))
    if is_primary():
        _prefetch_deps_lock(info)
    try:
        # The backend and the engine get the data with `Standardize` fitted on the training split; what the stage
        # records (its YAML, the dataset hash, the resume fingerprint) is the configuration as written.
        fitted, statistics = fit_data(loop)
        model = starting_model(fitted, state, info.stage, plan.backend, fresh=plan.fresh)
        take_carried(loop, state, info.stage)
        step_backend = plan.backend.start(fitted, model, state)
        phase("started")
        result = train(fitted, plan.backend, step_backend, info, hooks)
        if statistics:
            result.artifact_fields["data_statistics"] = statistics
        if settings.extension is not None:
            result.artifact_fields["extension"] = settings.extension.record()
        return finish(loop, result, info, settings, hooks)
    finally:  # a stage that fails or is refused before its artifact leaves no pending lock behind
        _DEPS_LOCKS.pop(info.stage_dir, None)


#: Stage directory -> the future of its `collect_deps_lock()`, started when the stage starts (`_prefetch_deps_lock`).
_DEPS_LOCKS: dict[str, Any] = {}


def _prefetch_deps_lock(info: RunInfo) -> None:
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


def _deps_lock(info: RunInfo, collect: Any) -> dict[str, Any]:
    """The stage's prefetched dependency lock, or `collect()` now when none was started."""
    future = _DEPS_LOCKS.pop(info.stage_dir, None)
    return dict(future.result()) if future is not None else dict(collect())


def fit_data(loop: TrainingLoop) -> tuple[TrainingLoop, dict[str, Any]]:
    """`loop` with each unfitted `Standardize` of its training dataset fitted on that dataset, the validation and
    test datasets given the same statistics, and the statistics (``{key: {"mean", "std"}}``, empty when none)."""
    from ..data._standardize import Standardize, statistics_of

    def unfitted(ds: Any) -> bool:
        return ds is not None and any(isinstance(t, Standardize) and not t.fitted for t in ds.transforms)

    datasets = (loop.dataset, loop.val_dataset, loop.test_dataset)
    if not any(unfitted(ds) for ds in datasets):
        return loop, statistics_of(loop.dataset.transforms)
    train = loop.dataset.fitted()
    statistics = statistics_of(train.transforms)
    changes: dict[str, Any] = {"dataset": train}
    for role in ("val_dataset", "test_dataset"):
        ds = getattr(loop, role)
        if unfitted(ds):
            changes[role] = ds.with_statistics(statistics, f"TrainingLoop.{role}")
    return loop.replace(**changes), statistics


def train(loop: TrainingLoop, backend: Any, step_backend: Any, info: RunInfo, hooks: Any) -> Any:
    """The `Engine` over `step_backend` (after the hooks restore a warm start or a resume), and what the artifact
    records of the backend: `Backend.info`, the topology, the run's steps and what the step backend adds."""
    import numpy as np

    from ..engine._loop import run_steps

    with step_backend.running():
        result = run_steps(step_backend.engine_loop(loop), step_backend, info, hooks)
    if result.stop_reason is None:  # completed
        result.metrics.update(step_backend.final_metrics(info.stage, info.stage_dir))
    result.opt_state = step_backend.optimizer_state()
    result.rng = np.asarray(_seed_key_data(loop.seed)).tolist()
    result.backend_info = {
        **backend.info(),
        "steps": result.step,
        **result.backend_info,  # what the engine resolved: steps_per_call (after `auto`), the data path
        **step_backend.summary(),
    }
    if hooks.topology_changes:  # elastic resumes (`checkpoint._elastic`)
        result.backend_info["topology_changes"] = hooks.topology_changes
    return result


@functools.cache
def _seed_key_data_jit() -> Any:
    import jax

    return jax.jit(lambda seed: jax.random.key_data(jax.random.key(seed)))


def _seed_key_data(seed: int) -> Any:
    """``key_data(key(seed))`` as one compiled program (eagerly, the seeding and the unwrapping compile two);
    a seed outside int32 takes the eager path, where `jax.random.key` folds its 64 bits."""
    import jax

    if -(2**31) <= seed < 2**31:
        return _seed_key_data_jit()(seed)
    return jax.random.key_data(jax.random.key(seed))


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
        _record_in_store(artifact, settings, info)
        raise TrainingInterrupted(interrupted[0], artifact, interrupted[1])
    # final.json marks the stage finished: written before the store insert, so a crash between the two leaves one
    # artifact, which a resume finds in artifact.json and records (it never trains or records the stage again).
    if model_uri is not None:  # process 0 (or the only process) writes what the run keeps
        _write_final(info, result.step, result.epoch, artifact.artifact_id, model_uri)
    _record_in_store(artifact, settings, info)
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


def _check_targets(loop: TrainingLoop, info: RunInfo) -> None:
    """Refuse before training when a folder the stage writes is read-only or full (it would fail at the first
    save, or after the whole training): the stage folder (metrics, final.json), the checkpoints, the models."""

    targets = [
        ("run directory", info.run_dir),
        ("stage directory", info.stage_dir),
        ("model folder", os.path.join(info.run_dir, "models")),
    ]
    if loop.checkpoint_settings is not None:
        targets.append(("checkpoint directory", loop.checkpoint_directory(info.stage_dir)))
    for what, path in targets:
        check_writable(path, f"stage {info.stage!r}: the {what}", "Choose another --run-dir (or checkpoint_dir)")


def _check_store(settings: RunSettings) -> None:
    """Refuse before training when the artifact store cannot be written (it would fail after the whole run)."""
    if settings.store is False or not is_primary():
        return
    import sqlite3

    from ..provenance._store import ArtifactStore, ArtifactStoreError

    store = ArtifactStore(settings.store or None)
    remedy = "Choose a writable store with --store PATH (or PIPEKIT_ARTIFACT_STORE), or record nothing with --no-store"
    try:
        check_writable(store.path, "the artifact store", remedy, is_folder=False)  # read-only or full, in plain words
    except DirectoryNotWritableError as e:
        raise ArtifactStoreError(str(e)) from None
    try:
        store.schema_version()  # creates the database, or brings its schema up to date
        with contextlib.closing(sqlite3.connect(store.path, timeout=30)) as conn:
            conn.execute("BEGIN IMMEDIATE")  # takes the write lock: fails on a read-only file or folder
            conn.execute("ROLLBACK")
    except (sqlite3.Error, OSError) as e:
        raise ArtifactStoreError(
            f"the artifact store {store.path} cannot be written ({e}); nothing was trained. Choose a writable "
            "store with --store PATH (or PIPEKIT_ARTIFACT_STORE), or record nothing with --no-store"
        ) from None


def _write_run_meta(run_dir: str, run_id: str, settings: RunSettings) -> None:
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


def _record_in_store(artifact: Any, settings: RunSettings, info: RunInfo) -> None:
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
