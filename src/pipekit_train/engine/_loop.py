"""The backend-agnostic step loop: `Engine.run`, a stage's steps from its first dispatch to its `AdapterResult`.

An adapter supplies a `StepBackend` (how to run steps on its framework) and calls `Engine.run`. The engine decides
*when* things happen, by absolute step numbers, so a resumed run makes exactly the decisions an uninterrupted run
would have made: a chunk of fused steps never crosses a log, eval, checkpoint or epoch boundary.

The loop is this module; the engine's other parts, one idea each, are mixed into `Engine`: the schedule
(`_chunks.Schedule`), the log window and its records (`_window.LogWindow`), the phases it reports
(`_phases.Phases`), evaluation (`_evaluation.Evaluation`), its side of checkpoints and overlapped saves
(`_saves.Saves`), divergence checks (`_divergence.Divergence`) and the `on_step_end` reports
(`_step_ends.StepEnds`); the training batches are `_data`. What it drives
and returns (`StepBackend`, `StageHooks`, `EngineSnapshot`, `AdapterResult`) is `_protocol`; the checkpoint and
resume hooks are `_hooks`.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._warnings import PipekitTrainWarning
from ..backends._contract import StepBackend
from ..callbacks._base import Callback, TrainContext
from ..scale._distributed import is_primary
from ..tracking._progress import CompileWatch, PhaseClock, Progress, model_summary
from ..tracking._writers import JsonLinesWriter, MetricWriter, NullWriter
from ._chunks import Schedule, callback_keys, chunk_plan
from ._data import batch_bytes, data_steps_per_epoch, training_batches
from ._divergence import Divergence
from ._evaluation import Evaluation
from ._phases import Phases
from ._probe import from_env as probe_from_env
from ._protocol import AdapterResult, NonFiniteLossError, StageHooks, now_iso
from ._saves import Saves
from ._step_ends import StepEnds
from ._window import LogWindow

__all__ = ["Engine", "run_steps"]

#: The loop reads a dispatch's losses for the divergence check (`_divergence`) when at least this many steps have
#: passed since its last read: every fused chunk of that length or more, one in this many one-step calls.
FINITE_READ_STEPS = 16


class Engine(Schedule, LogWindow, Phases, Evaluation, Saves, Divergence, StepEnds):
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
        self.steps_per_epoch: int | None = loop.steps_per_epoch or data_steps_per_epoch(loop)
        self.ctx.epoch = self.epoch_of(start_step)
        self.clock = PhaseClock()
        self.progress: Progress | None = None
        self._saved = False
        self.hooks = hooks
        # `pipekit-train check-resume`: a trace of the state after every chunk, kills at exact steps (`probe`).
        self.probe = probe_from_env(stage)
        self._plan_step_ends(self.probe)
        self.chunks = chunk_plan(loop, self._periods(), backend.fuses_steps(), batch_bytes(loop), self.callbacks)
        self.iterator, self.resident = training_batches(loop, backend, self.chunks.size)
        if data_state is not None:
            self.iterator.set_state(data_state)
        self.window: list[tuple[int, Mapping[str, Any]]] = []
        self._finite_read = start_step  # the step whose loss the divergence check last read early
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

    # The run -----------------------------------------------------------------------------------------------
    def run(self) -> AdapterResult:
        import jax

        loop, ctx = self.loop, self.ctx
        started = now_iso()
        self.writer.open(ctx.run_dir)
        CompileWatch.install()
        samples = loop.adapter().samples  # a sampler's stage: its output speaks of draws (`Backend.samples`)
        progress = self.progress = Progress(
            self.stage,
            loop.max_steps,
            self.step,
            enabled=loop.progress and self.primary,
            batch_size=None if samples else loop.batch_size,
            samples=samples,
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
            summary = None if samples else self._model_summary()  # a posterior's draws are not parameters
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
                    self._deliver_pending()
                    self._phase_start("compiling")
                t0 = time.perf_counter()
                if self.resident:  # the chunk slices its own batches on the device
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
                self._deliver_pending()  # the previous chunk's steps, while this one runs (`_step_ends`)
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
                # it never makes the host wait for the device, and at most once per `FINITE_READ_STEPS` steps (at
                # one step per call it was a host transfer every step); every step's loss is checked at the next
                # log step and before a checkpoint (`_divergence`).
                if pending is not None and self.step - self._finite_read >= FINITE_READ_STEPS and _ready(pending[1]):
                    self._check_finite(*pending)
                    self._finite_read = self.step
                pending = (self.step, metrics["loss"])
                self._after_chunk(first, n, metrics, may_defer=not compiled_now)
                if self.probe is not None:  # (it reads the callbacks' states: their steps were reported)
                    self.probe.after_chunk(self, first, metrics, data_state)
                if self.hooks is not None and ctx.stop_reason is None and not self.hooks.idle_after(self.step):
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
                if progress.enabled:
                    progress.update(self.step, ctx.epoch, self.last_train.get("loss"), self.clock.recent_step_s())
            self._deliver_pending()  # the last chunk's steps, before anything of the stage's end
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
            with contextlib.suppress(Exception):  # the steps computed are reported, as they would have been
                self._deliver_pending()
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

    def _after_chunk(self, first: int, n: int, metrics: Mapping[str, Any], may_defer: bool = False) -> None:
        loop, ctx = self.loop, self.ctx
        self._report_steps(first, n, metrics)
        if self.step % loop.log_every_n_steps == 0 or self.step == loop.max_steps:
            if may_defer and self._deferrable():
                # The learning rate now (it reads this chunk's state, as the flush would have); the transfer,
                # the records and the writer after the next dispatch, while the device runs the next chunk.
                self._deferred = (self.window, self.backend.learning_rate(self.step))
                self.window = []
            else:
                self._flush_window()
        if loop.val_dataset is not None and (self.step % loop.eval_every_n_steps == 0 or self.step == loop.max_steps):
            self._deliver_pending()
            self._evaluate()
        if loop.steps_per_epoch and self.step % loop.steps_per_epoch == 0:
            self._deliver_pending()
            for cb in self.callbacks:
                cb.on_epoch_end(ctx)

    def _model_summary(self) -> dict[str, Any] | None:
        """Parameters per top-level submodule and in all (`tracking._progress.model_summary`), or ``None``."""
        try:
            weights = self.backend.bound_model().weights()
        except Exception:  # a model without plain weights (a sampler before its first draw): no summary
            return None
        return model_summary(weights, trainable=self.backend.trainable_params())

    def _params(self) -> dict[str, Any]:
        from pipekit._yaml import to_plain

        fields = to_plain(self.loop, strict=False)
        return {"stage": self.stage, "params": fields}


def _ready(value: Any) -> bool:
    """Whether a dispatched value is computed (a JAX array's ``is_ready``; anything else is)."""
    is_ready = getattr(value, "is_ready", None)
    return True if is_ready is None else bool(is_ready())


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
