"""Reporting each step to `Callback.on_step_end`: at once, or after the next dispatch when every callback that
listens only observes, so watching every step keeps the steps fused and the device busy.

A fused chunk's steps are reported after its compiled call, one by one, in order, each with its own ``ctx.step``,
``ctx.epoch`` and values; the values are host values (NumPy scalars) read once for the whole chunk, by whoever
reads first (`_window._Fetched`: a callback, or the log window's record, which then reads nothing more). When every
listening callback only observes (`_chunks.step_hook` is ``"observes"``), a chunk's report waits until the next
chunk is dispatched: the read of its values then overlaps the next chunk's work, where reading them at once would
leave the device idle while the host calls the callbacks and dispatches. It is never later than anything else a
callback could see: every record (`LogWindow._emit`), checkpoint snapshot, evaluation, epoch end, stop and the
stage's end comes after the report of the steps before it, as it does when each step is reported at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..callbacks._base import Callback, TrainContext
from ._chunks import step_hook
from ._window import _Fetched, _HostStepMetrics, _LazyStepMetrics


class StepEnds:
    """The engine's `on_step_end` reports (a part of `Engine`)."""

    callbacks: tuple[Callback, ...]
    ctx: TrainContext
    step: int
    window: list[tuple[int, Mapping[str, Any]]]

    if TYPE_CHECKING:

        def epoch_of(self, step: int) -> int: ...

    def _plan_step_ends(self, probe: Any) -> None:
        """Which callbacks listen to steps (those overriding `on_step_end`, in their order), and whether their
        reports may wait for the next dispatch (all of them only observe; not under the resume probe, whose trace
        reads the callbacks' states after every chunk)."""
        kinds = [(cb, step_hook(cb)) for cb in self.callbacks]
        self._listeners = tuple(cb for cb, kind in kinds if kind != "none")
        self._late = bool(self._listeners) and probe is None and all(k in ("none", "observes") for _, k in kinds)
        self._pending: tuple[int, int, _Fetched] | None = None

    def _report_steps(self, first: int, n: int, metrics: Mapping[str, Any]) -> None:
        """Add the chunk of steps ``first + 1 .. first + n`` to the log window and report them (or keep them for
        `_deliver_pending`)."""
        if n == 1 and not self._late:
            step_metrics = _LazyStepMetrics(metrics, None)
            self.window.append((first + 1, step_metrics))
            for cb in self._listeners:  # one step per call: its own values, read when a callback reads them
                cb.on_step_end(self.ctx, step_metrics)
            return
        fetched = _Fetched(metrics)
        if n == 1:
            self.window.append((first + 1, _LazyStepMetrics(metrics, None, fetched)))
        else:
            self.window.extend((first + i + 1, _LazyStepMetrics(metrics, i, fetched)) for i in range(n))
        if not self._listeners:
            return
        self._deliver_pending()
        self._pending = (first, n, fetched)
        if not self._late:
            self._deliver_pending()

    def _deliver_pending(self) -> None:
        """Report the kept chunk's steps, if any: each step in order, with its step, epoch and host values."""
        if self._pending is None:
            return
        first, n, fetched = self._pending
        self._pending = None
        ctx, listeners = self.ctx, self._listeners
        step, epoch = ctx.step, ctx.epoch
        try:
            for i in range(n):
                ctx.step = first + i + 1
                ctx.epoch = self.epoch_of(ctx.step)
                seen = _HostStepMetrics(fetched, i if n > 1 else None)
                for cb in listeners:
                    cb.on_step_end(ctx, seen)
        finally:
            ctx.step, ctx.epoch = step, epoch
