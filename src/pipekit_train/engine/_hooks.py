"""The engine's checkpoint and resume hooks: save cadence, exact resume, weight-only starts, graceful stops.

`make_hooks` builds one `CheckpointHooks` per stage. The engine calls it at fixed points:

- ``restore(backend)`` before the first step: a weights-only start (`TrainingLoop.init_from`), then, with
  ``resume="auto"``, the latest committed checkpoint of this stage: params, optimizer state (so the step count and
  the learning-rate schedule position), EMA, data position, callbacks' state. A checkpoint written under another
  configuration is refused with a readable diff; one written on another device or process count continues (an
  elastic resume, `_elastic`) and is recorded.
- ``after_chunk(call, data_state)`` after every dispatch (`call`: a `HookCall`, never the engine): save at
  multiples of ``Checkpoint.every_n_steps`` (chunks never cross that boundary, so a resumed run makes the same
  chunks as an uninterrupted one). With ``call.may_wait`` (one process) it only takes the state
  (`Checkpointer.hold`) and returns the rest of the save, which the engine runs once the next chunk is dispatched.
- ``stop_requested()``: SIGINT/SIGTERM received (the handlers only set a flag; the step finishes first).
- ``at_end(call, data_state, stop_reason)``: a last save, waiting for asynchronous writes, retention
  (`Checkpointer.prune`, also applied once a resumed checkpoint is accepted), `restore_best`.

The data position saved with step ``s`` is the iterator's state right after the batches of step ``s`` were drawn,
and the PRNG key of every step is derived from the seed and the step number, so restoring the three (weights and
optimizer state, data position, step) continues the run bitwise.

This module is the hooks' object, when to save and what a save holds; its parts are the fingerprint
(`_fingerprint`), resume (`_resume`), warm starts (`_warm_start`) and the signals' flag (`_stop`).
"""

from __future__ import annotations

import functools
import signal
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._warnings import PipekitTrainWarning
from ..checkpoint._checkpointer import Checkpointer
from ..checkpoint._elastic import topology_now
from ..checkpoint._layout import HeldState
from ..checkpoint._settings import Checkpoint
from ..scale._distributed import agree, gather_data_state, process_count
from ._fingerprint import fingerprint
from ._resume import resume_from_checkpoint
from ._stop import _Signals
from ._warm_start import warm_start

if TYPE_CHECKING:
    from ._protocol import HookCall


class CheckpointHooks:
    """Checkpointing, resume and graceful-stop hooks for one stage (see the module docstring)."""

    def __init__(
        self, loop: Any, info: Any, resume: bool, config: Checkpoint | None, force: bool = False, extension: Any = None
    ) -> None:
        self.loop = loop
        self.extension = extension  # a `stage.extension.Extension`: this stage continues a finished one
        self.force = force
        self.forced: str | None = None
        self.info = info
        self.resume = resume
        self.config = config
        self.directory = loop.checkpoint_directory(info.stage_dir)
        self.checkpointer: Checkpointer | None = config.checkpointer(self.directory) if config else None
        self.fingerprint = fingerprint(loop) if config else None
        self.signals = _Signals()
        self.last_saved: int | None = None
        self.interrupted: tuple[str, int] | None = None
        # A signal that came as the stage ended anyway: the stage is recorded, then the pipeline stops.
        self.pending_signal: tuple[str, int] | None = None
        self.stopping: str | None = None
        self.parent_ids: tuple[str, ...] = ()
        self.restored_meta: dict[str, Any] | None = None
        # The stop a callback asked for (early stopping, pruning) that the resumed checkpoint was written at: the
        # stage had ended there, and ends there again (a kill came before it was recorded). Not for a stage recorded
        # as finished that runs again under a changed configuration (`keep_callback_stop` false, the runner's call).
        self.resumed_stop: str | None = None
        self.keep_callback_stop = True
        self.backend: Any = None
        self.topology: dict[str, int] | None = topology_now(loop) if config else None
        self.topology_changes: list[dict[str, Any]] = []  # elastic resumes so far (`_elastic`)
        self.topology_note: str | None = None
        self.fork_point: Any = None  # a `_fork.ForkPoint`: this stage starts from another run's checkpoint
        self.fork: dict[str, Any] | None = None  # the lineage edge `_fork.restore_fork` recorded

    # Engine protocol ---------------------------------------------------------------------------------------
    def boundaries(self) -> list[int]:
        return [self.config.every_n_steps] if self.config else []

    def restore(self, backend: Any) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]] | None]:
        try:
            return self._restore(backend)
        except BaseException:  # a refused or failed restore must not leave our signal handlers installed
            self.close()
            raise

    def _restore(self, backend: Any) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]] | None]:
        self.backend = backend
        self.signals.install()
        if self.loop.init_from:
            parent = warm_start(self.loop.init_from, backend)
            if parent:
                self.parent_ids = (parent,)
        if not self.resume:
            if self.fork_point is not None:  # --fork: another run's whole training state (`_fork.py`)
                from ._fork import restore_fork

                return restore_fork(self, backend, self.fork_point)
            return 0, None, None
        return resume_from_checkpoint(self, backend)

    def idle_after(self, step: int) -> bool:
        """Whether `after_chunk` at `step` would do nothing: one process (no agreement to take part in), no signal
        seen and no checkpoint due. The engine then skips the call and the `HookCall` it builds for it (a few µs of
        each step of a one-step-per-call loop)."""
        quiet = self.config is None or not self.config.should_save(step)
        if quiet and self.signals.reason is None and process_count() == 1:
            self.stopping = None  # what `after_chunk` would have agreed on: no signal
            return True
        return False

    def after_chunk(self, call: HookCall, data_state: dict[str, Any]) -> Callable[[], None] | None:
        # A signal seen now stops after this chunk and `at_end` writes the checkpoint with its stop_reason; one that
        # arrives during the save below is acted on after the next chunk, so the stop checkpoint always records it.
        # Several processes stop together: a signal one of them saw stops every one after this chunk.
        self.stopping = agree("stop", self.signals.reason)
        if self.stopping is not None and self.signals.reason is None:
            self.signals.reason, self.signals.signum = self.stopping, int(signal.Signals[self.stopping])
        if self.config is None or not self.config.should_save(call.step) or self.stopping is not None:
            return None
        assert self.checkpointer is not None
        if call.may_wait and process_count() == 1:  # several processes save together, in step
            held = self.checkpointer.hold(call.backend.state_tree())
            return functools.partial(self._save, call, data_state, held=held)
        self._save(call, data_state)
        return None

    def stop_requested(self) -> str | None:
        return self.stopping

    def at_end(self, call: HookCall, data_state: dict[str, Any], stop_reason: str | None) -> None:
        try:
            # The engine stops a stage on a signal only when it would go on (`stop_reason` is then the signal's
            # name); a signal that came as the stage ended anyway lets it be recorded and stops what follows.
            interrupted = self.signals.reason is not None and stop_reason == self.signals.reason
            wanted = self.config is not None and (self.config.save_on_end or stop_reason is not None)
            if wanted and self.last_saved != call.step:
                self._save(call, data_state, stop_reason, resume_point=interrupted)
            if self.checkpointer is not None:
                self.checkpointer.wait()
                self.checkpointer.prune()  # the directory holds what `keep` says, whatever a crash left
            if self.signals.reason is not None:
                signal_ = (self.signals.reason, self.signals.signum)
                if interrupted:
                    self.interrupted = signal_
                else:
                    self.pending_signal = signal_
            if self.loop.restore_best and not interrupted:
                self._restore_best(call)
        finally:
            self.close()

    def close(self) -> None:
        self.signals.uninstall()
        if self.checkpointer is not None:
            self.checkpointer.close()

    # Internals ---------------------------------------------------------------------------------------------
    def _save(
        self,
        call: HookCall,
        data_state: dict[str, Any],
        stop_reason: str | None = None,
        held: HeldState | None = None,
        resume_point: bool = False,
    ) -> None:
        """Save `call.step`: the backend's state now, or `held`, the state `Checkpointer.hold` took at that step
        (the backend may have moved on by a dispatched chunk since; the engine's records have not).

        With `resume_point` (a signal's stop), a step off the periodic cadence is saved as a resume point
        (`ManifestEntry.resume_point`: unscored, never ranked or counted by `keep`); a step on it is saved as the
        uninterrupted run saves it."""
        assert self.checkpointer is not None and self.config is not None
        snap = call.snapshot()
        if self.loop.stop_on_nonfinite:
            from ._protocol import NonFiniteWeightsError, first_nonfinite

            if held is None:
                weights = call.backend.weights_tree()
            else:  # the same parts of the held state (`weights_tree`'s keys are `state_tree`'s)
                state = held.tree()
                weights = {part: state[part] for part in call.backend.weights_tree()}
            bad = first_nonfinite(weights)
            if bad is not None:
                last = f"step {self.last_saved}" if self.last_saved is not None else "none"
                raise NonFiniteWeightsError(
                    f"stage {self.info.stage!r}: the weights at {bad} are not finite at step {snap.step}; no "
                    f"checkpoint was written for that step (the last good one: {last}). Lower the learning rate, "
                    "set grad_clip_norm, or resume from the last good checkpoint with other settings (init_from)"
                )
        resume_point = resume_point and not self.config.should_save(snap.step)
        evaluated_now = snap.evaluated_at == snap.step
        score = snap.last_eval.get(self.config.monitor) if evaluated_now else None
        if score is None and self.config.monitor.startswith("train/") and snap.last_train:
            score = snap.last_train.get(self.config.monitor[len("train/") :])
        if resume_point:
            score = None
        meta = {
            "step": snap.step,
            "epoch": snap.epoch,
            "stage": self.info.stage,
            "run_id": self.info.run_id,
            "score": score,
            "stop_reason": stop_reason,
            "callbacks": snap.callback_states,
            "fingerprint": self.fingerprint,
            "window": snap.pending,
            "last_train": snap.last_train,
            "last_eval": snap.last_eval,
            "evaluated_at": snap.evaluated_at,
            "topology": self.topology,
            "topology_changes": self.topology_changes,
        }
        if resume_point:
            meta["resume_point"] = True
        if self.fork is not None:  # a resumed fork still records where it was forked from
            meta["fork"] = self.fork
        data_iter = gather_data_state(data_state)  # several processes: every one's position, by process index
        state = held if held is not None else call.backend.state_tree()
        if self.checkpointer.save(snap.step, state=state, data_iter=data_iter, meta=meta):
            self.last_saved = snap.step
            call.written(snap.step)

    def _restore_best(self, call: HookCall) -> None:
        ckpt = self.checkpointer
        best = ckpt.best_step() if ckpt is not None else None
        if ckpt is None or best is None:
            warnings.warn(
                f"restore_best: stage {self.info.stage!r} has no scored checkpoint; keeping the last weights",
                PipekitTrainWarning,
                stacklevel=2,
            )
            return
        # The whole training state of the best step: weights, EMA and the optimizer state that goes with them.
        state, _, meta = ckpt.restore(best, call.backend.state_tree())
        call.backend.load_state_tree(state)
        call.restored(best, meta)


def make_hooks(loop: Any, info: Any, settings: Any) -> CheckpointHooks:
    """The hooks for one stage: with its `Checkpoint` callback (if any) and the run's settings (a
    `pipekit_train.stage.RunSettings`: ``resume``, ``force_resume``, ``extension``, ``fork``)."""
    config = loop.checkpoint_settings
    resume = settings.resume == "auto" or loop.resume == "auto"
    extension = settings.extension
    hooks = CheckpointHooks(
        loop, info, resume or extension is not None, config, force=bool(settings.force_resume), extension=extension
    )
    if info.stage_index == 0:  # a fork starts the run's first stage
        hooks.fork_point = settings.fork
    return hooks
