"""`TrainingLoop.carry` on the Equinox backend: the previous stage's EMA weights or parameters as the starting
model, and its optimizer state continued, from the previous stage's final checkpoint the core hands over as
``incoming.carried`` (see `pipekit_train.stage.carry`)."""

from __future__ import annotations

from typing import Any

import jax

from pipekit import ConfigError
from pipekit_train.backends.kit import FrozenUntilState, LrScaleState, carry_settings, match_by_path, reset_anchor

from ._steps import combine, partition

__all__ = ["carry_in", "continue_optimizer_state"]


def _is_hyper(name: str) -> bool:
    """A leaf of a `Hyperparams` node (the optimizer's numbers): this stage's configuration decides them."""
    return "hyper" in name.split("/")


def carry_in(loop: Any, incoming: Any, module: Any, stage: str) -> tuple[Any, Any]:
    """``(module, opt_state)``: the module the stage starts from with the weights `carry.weights` asks for (the
    previous stage's EMA weights or raw parameters instead of the model it returned), and the previous stage's
    final optimizer state as saved when `carry.optimizer_state` (else ``None``)."""
    if incoming is None or incoming.carried is None:  # no carry asked for (pre-flight checked the source)
        return module, None
    optimizer_state, weights = carry_settings(loop.carry)
    saved = incoming.carried
    if weights != "returned":
        key = "ema" if weights == "ema" else "params"
        if getattr(incoming.model, "backend", None) != "equinox" or key not in saved or loop.transfer is not None:
            raise ConfigError(
                f"stage {stage!r}: TrainingLoop.carry.weights is {weights!r} but the previous stage's final "
                f"checkpoint holds no {key!r} of an Equinox model carried whole (it has {sorted(saved)}"
                + (", and the stage assembles its model with transfer" if loop.transfer is not None else "")
                + ")"
            )
        params, consts, static = partition(module)
        what = "EMA weights" if key == "ema" else "parameters"
        chosen = match_by_path(saved[key], params, what, stage)
        module = combine(chosen, consts, static)
    return module, (saved["opt_state"] if optimizer_state else None)


def _restart(carried: Any, fresh: Any) -> Any:
    """`carried` with this stage's own per-stage state from `fresh`: the learning-rate schedule's count and
    run-time factor, the unfreezing counters and (below) the L2-SP anchors."""

    def is_node(node: Any) -> bool:
        return isinstance(node, (LrScaleState, FrozenUntilState))

    def pick(old: Any, new: Any) -> Any:
        if isinstance(old, LrScaleState):
            return new
        if isinstance(old, FrozenUntilState):
            return old._replace(count=new.count, inner=_restart(old.inner, new.inner))
        return old

    return jax.tree.map(pick, carried, fresh, is_leaf=is_node)


def continue_optimizer_state(backend: Any, saved: Any, stage: str) -> None:
    """Put the previous stage's optimizer state (restored as saved) into `backend`, leaf by leaf by path."""
    fresh = backend.opt_state
    carried = match_by_path(saved, fresh, "optimizer state", stage, skip=_is_hyper)
    backend._set(opt_state=reset_anchor(_restart(carried, fresh), fresh))
