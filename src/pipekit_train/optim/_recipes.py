"""Finetuning recipes on `TrainingLoop`: a gradient rule (`SAM`) and parameter groups (`ParamGroup`).

These are plain configuration values; the Equinox adapter compiles them into its step (the SAM pass, per-group
optimizers through `optax.multi_transform`, L2-SP anchors in the optimizer state). ``docs/recipes.md`` says when to
use which. Parameter paths are dotted: ``encoder.layers.0.weight`` (`param_path`); a group's `pattern` is an
`fnmatch` pattern over them (``encoder.*``, ``*.bias``).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Sequence
from typing import Any

from pipekit import ConfigError, Operator

__all__ = ["SAM", "GradientRule", "ParamGroup", "group_labels", "param_path"]


class GradientRule(Operator, register=False):
    """Base of the rules that turn a batch into the gradient the optimizer sees (`TrainingLoop.gradient`)."""


class SAM(GradientRule):
    """Sharpness-aware minimization: the gradient at the worst nearby point, ``w + rho * g / ||g||``.

    Each step takes two gradients on the same batch (and the same dropout key): ``g`` at the weights, then the
    gradient at the perturbed weights, which the optimizer uses. The logged loss is the first pass's.

    Args:
        rho: The radius of the neighbourhood (> 0). 0.05 is the paper's default for SGD; ASAM uses larger ones
            (0.5-2.0) because its perturbation is scaled by the weights.
        adaptive: ASAM: the perturbation is ``rho * w² g / ||w g||`` (elementwise), so it is invariant to rescaling
            the weights.
        eps: Added to the norm in the denominator (> 0).

    Example:
        >>> SAM(rho=0.1, adaptive=True)
        SAM(rho=0.1, adaptive=True)
    """

    rho: float = 0.05
    adaptive: bool = False
    eps: float = 1e-12

    def validate(self) -> None:
        if not (math.isfinite(self.rho) and self.rho > 0):
            raise ConfigError(f"SAM.rho must be a float > 0, got {self.rho}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ConfigError(f"SAM.eps must be a float > 0, got {self.eps}")


class ParamGroup(Operator):
    """Parameters selected by a path pattern, trained with their own settings (`TrainingLoop.param_groups`).

    A parameter belongs to the first group whose `pattern` matches its dotted path (`param_path`); parameters no
    group matches keep the loop's `optimizer_config` as it is.

    Args:
        pattern: An `fnmatch` pattern over dotted paths: ``encoder.*``, ``*.bias``, ``head.layers.1.*``.
        lr_scale: Multiplies the learning rate (and its schedule) for this group (>= 0).
        weight_decay: Replaces `optimizer_config.weight_decay` for this group (null: keep it).
        frozen: No updates and no optimizer state (unless `unfreeze_at` is set).
        unfreeze_at: With `frozen`, the loop step from which the group trains. Its optimizer state exists from
            the start and stays untouched while frozen (a mask inside the compiled step: no recompile).
        l2sp: L2-SP strength: decoupled weight decay toward the weights the stage started from, not toward zero
            (the update gains ``l2sp * (w - w_start)``, scaled by the learning rate like adamw's decay).
        name: How metrics name the group (``diag/grad_norm/<name>``); null: made from the pattern (``encoder.*`` →
            ``encoder``, ``*.bias`` → ``any.bias``).

    Example:
        >>> ParamGroup(pattern="encoder.*", lr_scale=0.1)
        ParamGroup(pattern='encoder.*', lr_scale=0.1)
    """

    pattern: str
    lr_scale: float = 1.0
    weight_decay: float | None = None
    frozen: bool = False
    unfreeze_at: int | None = None
    l2sp: float = 0.0
    name: str | None = None

    @classmethod
    def example(cls) -> ParamGroup:
        return cls(pattern="encoder.*", lr_scale=0.1, l2sp=0.01)

    def validate(self) -> None:
        where = f"ParamGroup(pattern={self.pattern!r})"
        if not self.pattern:
            raise ConfigError("ParamGroup.pattern must be a non-empty pattern such as 'encoder.*', got ''")
        if not (math.isfinite(self.lr_scale) and self.lr_scale >= 0):
            raise ConfigError(f"{where}.lr_scale must be a float >= 0, got {self.lr_scale}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"{where}.weight_decay must be a float >= 0 or null, got {self.weight_decay}")
        if not (math.isfinite(self.l2sp) and self.l2sp >= 0):
            raise ConfigError(f"{where}.l2sp must be a float >= 0, got {self.l2sp}")
        if self.unfreeze_at is not None:
            if not self.frozen:
                raise ConfigError(f"{where}.unfreeze_at needs frozen: true (a group that is not frozen trains already)")
            if self.unfreeze_at < 1:
                raise ConfigError(f"{where}.unfreeze_at must be a step >= 1 or null, got {self.unfreeze_at}")
        if self.frozen and self.unfreeze_at is None and (self.l2sp or self.weight_decay or self.lr_scale != 1.0):
            raise ConfigError(
                f"{where} is frozen for the whole stage: lr_scale, weight_decay and l2sp would do nothing; remove "
                "them or set unfreeze_at"
            )

    @property
    def label(self) -> str:
        """`name`, or one made from the pattern that metric stores accept: ``encoder.*`` → ``encoder``,
        ``*.bias`` → ``any.bias``."""
        if self.name:
            return self.name
        base = self.pattern[:-2] if self.pattern.endswith(".*") and len(self.pattern) > 2 else self.pattern
        return re.sub(r"[^\w.\-]", "_", base.replace("*", "any"))


def param_path(path: Sequence[Any]) -> str:
    """The dotted name of a `jax.tree_util` key path: ``encoder.layers.0.weight``."""
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def group_labels(
    paths: Sequence[str], groups: Sequence[ParamGroup], where: str = "TrainingLoop.param_groups"
) -> list[int]:
    """For each path, the index of the first group matching it, or ``-1``; a group matching nothing is an error."""
    labels = []
    for path in paths:
        labels.append(next((i for i, g in enumerate(groups) if fnmatch.fnmatchcase(path, g.pattern)), -1))
    for i, group in enumerate(groups):
        if i not in labels:
            matched = any(fnmatch.fnmatchcase(p, group.pattern) for p in paths)
            why = "every parameter it matches is taken by an earlier group" if matched else "it matches no parameter"
            shown = ", ".join(paths[:6]) + ("..." if len(paths) > 6 else "")
            raise ConfigError(f"{where}[{i}] pattern {group.pattern!r}: {why}; the model's parameters are {shown}")
    names = [g.label for g in groups]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"{where}: two groups share the name {sorted(dupes)[0]!r}; give each a distinct name")
    return labels
