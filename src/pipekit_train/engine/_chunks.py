"""How the engine fuses steps into compiled calls: `steps_per_call` (``auto`` resolved by the batch size and the
callbacks), and chunks that never cross a log, eval, checkpoint or epoch boundary, so a resumed run makes exactly
the chunks an uninterrupted one makes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..callbacks._base import Callback
from ..callbacks._observing import observes_only

if TYPE_CHECKING:
    from ..backends._contract import StepBackend
    from ._protocol import StageHooks

__all__ = [
    "AUTO_CHUNK_BYTES",
    "AUTO_MAX_STEPS",
    "ChunkPlan",
    "Schedule",
    "callback_keys",
    "chunk_plan",
    "needs_every_step",
    "step_hook",
]


#: `steps_per_call: auto` fuses at most this many steps into one compiled call: enough that the dispatch costs
#: nothing per step, few enough that a graceful stop (SIGTERM) or the progress display waits at most one chunk.
AUTO_MAX_STEPS = 100


#: ... and at most this many bytes of one call's stacked batches (on the host, or gathered on the device).
AUTO_CHUNK_BYTES = 64 * 2**20


def step_hook(cb: Callback) -> str:
    """How `cb` hears of steps: ``"none"`` (it does not override `on_step_end`), ``"observes"`` (it only observes:
    after its chunk, possibly while the next one runs), ``"chunk_end"`` (after its chunk, before anything else
    happens at the chunk's end) or ``"every_step"`` (one step per compiled call under ``auto``).

    From `Callback.needs_every_step` and `Callback.observes_only`; what neither says is inferred: a callback that
    overrides `on_step_end` observes when its source shows it (`callbacks._observing.observes_only`: it reads the
    metrics and the step, keeps its state, writes records), and needs every step otherwise.
    """
    kind = type(cb)
    every, observes = kind.needs_every_step, kind.observes_only
    if every and observes:
        raise ValueError(
            f"callback {kind.__name__} declares both needs_every_step = True and observes_only = True: a callback "
            "that only observes never needs the host after each step; keep one of them"
        )
    if every:
        return "every_step"
    if kind.on_step_end is Callback.on_step_end:
        return "none"
    if observes:
        return "observes"
    if every is False:
        return "chunk_end"
    if observes is None and observes_only(kind.on_step_end):
        return "observes"
    return "every_step"


def needs_every_step(cb: Callback) -> bool:
    """Whether `cb` needs the host after every single step (`step_hook` says ``"every_step"``)."""
    return step_hook(cb) == "every_step"


def _largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of `n` that is at most `cap` (1 at least)."""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for q in (d, n // d):
                if best < q <= cap:
                    best = q
    return best


@dataclass(frozen=True)
class ChunkPlan:
    """How a stage cuts its steps into compiled calls (`Engine.next_chunk`).

    Attributes:
        size: The usual chunk: an explicit `steps_per_call`, or what `auto` resolved to. Chunks start at multiples
            of it and never cross a boundary (log, eval, checkpoint, epoch end, `max_steps`).
        small: With `auto`, what fills a stretch shorter than `size` (before a boundary that is not a multiple of
            `size`, the tail before `max_steps`, after a resume between boundaries); then single steps. So an
            `auto` stage compiles at most three chunk lengths: `size`, `small` and 1.
        auto: Whether `steps_per_call` is `auto`.
    """

    size: int
    small: int
    auto: bool


def chunk_plan(
    loop: Any, periods: list[int], fuses: bool, batch_bytes: int, callbacks: tuple[Callback, ...]
) -> ChunkPlan:
    """Resolve `loop.steps_per_call` into a `ChunkPlan` (see docs/performance.md, "Fusion").

    `periods` are the step multiples chunks must not cross (log, eval, epoch, checkpoint cadences); `fuses` says
    whether the backend runs several steps per call at all (a backend that cannot treats `auto` as 1);
    `batch_bytes` is one batch's size on the host. `auto` takes the largest divisor of the periods' (and
    `max_steps`') common divisor that fits the caps (`AUTO_MAX_STEPS`, `AUTO_CHUNK_BYTES`), so every stretch
    between two boundaries is a whole number of equal chunks; when that divisor is poor (periods 100 and 33), the
    shortest period within the caps instead.
    """
    setting = loop.steps_per_call
    if setting != "auto":
        return ChunkPlan(int(setting), 1, False)
    if not fuses or any(needs_every_step(cb) for cb in callbacks):
        return ChunkPlan(1, 1, True)
    cap = max(1, min(AUTO_MAX_STEPS, AUTO_CHUNK_BYTES // max(1, batch_bytes)))
    every = [p for p in periods if p] + [int(loop.max_steps)]
    divisor = _largest_divisor(math.gcd(*every), cap)
    shortest = min(cap, *every)
    size = divisor if 4 * divisor >= shortest else shortest
    return ChunkPlan(size, max(1, size // 8), True)


def callback_keys(callbacks: tuple[Callback, ...]) -> list[str]:
    """``"EarlyStopping:0"``-style keys: a callback's type and how many callbacks of that type come before it."""
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        name = type(cb).__name__
        keys.append(f"{name}:{seen.get(name, 0)}")
        seen[name] = seen.get(name, 0) + 1
    return keys


class Schedule:
    """The engine's schedule: the epoch of a step, and the steps of the next dispatch (a part of `Engine`)."""

    loop: Any
    backend: StepBackend
    hooks: StageHooks | None
    chunks: ChunkPlan
    step: int
    steps_per_epoch: int | None
    _bounds: tuple[int, ...]  # `_boundaries()`, built at the first `next_chunk`

    def epoch_of(self, step: int) -> int:
        """The epoch of `step`: `steps_per_epoch`, or else the training set's batches per epoch, make an epoch."""
        spe = self.steps_per_epoch
        return step // spe if spe else 0

    def _periods(self) -> list[int]:
        """The step multiples a chunk must not cross: log, eval, epoch (`steps_per_epoch`), checkpoint cadences."""
        loop = self.loop
        every = [loop.log_every_n_steps]
        if loop.val_dataset is not None:
            every.append(loop.eval_every_n_steps)
        if loop.steps_per_epoch:
            every.append(loop.steps_per_epoch)
        if self.hooks is not None:
            every.extend(self.hooks.boundaries())
        every.extend(self.backend.chunk_periods())  # a sampler's `until` checks (adapters/numpyro)
        return [e for e in every if e]

    def _boundaries(self) -> list[int]:
        return [*self._periods(), self.chunks.size]

    def next_chunk(self) -> int:
        """How many steps the next dispatch runs: up to the `ChunkPlan`'s size, never past a boundary.

        With `auto` a stretch shorter than the plan's size runs in chunks of its `small` size, then single steps,
        so the stage compiles at most three chunk lengths.
        """
        bounds: tuple[int, ...] | None = getattr(self, "_bounds", None)
        if bounds is None:  # fixed for the stage (the loop's, the hooks' and the backend's settings): built once
            bounds = self._bounds = tuple(self._boundaries())
        step = self.step
        stop: int = self.loop.max_steps
        for e in bounds:
            stop = min(stop, (step // e + 1) * e)
        boundary = self.backend.next_boundary(self.step)  # one not at multiples of a period (after warm-up)
        if boundary is not None:
            stop = min(stop, boundary)
        span = stop - step
        plan = self.chunks
        if not plan.auto or span >= plan.size:
            return max(1, min(span, plan.size))
        return plan.small if span >= plan.small else 1
