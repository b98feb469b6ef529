"""`optimizer_config.lora`: low-rank adapters, the settings and which layers they go on (backend-neutral).

``lora: {rank, alpha, targets}`` trains, for each targeted linear layer ``y = W x + b``, two small matrices
``A`` (``rank x in``, random) and ``B`` (``out x rank``, zeros) so that the layer computes
``W x + b + (alpha / rank) B A x`` while ``W`` and ``b`` stay frozen (Hu et al. 2021). A backend that lists the
``lora`` capability honours it (pre-flight refuses it elsewhere). `resolve_lora` is the one reading of the
mapping; `select_targets` the one matching of `targets` against a model's linear layers, by part path.

A part path is written as `pipekit_train.Transfer` writes one: ``layers[0]``, ``blocks[1].attention.query_proj``.
A target is a glob over those paths: ``*`` matches any run of characters (dots and indices included), ``?`` one;
``layers[*]`` is every element of ``layers``. Matching is done on the dotted form (``layers.0``, as
`ParamGroup` patterns are), so ``layers.*`` means the same. A target also takes every linear layer *inside* a part
it matches: ``encoder`` is all of the encoder's linear layers.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pipekit import ConfigError, suggestion

__all__ = ["DEFAULT_TARGETS", "LoraSettings", "lora_settings", "resolve_lora", "select_targets"]

#: The parts adapters go on when `targets` is not given: a transformer's attention and MLP projections.
DEFAULT_TARGETS: tuple[str, ...] = ("*.attention.*_proj", "*.mlp.up", "*.mlp.down")

_KEYS = ("rank", "alpha", "targets")


class LoraSettings(NamedTuple):
    """A resolved ``optimizer_config.lora``.

    Attributes:
        rank: The adapters' inner size (>= 1).
        alpha: The adapters' output is scaled by ``alpha / rank`` (`scale`).
        targets: Glob patterns over part paths, or ``None`` for `DEFAULT_TARGETS`.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] | None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_lora(value: Any) -> dict[str, Any]:
    """Check ``optimizer_config.lora`` and fill in its defaults: ``{rank, alpha, targets}``.

    ``rank`` defaults to 8, ``alpha`` to the rank (a scale of 1), ``targets`` to ``None`` (the attention and MLP
    projections, `DEFAULT_TARGETS`). A resolved mapping resolves to itself.

    Example:
        >>> resolve_lora({"rank": 4, "targets": ["layers[*]"]})
        {'rank': 4, 'alpha': 4.0, 'targets': ['layers[*]']}
    """
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"optimizer_config.lora must be a mapping such as {{rank: 8, alpha: 16, targets: ['layers[*]']}}, "
            f"got {value!r}"
        )
    for key in value:
        if key not in _KEYS:
            raise ConfigError(
                f"unknown optimizer_config.lora key {key!r}{suggestion(str(key), _KEYS)}; allowed keys: "
                f"{', '.join(_KEYS)}"
            )
    rank = value.get("rank", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"optimizer_config.lora.rank must be an int >= 1, got {rank!r}")
    alpha = value.get("alpha", rank)
    if alpha is None:
        alpha = rank
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        hint = " (YAML reads 1e1 as text; write 10.0)" if isinstance(alpha, str) else ""
        raise ConfigError(f"optimizer_config.lora.alpha must be a float > 0, got {alpha!r}{hint}")
    targets = value.get("targets")
    if targets is not None:
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, Sequence) or not targets:
            raise ConfigError(
                f"optimizer_config.lora.targets must be a non-empty list of part-path patterns such as "
                f"['layers[*]'], or null for the attention and MLP projections, got {targets!r}"
            )
        for i, pattern in enumerate(targets):
            if not isinstance(pattern, str) or not pattern.strip():
                raise ConfigError(
                    f"optimizer_config.lora.targets[{i}] must be a part-path pattern such as 'layers[*]' or "
                    f"'*.attention.*_proj', got {pattern!r}"
                )
        targets = list(targets)
    return {"rank": rank, "alpha": float(alpha), "targets": targets}


def lora_settings(config: Mapping[str, Any]) -> LoraSettings | None:
    """The `LoraSettings` of an ``optimizer_config`` (raw or resolved), or ``None`` when it has no ``lora``."""
    value = config.get("lora")
    if value is None:
        return None
    lora = resolve_lora(value)
    targets = tuple(lora["targets"]) if lora["targets"] is not None else None
    return LoraSettings(rank=lora["rank"], alpha=lora["alpha"], targets=targets)


def _dotted(path: str) -> str:
    """``blocks[0].attention`` → ``blocks.0.attention`` (``[*]`` → ``.*``): the form patterns match on."""
    return re.sub(r"\[([^\]]*)\]", r".\1", path).lstrip(".")


def _matches(path: str, pattern: str) -> bool:
    """Whether `pattern` matches `path` or one of the parts it lies in (``encoder`` takes ``encoder.layers[0]``)."""
    dotted, glob = _dotted(path), _dotted(pattern)
    steps = dotted.split(".")
    return any(fnmatch.fnmatchcase(".".join(steps[:n]), glob) for n in range(1, len(steps) + 1))


def select_targets(paths: Sequence[str], settings: LoraSettings, model: str) -> list[str]:
    """The paths of `paths` (a model's linear layers, as part paths) that `settings.targets` select, in order.

    A target that matches no linear layer is an error naming the closest path and the model's linear layers; so is
    the default when it matches nothing (a model that is not a transformer), asking for ``targets``.
    """
    shown = ", ".join(paths[:8]) + (f", ... ({len(paths)} in all)" if len(paths) > 8 else "") or "none"
    if settings.targets is None:
        chosen = [p for p in paths if any(_matches(p, t) for t in DEFAULT_TARGETS)]
        if not chosen:
            example = _example_pattern(paths)
            raise ConfigError(
                f"optimizer_config.lora.targets is not set, and its default (the attention and MLP projections: "
                f"{', '.join(DEFAULT_TARGETS)}) matches no linear layer of {model}; its linear layers are {shown}: "
                f"set optimizer_config.lora.targets{f', e.g. [{example!r}]' if example else ''}"
            )
        return chosen
    for i, pattern in enumerate(settings.targets):
        if not any(_matches(p, pattern) for p in paths):
            parts = sorted({_part(p, n) for p in paths for n in range(1, len(_dotted(p).split(".")) + 1)})
            raise ConfigError(
                f"optimizer_config.lora.targets[{i}] {pattern!r} matches no linear layer of {model}"
                f"{suggestion(pattern, [*paths, *parts])}; its linear layers are {shown}"
            )
    return [p for p in paths if any(_matches(p, t) for t in settings.targets)]


def _part(path: str, n: int) -> str:
    """The first `n` steps of part path `path`, written as a part path (``layers[0]`` of ``layers[0].weight``)."""
    out = ""
    for name, index in re.findall(r"\.?([A-Za-z_]\w*)|\[(\d+)\]", path)[:n]:
        out += f"[{index}]" if index else (f".{name}" if out else name)
    return out


def _example_pattern(paths: Sequence[str]) -> str:
    """A pattern for the model's first list of linear layers (``layers[*]``), or its first linear layer."""
    if not paths:
        return ""
    first = paths[0]
    match = re.match(r"(.*?)\[\d+\]$", first)
    return f"{match.group(1)}[*]" if match else first
