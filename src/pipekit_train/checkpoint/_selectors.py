"""Checkpoint selectors: which of a directory's checkpoints a rule picks, read from the manifest alone.

A `Selector` looks at `ManifestEntry` values (step, score, ...) and returns a set of steps. `Checkpoint.keep` and
`Checkpointer(keep=...)` retain the union of what their selectors pick; `Average(selector)` names the checkpoints
whose weights are averaged. Selectors never open a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pipekit import ConfigError, Operator

Mode = Literal["min", "max"]


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """One retained checkpoint as the manifest lists it.

    Attributes:
        step: The optimizer step the checkpoint holds (its directory name).
        epoch: The epoch recorded at save time, or ``None``.
        stage: The pipeline stage that wrote it, or ``None``.
        run_id: The run that wrote it, or ``None``.
        metric: The monitored metric `score` measures (the checkpointer's ``monitor``).
        mode: ``"min"`` or ``"max"``: which way `score` is better.
        score: The value of `metric` at this step, or ``None`` when unscored (no validation yet, or not finite).
        stop_reason: Why the run stopped, for the checkpoint written at the end of a run; else ``None``.
        resume_point: Written because a signal stopped the run between two periodic saves: where a resume
            starts, not a checkpoint `keep` chooses among. Selectors never pick it (it is unscored); it is kept
            while it is the latest and deleted once a later checkpoint commits, so the kept set is the one an
            uninterrupted run keeps.
        time: Wall-clock ``time.time()`` of the save call.
        files: ``{relative path: [size, sha256]}`` of the committed files, or ``None`` for an entry rebuilt from
            the checkpoint itself after a crash (its files were never digested).
    """

    step: int
    epoch: int | None = None
    stage: str | None = None
    run_id: str | None = None
    metric: str | None = None
    mode: Mode = "min"
    score: float | None = None
    stop_reason: str | None = None
    resume_point: bool = False
    time: float = 0.0
    files: dict[str, list[Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry as plain JSON data (what ``manifest.json`` holds)."""
        data = {name: getattr(self, name) for name in _ENTRY_FIELDS}
        if self.files is not None:  # the one mutable field: the caller gets its own copy
            data["files"] = {path: list(v) for path, v in self.files.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ManifestEntry:
        """Rebuild an entry from `to_json` output; unknown keys (from a newer writer) are ignored."""
        kwargs = {k: v for k, v in data.items() if k in _ENTRY_FIELDS}
        if not isinstance(kwargs.get("step"), int) or isinstance(kwargs.get("step"), bool):
            raise ValueError(f"manifest entry needs an int 'step', got {data.get('step')!r}")
        return cls(**kwargs)


_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(ManifestEntry))


def finite_score(value: Any, what: str) -> float | None:
    """`value` as a float score, ``None`` for ``None`` and non-finite values; anything else is an error."""
    if value is None:
        return None
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a real number or None, got {value!r}") from None
    return out if math.isfinite(out) else None


class Selector(Operator, register=False):
    """Which checkpoints a rule picks. Subclasses implement `select`."""

    def select(self, entries: list[ManifestEntry], mode: Mode) -> set[int]:
        """The steps of `entries` this selector picks; `mode` says which way a score is better."""
        raise NotImplementedError


class Best(Selector):
    """The `k` best checkpoints by score (lower is better under ``mode="min"``).

    Unscored entries are never picked. Ties go to the earlier step (the one that reached the score first).
    `among` restricts the ranking to what another selector picks: ``Best(k=5, among=Last(n=20))`` is the best 5
    of the latest 20. `among` is for choosing what to load or average; `Checkpoint.keep` refuses it, because
    retention would apply it to what is left after earlier deletions rather than to everything written.

    Args:
        k: How many checkpoints to pick (>= 1).
        among: Rank only what this selector picks (``Last(n=20)``); not allowed in `Checkpoint.keep`.

    Example:
        >>> from pipekit_train.checkpoint._selectors import Best, ManifestEntry
        >>> entries = [ManifestEntry(step=s, score=v) for s, v in [(1, 0.5), (2, 0.2), (3, None), (4, 0.3)]]
        >>> sorted(Best(k=2).select(entries, "min"))
        [2, 4]
    """

    k: int = 1
    among: Selector | None = None

    def validate(self) -> None:
        if self.k < 1:
            raise ConfigError(f"Best.k must be a positive int, got {self.k}")

    def select(self, entries: list[ManifestEntry], mode: Mode) -> set[int]:
        pool = entries
        if self.among is not None:
            allowed = self.among.select(entries, mode)
            pool = [e for e in entries if e.step in allowed]
        scored = [e for e in pool if e.score is not None]
        sign = 1.0 if mode == "min" else -1.0
        scored.sort(key=lambda e: (sign * e.score, e.step))  # type: ignore[operator]
        return {e.step for e in scored[: self.k]}


class Last(Selector):
    """The `n` checkpoints with the highest steps, scored or not.

    Args:
        n: How many of the latest checkpoints to pick (>= 1).

    Example:
        >>> from pipekit_train.checkpoint._selectors import Last, ManifestEntry
        >>> sorted(Last(n=2).select([ManifestEntry(step=s) for s in (10, 30, 20)], "min"))
        [20, 30]
    """

    n: int = 1

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError(f"Last.n must be a positive int, got {self.n}")

    def select(self, entries: list[ManifestEntry], mode: Mode) -> set[int]:
        return set(sorted(e.step for e in entries)[-self.n :])


class Every(Selector):
    """Every checkpoint whose step is a multiple of `n` (a sparse, permanent history).

    Args:
        n: Pick the checkpoints whose step is a multiple of this (>= 1).

    Example:
        >>> from pipekit_train.checkpoint._selectors import Every, ManifestEntry
        >>> sorted(Every(n=3).select([ManifestEntry(step=s) for s in range(1, 10)], "min"))
        [3, 6, 9]
    """

    n: int

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError(f"Every.n must be a positive int, got {self.n}")

    def select(self, entries: list[ManifestEntry], mode: Mode) -> set[int]:
        return {e.step for e in entries if e.step % self.n == 0}

    @classmethod
    def example(cls) -> Every:
        return cls(n=1000)


class Average(Operator):
    """A weights source: the uniform mean of the checkpoints `selector` picks (see `average_checkpoints`).

    Float leaves are averaged; integer leaves (counters, PRNG key data) come from the newest picked checkpoint.
    The directory must still hold every picked checkpoint, so keep them while training, e.g.
    ``Checkpoint(keep=(Best(k=3), Last(n=10)))`` for ``Average(selector=Last(n=10))``.

    Args:
        selector: Which checkpoints to average (`Best`, `Last`, `Every`).
    """

    selector: Selector

    def steps(self, entries: list[ManifestEntry], mode: Mode) -> list[int]:
        """The picked steps, ascending."""
        return sorted(self.selector.select(entries, mode))

    @classmethod
    def example(cls) -> Average:
        return cls(selector=Best(k=5, among=Last(n=20)))


def union_select(selectors: Iterable[Selector], entries: list[ManifestEntry], mode: Mode) -> set[int]:
    """The union of what each selector picks from `entries`."""
    out: set[int] = set()
    for sel in selectors:
        out |= sel.select(entries, mode)
    return out
