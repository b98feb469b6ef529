"""Resume: a stage that continues from the latest committed checkpoint of its own directory (``resume="auto"``), or
an extension that continues a finished stage from its final checkpoint, restoring params, optimizer state (so the
step count and the learning-rate schedule position), EMA, data position and the callbacks' state.

A checkpoint written under another configuration is refused with a readable diff of the fingerprints
(`_fingerprint`), or taken with ``--force-resume`` (recorded); one written on another device or process count
continues (an elastic resume, `checkpoint._elastic`) and is recorded. Step directories that never committed are
moved aside first. `CheckpointHooks.restore` calls `resume_from_checkpoint` (a warm start is `_warm_start`, a fork
`_fork`).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._warnings import PipekitTrainWarning
from ..checkpoint._checkpointer import Checkpointer
from ..checkpoint._elastic import refusal, saved_topology, topology_now, topology_text, without_topology
from ..checkpoint._errors import CheckpointError, CheckpointMismatchError
from ..scale._distributed import barrier, is_primary, local_data_state
from ._fingerprint import _diff, comparable, fingerprint
from ._stop import _SIGNAL_NAMES

if TYPE_CHECKING:
    from ._hooks import CheckpointHooks


def resume_from_checkpoint(
    hooks: CheckpointHooks, backend: Any
) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]] | None]:
    """Restore the stage's latest committed checkpoint into `backend` (an extension's first start: the finished
    stage's final one); return the step, the data position and the callbacks' state, as `StageHooks.restore`."""
    ckpt = hooks.checkpointer
    step = ckpt.latest_step() if ckpt is not None else None
    if is_primary():  # several processes: process 0 moves what never committed, the others wait for it
        _set_aside_uncommitted(hooks, step)
    barrier("set-aside")
    if hooks.extension is not None and step is None:  # an extension's first start: the finished stage's end
        return _continue_finished(hooks, backend)
    if ckpt is None or step is None:
        where = hooks.directory if ckpt is not None else "this stage (it has no Checkpoint callback)"
        warnings.warn(f"resume='auto': nothing to resume in {where}; starting fresh", PipekitTrainWarning, stacklevel=2)
        return 0, None, None
    try:
        state, data_iter, meta = ckpt.restore(step, backend.state_tree())
    except CheckpointMismatchError:  # other shapes: report the configuration change when that is the cause
        meta = ckpt.restore(step, None)[2]
        if without_topology(meta.get("fingerprint")) == without_topology(hooks.fingerprint):
            raise
    # Another device or process count alone is an elastic resume (`_elastic`): accepted and recorded.
    _elastic(hooks, meta, step)
    saved = without_topology(comparable(meta.get("fingerprint"), hooks.loop))
    now = without_topology(comparable(hooks.fingerprint, hooks.loop))
    if saved != now and hooks.force:
        hooks.forced = _diff(saved, now)
        warnings.warn(
            f"--force-resume: stage {hooks.info.stage!r} continues from step {step} under a changed "
            f"configuration; the result is not what either configuration alone gives:\n{hooks.forced}",
            PipekitTrainWarning,
            stacklevel=2,
        )
    elif saved != now:
        raise CheckpointMismatchError(
            f"refusing to resume stage {hooks.info.stage!r} from step {step} in {hooks.directory}: the "
            "configuration changed since that checkpoint was written:\n"
            f"{_diff(saved, now)}\n"
            "Resume with the original configuration, start a new run from these weights with "
            f"init_from: {hooks.directory}@{step}, or continue anyway with --force-resume (recorded in the "
            "artifact)"
        )
    backend.load_state_tree(state)
    if hooks.extension is not None and hooks.extension.new_segment:  # the segment's schedule, as saved
        backend.schedule_segment(hooks.extension.step, restart=False)
    hooks.last_saved = step
    # A crash between a commit and its rotation leaves checkpoints `keep` no longer retains: apply it now that
    # the checkpoint is accepted (a refused resume deletes nothing).
    ckpt.prune()
    callbacks = dict(meta.get("callbacks", {}))
    if callbacks and all(k.isdigit() for k in callbacks):  # written by 0.1, by position in the sorted list
        from ._chunks import callback_keys

        keys = callback_keys(tuple(sorted(hooks.loop.callbacks, key=lambda c: c.order)))
        callbacks = {keys[int(k)]: v for k, v in callbacks.items() if int(k) < len(keys)}
    hooks.restored_meta = meta
    reason = meta.get("stop_reason")
    if reason and reason not in _SIGNAL_NAMES and hooks.extension is None and hooks.keep_callback_stop:
        hooks.resumed_stop = str(reason)
    if meta.get("fork"):
        hooks.fork = meta["fork"]
        hooks.parent_ids = (meta["fork"]["parent_artifact"],) if meta["fork"].get("parent_artifact") else ()
    where = f"resuming stage {hooks.info.stage!r} from step {step} in {hooks.directory}"
    return int(meta["step"]), local_data_state(data_iter, where), callbacks


def _elastic(hooks: CheckpointHooks, meta: dict[str, Any], step: int) -> None:
    """The topology history to carry on: the checkpoint's, plus this resume when the topology changed (refused
    in one line when the new device count cannot split the global batch)."""
    then, now = saved_topology(meta), topology_now(hooks.loop)
    history = [dict(c) for c in meta.get("topology_changes") or []]
    if then != now:
        message = refusal(hooks.loop, hooks.info.stage, str(hooks.directory), step, then, now)
        if message is not None:
            raise CheckpointMismatchError(message)
        history.append({"step": step, "from": then, "to": now})
        hooks.topology_note = (
            f"{hooks.info.stage}: elastic resume at step {step} on {topology_text(now)}, written on "
            f"{topology_text(then)}: the same batches, weights within float rounding (docs/reliability.md)"
        )
    hooks.topology_changes = history


def _continue_finished(
    hooks: CheckpointHooks, backend: Any
) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """Restore everything the finished stage's final checkpoint holds (the state, the data position, the
    callbacks and the pending records), as a resume would: the extension continues where the stage ended.
    The step backend reads the state (`StepBackend.extend_from`: a sampler grows its draw buffer)."""
    ext = hooks.extension
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
            f"stage {hooks.info.stage!r}: {type(backend).__name__}.extend_from did not read the finished stage's "
            "checkpoint (it must call restore)"
        )
    if ext.new_segment:  # pre-flight refused it for a backend without the schedule_segment capability
        backend.schedule_segment(ext.step, restart=True)
    meta = read["meta"]
    callbacks = dict(meta.get("callbacks", {}))
    hooks.restored_meta = meta
    where = f"extending stage {ext.stage!r} from step {ext.step} in {ext.directory}"
    return int(meta["step"]), local_data_state(read["data_iter"], where), callbacks


def _set_aside_uncommitted(hooks: CheckpointHooks, latest: int | None) -> None:
    """Step directories newer than the latest committed checkpoint never committed (a crash during the save):
    say which and why, and move them aside, so the resumed run can write those steps again."""
    from ..checkpoint._layout import _never_committed, _uncommitted_after

    resumed = f"resuming from step {latest}" if latest is not None else "starting fresh"
    for child, reason in _uncommitted_after(Path(hooks.directory), latest):
        aside = child.with_name(f"{child.name}.uncommitted-{int(time.time())}")
        child.rename(aside)
        warnings.warn(
            f"stage {hooks.info.stage!r}: {_never_committed(child, reason, resumed)}. Its files were moved to "
            f"{aside.name}",
            PipekitTrainWarning,
            stacklevel=3,
        )
