"""The pipekit losses as torch functions: `to_torch_loss` and `register_torch_loss`.

pipekit's losses (`MSE`, `NLL`, `KL`, `CrossEntropy`, `Composite`) are JAX functions; this backend maps each
onto the same formula in torch, returning ``(scalar, aux)`` exactly as the JAX loss does, so the logged metrics
(``loss``, ``accuracy``, ``loss/MSE_0`` ...) have the same names and values as on the Equinox backend. A loss type
without a mapping is refused before anything trains; map your own with `register_torch_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pipekit import ConfigError, ShapeError
from pipekit_train.backends.kit import fixed_value
from pipekit_train.losses import KL, MSE, NLL, Composite, CrossEntropy, Loss, LossFunction

__all__ = ["register_torch_loss", "to_torch_loss", "torch_loss_types"]

TorchLoss = Callable[[Any, Any], Any]
_MAPPERS: dict[type, Callable[[Any], TorchLoss]] = {}
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_MSG_FUNCTION = (
    "backend 'lightning' cannot train with {loss!r}, a loss given as a plain function: such a loss runs inside the "
    "JAX step of the equinox and keras backends; here write it as a Loss subclass and give it a torch version "
    "(pipekit_train.adapters.lightning.register_torch_loss)"
)


def register_torch_loss(loss_type: type) -> Callable[[Callable[[Any], TorchLoss]], Callable[[Any], TorchLoss]]:
    """Register ``mapper(loss_op) -> fn(predicted, target)`` (torch tensors in, a scalar tensor or ``(scalar,
    {name: tensor})`` out) for pipekit losses of `loss_type` on the ``lightning`` backend.

    Example:
        >>> from pipekit_train import Loss
        >>> class DocL1(Loss, register=False):
        ...     def __call__(self, predicted, target):
        ...         import jax.numpy as jnp
        ...         return jnp.mean(jnp.abs(predicted - target))
        >>> @register_torch_loss(DocL1)
        ... def _l1(loss):
        ...     return lambda p, t: (p - t).abs().mean()
        >>> import torch
        >>> float(to_torch_loss(DocL1())(torch.ones(2), torch.zeros(2)))
        1.0
    """

    def decorator(mapper: Callable[[Any], TorchLoss]) -> Callable[[Any], TorchLoss]:
        _MAPPERS[loss_type] = mapper
        return mapper

    return decorator


def torch_loss_types() -> list[str]:
    """The loss types the ``lightning`` backend maps, sorted by name."""
    return sorted(t.__name__ for t in _MAPPERS)


def to_torch_loss(loss: Loss) -> TorchLoss:
    """`loss` as ``fn(predicted, target)`` on torch tensors, giving the same values (and aux metrics).

    Example:
        >>> import torch
        >>> from pipekit_train.losses import MSE
        >>> float(to_torch_loss(MSE())(torch.tensor([1.0, 2.0]), torch.zeros(2)))
        2.5
    """
    if not isinstance(loss, Loss):
        raise ConfigError(f"to_torch_loss expects a pipekit_train Loss, got {type(loss).__name__}")
    if isinstance(loss, LossFunction):
        raise ConfigError(_MSG_FUNCTION.format(loss=loss))
    for cls in type(loss).__mro__:
        mapper = _MAPPERS.get(cls)
        if mapper is not None:
            return mapper(loss)
    raise ConfigError(
        f"backend 'lightning' has no torch version of loss {type(loss).__name__}; it maps "
        f"{', '.join(torch_loss_types())} (add one with pipekit_train.adapters.lightning.register_torch_loss)"
    )


# Helpers -------------------------------------------------------------------------------------------------------
def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in _leaves(t)]
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    return [tree]


def _pairs(name: str, predicted: Any, target: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    p, t = _leaves(predicted), _leaves(target)
    if len(p) != len(t):
        raise ShapeError(f"{name}: predicted has {len(p)} array leaves but target has {len(t)}")
    for a, b in zip(p, t):
        if a.shape != b.shape:
            raise ShapeError(f"{name}: predicted shape {tuple(a.shape)} != target shape {tuple(b.shape)}")
    return p, t


def _reduce(values: list[torch.Tensor], reduction: str) -> Any:
    if reduction == "none":
        return values[0] if len(values) == 1 else values
    if len(values) == 1:
        return values[0].sum() if reduction == "sum" else values[0].mean()
    total = sum(v.sum() for v in values)
    return total if reduction == "sum" else total / max(sum(v.numel() for v in values), 1)


def _gaussian(name: str, value: Any, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TypeError(f"{name}: {role} must be a (mean, log_var) pair or a torch distribution")
    return value[0], value[1]


# The mappings --------------------------------------------------------------------------------------------------
@register_torch_loss(MSE)
def _mse(loss: MSE) -> TorchLoss:
    def fn(predicted: Any, target: Any) -> Any:
        p, t = _pairs("MSE", predicted, target)
        return _reduce([torch.square(a - b) for a, b in zip(p, t)], loss.reduction)

    return fn


@register_torch_loss(NLL)
def _nll(loss: NLL) -> TorchLoss:
    def fn(predicted: Any, target: Any) -> Any:
        if hasattr(predicted, "log_prob"):
            return _reduce([-predicted.log_prob(target)], loss.reduction)
        mean, log_var = _gaussian("NLL", predicted, "predicted")
        (mean,), (target,) = _pairs("NLL", mean, target)
        values = _HALF_LOG_2PI + 0.5 * (log_var + torch.square(target - mean) * torch.exp(-log_var))
        return _reduce([values], loss.reduction)

    return fn


@register_torch_loss(KL)
def _kl(loss: KL) -> TorchLoss:
    def fn(q: Any, p: Any) -> Any:
        if isinstance(q, torch.distributions.Distribution):
            values = torch.distributions.kl_divergence(q, p)
        else:
            mu_q, lv_q = _gaussian("KL", q, "q")
            mu_p, lv_p = _gaussian("KL", p, "p")
            if mu_q.shape != mu_p.shape:
                raise ShapeError(f"KL: q shape {tuple(mu_q.shape)} != p shape {tuple(mu_p.shape)}")
            values = 0.5 * (lv_p - lv_q + (torch.exp(lv_q) + torch.square(mu_q - mu_p)) * torch.exp(-lv_p) - 1.0)
        if loss.reduction == "batchmean":
            batch = values.shape[0] if values.ndim else 1
            return values.sum() / max(batch, 1)
        return _reduce([values], loss.reduction)

    return fn


@register_torch_loss(CrossEntropy)
def _cross_entropy(loss: CrossEntropy) -> TorchLoss:
    smoothing = float(loss.label_smoothing)

    def fn(logits: Any, target: Any) -> Any:
        classes = logits.shape[-1]
        flat = logits.reshape(-1, classes)
        if not target.is_floating_point():
            if tuple(target.shape) != tuple(logits.shape[:-1]):
                raise ShapeError(
                    f"CrossEntropy: integer labels of shape {tuple(target.shape)} need logits of shape "
                    f"{tuple(target.shape)} + (classes,), got {tuple(logits.shape)}"
                )
            labels = target.reshape(-1).long()
            value = F.cross_entropy(flat, labels, label_smoothing=smoothing)
        else:
            if target.shape != logits.shape:
                raise ShapeError(
                    f"CrossEntropy: one-hot target shape {tuple(target.shape)} != logits shape {tuple(logits.shape)}"
                )
            probs = target.reshape(-1, classes).to(logits.dtype)
            labels = probs.argmax(-1)
            value = F.cross_entropy(flat, probs, label_smoothing=smoothing)
        accuracy = (flat.argmax(-1) == labels).float().mean()
        return value, {"accuracy": accuracy}

    return fn


@register_torch_loss(Composite)
def _composite(loss: Composite) -> TorchLoss:
    parts = [
        (fixed_value(w, f"Composite.components[{i}] weight"), f"{type(c).__name__}_{i}", to_torch_loss(c))
        for i, (w, c) in enumerate(loss.components)
    ]

    def fn(predicted: Any, target: Any) -> Any:
        terms: dict[str, Any] = {}
        total: Any = 0.0
        for weight, name, part in parts:
            value, aux = split(part(predicted, target))
            terms[name] = value
            for k, v in aux.items():
                terms[f"{name}/{k}"] = v
            total = total + weight * value
        return total, terms

    return fn


def split(out: Any) -> tuple[Any, dict[str, Any]]:
    """``(scalar, aux)`` of what a torch loss returned (see `pipekit_train.split_loss_output`)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], dict(out[1])
    return out, {}
