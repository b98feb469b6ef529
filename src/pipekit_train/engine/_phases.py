"""The phases a stage reports while it runs (design/progress.md): ``compiling``, ``evaluating``, ``checkpointing``
and the ``stepping`` spans between them, each as a ``phase_start`` record before it (where it may take long) and a
``phase`` record with its duration after it, heard by the callbacks (`Callback.on_phase_start`, `Callback.on_phase`)
and shown by the progress display."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..callbacks._base import Callback, TrainContext
from ..tracking._progress import STARTED_PHASES, PhaseClock, Progress

if TYPE_CHECKING:
    from ..backends._contract import StepBackend


class Phases:
    """The engine's phase reports (a part of `Engine`)."""

    backend: StepBackend
    callbacks: tuple[Callback, ...]
    ctx: TrainContext
    clock: PhaseClock
    progress: Progress | None
    step: int
    _deferred: Any
    _async: bool
    _lengths: set[int]
    _open: list[str]

    if TYPE_CHECKING:

        def _emit(self, record: dict[str, Any]) -> None: ...

        def _flush_deferred(self) -> None: ...

    def _phase_start(self, phase: str) -> None:
        """Report the start of a phase: first the stepping span it ends, then a ``phase_start`` record,
        `Callback.on_phase_start` and the progress display (design/progress.md).

        Only where a phase may take long: before the first dispatch of each chunk length (``compiling``: the one
        that compiles, unless JAX has the program already), before an evaluation, when a checkpoint is taken. No
        host sync and nothing compiled: a log record deferred past the previous dispatch is written first (one
        wait for that chunk, at a new chunk length only), so the records keep the order they have without
        deferring.
        """
        if self._deferred is not None:
            self._flush_deferred()
        self._end_span()
        if phase != "stepping":
            self._open.append(phase)
        self._emit(
            {"type": "phase_start", "context": "train", "step": self.step, "epoch": self.ctx.epoch, "phase": phase}
        )
        for cb in self.callbacks:
            cb.on_phase_start(self.ctx, phase)
        if self.progress is not None:
            self.progress.phase_started(phase, self.step, self.ctx.epoch)

    def _may_compile(self) -> bool:
        """Whether the backend's dispatches may compile: after the first, whether it dispatched through JAX (its loss
        is a JAX array); before, unless it steps in Python (``fuses_steps = False``: Lightning runs torch)."""
        return self._async if self._lengths else self.backend.fuses_steps()

    def _not_happened(self, phase: str) -> None:
        """A started `phase` that did nothing (a dispatch that compiled nothing, a checkpoint its retention does not
        keep): the stage is stepping again, which a ``stepping`` start says in place of the phase's end."""
        self._open.remove(phase)
        self._phase_start("stepping")

    def _end_span(self) -> None:
        """Report the open stepping span's end (consecutive dispatches that compiled nothing), if it has steps."""
        clock = self.clock
        if clock.span_steps:
            span_s, clock.span_s, clock.span_steps = clock.span_s, 0.0, 0
            self._phase("stepping", span_s)

    def _phase(self, phase: str, duration_s: float) -> None:
        """Report the end of a phase: first the stepping span it interrupts, then `phase` itself.

        A phase that reports its start and was not foreseen (a compile in a later dispatch of a known chunk length,
        a new program mid-stage) gets its start now, so every end of one has a start before it.
        """
        if phase in STARTED_PHASES and phase not in self._open:
            self._phase_start(phase)
        if phase != "stepping":
            self._end_span()
        if phase in self._open:
            self._open.remove(phase)
        elif phase in ("done", "failed"):
            self._open.clear()
        record = {"type": "phase", "context": "train", "step": self.step, "epoch": self.ctx.epoch}
        self._emit({**record, "phase": phase, "duration_s": duration_s})
        for cb in self.callbacks:
            cb.on_phase(self.ctx, phase, duration_s)
