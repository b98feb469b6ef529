"""How a `Checkpointer` writes one checkpoint: the host copies and their digests, the flat writer or Orbax, the
commit; on the process's one background writer thread when the save is asynchronous.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ._errors import CheckpointSaveError
from ._flat import plan_offsets, write_flat
from ._kill_point import at_save
from ._layout import (
    _ITEMS,
    FORMAT,
    HeldState,
    _add_digests,
    _host_leaves,
    _json_digest,
    _remove_stale_tmp,
    _short,
    _space_note,
)
from ._manifest import MANIFEST
from ._retention import _Retention
from ._selectors import ManifestEntry

if TYPE_CHECKING:
    from ._checkpointer import Checkpointer


logger = logging.getLogger("pipekit_train.checkpoint")
#: Orbax's own threads of one save, named as Orbax 0.12 names them (joined after a failed save).
_ORBAX_SAVE_THREADS = frozenset({"write_metadata_after_commits", "json_ch_save"})


class _Writer(_Retention):
    """Writing and committing one checkpoint, then handing it to the retention (a part of `Checkpointer`)."""

    _cleared_tmp: bool

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
