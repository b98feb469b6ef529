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
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._warnings import PipekitTrainWarning
from ..scale._distributed import agree, barrier, gather_data_state, is_primary, local_data_state, process_count

if TYPE_CHECKING:
    from ._protocol import HookCall
from .._trees import path_name
from ..checkpoint._checkpointer import Checkpointer
from ..checkpoint._elastic import refusal, saved_topology, topology_now, topology_text, without_topology
from ..checkpoint._errors import CheckpointError, CheckpointMismatchError
from ..checkpoint._layout import HeldState
from ..checkpoint._settings import Checkpoint

#: Configuration that must not change between a checkpoint and the run resuming it.
_FINGERPRINT_FIELDS = (
    "model_op",
    "loss",
    "optimizer_config",
    "max_steps",
    "batch_size",
    "seed",
    "accum",
    "grad_clip_norm",
    "steps_per_call",
    "input_key",
    "target_key",
    "steps_per_epoch",
    "transfer",
    "task",
)


def fingerprint(loop: Any) -> dict[str, Any]:
    """What a checkpoint must have been written under for a resume to be exact, as plain data."""
    from pipekit._yaml import to_plain

    from ..optim._config import resolve_optimizer_config

    out = {name: to_plain(getattr(loop, name), name, strict=False) for name in _FINGERPRINT_FIELDS}
    # Defaults written out change nothing: compare the configuration with every default filled in.
    out["optimizer_config"] = resolve_optimizer_config(loop.optimizer_config)
    out["dataset_hash"] = loop.dataset.content_hash()
    out["dataset_shuffle"] = loop.dataset.shuffle
    out["dataset_drop_remainder"] = loop.dataset.drop_remainder
    # Validation feeds callbacks (early stopping, plateaus) and `Best` checkpoints: its data and cadence count.
    val = loop.val_dataset
    out["val_dataset_hash"] = val.content_hash() if val is not None else None
    out["eval_every_n_steps"] = loop.eval_every_n_steps if val is not None else None
    out["eval_batch_size"] = (loop.eval_batch_size or loop.batch_size) if val is not None else None
    callbacks: dict[str, list[Any]] = {}
    for cb in loop.callbacks:
        mark = cb.fingerprint()
        if mark is not None:
            callbacks.setdefault(type(cb).__name__, []).append(mark)
    out["callbacks"] = callbacks
    # The recipes (docs/recipes.md) change the result; written only when set, so other checkpoints keep theirs.
    # `diagnostics` only adds metrics and is left out.
    for name in ("gradient", "param_groups"):
        if getattr(loop, name, None):
            out[name] = to_plain(getattr(loop, name), name, strict=False)
    # The topology and the compute dtype change the floating-point result. Another precision is refused like any
    # other change; another device or process count alone is an elastic resume (`_elastic.without_topology`: the
    # data position is global). Only written when not the defaults, so checkpoints of one-device float32 runs keep
    # their fingerprint.
    from ..scale._mesh import describe
    from ..scale._precision import compute_dtype

    topology = describe(loop)
    if topology["num_devices"] > 1 or topology["shard_params"]:
        out["mesh"] = {"num_devices": topology["num_devices"], "shard_params": topology["shard_params"]}
        if topology["num_processes"] > 1:
            out["mesh"]["num_processes"] = topology["num_processes"]
    if compute_dtype(loop.precision) is not None:
        out["precision"] = compute_dtype(loop.precision)
    # Fused chunks end at checkpoint steps: the cadence may shape the compiled calls (`auto` fuses too). It is
    # recorded as it is; a resume compares it only where it shapes them (`comparable`).
    if loop.steps_per_call == "auto" or loop.steps_per_call > 1:
        checkpoint = loop.checkpoint_settings
        out["checkpoint_every"] = checkpoint.every_n_steps if checkpoint is not None else None
    return out


def cadence_shapes_chunks(loop: Any, every: int) -> bool:
    """Whether checkpoints every `every` steps change how the engine cuts `loop`'s steps into compiled calls
    (`stage.chunks`). They do not when every multiple of `every` before `max_steps` is a boundary anyway (`every`
    is a multiple of the log cadence, of the evaluation cadence with validation data, of `steps_per_epoch`, of an
    integer `steps_per_call` or of `max_steps`, or at least `max_steps`) and, with `auto`, the chunk size it
    resolves to does not move (`every` is a multiple of the other periods' common divisor and no shorter than the
    shortest of them)."""
    setting = loop.steps_per_call
    if setting != "auto" and int(setting) <= 1:
        return False
    periods = [loop.log_every_n_steps, loop.max_steps]
    if loop.val_dataset is not None:
        periods.append(loop.eval_every_n_steps)
    if loop.steps_per_epoch:
        periods.append(loop.steps_per_epoch)
    periods = [int(p) for p in periods if p]
    cuts = periods if setting == "auto" else [*periods, int(setting)]
    if not (every >= loop.max_steps or any(every % p == 0 for p in cuts)):
        return True
    return setting == "auto" and not (every % math.gcd(*periods) == 0 and every >= min(periods))


def comparable(recorded: dict[str, Any] | None, loop: Any) -> dict[str, Any]:
    """A fingerprint as a resume under `loop` compares it: a checkpoint cadence that shapes no chunk of `loop`
    (`cadence_shapes_chunks`) reads as `SHAPES_NO_CHUNK`, so a change between such cadences resumes into exactly
    the chunks the uninterrupted run with the new cadence makes, while any other change of it is refused."""
    out = dict(recorded or {})
    every = out.get("checkpoint_every")
    if isinstance(every, int) and not cadence_shapes_chunks(loop, every):
        out["checkpoint_every"] = SHAPES_NO_CHUNK
    return out


#: What `comparable` shows for a checkpoint cadence whose steps are chunk boundaries anyway (in a refusal's diff).
SHAPES_NO_CHUNK = "shapes no chunk (a multiple of a boundary)"


def _diff(saved: dict[str, Any], now: dict[str, Any], then: str = "checkpoint") -> str:
    """A unified diff of two fingerprints: `then` (what was saved) against ``this run``."""
    a = json.dumps(saved, indent=1, sort_keys=True).splitlines()
    b = json.dumps(now, indent=1, sort_keys=True).splitlines()
    return "\n".join(difflib.unified_diff(a, b, then, "this run", lineterm="", n=1))


#: The stop reasons of a signal's stop: a checkpoint written with one is resumed from; any other ended the stage.
_SIGNAL_NAMES = ("SIGINT", "SIGTERM")


class _Signals:
    """SIGINT/SIGTERM → a flag the loop reads after each step; a second SIGINT aborts at once."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # inherited ignored (a background job of a shell): Ctrl+C is not this process's to hear
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt("second Ctrl+C: aborting without a checkpoint")
        self.reason = signal.Signals(signum).name
        self.signum = signum

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


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
            self._warm_start(backend)
        if not self.resume:
            if self.fork_point is not None:  # --fork: another run's whole training state (`_fork.py`)
                from ._fork import restore_fork

                return restore_fork(self, backend, self.fork_point)
            return 0, None, None
        ckpt = self.checkpointer
        step = ckpt.latest_step() if ckpt is not None else None
        if is_primary():  # several processes: process 0 moves what never committed, the others wait for it
            self._set_aside_uncommitted(step)
        barrier("set-aside")
        if self.extension is not None and step is None:  # an extension's first start: the finished stage's end
            return self._continue_finished(backend)
        if ckpt is None or step is None:
            where = self.directory if ckpt is not None else "this stage (it has no Checkpoint callback)"
            warnings.warn(
                f"resume='auto': nothing to resume in {where}; starting fresh", PipekitTrainWarning, stacklevel=2
            )
            return 0, None, None
        try:
            state, data_iter, meta = ckpt.restore(step, backend.state_tree())
        except CheckpointMismatchError:  # other shapes: report the configuration change when that is the cause
            meta = ckpt.restore(step, None)[2]
            if without_topology(meta.get("fingerprint")) == without_topology(self.fingerprint):
                raise
        # Another device or process count alone is an elastic resume (`_elastic`): accepted and recorded.
        self._elastic(meta, step)
        saved = without_topology(comparable(meta.get("fingerprint"), self.loop))
        now = without_topology(comparable(self.fingerprint, self.loop))
        if saved != now and self.force:
            self.forced = _diff(saved, now)
            warnings.warn(
                f"--force-resume: stage {self.info.stage!r} continues from step {step} under a changed "
                f"configuration; the result is not what either configuration alone gives:\n{self.forced}",
                PipekitTrainWarning,
                stacklevel=2,
            )
        elif saved != now:
            raise CheckpointMismatchError(
                f"refusing to resume stage {self.info.stage!r} from step {step} in {self.directory}: the "
                "configuration changed since that checkpoint was written:\n"
                f"{_diff(saved, now)}\n"
                "Resume with the original configuration, start a new run from these weights with "
                f"init_from: {self.directory}@{step}, or continue anyway with --force-resume (recorded in the "
                "artifact)"
            )
        backend.load_state_tree(state)
        if self.extension is not None and self.extension.new_segment:  # the segment's schedule, as saved
            backend.schedule_segment(self.extension.step, restart=False)
        self.last_saved = step
        # A crash between a commit and its rotation leaves checkpoints `keep` no longer retains: apply it now that
        # the checkpoint is accepted (a refused resume deletes nothing).
        ckpt.prune()
        callbacks = dict(meta.get("callbacks", {}))
        if callbacks and all(k.isdigit() for k in callbacks):  # written by 0.1, by position in the sorted list
            from ._chunks import callback_keys

            keys = callback_keys(tuple(sorted(self.loop.callbacks, key=lambda c: c.order)))
            callbacks = {keys[int(k)]: v for k, v in callbacks.items() if int(k) < len(keys)}
        self.restored_meta = meta
        reason = meta.get("stop_reason")
        if reason and reason not in _SIGNAL_NAMES and self.extension is None and self.keep_callback_stop:
            self.resumed_stop = str(reason)
        if meta.get("fork"):
            self.fork = meta["fork"]
            self.parent_ids = (meta["fork"]["parent_artifact"],) if meta["fork"].get("parent_artifact") else ()
        where = f"resuming stage {self.info.stage!r} from step {step} in {self.directory}"
        return int(meta["step"]), local_data_state(data_iter, where), callbacks

    def _elastic(self, meta: dict[str, Any], step: int) -> None:
        """The topology history to carry on: the checkpoint's, plus this resume when the topology changed (refused
        in one line when the new device count cannot split the global batch)."""
        then, now = saved_topology(meta), topology_now(self.loop)
        history = [dict(c) for c in meta.get("topology_changes") or []]
        if then != now:
            message = refusal(self.loop, self.info.stage, str(self.directory), step, then, now)
            if message is not None:
                raise CheckpointMismatchError(message)
            history.append({"step": step, "from": then, "to": now})
            self.topology_note = (
                f"{self.info.stage}: elastic resume at step {step} on {topology_text(now)}, written on "
                f"{topology_text(then)}: the same batches, weights within float rounding (docs/reliability.md)"
            )
        self.topology_changes = history

    def _continue_finished(self, backend: Any) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """Restore everything the finished stage's final checkpoint holds (the state, the data position, the
        callbacks and the pending records), as a resume would: the extension continues where the stage ended.
        The step backend reads the state (`StepBackend.extend_from`: a sampler grows its draw buffer)."""
        ext = self.extension
        read: dict[str, Any] = {}

        def restore(like: Any) -> Any:
            source = Checkpointer(ext.directory, async_save=False)
            try:
                state, read["data_iter"], meta = source.restore(ext.step, like)
            finally:
                source.close()
            saved, expected = meta.get("fingerprint"), fingerprint(ext.loop)
            if saved != expected:
                raise CheckpointMismatchError(
                    f"refusing to extend stage {ext.stage!r}: its checkpoint of step {ext.step} in {ext.directory} "
                    f"was written under another configuration than the stage recorded:\n{_diff(saved or {}, expected)}"
                )
            read["meta"] = meta
            return state

        backend.extend_from(restore, ext.loop)
        if "meta" not in read:
            raise CheckpointError(
                f"stage {self.info.stage!r}: {type(backend).__name__}.extend_from did not read the finished stage's "
                "checkpoint (it must call restore)"
            )
        if ext.new_segment:  # pre-flight refused it for a backend without the schedule_segment capability
            backend.schedule_segment(ext.step, restart=True)
        meta = read["meta"]
        callbacks = dict(meta.get("callbacks", {}))
        self.restored_meta = meta
        where = f"extending stage {ext.stage!r} from step {ext.step} in {ext.directory}"
        return int(meta["step"]), local_data_state(read["data_iter"], where), callbacks

    def _set_aside_uncommitted(self, latest: int | None) -> None:
        """Step directories newer than the latest committed checkpoint never committed (a crash during the save):
        say which and why, and move them aside, so the resumed run can write those steps again."""
        from ..checkpoint._layout import _never_committed, _uncommitted_after

        resumed = f"resuming from step {latest}" if latest is not None else "starting fresh"
        for child, reason in _uncommitted_after(Path(self.directory), latest):
            aside = child.with_name(f"{child.name}.uncommitted-{int(time.time())}")
            child.rename(aside)
            warnings.warn(
                f"stage {self.info.stage!r}: {_never_committed(child, reason, resumed)}. Its files were moved to "
                f"{aside.name}",
                PipekitTrainWarning,
                stacklevel=3,
            )

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

    def _warm_start(self, backend: Any) -> None:
        """Load only the weights of `init_from` (``DIR[@best|@latest|@STEP|@average(last=N)|@average(best=N)]``)."""
        spec = self.loop.init_from
        path, _, which = spec.partition("@")
        directory = Path(path)
        if (directory / "checkpoints").is_dir():
            directory = directory / "checkpoints"
        if not (directory / "manifest.json").exists():
            raise CheckpointError(
                f"TrainingLoop.init_from {spec!r}: {directory} is not a checkpoint directory (no manifest.json); "
                "give a stage directory or its checkpoints/ folder, optionally with @best, @latest, @STEP or "
                "@average(last=N)"
            )
        averaged = re.fullmatch(r"average\((last|best)=(\d+)\)", which)
        if averaged is not None:  # DIR@average(last=3): the uniform mean of those checkpoints' weights
            from ..checkpoint._average import average_checkpoints
            from ..checkpoint._selectors import Average, Best, Last

            count = int(averaged.group(2))
            selector = Last(n=count) if averaged.group(1) == "last" else Best(k=count)
            raw = average_checkpoints(directory, Average(selector=selector), None)
        elif which and not which.isdigit() and which not in ("best", "latest"):
            raise CheckpointError(
                f"TrainingLoop.init_from {spec!r}: {which!r} is not a checkpoint choice; write DIR, DIR@best, "
                "DIR@latest, DIR@STEP, DIR@average(last=N) or DIR@average(best=N)"
            )
        else:
            source = Checkpointer(directory, async_save=False)
            try:
                choice: int | str = (
                    int(which) if which.isdigit() else (which or ("best" if source.best_step() else "latest"))
                )
                raw, _, _ = source.restore(choice, None)
            finally:
                source.close()
        weights = backend.weights_tree()
        backend.load_weights_tree(
            {part: _graft(tree, raw.get(part, {}), f"{spec}: {part}") for part, tree in weights.items()}
        )
        parent = _source_artifact(directory)
        if parent:
            self.parent_ids = (parent,)


def _graft(template: Any, raw: Any, where: str) -> Any:
    """`template` with every array leaf replaced by the leaf at the same path of the restored `raw` tree."""
    import jax

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves_with_path:
        node = raw
        for part in path_name(path).split("/"):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise CheckpointMismatchError(
                    f"init_from {where}: the checkpoint has no weights at {path_name(path)!r}; the architectures differ"
                )
        value = np.asarray(node)
        if value.shape != tuple(leaf.shape):
            raise CheckpointMismatchError(
                f"init_from {where}: weights {path_name(path)!r} have shape {value.shape} in the checkpoint but "
                f"{tuple(leaf.shape)} in this model"
            )
        out.append(np.asarray(value, dtype=leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _source_artifact(directory: Path) -> str | None:
    """The artifact id of the stage that wrote `directory`, when it finished and recorded one."""
    for candidate in (directory / "artifact.json", directory.parent / "artifact.json"):
        if candidate.exists():
            try:
                return str(json.loads(candidate.read_text())["artifact_id"])
            except (ValueError, KeyError):
                return None
    return None


def make_hooks(loop: Any, info: Any, settings: Any) -> CheckpointHooks:
    """The hooks for one stage: with its `Checkpoint` callback (if any) and the run's resume setting."""
    config = loop.checkpoint_settings
    resume = settings.resume == "auto" or loop.resume == "auto"
    extension = getattr(settings, "extension", None)
    force = bool(getattr(settings, "force_resume", False))
    hooks = CheckpointHooks(loop, info, resume or extension is not None, config, force=force, extension=extension)
    if info.stage_index == 0:  # a fork starts the run's first stage
        hooks.fork_point = getattr(settings, "fork", None)
    return hooks
