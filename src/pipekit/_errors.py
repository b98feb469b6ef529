"""Errors raised by pipekit, and the closest-match helper they share."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PipekitError(ValueError):
    """Base class of pipekit's errors. A `ValueError`, so `except ValueError` catches it."""


class ConfigError(PipekitError):
    """A configuration value breaks a rule: wrong type, unknown field, unknown operator.

    Attributes:
        where: ``file:line:column`` of the offending YAML node, or ``None`` for Python-built values.
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        self.where = where
        self.bare_message = message
        super().__init__(f"{where}: {message}" if where else message)


class ShapeError(PipekitError):
    """An array leaf does not have the shape or dtype a check expected."""


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The up-to-`n` names in `candidates` closest to `name` (case-insensitive)."""
    pool = sorted(set(candidates))
    lowered = {c.lower(): c for c in pool}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.6)
    return [lowered[h] for h in hits]


def suggestion(name: str, candidates: Iterable[str]) -> str:
    """A ``" (did you mean 'x'?)"`` suffix, or an empty string when nothing is close."""
    hits = closest(name, candidates)
    if not hits:
        return ""
    return " (did you mean " + " or ".join(repr(h) for h in hits) + "?)"
