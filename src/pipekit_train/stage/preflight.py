"""Pre-flight: every check a stage makes before it trains, in one place. ``pipekit-train validate`` runs exactly this.

`check` checks one `TrainingLoop` once: the optimizer configuration against `max_steps`, what the backend's
capabilities allow (recipes, scale, transfer), `batch_size` against the data, the validation and test data, the
backend's own rules (`Backend.check`: shapes, loss, data keys) and the hand-off from the previous stage (how the
model starts: `stage.start.route`). Its result is a `StagePlan`, plain data the run reuses. A backend that can
size its model from the architecture alone (Equinox: `jax.eval_shape` of the factory) asks `check_model_size`
whether the weights can fit in memory at all, so an absurd width is refused before anything is allocated.

`plan_pipeline` checks every stage of a pipeline before any trains, threading the model each stage would hand the
next (its architecture: nothing is converted or transferred to plan); it builds each stage's fresh model there,
once, and the run takes it from the plan (`stage.driver.run_pipeline` hands each stage its plan, in run order). A
stage run without a plan (``op.run()`` in Python) checks itself before it claims its run directory, so a failed
pre-flight writes nothing. Where the run writes is checked here too, before anything is created: a run directory
another run holds (`existing_run`), folders that cannot be written (`check_targets`), the artifact store
(`check_store`), a device count a checkpoint cannot continue on (`check_pipeline_topologies`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipekit import ConfigError, Operator, Sequential

from .._jsonio import read_json
from .._lock import DirectoryNotWritableError, check_writable
from .._signals import phase
from ..scale._distributed import is_primary
from .settings import RunSettings

if TYPE_CHECKING:
    from ..backends._contract import Backend
    from ..backends._model import ModelOp
    from .loop import RunInfo, TrainerCarryState, TrainingLoop
    from .start import Route

__all__ = [
    "StagePlan",
    "check",
    "check_pipeline",
    "check_pipeline_topologies",
    "check_store",
    "check_targets",
    "existing_run",
    "check_without_jax",
    "plan_pipeline",
]


@dataclass(frozen=True, eq=False)
class StagePlan:
    """A checked stage: what its run reuses instead of checking or building again.

    Attributes:
        loop: The stage's `TrainingLoop` (the plan is for this object).
        stage: The stage's name.
        backend: The backend object that trains it.
        route: How its model starts: ``"fresh"``, ``"carried"``, ``"converted"`` or ``"transferred"``.
        fresh: The fresh model pre-flight built for it (`plan_pipeline`), or ``None``: the run builds it then.
    """

    loop: TrainingLoop
    stage: str
    backend: Backend
    route: Route
    fresh: ModelOp | None = None


def _stages(op: Operator) -> list[Operator]:
    if isinstance(op, Sequential):
        out: list[Operator] = []
        for stage in op.stages:
            out.extend(_stages(stage))
        return out
    return [op]


def training_stages(op: Operator) -> list[TrainingLoop]:
    """The `TrainingLoop` stages of `op`, in the order they run."""
    from .loop import TrainingLoop

    return [s for s in _stages(op) if isinstance(s, TrainingLoop)]


def check(loop: TrainingLoop, incoming: TrainerCarryState | None, stage: str) -> StagePlan:
    """Check `loop` as stage `stage` after `incoming` (see the module docstring); builds nothing."""
    check_without_jax(loop, stage)
    return _check_with_jax(loop, incoming, stage)


def check_without_jax(loop: TrainingLoop, stage: str) -> None:
    """The part of `check` that needs no JAX (nor any framework): the optimizer configuration, the backend's
    capabilities, the data files, `batch_size` against the data, the validation and test data's keys and shapes.

    `plan_pipeline` runs it for every stage before anything imports JAX, so a wrong path or key of any stage is
    reported at once.
    """
    from ..optim._config import check_optimizer_config

    backend = loop.adapter()
    check_optimizer_config(loop.optimizer_config, loop.max_steps)
    _check_capabilities(loop, backend, stage)
    _check_registries(loop, stage)
    _check_tokenizer(loop, stage)
    if not backend.samples:  # a sampler takes the data whole: its batch_size is unused
        loop.dataset.num_batches(loop.batch_size)  # a batch_size the data cannot fill is refused here
    # Validation and test data are read with what the training split's source fitted (classes, categories).
    fitted = None if loop.dataset.source.fitted else loop.dataset.source.fit().fitted_statistics()
    datasets = {
        role: ds if role == "dataset" else ds.with_source_statistics(fitted, f"stage {stage!r}: TrainingLoop.{role}")
        for role in ("dataset", "val_dataset", "test_dataset")
        if (ds := getattr(loop, role)) is not None
    }
    for role, ds in datasets.items():
        _check_finite_data(ds, f"stage {stage!r}: TrainingLoop.{role}")
    for role in ("val_dataset", "test_dataset"):
        ds = datasets.get(role)
        if ds is None:
            continue
        spec, train_spec = ds.element_spec(), loop.dataset.element_spec()
        keys = (loop.input_key, loop.target_key) if loop.task is None else tuple(train_spec)
        for key in keys:
            if key not in spec:
                raise ConfigError(
                    f"stage {stage!r}: TrainingLoop.{role} has no {key!r} (its batches have keys {sorted(spec)}); "
                    "evaluation runs the same model and loss as training"
                )
            if key in train_spec and tuple(spec[key][0]) != tuple(train_spec[key][0]):
                raise ConfigError(
                    f"stage {stage!r}: TrainingLoop.{role}'s {key!r} has per-example shape {tuple(spec[key][0])} but "
                    f"the training data's has {tuple(train_spec[key][0])}"
                )


def _check_with_jax(loop: TrainingLoop, incoming: TrainerCarryState | None, stage: str) -> StagePlan:
    """The rest of `check`: devices, precision, the backend's own rules and the hand-off from `incoming`."""
    from ..scale._mesh import check_mesh
    from ..scale._precision import check_precision
    from .carry import check_carry_source
    from .start import route

    backend = loop.adapter()
    check_mesh(loop)  # the devices exist, the backend trains on a mesh, the global batch splits evenly
    check_precision(loop)
    backend.check(loop, incoming, stage)
    check_carry_source(loop, incoming, stage)
    return StagePlan(loop=loop, stage=stage, backend=backend, route=route(loop, incoming, stage, backend))


#: The `TrainingLoop` fields of docs/recipes.md, each honoured by the backends whose capabilities list it.
RECIPE_FIELDS = ("gradient", "param_groups", "diagnostics", "carry")


def _refusal(stage: str, loop: TrainingLoop, what: str, capability: str, remedy: str) -> ConfigError:
    from ..backends._registry import able_to

    able = able_to(capability, besides=loop.backend)
    where = (
        "no installed backend can" if able == "none installed" else f"train this stage with a backend that can ({able})"
    )
    return ConfigError(
        f"stage {stage!r}: backend {loop.backend!r} cannot {what}; {remedy}, or {where} (docs/recipes.md)"
    )


def _check_capabilities(loop: TrainingLoop, backend: Backend, stage: str) -> None:
    """Refuse a field the stage's backend does not honour (its `capabilities` do not list it)."""
    for name in RECIPE_FIELDS:
        value = getattr(loop, name)
        if value and name not in backend.capabilities:
            raise _refusal(stage, loop, f"honour TrainingLoop.{name} ({value!r})", name, "remove it")
    if loop.init_from and "init_from" not in backend.capabilities:
        raise _refusal(
            stage,
            loop,
            f"warm-start from a checkpoint (TrainingLoop.init_from {loop.init_from!r})",
            "init_from",
            "remove it",
        )
    if "schedules" not in backend.capabilities:
        from ..optim._schedules import schedules_in

        found = schedules_in(loop.loss, "loss") + schedules_in(loop.callbacks, "callbacks")
        if found:
            path, schedule = found[0]
            raise _refusal(
                stage,
                loop,
                f"follow a schedule (TrainingLoop.{path} is {schedule!r})",
                "schedules",
                "use a fixed value",
            )
    if loop.ema_settings is not None and "ema" not in backend.capabilities:
        raise _refusal(stage, loop, f"keep an EMA of the weights ({loop.ema_settings!r})", "ema", "remove the callback")
    lora = loop.optimizer_config.get("lora")
    if lora is not None and "lora" not in backend.capabilities:
        raise _refusal(
            stage,
            loop,
            f"train low-rank adapters (optimizer_config.lora is {lora!r})",
            "lora",
            "remove optimizer_config.lora to train every weight",
        )


def _check_tokenizer(loop: TrainingLoop, stage: str) -> None:
    """Text data: every split read with the training split's tokenizer setting, and a model whose ``vocab_size``
    argument (its factory's kwargs) holds every id the tokenizer can give (a BPE's `vocab_size` setting, 259 for
    bytes). An id past an embedding table is clamped silently by JAX, so it is refused here, before any training."""
    from ..data._text import TextSource

    source = loop.dataset.source
    if not isinstance(source, TextSource):
        return
    setting = source.setting
    for role in ("val_dataset", "test_dataset"):
        other = getattr(getattr(loop, role), "source", None)
        if isinstance(other, TextSource) and other.setting != setting:
            raise ConfigError(
                f"stage {stage!r}: TrainingLoop.{role}'s TextSource.tokenizer is {other.setting.text()}, but the "
                f"training data's is {setting.text()}; every split is read with the training split's tokenizer"
            )
    kwargs = getattr(loop.model_op, "kwargs", None)
    vocab = kwargs.get("vocab_size") if isinstance(kwargs, dict) else None
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < setting.vocab_size:
        raise ConfigError(
            f"stage {stage!r}: the model's vocab_size {vocab} is smaller than the tokenizer's vocab_size "
            f"{setting.vocab_size} (TextSource.tokenizer {setting.text()}); set the model's vocab_size to at least "
            f"{setting.vocab_size}"
        )


def _check_registries(loop: TrainingLoop, stage: str) -> None:
    """Refuse a `RegisterModel` registry that cannot be written (read-only or full): found now, not after the whole
    training, when the callback stores the model. The run's own folders and the store are checked when the run
    directory is known (`stage.driver`)."""
    from .._lock import check_writable
    from ..provenance._model_registry import ENV_VAR, LocalModelRegistry
    from ..provenance._register import RegisterModel

    for callback in loop.callbacks:
        if isinstance(callback, RegisterModel):
            check_writable(
                LocalModelRegistry(callback.registry).root,
                f"stage {stage!r}: the model registry of RegisterModel",
                f"RegisterModel stores the trained model there, so its registry must be a folder this process can "
                f"write: choose another RegisterModel.registry (or ${ENV_VAR})",
            )


def _check_finite_data(dataset: Any, where: str) -> None:
    """Refuse NaN or infinity in a dataset's floating-point arrays (they would train or evaluate to NaN)."""
    import math

    import numpy as np

    for key, values in dataset.arrays().items():
        if np.dtype(values.dtype).kind not in "fc":
            continue
        # In chunks, so a lazily read source (`RandomAccessSource`) is streamed rather than held in memory.
        rows = max(1, (1 << 24) // max(1, values.itemsize * math.prod(values.shape[1:])))
        for start in range(0, len(values), rows):
            bad = ~np.isfinite(np.asarray(values[start : start + rows]))
            if bad.any():
                first = start + int(np.argwhere(bad)[0][0])
                count = int(bad.sum()) + sum(
                    int((~np.isfinite(np.asarray(values[s : s + rows]))).sum())
                    for s in range(start + rows, len(values), rows)
                )
                raise ConfigError(
                    f"{where}: {key!r} holds {count} NaN or infinite value(s) (the first in record {first}); "
                    "clean the data or drop those records"
                )


def plan_pipeline(op: Operator) -> list[StagePlan]:
    """Pre-flight every training stage of `op` before any trains (see the module docstring): one `StagePlan` per
    stage, each with the fresh model its run will start from or fill in.

    Raises the same errors a run would raise before training.
    """
    from .carry import handoff
    from .loop import TrainerCarryState

    loops = training_stages(op)
    names = [loop.name or f"stage{index}" for index, loop in enumerate(loops)]
    for loop, name in zip(loops, names):  # every stage's files and fields first, before JAX is imported
        check_without_jax(loop, name)
    phase("preflight")
    incoming: TrainerCarryState | None = None
    plans = []
    for index, (loop, name) in enumerate(zip(loops, names)):
        plan = _check_with_jax(loop, incoming, name)
        if plan.route in ("fresh", "transferred"):
            plan = replace(plan, fresh=plan.backend.build(loop))
            phase("built")
        # What the next stage is checked against: this stage's model as it will hand it over (its own architecture,
        # or the previous stage's model carried whole); a transfer or a conversion waits for the run.
        handed = incoming.model if plan.route == "carried" and incoming is not None else (plan.fresh or loop.model_op)
        incoming = TrainerCarryState(model=handed, stage_index=index + 1, **handoff(loop, os.path.join("<run>", name)))
        plans.append(plan)
    return plans


def check_pipeline(op: Operator) -> str:
    """`plan_pipeline`, described in one line (what ``pipekit-train validate`` prints)."""
    plans = plan_pipeline(op)
    steps = sum(p.loop.max_steps for p in plans)
    plural = "s" if len(plans) != 1 else ""
    return f"{len(plans)} training stage{plural}, {steps} steps in all"


def check_pipeline_topologies(op: Any, run_dir: str | None) -> None:
    """`check_resume_topology` for every training stage of `op` resumed in `run_dir` (``pipekit-train run``)."""
    if not run_dir:
        return
    from ..checkpoint._elastic import check_resume_topology

    for index, loop in enumerate(training_stages(op)):
        name = loop.name or f"stage{index}"
        check_resume_topology(loop, os.path.join(run_dir, name), name)


# Where the run writes: checked before the run directory is created or claimed ---------------------------------
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


def check_targets(loop: TrainingLoop, info: RunInfo) -> None:
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


def check_store(settings: RunSettings) -> None:
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
