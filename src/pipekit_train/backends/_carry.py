"""`TrainingLoop.carry` as a backend takes it: the setting read (`carry_settings`, `wants_checkpoint`) and the
previous stage's saved trees matched to this stage's by leaf path (`match_by_path`). The core reads the previous
stage's final checkpoint and hands it over as ``incoming.carried`` (`pipekit_train.stage.carry`); a backend with
the ``carry`` capability starts from it."""

from __future__ import annotations

from typing import Any

from pipekit import ConfigError, suggestion

__all__ = ["CARRY_KEYS", "WEIGHTS", "carry_settings", "match_by_path", "wants_checkpoint"]

CARRY_KEYS = ("optimizer_state", "weights")
WEIGHTS = ("returned", "ema", "params")


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


def match_by_path(saved: Any, like: Any, what: str, stage: str, skip: Any = None) -> Any:
    """`saved` (a restored tree, as saved) rebuilt with the structure of `like`, leaf by leaf by path.

    `skip(name)` names leaves of `like` that are not read from `saved` (they keep `like`'s value, and `saved`'s
    leaves of that name are ignored). A leaf missing on either side, or of another shape or dtype, is refused,
    naming the first few paths.
    """
    import jax
    import numpy as np

    from .._trees import flatten

    ours = flatten(like)
    theirs = dict(flatten(saved))
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
