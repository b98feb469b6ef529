"""Running a pipeline, and one stage of it: the one way every run goes (``pipekit-train run``, a sweep's trial, an
extension, lr-find, ``op.run()`` in Python). The stage flow of ``design/overview.md``.

`run_pipeline` walks a pipeline (a `TrainingLoop`, or a `Sequential` of stages) and runs each training stage with
`run_stage`, handing it the `StagePlan` pre-flight made for it (in run order) and the run's `RunSettings`,
explicitly. `run_stage` names the run and the stage, takes a stage that already finished as it is (``resume:
auto``: `stage.recorded`), pre-flights a stage that has no plan, checks where it writes and claims the run
directory, then: the checkpoint hooks, `start_stage` (the data fitted, the model the plan routes, `Backend.start`:
the one call into the backend), `train` (the engine), `stage.record.finish` (the registry, the artifact,
``final.json``, the store, the next carry-state).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipekit import Operator, Sequential, StatefulOperator

from .._lock import run_dir_lock
from .._signals import note_run_dir, phase
from ..scale._distributed import allgather, initialize_distributed, is_primary, primary_holds
from .carry import take_carried
from .loop import RunInfo, TrainerCarryState, TrainingLoop, TrainingResult
from .preflight import StagePlan, check, check_store, check_targets, existing_run
from .record import FINAL_FILE, drop_deps_lock, finish, prefetch_deps_lock, write_run_meta
from .recorded import finished_stage
from .settings import RunSettings
from .start import starting_model

__all__ = ["fit_data", "run_pipeline", "run_stage", "start_stage", "train"]


def run_pipeline(op: Operator, settings: RunSettings, plans: Sequence[StagePlan] = ()) -> Any:
    """Run `op` with `settings` and return what it returns (a stage's ``(model, artifact)``; a `Sequential`'s last
    stage's). `plans` are `stage.preflight.plan_pipeline`'s for `op`, in run order: each training stage takes the next
    (a stage without one pre-flights itself). Other operators run as `pipekit.Sequential` runs them."""
    queue = list(plans)
    initial = op.initial_state() if isinstance(op, StatefulOperator) else None
    carrier, _ = _walk(op, None, initial, settings, queue)
    return carrier


def _walk(op: Operator, carrier: Any, state: Any, settings: RunSettings, plans: list[StagePlan]) -> tuple[Any, Any]:
    if isinstance(op, TrainingLoop):
        plan = plans.pop(0) if plans else None
        return run_stage(op, state, settings, plan)
    if isinstance(op, Sequential):
        for stage in op.stages:
            carrier, state = _walk(stage, carrier, state, settings, plans)
        return carrier, state
    if isinstance(op, StatefulOperator):
        return op._apply(carrier, state)
    return op(carrier), state


def run_stage(
    loop: TrainingLoop, state: TrainerCarryState | None, settings: RunSettings, plan: StagePlan | None = None
) -> tuple[TrainingResult, TrainerCarryState]:
    """Train one stage. `state` is what the previous stage returned (or ``None``); `plan` the stage's pre-flight
    (``None``: it is checked here, before anything is written)."""
    initialize_distributed()  # a multi-process environment ($PIPEKIT_NUM_PROCESSES, ...): connect once, first
    if loop.resume == "auto" and settings.resume != "auto":
        settings = replace(settings, resume="auto")
    # Several processes: process 0 names the run (or finds it in the run directory) and tells the others.
    identity = _run_identity(settings, state) if is_primary() else None
    run_id, run_dir, stage_index = allgather("run-identity", identity)[0]
    stage = loop.name or f"stage{stage_index}"
    parents: tuple[str, ...] = (state.artifact_id,) if state is not None and state.artifact_id else ()
    info = RunInfo(
        run_id=run_id,
        run_dir=run_dir,
        stage=stage,
        stage_index=stage_index,
        parent_ids=parents,
        stage_dir=os.path.join(run_dir, stage),
    )
    if settings.resume == "auto":
        done = finished_stage(info, loop, settings)
        if done is not None:
            return done
    # Everything that can be checked before training is checked before the run directory is created or claimed.
    if plan is not None and plan.stage != stage:
        raise RuntimeError(f"the plan of stage {plan.stage!r} was handed to stage {stage!r}")  # a driver's mistake
    if plan is None:
        if settings.resume == "auto":  # another device count that cannot continue the checkpoint: said as such
            from ..checkpoint._elastic import check_resume_topology

            check_resume_topology(loop, info.stage_dir, info.stage)
        plan = check(loop, state, info.stage)
    check_store(settings)
    check_targets(loop, info)
    if is_primary():
        note_run_dir(run_dir)  # a signal before training removes it if this process began it and kept nothing
    # One writer per run directory: a second run is refused, naming the one that holds it. Several processes of one
    # run (jax.distributed): process 0 holds the lock, the others wait until it does (or fail with its refusal).
    with primary_holds("run-dir", lambda: run_dir_lock(run_dir)):
        return _run_claimed(plan, state, info, settings)


def _run_claimed(
    plan: StagePlan, state: TrainerCarryState | None, info: RunInfo, settings: RunSettings
) -> tuple[TrainingResult, TrainerCarryState]:
    loop = plan.loop
    os.makedirs(info.stage_dir, exist_ok=True)
    if is_primary():
        write_run_meta(info.run_dir, info.run_id, settings)
    from ..engine._hooks import make_hooks

    hooks = make_hooks(loop, info, settings)
    # A stage recorded as finished that runs again (its configuration changed) continues its last checkpoint as the
    # new configuration says, even past a callback's stop; only a stage stopped but never recorded ends there again.
    hooks.keep_callback_stop = not os.path.exists(os.path.join(info.stage_dir, FINAL_FILE))
    if is_primary():
        prefetch_deps_lock(info)
    try:
        fitted, statistics, step_backend = start_stage(plan, state)
        phase("started")
        result = train(fitted, plan.backend, step_backend, info, hooks)
        if statistics:
            result.artifact_fields["data_statistics"] = statistics
        source_statistics = fitted.dataset.source.fitted_statistics()
        if source_statistics:
            result.artifact_fields["source_statistics"] = source_statistics
        if settings.extension is not None:
            result.artifact_fields["extension"] = settings.extension.record()
        return finish(loop, result, info, settings, hooks)
    finally:  # a stage that fails or is refused before its artifact leaves no pending lock behind
        drop_deps_lock(info)


def start_stage(plan: StagePlan, incoming: TrainerCarryState | None) -> tuple[TrainingLoop, dict[str, Any], Any]:
    """Hand the stage of `plan` to its backend: ``(the loop with its data fitted, the fitted statistics, the
    StepBackend)``. The data's `Standardize` transforms are fitted on the training split (`fit_data`; what the stage
    records stays the configuration as written), the model starts where the plan routes it (`starting_model`), the
    previous stage's final state is read for `TrainingLoop.carry`, and `Backend.start` is called: the one call that
    hands the stage over."""
    fitted, statistics = fit_data(plan.loop)
    model = starting_model(plan, incoming)
    take_carried(plan.loop, incoming, plan.stage)
    return fitted, statistics, plan.backend.start(fitted, model, incoming)


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


def fit_data(loop: TrainingLoop) -> tuple[TrainingLoop, dict[str, Any]]:
    """`loop` with its training dataset's source (`Source.fit`: a `CsvSource`'s classes, categories, imputed
    values) and each unfitted `Standardize` fitted on that dataset, the validation and test datasets given the same
    values, and the `Standardize` statistics (``{key: {"mean", "std"}}``, empty when none). The fitted source's
    `fitted_statistics` is what the artifact records as ``source_statistics``."""
    from ..data._standardize import Standardize, statistics_of

    def unfitted(ds: Any) -> bool:
        return ds is not None and (
            not ds.source.fitted or any(isinstance(t, Standardize) and not t.fitted for t in ds.transforms)
        )

    datasets = (loop.dataset, loop.val_dataset, loop.test_dataset)
    if not any(unfitted(ds) for ds in datasets):
        return loop, statistics_of(loop.dataset.transforms)
    train = loop.dataset.fitted()
    statistics = statistics_of(train.transforms)
    source_statistics = train.source.fitted_statistics()
    changes: dict[str, Any] = {"dataset": train}
    for role in ("val_dataset", "test_dataset"):
        ds = getattr(loop, role)
        if unfitted(ds):
            owner = f"TrainingLoop.{role}"
            changes[role] = ds.with_source_statistics(source_statistics, owner).with_statistics(statistics, owner)
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
