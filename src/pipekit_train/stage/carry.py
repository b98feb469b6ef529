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

from pipekit import ConfigError, suggestion

__all__ = [
    "CARRY_KEYS",
    "WEIGHTS",
    "carry_settings",
    "check_carry_source",
    "handoff",
    "match_by_path",
    "read_final_state",
    "wants_checkpoint",
]

CARRY_KEYS = ("optimizer_state", "weights")
WEIGHTS = ("returned", "ema", "params")
_NO_CHECKPOINT = (
    "stage {stage!r}: TrainingLoop.carry ({carry}) reads the previous stage's final checkpoint, so that a resumed "
    "run carries exactly what a fresh one does, but the previous stage has no Checkpoint callback; add "
    "`callbacks: [{{type: Checkpoint}}]` to it"
)


def carry_settings(carry: dict[str, Any] | None) -> tuple[bool, str]:
    """``(optimizer_state, weights)`` of a `TrainingLoop.carry` mapping; null carries only the returned model."""
    if carry is None:
        return False, "returned"
    if not isinstance(carry, dict):
        raise ConfigError(f"TrainingLoop.carry must be a mapping such as {{optimizer_state: true}}, got {carry!r}")
    for key in carry:
        if key not in CARRY_KEYS:
            raise ConfigError(
                f"TrainingLoop.carry has no key {key!r}{suggestion(str(key), CARRY_KEYS)}; allowed keys: "
                f"{', '.join(CARRY_KEYS)}"
            )
    optimizer_state = carry.get("optimizer_state", False)
    if not isinstance(optimizer_state, bool):
        raise ConfigError(f"TrainingLoop.carry.optimizer_state must be true or false, got {optimizer_state!r}")
    weights = carry.get("weights", "returned")
    if weights not in WEIGHTS:
        raise ConfigError(
            f"TrainingLoop.carry.weights must be one of {', '.join(WEIGHTS)}, got {weights!r}"
            f"{suggestion(str(weights), WEIGHTS)}"
        )
    return optimizer_state, str(weights)


def wants_checkpoint(carry: dict[str, Any] | None) -> bool:
    """Whether `carry` reads the previous stage's final checkpoint."""
    optimizer_state, weights = carry_settings(carry)
    return optimizer_state or weights != "returned"


def check_carry_source(loop: Any, incoming: Any, stage: str) -> None:
    """Refuse `loop.carry` when there is no previous stage, or it kept no checkpoint or EMA to carry."""
    if not wants_checkpoint(loop.carry):
        return
    if incoming is None or incoming.model is None:
        raise ConfigError(
            f"stage {stage!r}: TrainingLoop.carry ({loop.carry}) takes from the previous stage, but the stage is the "
            "first of its pipeline; remove carry"
        )
    if getattr(incoming, "checkpoint_dir", None) is None:
        raise ConfigError(_NO_CHECKPOINT.format(stage=stage, carry=loop.carry))
    if carry_settings(loop.carry)[1] == "ema" and not getattr(incoming, "has_ema", False):
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


def match_by_path(saved: Any, like: Any, what: str, stage: str, skip: Any = None) -> Any:
    """`saved` (a restored tree, as saved) rebuilt with the structure of `like`, leaf by leaf by path.

    `skip(name)` names leaves of `like` that are not read from `saved` (they keep `like`'s value, and `saved`'s
    leaves of that name are ignored). A leaf missing on either side, or of another shape or dtype, is refused,
    naming the first few paths.
    """
    import jax
    import numpy as np

    from ..checkpoint._layout import _flatten

    ours = _flatten(like)
    theirs = dict(_flatten(saved))
    skip = skip or (lambda name: False)
    wanted = [name for name, _ in ours if not skip(name)]
    missing = [n for n in wanted if n not in theirs]
    extra = sorted(n for n in set(theirs) - {name for name, _ in ours} if not skip(n))
    shapes = [
        f"{n}: {tuple(np.shape(theirs[n]))} {np.asarray(theirs[n]).dtype} there, {tuple(np.shape(x))} "
        f"{np.asarray(x).dtype} here"
        for n, x in ours
        if n in theirs
        and not skip(n)
        and (np.shape(theirs[n]) != np.shape(x) or np.asarray(theirs[n]).dtype != np.asarray(x).dtype)
    ]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"not in the previous stage's: {missing[:4]}")
        if extra:
            parts.append(f"only in the previous stage's: {extra[:4]}")
        if shapes:
            parts.append(f"other shapes: {shapes[:3]}")
        raise ConfigError(
            f"stage {stage!r}: TrainingLoop.carry cannot continue the previous stage's {what}: it has another "
            f"structure than this stage's ({'; '.join(parts)}); carrying it needs the same model parameters, "
            "optimizer and parameter groups"
        )
    leaves = [x if skip(name) else theirs[name] for name, x in ours]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def handoff(loop: Any, stage_dir: str) -> dict[str, Any]:
    """What a stage tells the next one for `carry`: where its checkpoints are (or None) and whether it kept EMA."""

    has_checkpoint = loop.checkpoint_settings is not None
    directory = loop.checkpoint_directory(stage_dir) if has_checkpoint else None
    return {"checkpoint_dir": directory, "has_ema": loop.ema_settings is not None}
