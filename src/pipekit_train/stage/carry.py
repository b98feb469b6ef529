"""`TrainingLoop.carry`: what a stage takes from the previous one besides the model it returned.

``carry: {optimizer_state: true, weights: ema}`` lets a stage continue the previous stage's optimizer state (its
moments and counters; this stage's own learning-rate schedule, run-time factor, L2-SP anchors and unfreezing
counters start afresh) and/or start from its EMA weights (``weights: ema``) or its raw trained parameters
(``weights: params``, when it returned its EMA) instead of the model it returned (``weights: returned``).

Both are read from the previous stage's checkpoint of its final step, in a fresh run and in a resumed one alike, so
a killed and resumed pipeline carries bitwise the same state (an in-memory hand-off would be lost when a resume
skips the finished stage). The previous stage therefore needs a `Checkpoint` callback (with ``save_on_end``, the
default). The leaves are matched by their path in the tree, so the optimizer states must have the same structure:
the same optimizer, parameter groups and model parameters (its numbers, such as the learning rate, may differ).
"""

from __future__ import annotations

import os
from typing import Any

from pipekit import ConfigError

from ..backends._carry import carry_settings, wants_checkpoint

__all__ = ["check_carry_source", "handoff", "read_final_state", "take_carried"]

_NO_CHECKPOINT = (
    "stage {stage!r}: TrainingLoop.carry ({carry}) reads the previous stage's final checkpoint, so that a resumed "
    "run carries exactly what a fresh one does, but the previous stage has no Checkpoint callback; add "
    "`callbacks: [{{type: Checkpoint}}]` to it"
)


def check_carry_source(loop: Any, incoming: Any, stage: str) -> None:
    """Refuse `loop.carry` when there is no previous stage, or it kept no checkpoint or EMA to carry."""
    if not wants_checkpoint(loop.carry):
        return
    if incoming is None or incoming.model is None:
        raise ConfigError(
            f"stage {stage!r}: TrainingLoop.carry ({loop.carry}) takes from the previous stage, but the stage is the "
            "first of its pipeline; remove carry"
        )
    if incoming.checkpoint_dir is None:
        raise ConfigError(_NO_CHECKPOINT.format(stage=stage, carry=loop.carry))
    if carry_settings(loop.carry)[1] == "ema" and not incoming.has_ema:
        raise ConfigError(
            f"stage {stage!r}: TrainingLoop.carry.weights is 'ema' but the previous stage kept no EMA weights; add "
            "an EMA callback to it (`{type: EMA, decay: 0.999}`), or carry weights: returned"
        )


def read_final_state(incoming: Any, stage: str) -> dict[str, Any]:
    """The previous stage's checkpoint at its final step, as saved (``params``, ``opt_state``, maybe ``ema``)."""
    from ..checkpoint._checkpointer import Checkpointer
    from ..checkpoint._errors import CheckpointNotFoundError

    directory = incoming.checkpoint_dir
    checkpointer = Checkpointer(directory, async_save=False)
    try:
        steps = checkpointer.steps()
        if incoming.step not in steps:
            raise CheckpointNotFoundError(
                f"stage {stage!r}: TrainingLoop.carry reads the previous stage's checkpoint of its final step "
                f"{incoming.step}, but {os.fspath(directory)} holds steps {steps}; keep Checkpoint.save_on_end: true "
                "in the previous stage"
            )
        state, _, _ = checkpointer.restore(incoming.step, None)
    finally:
        checkpointer.close()
    return dict(state)


def take_carried(loop: Any, incoming: Any, stage: str) -> None:
    """Before `Backend.start`: with `loop.carry` asking for it, read the previous stage's final checkpoint into
    ``incoming.carried`` (the core reads checkpoints; the backend starts from what it is handed)."""
    if incoming is not None and wants_checkpoint(loop.carry):
        incoming.carried = read_final_state(incoming, stage)


def handoff(loop: Any, stage_dir: str) -> dict[str, Any]:
    """What a stage tells the next one for `carry`: where its checkpoints are (or None) and whether it kept EMA."""

    has_checkpoint = loop.checkpoint_settings is not None
    directory = loop.checkpoint_directory(stage_dir) if has_checkpoint else None
    return {"checkpoint_dir": directory, "has_ema": loop.ema_settings is not None}
