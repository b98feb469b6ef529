"""The backend-agnostic step loop: data, chunking, callbacks, logging, validation, divergence checks.

An adapter supplies a `StepBackend` (how to run steps on its framework) and calls `Engine.run`. The engine decides
*when* things happen, by absolute step numbers, so a resumed run makes exactly the decisions an uninterrupted run
would have made: a chunk of fused steps never crosses a log, eval, checkpoint or epoch boundary.

The engine is this module; what it drives and returns (`StepBackend`, `StageHooks`, `EngineSnapshot`,
`AdapterResult`) is `stage.steps`, how it fuses steps into calls `stage.chunks`, the window of step metrics between
two logs `stage.window`.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._warnings import PipekitTrainWarning
from ..backends._contract import StepBackend
from ..callbacks._base import Callback, TrainContext
from ..scale._distributed import is_primary, local_rows
from ..tracking._progress import STARTED_PHASES, CompileWatch, PhaseClock, Progress, model_summary
from ..tracking._writers import JsonLinesWriter, MetricWriter, NullWriter
from ._chunks import AUTO_CHUNK_BYTES, AUTO_MAX_STEPS, ChunkPlan, callback_keys, chunk_plan, needs_every_step
from ._probe import from_env as probe_from_env
from ._protocol import (
    AdapterResult,
    EngineSnapshot,
    HookCall,
    NonFiniteLossError,
    NonFiniteWeightsError,
    StageHooks,
    first_nonfinite,
    now_iso,
)
from ._window import _columns, _LazyStepMetrics, _on_host

__all__ = [
    "AUTO_CHUNK_BYTES",
    "AUTO_MAX_STEPS",
    "AdapterResult",
    "ChunkPlan",
    "Engine",
    "EngineSnapshot",
    "NonFiniteLossError",
    "NonFiniteWeightsError",
    "StageHooks",
    "callback_keys",
    "chunk_plan",
    "evaluate",
    "first_nonfinite",
    "needs_every_step",
    "run_steps",
]


class Engine:
    """Runs one stage's steps. Checkpointing and signal handling plug in through `hooks`."""

    def __init__(
        self,
        loop: Any,
        backend: StepBackend,
        *,
        stage: str,
        run_id: str,
        stage_dir: str | None,
        start_step: int = 0,
        data_state: dict[str, Any] | None = None,
        callback_states: dict[str, dict[str, Any]] | None = None,
        hooks: StageHooks | None = None,
    ) -> None:
        self.loop = loop
        self.backend = backend
        self.stage = stage
        self.step = start_step
        self.callbacks: tuple[Callback, ...] = tuple(sorted(loop.callbacks, key=lambda c: c.order))
        states = callback_states or {}
        self.callback_states = {
            key: dict(states.get(key, cb.initial_state()))
            for key, cb in zip(callback_keys(self.callbacks), self.callbacks)
        }
        # Several processes: process 0 alone writes metrics and shows progress (`_distributed`).
        self.primary = is_primary()
        self.writer: MetricWriter = (loop.metric_writer or JsonLinesWriter()) if self.primary else NullWriter()
        self.ctx = TrainContext(
            loop=loop,
            stage=stage,
            run_id=run_id,
            run_dir=stage_dir,
            writer=self.writer,
            callback_states=self.callback_states,
            callbacks=self.callbacks,
            get_model=backend.bound_model,
            set_model=backend.set_model,
            lr_scale=_LRScale(backend),
        )
        self.ctx.step = start_step
        self.steps_per_epoch: int | None = loop.steps_per_epoch or _data_steps_per_epoch(loop)
        self.ctx.epoch = self.epoch_of(start_step)
        self.clock = PhaseClock()
        self.progress: Progress | None = None
        self._saved = False
        self.hooks = hooks
        # `pipekit-train check-resume`: a trace of the state after every chunk, kills at exact steps (`probe`).
        self.probe = probe_from_env(stage)
        self.chunks = chunk_plan(loop, self._periods(), backend.fuses_steps(), _batch_bytes(loop), self.callbacks)
        shard = local_rows()  # several processes: each reads its rows of every global batch
        self.iterator: Any = self._resident_data(shard is None)
        self.resident = self.iterator is not None
        if self.iterator is None:
            self.iterator = (
                loop.dataset.iterator(loop.batch_size, loop.seed, shard=shard)
                if shard
                else loop.dataset.iterator(loop.batch_size, loop.seed)
            )
        if data_state is not None:
            self.iterator.set_state(data_state)
        self.window: list[tuple[int, Mapping[str, Any]]] = []
        self._interrupted = False  # stopped by SIGINT/SIGTERM: the stage will be resumed from its checkpoint
        self._showing_stop = False  # after the stop checkpoint: what the stop shows, which nothing resumes from
        # `restore_best`: the step whose checkpoint the stage returns, and what that checkpoint recorded.
        self._restored: tuple[int, Mapping[str, Any]] | None = None
        self._restored_record: dict[str, Any] | None = None  # what the artifact records of it (`restored`)
        # A log window whose record is written after the next chunk is dispatched (`_deferrable`), and its lr.
        self._deferred: tuple[list[tuple[int, Mapping[str, Any]]], float] | None = None
        # The rest of a checkpoint save whose state was taken before the next dispatch (`_finish_save`), and the
        # seconds its first part took; and whether the backend's last call was dispatched through JAX (returned
        # JAX arrays: the call may return before the device is done, so the device has work during the save).
        self._save_rest: tuple[Callable[[], None], float] | None = None
        self._async = False
        # A save may finish after the next dispatch only if no callback hears of it then (`on_checkpoint`,
        # `on_phase_start`, `on_phase`, `on_log`): one reading `ctx.model` there would see the next chunk's weights.
        self._saves_may_wait = all(
            getattr(type(cb), hook) is getattr(Callback, hook)
            for cb in self.callbacks
            for hook in ("on_checkpoint", "on_phase_start", "on_phase", "on_log")
        )
        # Phase starts (`_phase_start`): the chunk lengths dispatched so far (the first of a length may compile),
        # and the phases whose start was reported and whose end was not yet.
        self._lengths: set[int] = set()
        self._open: list[str] = []
        self.last_train: dict[str, Any] = {}
        self.eval_metrics: dict[str, Any] = {}
        self.evaluated_at: int | None = None
        restored = hooks.restored_meta if hooks is not None else None
        if restored:
            self.restore_records(restored)
        if hooks is not None and hooks.resumed_stop:  # a callback had ended the stage at this checkpoint
            self.ctx.request_stop(hooks.resumed_stop)

    # Schedule ----------------------------------------------------------------------------------------------
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
        remaining: int = self.loop.max_steps - self.step
        stop = min(self.step + remaining, *(((self.step // e) + 1) * e for e in self._boundaries()))
        boundary = self.backend.next_boundary(self.step)  # one not at multiples of a period (after warm-up)
        if boundary is not None:
            stop = min(stop, boundary)
        span = stop - self.step
        plan = self.chunks
        if not plan.auto or span >= plan.size:
            return max(1, min(span, plan.size))
        return plan.small if span >= plan.small else 1

    def _resident_data(self, single_process: bool) -> Any:
        """The device-resident training data (`pipekit_train.data._device.ResidentBatches`), or ``None``."""
        loop = self.loop
        dataset = loop.dataset
        setting = getattr(dataset, "device_resident", False)
        if setting is False:
            return None
        backend_ok = self.backend.resident_data() and single_process
        if not backend_ok and setting is not True:  # `auto` where it is not possible: the host path, quietly
            return None
        from ..data._device import ResidentBatches, check_forced, resident_reason

        reason = resident_reason(dataset, loop.batch_size, backend_ok)
        check_forced(dataset, reason)
        if reason is not None:
            return None
        return ResidentBatches(dataset, loop.batch_size, loop.seed, self.chunks.size)

    # The run -----------------------------------------------------------------------------------------------
    def run(self) -> AdapterResult:
        import jax

        loop, ctx = self.loop, self.ctx
        started = now_iso()
        self.writer.open(ctx.run_dir)
        CompileWatch.install()
        progress = self.progress = Progress(
            self.stage, loop.max_steps, self.step, enabled=loop.progress and self.primary, batch_size=loop.batch_size
        )
        progress.chains = self.backend.progress_chains  # a sampler's chains (adapters/numpyro)
        status = "completed"
        try:
            if self.step == 0:
                self._emit({"type": "params", "context": "train", "step": 0, "epoch": 0, **self._params()})
            else:
                progress.resumed(self.step, self.hooks.directory if self.hooks is not None else None)
                note = self.hooks.topology_note if self.hooks is not None else None
                if note and self.primary:  # an elastic resume (`checkpoint._elastic`): a notice, whatever `progress`
                    warnings.warn(note, PipekitTrainWarning, stacklevel=2)
            summary = self._model_summary()
            if summary is not None:
                ctx.artifact_fields["model_summary"] = summary
                progress.model(summary)
            for cb in self.callbacks:
                cb.on_train_start(ctx)
            pending: tuple[int, Any] | None = None  # (step, loss) of the previous chunk, checked one chunk late
            # A backend that decides it is done before max_steps (a sampler's `until`, checked at chunk ends on
            # what the chunks computed, and again after a resume) ends the stage as completed.
            done = self.backend.until_reached
            while self.step < loop.max_steps and ctx.stop_reason is None and not done(self.step):
                n = self.next_chunk()
                # A chunk length not dispatched yet: its program may compile.
                foreseen = n not in self._lengths and self._may_compile()
                if foreseen:
                    self._lengths.add(n)
                    self._phase_start("compiling")
                t0 = time.perf_counter()
                if self.resident:  # the chunk gathers its own batches on the device
                    data: Any = self.iterator.window(n)
                else:
                    data = [next(self.iterator) for _ in range(n)]
                data_s = time.perf_counter() - t0
                data_state = self.iterator.get_state()
                first = self.step
                compiles = CompileWatch.count - self.clock.eval_compiles
                aside = self.clock.eval_s + self.clock.checkpoint_s
                if self.resident:
                    metrics = self.backend.train_window(data, n, first)
                else:
                    metrics = self.backend.train(data, first)
                # Compiles happen while dispatching: known now, before the chunk's own log decision.
                compiled_now = CompileWatch.count - self.clock.eval_compiles != compiles
                if foreseen and not compiled_now:  # JAX had the program (an earlier stage of the same structure)
                    self._not_happened("compiling")
                self._async = isinstance(metrics["loss"], jax.Array)
                if self._deferred is not None:  # the previous log window: its chunk is done, this one is queued
                    self._flush_deferred()
                if self._save_rest is not None:  # the previous chunk's checkpoint, while this one runs
                    self._finish_save()
                self.step += n
                ctx.step, ctx.epoch = self.step, self.epoch_of(self.step)
                # The divergence check reads the previous dispatch's loss only when it is already computed, so
                # it never makes the host wait for the device; every step's loss is checked at the next log step.
                if pending is not None and getattr(pending[1], "is_ready", lambda: True)():
                    self._check_finite(*pending)
                pending = (self.step, metrics["loss"])
                self._after_chunk(first, n, metrics, may_defer=not compiled_now)
                if self.probe is not None:
                    self.probe.after_chunk(self, first, metrics, data_state)
                if self.hooks is not None and ctx.stop_reason is None:
                    may_wait = self._saves_may_wait and self._async and self.step < loop.max_steps
                    self._checkpointing(self.hooks.after_chunk, self._hook_call(may_wait), data_state)
                signal_name = self.hooks.stop_requested() if self.hooks is not None else None
                # A signal stops a stage that would go on; one that comes as the stage ends anyway (its last step, a
                # callback's stop, a sampler's `until`) lets it finish and be recorded, and stops what comes after.
                if signal_name and ctx.stop_reason is None and self.step < loop.max_steps and not done(self.step):
                    ctx.request_stop(signal_name)
                    self._interrupted = True
                wall = time.perf_counter() - t0 - (self.clock.eval_s + self.clock.checkpoint_s - aside)
                compiled = CompileWatch.count - self.clock.eval_compiles != compiles
                if compiled:  # something compiled (the step, a logging op): not a step's time
                    self.clock.compile_s += wall - data_s
                    self._phase("compiling", wall - data_s)
                    progress.compiled(wall - data_s)
                self.clock.chunk(n, wall, data_s, compiled)
                progress.update(self.step, ctx.epoch, self.last_train.get("loss"), self.clock.recent_step_s())
            if self._save_rest is not None:  # no next chunk came (a sampler reached `until`)
                self._finish_save()
            if ctx.stop_reason is not None:
                status = f"stopped: {ctx.stop_reason}"
            if self._interrupted:
                self._stop_for_resume()
            else:
                self._flush_window()
                if ctx.stop_reason is not None and loop.val_dataset is not None and self.evaluated_at != self.step:
                    self._evaluate()  # a callback's stop ends the stage: its last weights are evaluated
                if self.hooks is not None:
                    self._checkpointing(
                        self.hooks.at_end, self._hook_call(), self.iterator.get_state(), ctx.stop_reason
                    )
            for cb in self.callbacks:
                cb.on_train_end(ctx)
            final = self.final_metrics()
            final.update({f"time/{k}": v for k, v in self.clock.summary().items()})
            self._phase("done", self.clock.elapsed())
            self._emit(
                {"type": "finish", "context": "train", "step": self.step, "epoch": ctx.epoch, "status": status, **final}
            )
            progress.close(status, final)
        except BaseException as exc:
            # Nothing below may hide the original error.
            with contextlib.suppress(Exception):  # a deferred log record is written, as it would have been
                if self._deferred is not None:
                    self._flush_deferred()
            with contextlib.suppress(Exception):  # and a checkpoint begun before the failure is finished
                if self._save_rest is not None:
                    self._finish_save()
            if self.hooks is not None:
                with contextlib.suppress(Exception):
                    self.hooks.close()
            for cb in self.callbacks:
                with contextlib.suppress(Exception):
                    cb.on_exception(ctx, exc)
            with contextlib.suppress(Exception):
                self._phase("failed", self.clock.elapsed())
            with contextlib.suppress(Exception):
                progress.line(_failure_line(self.stage, self.step, exc))
            with contextlib.suppress(Exception):
                self._emit(
                    {
                        "type": "finish",
                        "context": "train",
                        "step": self.step,
                        "epoch": ctx.epoch,
                        "status": "failed",
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                )
            with contextlib.suppress(Exception):  # on a full disk the last lines cannot be flushed: not the error
                self.writer.close()
            raise
        finally:
            progress.close()
            self.iterator.close()  # stops a prefetch thread, if the dataset has one
            self.writer.close()
        return AdapterResult(
            model=self.backend.bound_model(),
            opt_state=None,
            step=self.step,
            epoch=ctx.epoch,
            metrics=final,
            # What the engine resolved; adapters record it (`steps_per_call` after `auto`, the data path).
            backend_info={"steps_per_call": self.chunks.size, "data": "device" if self.resident else "host"},
            artifact_fields=dict(ctx.artifact_fields),
            started_at=started,
            ended_at=now_iso(),
            status=status,
            stop_reason=ctx.stop_reason,
            restored=self._restored_record,
        )

    def _emit(self, record: dict[str, Any]) -> None:
        """Send one record to the writer and to every callback's `on_log`: all of them see the same values.

        The metrics a signal's stop shows after its checkpoint (`_stop_for_resume`) are marked ``interrupted``:
        the history drops them once the resumed run logs on, and writers that cannot take a point back
        (TensorBoard, MLflow) leave them out."""
        if self._showing_stop and record.get("type") == "metrics":
            record = {**record, "interrupted": True}
        self.writer.write(record)
        for cb in self.callbacks:
            cb.on_log(self.ctx, record)

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

    def _model_summary(self) -> dict[str, Any] | None:
        """Parameters per top-level submodule and in all (`tracking._progress.model_summary`), or ``None``."""
        try:
            weights = self.backend.bound_model().weights()
        except Exception:  # a model without plain weights (a sampler before its first draw): no summary
            return None
        return model_summary(weights)

    def _hook_call(self, may_wait: bool = False) -> HookCall:
        return HookCall(
            step=self.step,
            backend=self.backend,
            snapshot=self.snapshot,
            written=self.checkpoint_written,
            may_wait=may_wait,
            restored=self.best_restored,
        )

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

    def best_restored(self, step: int, meta: Mapping[str, Any]) -> None:
        """`restore_best` loaded the checkpoint of `step` (whose metadata is `meta`): the stage returns its
        weights, so the stage's final metrics are that step's (`final_metrics`)."""
        self._restored = (step, meta)

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

    def _params(self) -> dict[str, Any]:
        from pipekit._yaml import to_plain

        fields = to_plain(self.loop, strict=False)
        return {"stage": self.stage, "params": fields}

    def _check_finite(self, step: int, loss: Any) -> None:
        """Raise `NonFiniteLossError` if `loss` (the last step's, or a chunk's per-step losses) is not finite."""
        if not self.loop.stop_on_nonfinite:
            return
        values = np.atleast_1d(np.asarray(loss, dtype=np.float64))
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            step = step - len(values) + 1 + int(bad[0])
            value = float(values[bad[0]])
            raise NonFiniteLossError(
                f"stage {self.stage!r}: the training loss became {value} at step {step} "
                f"(epoch {self.epoch_of(step)}). Lower the learning rate, set grad_clip_norm, "
                "or set stop_on_nonfinite: false to train on regardless."
            )

    def _after_chunk(self, first: int, n: int, metrics: Mapping[str, Any], may_defer: bool = False) -> None:
        loop, ctx = self.loop, self.ctx
        for i in range(n):
            step_metrics = _LazyStepMetrics(metrics, i if n > 1 else None)
            self.window.append((first + i + 1, step_metrics))
            if self.callbacks:
                ctx.step = first + i + 1
                for cb in self.callbacks:
                    cb.on_step_end(ctx, step_metrics)
        ctx.step = self.step
        if self.step % loop.log_every_n_steps == 0 or self.step == loop.max_steps:
            if may_defer and self._deferrable():
                # The learning rate now (it reads this chunk's state, as the flush would have); the transfer,
                # the records and the writer after the next dispatch, while the device runs the next chunk.
                self._deferred = (self.window, self.backend.learning_rate(self.step))
                self.window = []
            else:
                self._flush_window()
        if loop.val_dataset is not None and (self.step % loop.eval_every_n_steps == 0 or self.step == loop.max_steps):
            self._evaluate()
        if loop.steps_per_epoch and self.step % loop.steps_per_epoch == 0:
            for cb in self.callbacks:
                cb.on_epoch_end(ctx)

    def _deferrable(self) -> bool:
        """Whether this log step's record may be written after the next chunk is dispatched.

        Waiting for the chunk's metrics at every log step leaves the device idle while the host writes records
        and dispatches the next chunk; with one chunk per log window (`auto`) that was the loop's largest cost
        over a hand-written scan. Only where nothing else happens at this step: no evaluation, epoch end,
        last step or stop, and no callback reading records (`on_log`), so every record is written with the same
        values and in the same order, only a chunk later. A checkpoint at this step writes the record first
        (`snapshot`), whether it is saved now or after the next dispatch (`_finish_save`).
        """
        loop, step = self.loop, self.step
        if step >= loop.max_steps or self.ctx.stop_reason is not None:
            return False
        if loop.val_dataset is not None and step % loop.eval_every_n_steps == 0:
            return False
        if loop.steps_per_epoch and step % loop.steps_per_epoch == 0:
            return False
        return all(type(cb).on_log is Callback.on_log for cb in self.callbacks)

    def _flush_deferred(self) -> None:
        assert self._deferred is not None
        window, lr = self._deferred
        self._deferred = None
        self._flush(window, lr)

    def _flush_window(self, keep: bool = False) -> None:
        """Write the pending records; with `keep` (a signal's stop) the window's record is marked ``interrupted``
        and the window stays pending, for the checkpoint."""
        if self._deferred is not None:
            self._flush_deferred()
        if not self.window:
            return
        window = self.window
        if not keep:
            self.window = []
        self._flush(window, None)

    def _flush(self, window: list[tuple[int, Mapping[str, Any]]], lr: float | None) -> None:
        """Write the train (and time) record of `window`; `lr`: the learning rate at its last step, if known."""
        steps = [s for s, _ in window]
        step = steps[-1]
        columns = _columns(window)
        record: dict[str, float] = {}
        if columns is not None:  # one array per metric: the same values and means, without a dict per step
            losses = np.asarray(columns["loss"], dtype=np.float64)
            if not np.isfinite(losses).all():
                i = int(np.flatnonzero(~np.isfinite(losses))[0])
                self._check_finite(steps[i], losses[i])
            for key, column in columns.items():  # in float64: a window restored from a checkpoint (Python floats)
                record[key] = float(np.mean(np.asarray(column, dtype=np.float64)))  # gives the same mean
        else:
            values = _on_host(window)
            for s, v in zip(steps, values):
                self._check_finite(s, v["loss"])
            for key in values[0]:
                record[key] = float(np.mean(np.asarray([v[key] for v in values], dtype=np.float64)))
        record["lr"] = lr if lr is not None else self.backend.learning_rate(step)
        self.last_train = record
        epoch = self.epoch_of(step)
        self._emit({"type": "metrics", "context": "time", "step": step, "epoch": epoch, **self.clock.summary()})
        self._emit({"type": "metrics", "context": "train", "step": step, "epoch": epoch, **record})
        if self.progress is not None:
            self.progress.logged(step, epoch, record.get("loss"))

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as plain data (see `EngineSnapshot`); checks the pending losses first.

        Called before a checkpoint is written: no checkpoint holds weights past a NaN loss, and the checkpoint
        carries the pending values so a resumed run writes the same train records as an uninterrupted one.
        """
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

    def _evaluate(self, observe: bool = True) -> dict[str, float]:
        """A validation pass at this step: a record, the progress line and (with `observe`) the callbacks'
        `on_eval_end`; without `observe` nothing the run goes on from changes (a stop's display)."""
        loop = self.loop
        self._phase_start("evaluating")
        t0, compiles = time.perf_counter(), CompileWatch.count
        metrics = evaluate(self.backend, loop.val_dataset, loop.eval_batch_size or loop.batch_size, loop)
        seconds = time.perf_counter() - t0
        self.clock.eval_s += seconds
        self.clock.eval_compiles += CompileWatch.count - compiles
        self._phase("evaluating", seconds)
        prefixed = {f"validate/{k}": v for k, v in metrics.items()}
        self.eval_metrics = dict(prefixed)
        self.evaluated_at = self.step
        self.ctx.last_eval = prefixed
        self._emit({"type": "metrics", "context": "validate", "step": self.step, "epoch": self.ctx.epoch, **metrics})
        if self.progress is not None:
            self.progress.evaluated(self.step, self.ctx.epoch, prefixed)
        if observe:
            for cb in self.callbacks:
                cb.on_eval_end(self.ctx, prefixed)
        return prefixed

    def final_metrics(self) -> dict[str, float]:
        """The stage's metrics for its artifact and the next stage: those of the model it returns.

        After `restore_best`, the restored step's: its validation metrics (recorded with its checkpoint, or
        computed now when that checkpoint was scored without a validation pass there) and the train window
        logged last before it; the last step's go to the artifact's ``restored`` record with the step.
        The test split is evaluated on the returned model.
        """
        out = {f"train/{k}": v for k, v in self.last_train.items()}
        out.update(self.eval_metrics)
        loop = self.loop
        if self._restored is not None:
            out = self._restored_metrics(out)
        if loop.test_dataset is not None:
            self._phase_start("evaluating")
            t0 = time.perf_counter()
            metrics = evaluate(self.backend, loop.test_dataset, loop.eval_batch_size or loop.batch_size, loop)
            seconds = time.perf_counter() - t0
            self.clock.eval_s += seconds
            self._phase("evaluating", seconds)
            self._emit({"type": "metrics", "context": "test", "step": self.step, "epoch": self.ctx.epoch, **metrics})
            out.update({f"test/{k}": v for k, v in metrics.items()})
        return out

    def _restored_metrics(self, last: dict[str, float]) -> dict[str, float]:
        """The final metrics of the step `restore_best` loaded (see `final_metrics`); records which step it was."""
        assert self._restored is not None
        step, meta = self._restored
        out = {f"train/{k}": float(v) for k, v in dict(meta.get("last_train") or {}).items()}
        last_eval = {k: v for k, v in dict(meta.get("last_eval") or {}).items() if not k.startswith("_")}
        evaluated_at = meta.get("evaluated_at", dict(meta.get("last_eval") or {}).get("_step"))
        if last_eval and evaluated_at is not None and int(evaluated_at) == step:
            out.update({k: float(v) for k, v in last_eval.items()})
        elif self.loop.val_dataset is not None:  # scored on a train metric: evaluate the restored weights now
            loop = self.loop
            metrics = evaluate(self.backend, loop.val_dataset, loop.eval_batch_size or loop.batch_size, loop)
            out.update({f"validate/{k}": v for k, v in metrics.items()})
        self._restored_record = {
            "from": "best",
            "step": step,
            "epoch": meta.get("epoch"),
            "monitor": self.loop.checkpoint_settings.monitor if self.loop.checkpoint_settings is not None else None,
            "score": meta.get("score"),
            "last_step": self.step,
            "last_metrics": {k: float(v) for k, v in last.items()},
        }
        return out


def evaluate(backend: StepBackend, dataset: Any, batch_size: int, loop: Any = None) -> dict[str, float]:
    """Record-weighted means of the backend's eval metrics over one ordered pass of `dataset`, then the loop's
    whole-split `metrics` (`pipekit_train.Metric`), which replace a same-named mean.

    Nothing is read back to the host before the pass ends.
    """
    import jax

    from ..data._standardize import invert, statistics_of
    from ..tracking._metrics import compute_metrics, init_states, update_states

    wanted = tuple(getattr(loop, "metrics", ()) or ())
    model = backend.bound_model() if wanted else None
    states = init_states(wanted)
    totals: dict[str, float] = {}
    count = 0
    results = []
    # A standardized target: the whole-split metrics compare predictions and targets in the data's units.
    stats = statistics_of(dataset.transforms) if wanted else {}
    for batch in dataset.epoch_batches(batch_size):
        size = len(next(iter(batch.values())))
        results.append((size, backend.evaluate(batch)))
        if model is not None:
            y = loop.target_key
            predicted, target = invert(stats, y, model(batch[loop.input_key])), invert(stats, y, batch[y])
            states = update_states(wanted, states, predicted, target)
    for size, metrics in jax.device_get(results):
        count += size
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * size
    out = {k: v / max(count, 1) for k, v in totals.items()}
    if wanted:
        out.update(compute_metrics(wanted, states))
    return out


def _batch_bytes(loop: Any) -> int:
    """Bytes of one training batch on the host after the transforms (0 when the dataset cannot say)."""
    try:
        spec = loop.dataset.element_spec()
    except Exception:  # a dataset without a spec: no byte cap on fusion
        return 0
    record: int = sum(int(math.prod(shape)) * int(np.dtype(dtype).itemsize) for shape, dtype in spec.values())
    return int(loop.batch_size) * record


def _data_steps_per_epoch(loop: Any) -> int | None:
    """Batches per epoch of the training set, for `epoch` when `steps_per_epoch` is unset (``None``: unknown)."""
    num_batches = getattr(loop.dataset, "num_batches", None)
    if num_batches is None:
        return None
    try:
        return int(num_batches(loop.batch_size)) or None
    except Exception:  # a dataset that cannot say: records keep epoch 0, as before
        return None


def _failure_line(stage: str, step: int, exc: BaseException) -> str:
    """The progress line for a stage that ended with `exc`."""
    if isinstance(exc, NonFiniteLossError):
        return f"{stage}: stopped on a non-finite loss: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return f"{stage}: interrupted at step {step} ({type(exc).__name__})"
    return f"{stage}: failed at step {step}: {type(exc).__name__}: {exc}"


class _LRScale:
    def __init__(self, backend: StepBackend) -> None:
        self.backend = backend

    def get(self) -> float:
        return self.backend.get_lr_scale()

    def set(self, value: float) -> None:
        self.backend.set_lr_scale(value)


def run_steps(loop: Any, backend: StepBackend, info: Any, hooks: StageHooks | None) -> AdapterResult:
    """The usual body of an adapter's ``run``: restore (warm start, resume), then the engine's loop.

    Returns the engine's `AdapterResult`; the adapter fills in ``backend_info``, ``opt_state`` and ``rng``.
    """
    start_step, data_state, callback_states = 0, None, None
    if hooks is not None:
        start_step, data_state, callback_states = hooks.restore(backend)
    engine = Engine(
        loop,
        backend,
        stage=info.stage,
        run_id=info.run_id,
        stage_dir=info.stage_dir,
        start_step=start_step,
        data_state=data_state,
        callback_states=callback_states,
        hooks=hooks,
    )
    return engine.run()
