"""`check_pipeline`: everything that can be checked about a pipeline without training it."""

from __future__ import annotations

from pipekit import Operator, Sequential


def _stages(op: Operator) -> list[Operator]:
    if isinstance(op, Sequential):
        out: list[Operator] = []
        for stage in op.stages:
            out.extend(_stages(stage))
        return out
    return [op]


def check_pipeline(op: Operator) -> str:
    """Check every stage through its backend's `preflight`: data, model and loss shapes, weight hand-offs, the
    optimizer configuration, the validation and test data.

    Raises the same errors a run would raise before compiling; returns a one-line description.
    """
    from ._loop import TrainerCarryState, TrainingLoop
    from ._optim import check_optimizer_config

    loops = [s for s in _stages(op) if isinstance(s, TrainingLoop)]
    state: TrainerCarryState | None = None
    steps = 0
    for index, loop in enumerate(loops):
        stage = loop.name or f"stage{index}"
        check_optimizer_config(loop.optimizer_config)
        model = loop.adapter().preflight(loop, state, stage)
        for ds in (loop.val_dataset, loop.test_dataset):
            if ds is not None:
                ds.element_spec()
        state = TrainerCarryState(model=model, stage_index=index + 1)
        steps += loop.max_steps
    plural = "s" if len(loops) != 1 else ""
    return f"{len(loops)} training stage{plural}, {steps} steps in all"
