"""The engine's side of checkpoints: what a save records of the engine (`snapshot`, taken back by
`restore_records`), the `HookCall` the hooks are called with, overlapped saves (a save's state taken before the next
dispatch, the rest of it written after, `_finish_save`), the checkpointing phase, `restore_best`'s step, and a
signal's stop (the stop checkpoint first, then what the stop shows).

The hooks themselves (when to save, what a checkpoint holds, resume) are `CheckpointHooks` (`_hooks`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..callbacks._base import Callback, TrainContext
from ..tracking._progress import PhaseClock
from ._protocol import EngineSnapshot, HookCall, StageHooks
from ._window import _on_host

if TYPE_CHECKING:
    from ..backends._contract import StepBackend


class Saves:
    """The engine's checkpoint calls and records (a part of `Engine`)."""

    loop: Any
    backend: StepBackend
    hooks: StageHooks | None
    iterator: Any
    callbacks: tuple[Callback, ...]
    callback_states: dict[str, dict[str, Any]]
    ctx: TrainContext
    clock: PhaseClock
    step: int
    window: list[tuple[int, Mapping[str, Any]]]
    last_train: dict[str, Any]
    eval_metrics: dict[str, Any]
    evaluated_at: int | None
    _deferred: Any
    _open: list[str]
    _saved: bool
    _save_rest: tuple[Callable[[], None], float] | None
    _showing_stop: bool
    _restored: tuple[int, Mapping[str, Any]] | None

    if TYPE_CHECKING:

        def _check_finite(self, step: int, loss: Any) -> None: ...

        def _flush_deferred(self) -> None: ...

        def _deliver_pending(self) -> None: ...

        def _flush(self, window: list[tuple[int, Mapping[str, Any]]], lr: float | None) -> None: ...

        def _phase_start(self, phase: str) -> None: ...

        def _phase(self, phase: str, duration_s: float) -> None: ...

        def _not_happened(self, phase: str) -> None: ...

        def _evaluate(self, observe: bool = True) -> dict[str, float]: ...

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as plain data (see `EngineSnapshot`); checks the pending losses first.

        Called before a checkpoint is written: no checkpoint holds weights past a NaN loss, and the checkpoint
        carries the pending values so a resumed run writes the same train records as an uninterrupted one.
        """
        self._deliver_pending()  # the steps saved are reported to the callbacks first (`_step_ends`)
        if self._deferred is not None:  # its record is written before the checkpoint, as without deferring
            self._flush_deferred()
        # A checkpoint is being taken: its phase starts (before the callbacks' state is copied below, so a
        # callback's state in the checkpoint is what it was after it heard of the start, as in a run going on).
        self._phase_start("checkpointing")
        values = _on_host(self.window)
        pending: list[list[Any]] = [[s, {k: float(v) for k, v in m.items()}] for (s, _), m in zip(self.window, values)]
        for step, metrics in pending:
            self._check_finite(step, metrics["loss"])
        return EngineSnapshot(
            step=self.step,
            epoch=self.ctx.epoch,
            pending=pending,
            last_train=dict(self.last_train),
            last_eval=dict(self.eval_metrics),
            evaluated_at=self.evaluated_at,
            callback_states={k: dict(s) for k, s in self.callback_states.items()},
        )

    def checkpoint_written(self, step: int) -> None:
        """Tell the callbacks that a checkpoint of `step` was written."""
        self._saved = True
        for cb in self.callbacks:
            cb.on_checkpoint(self.ctx, step)

    def restore_records(self, meta: Mapping[str, Any]) -> None:
        """Take back what `pending_window` and the latest records were when a checkpoint was written."""
        self.window = [(int(s), m) for s, m in meta.get("window", [])]
        self.last_train = dict(meta.get("last_train", {}))
        last_eval = dict(meta.get("last_eval", {}))
        step = meta.get("evaluated_at", last_eval.pop("_step", None))  # checkpoints before 0.2 kept it in last_eval
        self.evaluated_at = int(step) if step is not None else None
        self.eval_metrics = last_eval
        self.ctx.last_eval = dict(last_eval)

    def best_restored(self, step: int, meta: Mapping[str, Any]) -> None:
        """`restore_best` loaded the checkpoint of `step` (whose metadata is `meta`): the stage returns its
        weights, so the stage's final metrics are that step's (`final_metrics`)."""
        self._restored = (step, meta)

    def _hook_call(self, may_wait: bool = False) -> HookCall:
        return HookCall(
            step=self.step,
            backend=self.backend,
            snapshot=self.snapshot,
            written=self.checkpoint_written,
            may_wait=may_wait,
            restored=self.best_restored,
        )

    def _checkpointing(self, fn: Any, *args: Any) -> None:
        """Call a checkpoint hook; when it wrote a checkpoint, its time is a checkpointing phase.

        A hook that took the state and returned the rest of its save (`HookCall.may_wait`) leaves that rest for
        `_finish_save`, after the next dispatch: the chunk ending at a save no longer makes the device idle while
        the host checks the weights, gathers the records and hands the checkpoint to the writer thread.
        """
        self._saved = False
        t0 = time.perf_counter()
        rest = fn(*args)
        seconds = time.perf_counter() - t0
        if rest is not None:
            self.clock.checkpoint_s += seconds
            self._save_rest = (rest, seconds)
        elif self._saved:
            self.clock.checkpoint_s += seconds
            self._phase("checkpointing", seconds)
        elif "checkpointing" in self._open:  # taken, then not kept (its retention): nothing was written
            self._not_happened("checkpointing")

    def _finish_save(self) -> None:
        """The rest of a save begun at the previous chunk; the engine's state (step, records, callbacks) is still
        that chunk's, so the checkpoint is the one an immediate save would have written."""
        assert self._save_rest is not None
        rest, begun = self._save_rest
        self._save_rest = None
        self._saved = False
        t0 = time.perf_counter()
        rest()
        seconds = time.perf_counter() - t0
        self.clock.checkpoint_s += seconds
        if self._saved:
            self._phase("checkpointing", begun + seconds)
        elif "checkpointing" in self._open:
            self._not_happened("checkpointing")

    def _stop_for_resume(self) -> None:
        """A signal's stop: the stop checkpoint first, holding what the uninterrupted run holds at this step;
        then what the stop shows.

        The checkpoint is written before anything the uninterrupted run would not compute: its pending log window,
        its last records and every callback's state are those of a run that goes on from here. Only then does the
        stop show the partial window's means and a validation pass at the stop step, as records marked
        ``interrupted`` (the history drops them once the resumed run logs on); no callback hears of that
        validation (`on_eval_end`), so nothing it decides (a lower learning rate, an early stop) reaches the
        continuation or the logged events.
        """
        if self._deferred is not None:  # an on-cadence record: written as the uninterrupted run writes it
            self._flush_deferred()
        if self.hooks is not None:
            self._checkpointing(self.hooks.at_end, self._hook_call(), self.iterator.get_state(), self.ctx.stop_reason)
        self._showing_stop = True
        if self.window:
            self._flush(self.window, None)
        if self.loop.val_dataset is not None and self.evaluated_at != self.step:
            self._evaluate(observe=False)
