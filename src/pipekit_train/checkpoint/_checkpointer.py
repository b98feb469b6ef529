"""Checkpoints: the `Checkpoint` callback (configuration) and the `Checkpointer` that writes and reads them.

One checkpoint is one step directory holding three items committed together: ``state`` (the arrays),
``data_iter`` (the data iterator's JSON position) and ``meta`` (JSON: the caller's meta plus leaf digests). It is
written in one of two layouts: ``flat`` (four plain files and one rename, `_flat`; one process) or ``orbax`` (an
Orbax composite checkpoint; several processes). A ``manifest.json`` beside the step directories lists every
retained checkpoint, so ``latest`` / ``best`` lookups and `list_runs` never open one. See
``design/checkpoints.md`` for the layouts and the atomicity argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pipekit import ConfigError

from .._warnings import PipekitTrainWarning
from ..scale._distributed import barrier, is_primary, process_count
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from ._flat import fsync_dir, plan_offsets, retire, write_flat
from ._kill_point import at_save
from ._layout import (
    _ITEMS,
    FORMAT,
    MANIFEST,
    HeldState,
    _add_digests,
    _check_json,
    _check_step,
    _delete_step,
    _file_digests,
    _host_leaves,
    _json_digest,
    _never_committed,
    _optional,
    _pending,
    _prepare_state,
    _remove_stale_tmp,
    _scan,
    _short,
    _space_note,
    _step,
    _uncommitted_after,
    _uncommitted_reason,
    _with_io_retry,
    _write_manifest,
)
from ._selectors import Best, Last, ManifestEntry, Mode, Selector, finite_score, union_select
from ._settings import _check_keep, check_layout

logger = logging.getLogger("pipekit_train.checkpoint")
#: Orbax's own threads of one save, named as Orbax 0.12 names them (joined after a failed save).
_ORBAX_SAVE_THREADS = frozenset({"write_metadata_after_commits", "json_ch_save"})

Layout = Literal["auto", "flat", "orbax"]


# The checkpointer --------------------------------------------------------------------------------------------
class Checkpointer:
    """Writes checkpoints into one directory, keeps what the selectors pick, and restores them.

    A checkpoint is committed when its step directory has been renamed into place with its commit marker (by
    pipekit in the flat layout, by Orbax in the orbax layout); only then is it added to ``manifest.json``, and
    only after that are the checkpoints no selector keeps deleted, so a crash at any moment leaves the previous
    checkpoints restorable. Lookups read the manifest and check the commit markers; they never open a checkpoint.
    Both layouts are read whatever `layout` says.

    Steps must increase within a directory: a run resumed from an earlier checkpoint writes to a new directory.
    Nothing on disk changes until the first `save`. One process, one calling thread.

    Args:
        directory: Where the step directories and ``manifest.json`` live.
        keep: Retain the union of what these selectors pick (`Best`, `Last`, `Every`).
        monitor: The metric the ``score`` of a save measures. ``None`` follows the directory's manifest
            (``"validate/loss"`` for a new directory).
        mode: ``"min"`` or ``"max"``; ``None`` follows the manifest (``"min"`` for a new directory).
        async_save: Write in the background. `save` then returns once it holds a snapshot of the arrays; the next
            `save`, `wait`, `restore` and `close` wait for it and raise `CheckpointSaveError` if it failed.
        layout: ``"flat"`` (pipekit's own four files; one process only), ``"orbax"`` (an Orbax composite
            checkpoint) or ``"auto"``: flat for one process, Orbax for several.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from pipekit_train.checkpoint import Checkpointer, Last
        >>> with tempfile.TemporaryDirectory() as d, Checkpointer(d, keep=(Last(n=1),)) as ckpt:
        ...     ckpt.save(10, state={"w": jnp.ones(3)}, data_iter={"next_index": 4}, meta={"epoch": 0})
        ...     state, data_iter, meta = ckpt.restore("latest", {"w": jnp.zeros(3)})
        ...     (ckpt.steps(), data_iter, meta["epoch"], float(state["w"].sum()))
        True
        ([10], {'next_index': 4}, 0, 3.0)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: Sequence[Selector] = (Best(k=3), Last(n=1)),
        monitor: str | None = None,
        mode: Mode | None = None,
        async_save: bool = True,
        layout: Layout = "auto",
    ) -> None:
        self.directory = Path(directory).absolute()
        check_layout("Checkpointer.layout", layout)
        if layout == "flat" and process_count() > 1:
            raise ConfigError(
                f"Checkpointer.layout='flat' writes from one process; this run has {process_count()} processes, which "
                "save together with layout='orbax' (or 'auto', which picks it)"
            )
        self.layout: Literal["flat", "orbax"] = "orbax" if layout == "orbax" or process_count() > 1 else "flat"
        self.keep = _check_keep("Checkpointer.keep", keep)
        if mode not in (None, "min", "max"):
            raise ConfigError(f"Checkpointer.mode must be 'min' or 'max', got {mode!r}")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigError(f"Checkpointer.monitor must name a metric, got {monitor!r}")
        # Several processes save together (Orbax synchronises them with barriers): from the calling thread only.
        self.async_save = bool(async_save) and process_count() == 1
        header, entries, unlisted = _scan(self.directory)
        self.monitor: str = monitor or header.get("monitor") or "validate/loss"
        self.mode: Mode = mode or header.get("mode") or "min"
        self._entries: dict[int, ManifestEntry] = entries
        if unlisted:  # committed but not listed: list them now, and say why they were not
            # A stop between a manifest write and the deletions it announced (`_write_listed`'s ``dropping``) leaves
            # steps `keep` had dropped; any other was committed by a save stopped before its manifest write.
            dropping = set(header.get("dropping") or ())
            dropped, missed = [s for s in unlisted if s in dropping], [s for s in unlisted if s not in dropping]
            if missed:
                cause = (
                    "a stop right after the save, before the manifest was updated"
                    if header
                    else f"there was no readable {MANIFEST}: deleted, damaged, or a stop before its first write"
                )
                warnings.warn(
                    f"{self.directory}: step(s) {missed} were committed but missing from {MANIFEST} ({cause}); the "
                    "manifest lists them again",
                    PipekitTrainWarning,
                    stacklevel=2,
                )
            if dropped:
                warnings.warn(
                    f"{self.directory}: step(s) {dropped} were dropped by the retention policy (keep) but are still "
                    f"on disk (a stop after {MANIFEST} was updated, before they were deleted); listed again until "
                    "keep deletes them (a resumed run does so once its checkpoint is accepted)",
                    PipekitTrainWarning,
                    stacklevel=2,
                )
            header = {"monitor": self.monitor, "mode": self.mode, "keep": [repr(s) for s in self.keep]}
            with contextlib.suppress(OSError):  # a read-only directory is still read correctly from memory
                if is_primary():  # several processes: process 0 writes what they share
                    _write_manifest(self.directory, header, [entries[s] for s in sorted(entries)])
        self._lock = threading.Lock()
        self._manager: Any = None
        self._cleared_tmp = False  # flat layout: whether a save here removed what a killed writer left
        self._spare: Path | None = None  # flat layout: a dropped step's directory, for the next save (`retire`)
        self._job: _Job | None = None
        foreign = [e for e in entries.values() if not self._is_own(e)]
        if foreign:
            warnings.warn(
                f"{len(foreign)} checkpoint(s) in {self.directory} (steps {sorted(e.step for e in foreign)}) were "
                f"scored under another metric or mode than {self.monitor!r} ({self.mode}); they are kept, never "
                "ranked or deleted",
                PipekitTrainWarning,
                stacklevel=2,
            )

    # Lookups ---------------------------------------------------------------------------------------------
    def manifest(self) -> list[ManifestEntry]:
        """The committed checkpoints the manifest lists, by step."""
        with self._lock:
            entries = list(self._entries.values())
        return sorted((e for e in entries if _uncommitted_reason(self.directory / str(e.step)) is None), key=_step)

    def steps(self) -> list[int]:
        """The steps of the committed checkpoints, ascending."""
        return [e.step for e in self.manifest()]

    def latest_step(self) -> int | None:
        """The highest committed step, or ``None``.

        An interrupted save is never the latest, and neither is one still being written in the background
        (call `wait` first to count it).
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best committed step by `monitor` and `mode`, or ``None`` when none is scored."""
        picked = Best(k=1).select([e for e in self.manifest() if self._is_own(e)], self.mode)
        return next(iter(picked), None)

    # Saving ----------------------------------------------------------------------------------------------
    def hold(self, state: Any) -> HeldState:
        """Take `state` now, to `save` it later: what the caller does in between cannot change what is saved.

        A loop can hold the state of step ``s``, dispatch step ``s + 1`` (which may donate the state's buffers or
        overwrite its NumPy arrays) and then call ``save(s, state=held, ...)`` while the device runs, so the device
        does not wait for the save's checks and bookkeeping. JAX arrays on the CPU are held as views of their
        buffers (this waits for them to be computed; a buffer with a view outstanding is not donated), JAX arrays
        on other devices as device copies, NumPy arrays as copies.

        Raises:
            CheckpointError: a leaf is not an array (its path is named).
        """
        return _prepare_state(state)

    def save(self, step: int, *, state: Any, data_iter: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
        """Checkpoint `state` with the data position `data_iter` and `meta`, all in one checkpoint.

        Args:
            step: The optimizer step; greater than every step already in the directory.
            state: A PyTree of arrays (JAX or NumPy), or what `hold` returned for one. Typed PRNG keys are stored
                as their key data.
            data_iter: The data iterator's position (JSON data, e.g. ``iterator.get_state()``).
            meta: JSON data returned by `restore`. The checkpointer reads these keys (all optional) into
                the manifest: ``score`` (the value of `monitor` now, or ``None``; non-finite counts as
                unscored), ``epoch``, ``stage``, ``run_id`` and ``stop_reason``.

        Returns:
            ``True`` when the checkpoint was written (or queued), ``False`` when no selector in `keep` would
            retain it (for example an unscored step under ``keep=(Best(k=3),)``), so it was not written.

        Raises:
            CheckpointSaveError: the previous asynchronous save failed (this one is not started), or this one
                could not be written.
            CheckpointError: a bad argument, or `step` is not after the latest checkpoint.
        """
        step = _check_step("Checkpointer.save", step)
        _check_json("data_iter", data_iter)
        _check_json("meta", meta)
        # The JSON items are serialised in the background: snapshot them now, or a caller mutating its dicts
        # (callback state after the next evaluation) changes what is written after record_sha256 was computed.
        # A round trip through the C encoder is that deep copy at a fraction of `copy.deepcopy`'s cost (the
        # training thread waits for it); the items are JSON data (checked above), written as JSON.
        data_iter, meta = _json_copy(data_iter), _json_copy(meta)
        entry = ManifestEntry(
            step=step,
            epoch=_optional(meta, "epoch", int),
            stage=_optional(meta, "stage", str),
            run_id=_optional(meta, "run_id", str),
            metric=self.monitor,
            mode=self.mode,
            score=finite_score(meta.get("score"), "Checkpointer.save: meta['score']"),
            stop_reason=_optional(meta, "stop_reason", str),
            resume_point=meta.get("resume_point") is True,
            time=time.time(),
        )
        # Checks the leaves and snapshots them (views of CPU buffers), unless `hold` did.
        snapshot = state if isinstance(state, HeldState) else _prepare_state(state)
        self.wait()
        committed = self.manifest()
        if committed and step <= committed[-1].step:
            raise CheckpointError(
                f"Checkpointer.save: step {step} is not after the latest checkpoint {committed[-1].step} in "
                f"{self.directory}; steps must increase (a run resumed from an earlier checkpoint writes to a new "
                "directory)"
            )
        step_dir = self.directory / str(step)
        if step_dir.exists():
            raise CheckpointError(
                f"Checkpointer.save: {step_dir} exists but is not a committed checkpoint "
                f"({_uncommitted_reason(step_dir)}); remove it to save step {step}"
            )
        own = [e for e in committed if self._is_own(e) and not e.resume_point]
        if not entry.resume_point and step not in union_select(self.keep, [*own, entry], self.mode):
            return False
        if not self.async_save:
            self._write(step, snapshot, data_iter, meta, entry)
            return True
        # Asynchronous: the caller paid only for the copy of the leaves above. Checksums, the write, the commit, the
        # manifest and retention run on the writer thread; the next save or wait() waits for this job first.
        _finish_at_exit(self)
        self._job = _submit(functools.partial(self._write, step, snapshot, data_iter, meta, entry))
        return True

    def _write(
        self,
        step: int,
        snapshot: HeldState,
        data_iter: dict[str, Any],
        meta: dict[str, Any],
        entry: ManifestEntry,
    ) -> None:
        """Checksum the host copies, write and commit the checkpoint, update the manifest, rotate.

        On the writer thread, beside training: everything here that holds the GIL delays the training thread's next
        dispatch, so nothing walks the state's tree again (`_prepare_state` flattened it and its plan holds the
        sizes and empty containers) and the JSON is encoded by the C encoder (`_write_manifest`).
        """
        hosts = _host_leaves(snapshot.leaves)
        leaves = snapshot.records
        _add_digests(leaves, hosts)
        flat = self.layout == "flat"
        size = plan_offsets(leaves.values(), snapshot.nbytes) if flat else 0
        record: dict[str, Any] = {
            "format": FORMAT,
            "layout": self.layout,
            "step": step,
            "time": entry.time,
            "metric": self.monitor,
            "mode": self.mode,
            "score": entry.score,
            "leaves": leaves,
            "data_iter_sha256": _json_digest(data_iter),
            "user": meta,
        }
        if flat:  # Orbax keeps the tree's structure itself; a restore "as saved" needs them
            record["empty"] = snapshot.empty
        record["record_sha256"] = _json_digest(record)
        where = " in the background" if self.async_save else ""
        intact = f"the checkpoints already listed in {MANIFEST} are intact"
        if flat:
            if not self._cleared_tmp:  # the first save: what a killed process left half-written goes
                _remove_stale_tmp(self.directory)
                self._cleared_tmp = True
            texts = [json.dumps(value, allow_nan=True).encode() for value in (data_iter, record)]
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                spare, self._spare = self._spare, None
                # The manifest's write (`_finalize`) fsyncs the directory: that makes this commit's rename durable.
                files = write_flat(self.directory, step, hosts, list(leaves.values()), size, *texts, spare=spare)
            except OSError as e:
                raise CheckpointSaveError(
                    f"saving step {step} to {self.directory} failed{where}: {e}{_space_note(self.directory, e)}; "
                    f"{intact} (free space or fix the directory, then resume with --resume auto)"
                ) from e
            self._finalize(entry, files)
            return
        import jax

        tree = jax.tree_util.tree_unflatten(snapshot.treedef, hosts)
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(tree),
            data_iter=ocp.args.JsonSave(data_iter),
            meta=ocp.args.JsonSave(record),
        )
        at_save(step)  # `pipekit-train check-resume` kills here: the save begun, nothing committed
        try:
            self._get_manager().save(step, args=args, force=True)
        except Exception as e:
            self._discard_manager()
            raise CheckpointSaveError(
                f"saving step {step} to {self.directory} failed{where}: {_short(e)}{_space_note(self.directory, e)}; "
                f"{intact} (free space or fix the directory, then resume with --resume auto)"
            ) from e
        try:
            self._finalize(entry, None)
        except CheckpointSaveError:
            self._discard_manager()
            raise

    def wait(self) -> None:
        """Wait for an asynchronous save to commit and be rotated; raise `CheckpointSaveError` if it failed.

        The failure is raised once; the checkpointer stays usable (the flat writer removes its temporary directory
        when a write fails; in the orbax layout the next `save` starts a fresh Orbax manager, which removes it).
        """
        job, self._job = self._job, None
        if job is None:
            return
        job.done.wait()
        error = job.error
        if error is not None:
            self._discard_manager()
            raise error

    def _discard_manager(self) -> None:
        """Drop a manager whose last save failed: Orbax re-raises that failure once in every thread that waits."""
        manager, self._manager = self._manager, None
        if manager is None:
            return
        with contextlib.suppress(Exception):  # the failure just reported
            manager.wait_until_finished()
        # The waiting stops at the first failure; Orbax's other writer threads of that save (its metadata writer)
        # still run, and a process that exits now prints their tracebacks after the one-line error. Let them end.
        for thread in threading.enumerate():
            if thread.name in _ORBAX_SAVE_THREADS and thread is not threading.current_thread():
                with contextlib.suppress(Exception):  # Orbax's join re-raises the thread's own failure
                    thread.join(timeout=60)
        try:
            manager.close()
        except Exception as e:
            logger.warning("closing the Orbax manager of %s after a failed save: %s", self.directory, e)

    def close(self) -> None:
        """Wait for the last save (raising its failure) and release Orbax's resources."""
        try:
            self.wait()
        finally:
            if self._spare is not None:
                shutil.rmtree(self._spare, ignore_errors=True)
                self._spare = None
            if self._manager is not None:
                self._manager.close()
                self._manager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way out: do not mask it with a save failure
            self.close()
        except CheckpointError as e:
            logger.error("while closing %s: %s", self.directory, e)

    # Restoring -------------------------------------------------------------------------------------------
    def restore(self, which: int | str = "latest", abstract_state: Any = None) -> tuple[Any, dict[str, Any], Any]:
        """Read a committed checkpoint back: ``(state, data_iter, meta)``.

        Args:
            which: A step, ``"latest"`` or ``"best"`` (by `monitor` and `mode`).
            abstract_state: The tree to restore into: arrays or ``jax.ShapeDtypeStruct`` leaves, whose
                shardings and dtypes are used (a dtype other than the saved one is a cast after the
                checksum check). ``None`` restores the tree as saved, with dicts and lists as containers.

        Raises:
            CheckpointNotFoundError: no such committed checkpoint.
            CheckpointMismatchError: `abstract_state` has other leaves or shapes than the checkpoint.
            CheckpointCorruptedError: the checkpoint's files are damaged; the error names them.
        """
        self.wait()
        step = self._resolve(which)
        with self._lock:
            entry = self._entries.get(step)
        from ._restore import _restore_step

        return _restore_step(self.directory, step, abstract_state, entry.files if entry else None)

    def _resolve(self, which: int | str) -> int:
        if which == "latest":
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}{_pending(self.directory)}")
            for step_dir, missing in _uncommitted_after(self.directory, step):  # never quietly an older step
                warnings.warn(
                    _never_committed(step_dir, missing, f"restoring step {step}"), PipekitTrainWarning, stacklevel=3
                )
            return step
        if which == "best":
            step = self.best_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no checkpoint scored under {self.monitor!r} ({self.mode}) in {self.directory}; "
                    f"committed steps: {self.steps()}"
                )
            return step
        if isinstance(which, bool) or not isinstance(which, int):
            raise CheckpointError(f"Checkpointer.restore: which must be a step, 'latest' or 'best', got {which!r}")
        reason = _uncommitted_reason(self.directory / str(which))
        if reason is not None:
            raise CheckpointNotFoundError(
                f"step {which} in {self.directory} is not a committed checkpoint ({reason}); "
                f"committed steps: {self.steps()}"
            )
        return which

    # Internals -------------------------------------------------------------------------------------------
    def _is_own(self, entry: ManifestEntry) -> bool:
        return entry.metric == self.monitor and entry.mode == self.mode

    def _get_manager(self) -> Any:
        if self._manager is None:
            import orbax.checkpoint as ocp
            from orbax.checkpoint import checkpoint_managers as cm

            options = ocp.CheckpointManagerOptions(
                # Asynchronous saves already run in our own thread (`_write_in_background`): a second, Orbax-owned
                # thread per save would only add its start-up and hand-over to every save.
                enable_async_checkpointing=False,
                # Retention is ours: the manifest must be written between commit and deletion (see design).
                preservation_policy=cm.preservation_policy.PreserveAll(),
                # Cadence is ours too (`Checkpoint.should_save`); every save we hand over is written.
                save_decision_policy=cm.FixedIntervalPolicy(1),
                cleanup_tmp_directories=True,
                create=True,
            )
            # The state is written uncompressed: zstd over float weights saved ~9% of the bytes for about half of
            # a large save's CPU time (docs/performance.md), time the training threads share on a CPU machine. The
            # reader (`_restore`) needs no setting: tensorstore records the codec in each array's metadata.
            handlers = {
                "state": ocp.PyTreeCheckpointHandler(use_compression=False),
                "data_iter": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            }
            assert tuple(handlers) == _ITEMS
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager

    def _finalize(self, entry: ManifestEntry, files: dict[str, list[Any]] | None) -> None:
        """After `entry.step` committed: record it in the manifest, then delete what no selector keeps.

        `files` are the flat writer's file digests; ``None`` (the orbax layout) reads them from the step directory.
        """
        step_dir = self.directory / str(entry.step)
        if files is None:
            try:
                self._manager.wait_until_finished()
            except Exception as e:
                raise CheckpointSaveError(
                    f"saving step {entry.step} to {self.directory} failed in the background: {_short(e)}"
                    f"{_space_note(self.directory, e)}; the checkpoints already listed in {MANIFEST} are intact"
                ) from e
        reason = _uncommitted_reason(step_dir)
        if reason is not None:
            raise CheckpointSaveError(f"step {entry.step} did not commit in {self.directory}: {reason}")
        if files is None:
            files = _with_io_retry(lambda: _file_digests(step_dir))
        entry = dataclasses.replace(entry, files=files)
        with self._lock:
            entries = [e for e in self._entries.values() if _uncommitted_reason(self.directory / str(e.step)) is None]
            entries.append(entry)
            retained, doomed = self._retention(entries)
            try:
                if is_primary():  # several processes: process 0 writes the manifest and deletes, after Orbax's commit
                    self._write_listed(retained, doomed)
            except OSError as e:
                self._entries[entry.step] = entry  # listed by the next manifest write that succeeds
                if self.layout == "flat":  # the commit's rename (`write_flat` left its fsync to this write)
                    with contextlib.suppress(OSError):
                        fsync_dir(self.directory)
                raise CheckpointSaveError(
                    f"step {entry.step} committed in {self.directory} but {MANIFEST} could not be updated ({e})"
                    f"{_space_note(self.directory, e)}; nothing was deleted"
                ) from e
            self._entries = {e.step: e for e in retained}
        self._delete(doomed)
        barrier("checkpoint-manifest")  # no process reads the manifest before process 0 wrote it

    def prune(self) -> list[int]:
        """Delete the committed checkpoints that no selector in `keep` retains, as a `save` does after its commit.

        A save applies `keep` right after its commit; a crash in between (after the commit, before the manifest
        update or the deletions) leaves checkpoints the policy no longer keeps. A resumed run calls this once its
        checkpoint is accepted, and again at the end, so the directory holds what `keep` says. Checkpoints scored
        under another metric or mode are never deleted.

        Returns:
            The steps deleted, ascending (none when the directory already matches `keep`).
        """
        self.wait()
        with self._lock:
            entries = [e for e in self._entries.values() if _uncommitted_reason(self.directory / str(e.step)) is None]
            retained, doomed = self._retention(entries)
            if not doomed:
                return []
            try:
                if is_primary():
                    self._write_listed(retained, doomed)
            except OSError as e:
                logger.warning("could not update %s in %s (%s); nothing was deleted", MANIFEST, self.directory, e)
                return []
            self._entries = {e.step: e for e in retained}
        self._delete(doomed)
        logger.info("deleted checkpoint step(s) %s of %s: not kept by %s", doomed, self.directory, list(self.keep))
        return doomed

    def _retention(self, entries: list[ManifestEntry]) -> tuple[list[ManifestEntry], list[int]]:
        """(the entries `keep` retains, by step; the steps it does not), over committed `entries`.

        A resume point (`ManifestEntry.resume_point`) is kept while it is the latest and never counted by the
        selectors, so what they keep is what they keep in a run that was never stopped."""
        own = [e for e in entries if self._is_own(e) and not e.resume_point]
        kept = union_select(self.keep, own, self.mode) | {e.step for e in entries if not self._is_own(e)}
        latest = max(entries, key=_step, default=None)
        if latest is not None and latest.resume_point:
            kept.add(latest.step)
        retained = sorted((e for e in entries if e.step in kept), key=_step)
        return retained, sorted(e.step for e in entries if e.step not in kept)

    def _write_listed(self, retained: list[ManifestEntry], doomed: list[int]) -> None:
        """Write the manifest listing `retained`; ``dropping`` names `doomed`, the steps deleted right after, so a
        stop before their deletion is told from a save that never reached the manifest (`__init__`)."""
        header: dict[str, Any] = {"monitor": self.monitor, "mode": self.mode, "keep": [repr(s) for s in self.keep]}
        if doomed:
            header["dropping"] = doomed
        _with_io_retry(lambda: _write_manifest(self.directory, header, retained))

    def _delete(self, doomed: list[int]) -> None:
        """Delete the step directories of `doomed` (process 0 of several); the manifest no longer lists them."""
        for step in doomed if is_primary() else []:
            step_dir = self.directory / str(step)
            if self.layout == "flat" and self._spare is None:  # one rename; the next save rewrites its files
                self._spare = retire(step_dir)
                if self._spare is not None or not step_dir.exists():
                    continue
            try:
                _with_io_retry(functools.partial(_delete_step, step_dir))
            except OSError as e:
                logger.warning("could not delete checkpoint step %s in %s: %s", step, self.directory, e)


def _json_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of checked JSON data (any `Mapping` becomes a dict, as it is written)."""

    def as_dict(obj: Any) -> Any:
        if isinstance(obj, Mapping):
            return dict(obj)
        raise TypeError(f"{type(obj).__name__} is not JSON data")  # `_check_json` refused it already

    return json.loads(json.dumps(value, default=as_dict))  # type: ignore[no-any-return]


class _Job:
    """One background write: `fn`, then `done` is set, with `error` holding what it raised."""

    __slots__ = ("done", "error", "fn")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None


_JOBS: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_WRITER: threading.Thread | None = None
_WRITER_LOCK = threading.Lock()


def _submit(fn: Any) -> _Job:
    """Queue `fn` on the one writer thread of this process (started on first use, and again after a fork).

    One long-lived thread rather than one per save: starting a thread hands it the GIL and the caller waits up to
    a switch interval (5 ms) to get it back, which the training thread would pay at every save.
    """
    global _WRITER, _JOBS
    with _WRITER_LOCK:
        if _WRITER is None or not _WRITER.is_alive():
            _JOBS = queue.SimpleQueue()
            _WRITER = threading.Thread(target=_write_jobs, args=(_JOBS,), name="pipekit-checkpoint-writer", daemon=True)
            _WRITER.start()
        job = _Job(fn)
        _JOBS.put(job)
    return job


def _write_jobs(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        job = jobs.get()
        try:
            job.fn()
        except BaseException as e:  # handed to the caller by the next wait()
            logger.error("checkpoint: %s", e)
            job.error = e
        finally:
            job.done.set()
            del job


_PENDING: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_EXIT_HOOK = False


def _finish_at_exit(checkpointer: Checkpointer) -> None:
    """Make interpreter exit wait for `checkpointer`'s background save (a forgotten `close` would lose it).

    The hook must run before `concurrent.futures` stops accepting work, which Orbax's background write still
    needs; `atexit` runs too late for that, so the hook goes where concurrent.futures registers its own.
    """
    global _EXIT_HOOK
    _PENDING.add(checkpointer)
    if not _EXIT_HOOK:
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_wait_for_pending)
            _EXIT_HOOK = True


def _wait_for_pending() -> None:
    for checkpointer in list(_PENDING):
        try:
            checkpointer.close()
        except Exception as e:
            logger.error("checkpoint of %s failed while exiting: %s", checkpointer.directory, e)
