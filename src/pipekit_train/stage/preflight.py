"""Pre-flight: every check a run makes before it trains, in one place. ``pipekit-train validate`` runs exactly this.

`preflight_stage` checks one `TrainingLoop` (the optimizer configuration against `max_steps`, `batch_size`
against the data, the validation and test data, then the backend's own `preflight`: shapes, the hand-off from the
previous stage); `check_pipeline` runs it over every stage of a pipeline, threading the model each stage would
hand the next. A stage runs it again before it claims its run directory, so a failed pre-flight writes nothing.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pipekit import ConfigError, Operator, Sequential

if TYPE_CHECKING:
    from .loop import TrainerCarryState, TrainingLoop


def _stages(op: Operator) -> list[Operator]:
    if isinstance(op, Sequential):
        out: list[Operator] = []
        for stage in op.stages:
            out.extend(_stages(stage))
        return out
    return [op]


def preflight_stage(loop: TrainingLoop, state: TrainerCarryState | None, stage: str) -> Any:
    """Check `loop` as stage `stage` after `state`; return the bound model it would start from."""
    from ..optim._config import check_optimizer_config
    from ..scale._mesh import check_mesh
    from ..scale._precision import check_precision

    check_optimizer_config(loop.optimizer_config, loop.max_steps)
    _check_recipes_supported(loop, stage)
    check_mesh(loop)  # the devices exist, the backend trains on a mesh, the global batch splits evenly
    check_precision(loop)
    loop.dataset.num_batches(loop.batch_size)  # a batch_size the data cannot fill is refused here
    for role in ("dataset", "val_dataset", "test_dataset"):
        if getattr(loop, role) is not None:
            _check_finite_data(getattr(loop, role), f"stage {stage!r}: TrainingLoop.{role}")
    for role, ds in (("val_dataset", loop.val_dataset), ("test_dataset", loop.test_dataset)):
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
    return loop.adapter().preflight(loop, state, stage)


#: The `TrainingLoop` fields of docs/recipes.md; an adapter that honours some lists them in its ``RECIPES``.
RECIPE_FIELDS = ("gradient", "param_groups", "diagnostics", "carry")


def _check_recipes_supported(loop: TrainingLoop, stage: str) -> None:
    """Refuse a recipe field the stage's backend does not honour (its adapter's ``RECIPES`` does not list it)."""
    supported = getattr(loop.adapter(), "RECIPES", ())
    for name in RECIPE_FIELDS:
        value = getattr(loop, name)
        if value and name not in supported:
            raise ConfigError(
                f"stage {stage!r}: backend {loop.backend!r} cannot honour TrainingLoop.{name} ({value!r}); "
                "remove it or train this stage with backend: equinox (docs/recipes.md)"
            )
    if "schedules" not in supported:
        from ..optim._schedules import schedules_in

        found = schedules_in(loop.loss, "loss") + schedules_in(loop.callbacks, "callbacks")
        if found:
            path, schedule = found[0]
            raise ConfigError(
                f"stage {stage!r}: backend {loop.backend!r} cannot follow a schedule (TrainingLoop.{path} is "
                f"{schedule!r}); use a fixed value or train this stage with backend: equinox (docs/recipes.md)"
            )


def _check_finite_data(dataset: Any, where: str) -> None:
    """Refuse NaN or infinity in a dataset's floating-point arrays (they would train or evaluate to NaN)."""
    import numpy as np

    for key, values in dataset.arrays().items():
        host = np.asarray(values)
        if host.dtype.kind not in "fc":
            continue
        bad = ~np.isfinite(host)
        if bad.any():
            first = int(np.argwhere(bad)[0][0])
            raise ConfigError(
                f"{where}: {key!r} holds {int(bad.sum())} NaN or infinite value(s) (the first in record {first}); "
                "clean the data or drop those records"
            )


def check_pipeline(op: Operator) -> str:
    """Pre-flight every training stage of `op` (see the module docstring); returns a one-line description.

    Raises the same errors a run would raise before training.
    """
    from .carry import handoff
    from .loop import TrainerCarryState, TrainingLoop

    loops = [s for s in _stages(op) if isinstance(s, TrainingLoop)]
    state: TrainerCarryState | None = None
    steps = 0
    for index, loop in enumerate(loops):
        model = preflight_stage(loop, state, loop.name or f"stage{index}")
        stage_dir = os.path.join("<run>", loop.name or f"stage{index}")
        state = TrainerCarryState(model=model, stage_index=index + 1, **handoff(loop, stage_dir))
        steps += loop.max_steps
    plural = "s" if len(loops) != 1 else ""
    return f"{len(loops)} training stage{plural}, {steps} steps in all"
