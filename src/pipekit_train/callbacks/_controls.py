"""Training controls as callbacks: `EarlyStopping`, `ReduceLROnPlateau`, `EMA`.

Their counters live in ``ctx.state_of(self)`` (JSON), so a resumed run continues them exactly; the EMA weights
live with the parameters in the backend and are checkpointed with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pipekit import ConfigError, suggestion

from ..optim._schedules import Schedule
from ._base import Callback, TrainContext

Mode = Literal["min", "max"]


def _monitored(owner: str, monitor: str, metrics: Mapping[str, float]) -> float:
    if monitor not in metrics:
        raise ConfigError(
            f"{owner}.monitor {monitor!r} is not among the validation metrics {sorted(metrics)}"
            f"{suggestion(monitor, metrics)}"
        )
    return float(metrics[monitor])


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` validation passes.

    The stop is recorded as the run's stop reason (``early stopping: ...``); the stage then ends normally, so a
    `Sequential` goes on to its next stage.

    Args:
        monitor: The validation metric watched (``validate/loss``, ``validate/accuracy``, ...).
        mode: ``"min"`` if a lower `monitor` is better, ``"max"`` if a higher one is.
        patience: Validation passes without an improvement before the stage stops (>= 1).
        min_delta: How much `monitor` must beat its best by to count as an improvement (>= 0).
    """

    monitor: str = "validate/loss"
    mode: Mode = "min"
    patience: int = 5
    min_delta: float = 1e-4

    def validate(self) -> None:
        if self.patience < 1:
            raise ConfigError(f"EarlyStopping.patience must be a positive int, got {self.patience}")
        if self.min_delta < 0:
            raise ConfigError(f"EarlyStopping.min_delta must be >= 0, got {self.min_delta}")

    def initial_state(self) -> dict[str, Any]:
        return {"best": None, "best_step": None, "bad_evals": 0}

    def on_eval_end(self, ctx: TrainContext, metrics: Mapping[str, float]) -> None:
        state = ctx.state_of(self)
        value = _monitored("EarlyStopping", self.monitor, metrics)
        best = state["best"]
        improved = best is None or (
            value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta
        )
        if improved and math.isfinite(value):
            state.update(best=value, best_step=ctx.step, bad_evals=0)
            return
        state["bad_evals"] += 1
        if state["bad_evals"] >= self.patience:
            ctx.request_stop(
                f"early stopping: {self.monitor} did not improve by more than {self.min_delta} in "
                f"{self.patience} validation passes (best {best:.6g} at step {state['best_step']})"
            )


class ReduceLROnPlateau(Callback):
    """Multiply the learning rate by `factor` when `monitor` stops improving (PyTorch's rule).

    After each validation pass: the value is an improvement if it beats the best by more than `threshold`
    (relative, or absolute with ``threshold_mode: abs``); after more than `patience` passes without one, the
    learning-rate scale is multiplied by `factor` (never below `min_scale`) and `cooldown` passes follow in which
    bad passes are not counted. The scale multiplies the optimizer's schedule and is checkpointed.

    Args:
        monitor: The validation metric watched.
        mode: ``"min"`` if a lower `monitor` is better, ``"max"`` if a higher one is.
        factor: What the learning-rate scale is multiplied by at a plateau, in (0, 1).
        patience: Validation passes without an improvement tolerated before a reduction (>= 0).
        cooldown: Validation passes after a reduction in which bad passes are not counted (>= 0).
        min_scale: The learning-rate scale never goes below this (>= 0).
        threshold: How much a value must beat the best by to be an improvement.
        threshold_mode: ``"rel"``: `threshold` is relative to the best; ``"abs"``: absolute.
    """

    monitor: str = "validate/loss"
    mode: Mode = "min"
    factor: float = 0.1
    patience: int = 10
    cooldown: int = 0
    min_scale: float = 0.0
    threshold: float = 1e-4
    threshold_mode: Literal["rel", "abs"] = "rel"

    def validate(self) -> None:
        if not 0.0 < self.factor < 1.0:
            raise ConfigError(f"ReduceLROnPlateau.factor must be in (0, 1), got {self.factor}")
        if self.patience < 0 or self.cooldown < 0:
            raise ConfigError("ReduceLROnPlateau.patience and cooldown must be >= 0")
        if self.min_scale < 0:
            raise ConfigError(f"ReduceLROnPlateau.min_scale must be >= 0, got {self.min_scale}")

    def initial_state(self) -> dict[str, Any]:
        return {"best": None, "num_bad": 0, "cooldown_left": 0, "reductions": []}

    def _better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        if self.threshold_mode == "rel":
            edge = best * (1 - self.threshold) if self.mode == "min" else best * (1 + self.threshold)
        else:
            edge = best - self.threshold if self.mode == "min" else best + self.threshold
        return value < edge if self.mode == "min" else value > edge

    def on_eval_end(self, ctx: TrainContext, metrics: Mapping[str, float]) -> None:
        state = ctx.state_of(self)
        value = _monitored("ReduceLROnPlateau", self.monitor, metrics)
        if self._better(value, state["best"]):
            state["best"] = value
            state["num_bad"] = 0
        else:
            state["num_bad"] += 1
        if state["cooldown_left"] > 0:
            state["cooldown_left"] -= 1
            state["num_bad"] = 0
        if state["num_bad"] > self.patience:
            old = ctx.lr_scale
            new = max(old * self.factor, self.min_scale)
            if old - new > 1e-12:
                ctx.lr_scale = new
                state["reductions"].append([ctx.step, new])
                ctx.writer.write(
                    {
                        "type": "event",
                        "context": "train",
                        "step": ctx.step,
                        "epoch": ctx.epoch,
                        "event": "reduce_lr",
                        "lr_scale": new,
                    }
                )
            state["cooldown_left"] = self.cooldown
            state["num_bad"] = 0


class EMA(Callback):
    """Keep an exponential moving average of the weights, updated after every step inside the compiled step.

    ``ema = d * ema + (1 - d) * params`` with ``d = decay`` (or ``min(decay, (1 + t) / (10 + t))`` at step ``t``
    with `warmup`). With `evaluate_with_ema`, validation (and so best-checkpoint selection and early stopping)
    uses the EMA weights; with `return_ema`, the stage returns them. The EMA is checkpointed with the params.

    `decay` may be a schedule (``decay: {type: Cosine, start: 0.9, end: 0.999, steps: 2000}``): a short memory
    while the weights move fast, a long one later. It is evaluated in the compiled step at the traced step (no
    recompile, exact on resume) and logged as ``schedule/ema_decay``; every value it takes must be in (0, 1).

    Args:
        decay: The EMA's ``d``, in (0, 1), or a `Schedule` of it over the steps.
        warmup: Use ``min(decay, (1 + t) / (10 + t))`` at step ``t``: a short memory at the start.
        evaluate_with_ema: Validate (and so pick best checkpoints and stop early) with the EMA weights.
        return_ema: The stage returns the EMA weights instead of the raw ones.
    """

    decay: float | Schedule = 0.999
    warmup: bool = True
    evaluate_with_ema: bool = True
    return_ema: bool = True
    order: int = -10

    def validate(self) -> None:
        if isinstance(self.decay, Schedule):
            low, high = self.decay.bounds()
            if not (low > 0.0 and high < 1.0):
                raise ConfigError(
                    f"EMA.decay must stay in (0, 1) at every step, but {self.decay!r} ranges over [{low}, {high}]"
                )
        elif not 0.0 < self.decay < 1.0:
            raise ConfigError(f"EMA.decay must be in (0, 1), got {self.decay}")
