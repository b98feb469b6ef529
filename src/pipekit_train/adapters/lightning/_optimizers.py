"""``optimizer_config`` → ``torch.optim``, with the JAX backends' schedule, clipping, masking and accumulation.

The keys are read once, by `pipekit_train.optim._config.resolve_optimizer_config`; `TorchOptimizer` maps the result:

=================  =====================================================================================
key                torch
=================  =====================================================================================
name               ``torch.optim.AdamW``, ``Adam``, ``SGD``, ``RMSprop`` (``alpha`` = ``b2``); ``lion`` is refused
schedule           the JAX backends' schedule (same numbers, by loop step), times the run-time scale, written
                   into each param group's ``lr`` before each update
weight_decay       decoupled, as optax's ``add_decayed_weights``: AdamW's own; ``p *= 1 - lr * wd`` for SGD/RMSprop
decay_biases       ``false``: parameters with ndim <= 1 are in a param group without weight decay
grad_clip_norm     ``torch.nn.utils.clip_grad_norm_`` on the (accumulated) gradient
accum              the mean gradient of ``accum`` steps, then one update (the schedule still counts loop steps)
=================  =====================================================================================

A key torch cannot honour (``name: lion``, ``nesterov`` for ``rmsprop``) is a `pipekit.ConfigError` naming the
backend. The optimizer's state has a fixed structure from the start (zeros, which ``torch.optim`` treats exactly as
its lazily created state), so checkpoints restore into it as arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipekit import ConfigError
from pipekit_train.optim import resolve_optimizer_config

__all__ = ["TorchOptimizer", "build_torch_optimizer", "check_torch_optimizer_config"]


def check_torch_optimizer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config; a `pipekit.ConfigError` naming the backend for what torch cannot honour."""
    cfg = resolve_optimizer_config(config)
    if cfg["name"] == "lion":
        raise ConfigError(
            "backend 'lightning' cannot honour optimizer_config.name='lion': torch.optim has no Lion optimizer; "
            "use adamw, adam, sgd or rmsprop"
        )
    if cfg["name"] == "rmsprop" and cfg.get("nesterov"):
        raise ConfigError(
            "backend 'lightning' cannot honour optimizer_config.nesterov for name='rmsprop': torch.optim.RMSprop has "
            "no Nesterov momentum; set nesterov: false, or use name: sgd with nesterov: true"
        )
    return cfg


def _check_args(max_steps: Any, accum: Any, grad_clip_norm: Any) -> None:
    for name, value in (("max_steps", max_steps), ("accum", accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"build_torch_optimizer: {name} must be an int >= 1, got {value!r}")
    if grad_clip_norm is not None and (
        isinstance(grad_clip_norm, bool)
        or not isinstance(grad_clip_norm, (int, float))
        or not (math.isfinite(grad_clip_norm) and grad_clip_norm > 0)
    ):
        raise ConfigError(f"build_torch_optimizer: grad_clip_norm must be a float > 0 or None, got {grad_clip_norm!r}")


def schedule_table(config: Mapping[str, Any], max_steps: int) -> np.ndarray:
    """The scheduled learning rate of every loop step ``0..max_steps`` (one vectorised call of the JAX schedule)."""
    import jax
    import jax.numpy as jnp

    from pipekit_train.backends.kit import build_schedule

    fn = build_schedule(config, max_steps=max_steps)
    values = np.asarray(jax.vmap(fn)(jnp.arange(max_steps + 1)), np.float64)
    return np.broadcast_to(values, (max_steps + 1,)).copy()  # a constant schedule gives one number


class TorchOptimizer:
    """A ``torch.optim`` optimizer driven by loop steps: schedule, run-time scale, clipping, accumulation.

    Call `step` once per loop step after ``loss.backward()``: it updates every `accum` steps (the gradients summed
    over the micro-steps are divided by `accum` first) and zeroes the gradients after each update.

    Attributes:
        optimizer: the ``torch.optim.Optimizer`` (param groups: decayed, then not decayed).
        scale: the run-time learning-rate multiplier (`ReduceLROnPlateau`), part of `state_arrays`.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        params: Sequence[torch.nn.Parameter],
        *,
        max_steps: int,
        grad_clip_norm: float | None = None,
        accum: int = 1,
    ) -> None:
        cfg = check_torch_optimizer_config(config)
        _check_args(max_steps, accum, grad_clip_norm)
        self.config, self.cfg = dict(config), cfg
        self.max_steps, self.accum, self.clip = max_steps, accum, grad_clip_norm
        self.params = list(params)
        self.table = schedule_table(config, max_steps)
        self.scale = 1.0
        decay = float(cfg.get("weight_decay") or 0.0)
        decayed = [p for p in self.params if cfg.get("decay_biases") or p.ndim > 1] if decay else []
        kept = [p for p in self.params if not any(p is d for d in decayed)]
        self.decay = decay
        self.manual_decay: list[torch.Tensor] = []
        name = cfg["name"]
        groups: list[dict[str, Any]] = []
        if name == "adamw":
            groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decayed, decay), (kept, 0.0)) if ps]
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                groups, lr=0.0, betas=(cfg["b1"], cfg["b2"]), eps=cfg["eps"]
            )
        else:
            groups = [{"params": self.params}]
            self.manual_decay = list(decayed)
            if name == "adam":
                self.optimizer = torch.optim.Adam(groups, lr=0.0, betas=(cfg["b1"], cfg["b2"]), eps=cfg["eps"])
            elif name == "sgd":
                momentum = float(cfg["momentum"])
                self.optimizer = torch.optim.SGD(
                    groups, lr=0.0, momentum=momentum, nesterov=bool(cfg["nesterov"]) and momentum > 0
                )
            else:  # rmsprop
                self.optimizer = torch.optim.RMSprop(
                    groups, lr=0.0, alpha=cfg["b2"], eps=cfg["eps"], momentum=float(cfg["momentum"])
                )
        self._init_state()

    # The state -----------------------------------------------------------------------------------------------
    def _init_state(self) -> None:
        """Create torch's lazily built state now (one update with zero gradients at lr 0, then zeroed)."""
        with torch.no_grad():
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        self.keys = [sorted(k for k, v in self.optimizer.state[p].items() if isinstance(v, torch.Tensor))
                     for p in self.params]  # fmt: skip

    #: The loop step a new schedule segment began at (an extension with ``new_segment``: the schedule counts from
    #: there; torch's own step counts, Adam's bias correction, go on).
    segment_start = 0

    def lr_at(self, step: int) -> float:
        """The scheduled rate (without the scale) at loop step `step`."""
        step -= self.segment_start
        if 0 <= step < len(self.table):
            return float(self.table[step])
        from pipekit_train.backends.kit import learning_rate_at

        return learning_rate_at(self.config, step, self.max_steps)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The optimizer's state as host arrays, by ``p<index>_<name>``, with the run-time scale."""
        out = {"lr_scale": np.asarray(self.scale, np.float32)}
        for i, (p, keys) in enumerate(zip(self.params, self.keys)):
            state = self.optimizer.state[p]
            for k in keys:
                out[f"p{i}_{k}"] = state[k].detach().cpu().numpy().copy()
        return out

    def load_state_arrays(self, arrays: Mapping[str, Any]) -> None:
        self.scale = float(np.asarray(arrays["lr_scale"]))
        with torch.no_grad():
            for i, (p, keys) in enumerate(zip(self.params, self.keys)):
                state = self.optimizer.state[p]
                for k in keys:
                    state[k].copy_(torch.from_numpy(np.array(arrays[f"p{i}_{k}"], copy=True)))

    def grads(self) -> list[np.ndarray]:
        return [p.grad.detach().cpu().numpy().copy() for p in self.params]  # type: ignore[union-attr]

    def load_grads(self, arrays: Sequence[Any]) -> None:
        with torch.no_grad():
            for p, a in zip(self.params, arrays):
                p.grad.copy_(torch.from_numpy(np.array(a, copy=True)))  # type: ignore[union-attr]

    # The update ----------------------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """After ``backward()`` of loop step `step`: update when an accumulation window closes."""
        accum = self.accum
        if (step + 1) % accum:
            return
        params = self.params
        with torch.no_grad():
            if accum > 1:
                for p in params:
                    p.grad.div_(accum)  # type: ignore[union-attr]
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(params, self.clip)
            lr = self.lr_at(step + 1 - accum) * self.scale
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.manual_decay:
                factor = 1.0 - lr * self.decay
                for t in self.manual_decay:
                    t.mul_(factor)
            self.optimizer.step()
            for p in params:
                p.grad.zero_()  # type: ignore[union-attr]


def build_torch_optimizer(
    config: Mapping[str, Any],
    params: Sequence[torch.nn.Parameter],
    *,
    max_steps: int,
    grad_clip_norm: float | None = None,
    accum: int = 1,
) -> TorchOptimizer:
    """The `TorchOptimizer` an ``optimizer_config`` describes, for `params` (the same keys as every backend).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = build_torch_optimizer({"name": "sgd", "lr": 0.5, "momentum": 0.9}, [w], max_steps=10)
        >>> type(opt.optimizer).__name__, opt.optimizer.defaults["momentum"]
        ('SGD', 0.9)
        >>> w.sum().backward(); opt.step(0); w.tolist()
        [0.5, 0.5]
    """
    return TorchOptimizer(config, params, max_steps=max_steps, grad_clip_norm=grad_clip_norm, accum=accum)
