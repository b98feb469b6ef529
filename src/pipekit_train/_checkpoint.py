"""Checkpoints: the `Checkpoint` callback (configuration) and the `Checkpointer` that writes and reads them.

One checkpoint is one Orbax step directory holding three items committed together: ``state`` (the arrays),
``data_iter`` (the data iterator's JSON position) and ``meta`` (JSON: the caller's meta plus leaf digests). A
``manifest.json`` beside the step directories lists every retained checkpoint, so ``latest`` / ``best`` lookups and
`list_runs` never open one. See ``design/checkpoints.md`` for the layout and the atomicity argument.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError, PipekitError

from ._callbacks import Callback
from ._selectors import Average, Best, Every, Last, ManifestEntry, Mode, Selector, finite_score, union_select
from ._warnings import PipekitTrainWarning

__all__ = [
    "Average",
    "Best",
    "Checkpoint",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "Checkpointer",
    "Every",
    "Last",
    "ManifestEntry",
    "Selector",
    "average_checkpoints",
    "format_runs_table",
    "list_runs",
    "write_average",
]

logger = logging.getLogger("pipekit_train.checkpoint")

MANIFEST = "manifest.json"
FORMAT = 1
_ITEMS = ("state", "data_iter", "meta")
_COMMIT = "commit_success.txt"  # Orbax writes it into the step directory and into each item directory
_STEP_METADATA = "_CHECKPOINT_METADATA"
_TMP = ".orbax-checkpoint-tmp"
_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE, errno.EIO}
_T = TypeVar("_T")


# Errors ------------------------------------------------------------------------------------------------------
class CheckpointError(PipekitError):
    """A checkpoint cannot be written or read as asked."""


class CheckpointNotFoundError(CheckpointError):
    """The requested checkpoint does not exist, or exists but never committed."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (in the background when saving asynchronously); earlier ones are intact."""


class CheckpointMismatchError(CheckpointError):
    """The ``abstract_state`` given to a restore does not match the tree the checkpoint holds."""


class CheckpointCorruptedError(CheckpointError):
    """A committed checkpoint's files are damaged (truncated, changed, missing).

    Attributes:
        step: The step of the damaged checkpoint.
        files: The damaged files (absolute paths), or the item directory when they cannot be pinpointed.
    """

    def __init__(self, message: str, *, step: int, files: list[str]) -> None:
        super().__init__(message)
        self.step = step
        self.files = files


# The operator ------------------------------------------------------------------------------------------------
class Checkpoint(Callback):
    """When to checkpoint and what to keep: the one place cadence and retention are configured.

    The training loop drives saving: it asks `should_save` after each step, saves through the `Checkpointer`
    that `checkpointer` builds, and saves once more at the end when `save_on_end` is set.

    Attributes:
        every_n_steps: Save at every multiple of this many optimizer steps.
        keep: Retain the union of what these selectors pick; everything else is deleted once a newer
            checkpoint has committed. The default keeps the best 3 by `monitor` plus the latest.
        monitor: The metric `Best` ranks by (the ``score`` a save is given).
        mode: ``"min"`` if lower `monitor` is better, ``"max"`` if higher is.
        async_save: Write in the background; `save` returns once the arrays are copied to the host.
        save_on_end: Also save when the run ends (completion or a requested stop).
    """

    every_n_steps: int = 500
    keep: tuple[Selector, ...] = (Best(k=3), Last(n=1))
    monitor: str = "validate/loss"
    mode: Mode = "min"
    async_save: bool = True
    save_on_end: bool = True

    def validate(self) -> None:
        if self.every_n_steps < 1:
            raise ConfigError(f"Checkpoint.every_n_steps must be a positive int, got {self.every_n_steps}")
        if not self.monitor:
            raise ConfigError("Checkpoint.monitor must name a metric, got ''")
        _check_keep("Checkpoint.keep", self.keep)

    def should_save(self, step: int) -> bool:
        """Whether the periodic cadence asks for a checkpoint after `step` optimizer steps."""
        return step > 0 and step % self.every_n_steps == 0

    def checkpointer(self, directory: str | os.PathLike[str]) -> Checkpointer:
        """A `Checkpointer` writing into `directory` with this configuration."""
        return Checkpointer(directory, keep=self.keep, monitor=self.monitor, mode=self.mode, async_save=self.async_save)

    @classmethod
    def example(cls) -> Checkpoint:
        return cls(
            every_n_steps=100,
            keep=(Best(k=2), Last(n=3), Every(n=1000)),
            monitor="validate/accuracy",
            mode="max",
            async_save=False,
            save_on_end=False,
        )


def _check_keep(where: str, keep: Any) -> tuple[Selector, ...]:
    if not isinstance(keep, (tuple, list)) or not keep:
        raise ConfigError(f"{where} must be a non-empty list of selectors (Best, Last, Every), got {keep!r}")
    for i, sel in enumerate(keep):
        if not isinstance(sel, Selector):
            raise ConfigError(f"{where}[{i}] must be a selector (Best, Last, Every), got {sel!r}")
        if isinstance(sel, Best) and sel.among is not None:
            raise ConfigError(
                f"{where}[{i}] = {sel!r}: `among` is for choosing what to load or average, not for retention "
                f"(it would rank only what earlier deletions left); keep Best(k={sel.k}) and a Last instead"
            )
    return tuple(keep)


# The checkpointer --------------------------------------------------------------------------------------------
class Checkpointer:
    """Writes checkpoints into one directory, keeps what the selectors pick, and restores them.

    A checkpoint is committed when Orbax has renamed its step directory into place and written its commit
    markers; only then is it added to ``manifest.json``, and only after that are the checkpoints no selector
    keeps deleted, so a crash at any moment leaves the previous checkpoints restorable. Lookups read the
    manifest and check the commit markers; they never open a checkpoint.

    Steps must increase within a directory: a run resumed from an earlier checkpoint writes to a new directory.
    Nothing on disk changes until the first `save`. One process, one calling thread.

    Args:
        directory: Where the step directories and ``manifest.json`` live.
        keep: Retain the union of what these selectors pick (`Best`, `Last`, `Every`).
        monitor: The metric the ``score`` of a save measures. ``None`` follows the directory's manifest
            (``"validate/loss"`` for a new directory).
        mode: ``"min"`` or ``"max"``; ``None`` follows the manifest (``"min"`` for a new directory).
        async_save: Write in the background. `save` then returns once the arrays are on the host; the next
            `save`, `wait`, `restore` and `close` wait for it and raise `CheckpointSaveError` if it failed.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from pipekit_train._checkpoint import Checkpointer, Last
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
    ) -> None:
        self.directory = Path(directory).absolute()
        self.keep = _check_keep("Checkpointer.keep", keep)
        if mode not in (None, "min", "max"):
            raise ConfigError(f"Checkpointer.mode must be 'min' or 'max', got {mode!r}")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigError(f"Checkpointer.monitor must name a metric, got {monitor!r}")
        self.async_save = bool(async_save)
        header, entries = _load_entries(self.directory)
        self.monitor: str = monitor or header.get("monitor") or "validate/loss"
        self.mode: Mode = mode or header.get("mode") or "min"
        self._entries: dict[int, ManifestEntry] = entries
        self._lock = threading.Lock()
        self._manager: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
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
    def save(self, step: int, *, state: Any, data_iter: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
        """Checkpoint `state` with the data position `data_iter` and `meta`, all in one Orbax checkpoint.

        Args:
            step: The optimizer step; greater than every step already in the directory.
            state: A PyTree of arrays (JAX or NumPy). Typed PRNG keys are stored as their key data.
            data_iter: The data iterator's position (JSON data, e.g. ``iterator.get_state()``).
            meta: JSON data returned by `restore`. The checkpointer reads these keys (all optional) into
                the manifest: ``score`` (the value of `monitor` now, or ``None``; non-finite counts as
                unscored), ``epoch``, ``stage``, ``run_id`` and ``stop_reason``.

        Returns:
            ``True`` when the checkpoint was written (or queued), ``False`` when no selector in `keep` would
            retain it (for example an unscored step under ``keep=(Best(k=3),)``), so it was not written.

        Raises:
            CheckpointSaveError: the previous asynchronous save failed (this one is not started), or Orbax
                refused this one.
            CheckpointError: a bad argument, or `step` is not after the latest checkpoint.
        """
        step = _check_step("Checkpointer.save", step)
        _check_json("data_iter", data_iter)
        _check_json("meta", meta)
        # Orbax serialises the JSON items in the background: snapshot them now, or a caller mutating its dicts
        # (callback state after the next evaluation) changes what is written after record_sha256 was computed.
        data_iter, meta = copy.deepcopy(dict(data_iter)), copy.deepcopy(dict(meta))
        entry = ManifestEntry(
            step=step,
            epoch=_optional(meta, "epoch", int),
            stage=_optional(meta, "stage", str),
            run_id=_optional(meta, "run_id", str),
            metric=self.monitor,
            mode=self.mode,
            score=finite_score(meta.get("score"), "Checkpointer.save: meta['score']"),
            stop_reason=_optional(meta, "stop_reason", str),
            time=time.time(),
        )
        tree, leaves = _prepare_state(state)  # checks the leaves and copies them to the host
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
        own = [e for e in committed if self._is_own(e)]
        if step not in union_select(self.keep, [*own, entry], self.mode):
            return False
        if not self.async_save:
            self._write(step, tree, leaves, dict(data_iter), dict(meta), entry)
            return True
        # Asynchronous: the caller paid only for the host copy above. Checksums, Orbax's write, the commit, the
        # manifest and retention run in the background; the next save or wait() joins this thread first.
        _finish_at_exit(self)
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(step, tree, leaves, dict(data_iter), dict(meta), entry),
            name=f"pipekit-checkpoint-{step}",
        )
        self._thread.start()
        return True

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # handed to the caller by the next wait()
            logger.error("checkpoint step %s: %s", args[0], e)
            self._error = e

    def _write(
        self,
        step: int,
        tree: Any,
        leaves: dict[str, Any],
        data_iter: dict[str, Any],
        meta: dict[str, Any],
        entry: ManifestEntry,
    ) -> None:
        """Checksum the host copies, write one Orbax composite checkpoint, commit, update the manifest, rotate."""
        _add_digests(leaves, tree)
        record: dict[str, Any] = {
            "format": FORMAT,
            "step": step,
            "time": entry.time,
            "metric": self.monitor,
            "mode": self.mode,
            "score": entry.score,
            "leaves": leaves,
            "data_iter_sha256": _json_digest(data_iter),
            "user": meta,
        }
        record["record_sha256"] = _json_digest(record)
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(
            state=ocp.args.StandardSave(tree),
            data_iter=ocp.args.JsonSave(data_iter),
            meta=ocp.args.JsonSave(record),
        )
        try:
            self._get_manager().save(step, args=args, force=True)
        except Exception as e:
            self._discard_manager()
            raise CheckpointSaveError(f"saving step {step} to {self.directory} failed: {e}") from e
        try:
            self._finalize(entry)
        except CheckpointSaveError:
            self._discard_manager()
            raise

    def wait(self) -> None:
        """Wait for an asynchronous save to commit and be rotated; raise `CheckpointSaveError` if it failed.

        The failure is raised once; the checkpointer stays usable (the next `save` starts a fresh Orbax manager,
        which also removes the failed write's temporary directory).
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
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
        try:
            manager.close()
        except Exception as e:
            logger.warning("closing the Orbax manager of %s after a failed save: %s", self.directory, e)

    def close(self) -> None:
        """Wait for the last save (raising its failure) and release Orbax's resources."""
        try:
            self.wait()
        finally:
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
        return _restore_step(self.directory, step, abstract_state, entry.files if entry else None)

    def _resolve(self, which: int | str) -> int:
        if which == "latest":
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}{_pending(self.directory)}")
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
                enable_async_checkpointing=self.async_save,
                # Retention is ours: the manifest must be written between commit and deletion (see design).
                preservation_policy=cm.preservation_policy.PreserveAll(),
                # Cadence is ours too (`Checkpoint.should_save`); every save we hand over is written.
                save_decision_policy=cm.FixedIntervalPolicy(1),
                cleanup_tmp_directories=True,
                create=True,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
        return self._manager

    def _finalize(self, entry: ManifestEntry) -> None:
        """After Orbax commits `entry.step`: record it in the manifest, then delete what no selector keeps."""
        step_dir = self.directory / str(entry.step)
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointSaveError(
                f"saving step {entry.step} to {self.directory} failed in the background: {e}; "
                f"the checkpoints already listed in {MANIFEST} are intact"
            ) from e
        reason = _uncommitted_reason(step_dir)
        if reason is not None:
            raise CheckpointSaveError(f"step {entry.step} did not commit in {self.directory}: {reason}")
        entry = dataclasses.replace(entry, files=_with_io_retry(lambda: _file_digests(step_dir)))
        with self._lock:
            entries = [e for e in self._entries.values() if _uncommitted_reason(self.directory / str(e.step)) is None]
            entries.append(entry)
            own = [e for e in entries if self._is_own(e)]
            kept = union_select(self.keep, own, self.mode) | {e.step for e in entries if not self._is_own(e)}
            retained = sorted((e for e in entries if e.step in kept), key=_step)
            header = {"monitor": self.monitor, "mode": self.mode, "keep": [repr(s) for s in self.keep]}
            try:
                _with_io_retry(lambda: _write_manifest(self.directory, header, retained))
            except OSError as e:
                self._entries[entry.step] = entry  # listed by the next manifest write that succeeds
                raise CheckpointSaveError(
                    f"step {entry.step} committed in {self.directory} but {MANIFEST} could not be updated ({e}); "
                    "nothing was deleted"
                ) from e
            self._entries = {e.step: e for e in retained}
        for doomed in sorted(e.step for e in entries if e.step not in kept):
            try:
                _with_io_retry(lambda d=doomed: _delete_step(self.directory / str(d)))
            except OSError as e:
                logger.warning("could not delete checkpoint step %s in %s: %s", doomed, self.directory, e)


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


# Restore internals -------------------------------------------------------------------------------------------
def _restore_step(
    directory: Path, step: int, abstract_state: Any, files: dict[str, list[Any]] | None
) -> tuple[Any, dict[str, Any], Any]:
    import orbax.checkpoint as ocp

    step_dir = directory / str(step)
    reason = _uncommitted_reason(step_dir)
    if reason is not None:
        raise CheckpointNotFoundError(f"step {step} in {directory} is not a committed checkpoint ({reason})")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
        record = _read_record(reader, step_dir, step, files)
        target, finish = _restore_plan(abstract_state, record["leaves"], step_dir)
        try:
            out = reader.restore(
                step_dir,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data_iter=ocp.args.JsonRestore()),
            )
        except Exception as e:
            raise _corrupted(step_dir, step, files, "state", f"Orbax could not read it: {e}") from e
        state, data_iter = out.state, out.data_iter
        recorded = record["leaves"]
        bad = [p for p, x in _flatten(state) if _leaf_digest(np.asarray(x)) != recorded.get(p, {}).get("sha256")]
        if bad:
            raise _corrupted(step_dir, step, files, "state", f"leaf checksum mismatch at {bad}")
        if _json_digest(data_iter) != record["data_iter_sha256"]:
            raise _corrupted(step_dir, step, files, "data_iter", "data_iter checksum mismatch")
    return finish(state), data_iter, record["user"]


def _read_record(reader: Any, step_dir: Path, step: int, files: dict[str, list[Any]] | None) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    try:
        record = reader.restore(step_dir, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
        raise _corrupted(step_dir, step, files, "meta", f"cannot read its meta item: {e}") from e
    if not isinstance(record, dict) or "record_sha256" not in record:
        raise _corrupted(step_dir, step, files, "meta", "its meta item is not a pipekit checkpoint record")
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"{step_dir} has checkpoint format {record.get('format')!r}; this pipekit-train reads format {FORMAT}"
        )
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    if _json_digest(body) != record["record_sha256"]:
        raise _corrupted(step_dir, step, files, "meta", "meta checksum mismatch")
    return record


def _restore_plan(abstract_state: Any, leaves: dict[str, Any], step_dir: Path) -> tuple[Any, Callable[[Any], Any]]:
    """The tree Orbax restores into (saved shapes and dtypes) and the function that finishes the result."""
    import jax.numpy as jnp

    if abstract_state is None:

        def finish_as_saved(state: Any) -> Any:
            flat, treedef = jax.tree_util.tree_flatten_with_path(state)
            out = []
            for path, leaf in flat:
                impl = leaves.get(_path_name(path), {}).get("prng_impl")
                out.append(jax.random.wrap_key_data(leaf, impl=impl) if impl else leaf)
            return jax.tree_util.tree_unflatten(treedef, out)

        return None, finish_as_saved

    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    names = [_path_name(p) for p, _ in flat]
    problems = []
    missing = [n for n in names if n not in leaves]
    extra = sorted(set(leaves) - set(names))
    if missing:
        problems.append(f"not in the checkpoint: {missing}")
    if extra:
        problems.append(f"in the checkpoint but not in abstract_state: {extra}")
    targets, posts = [], []
    for name, (_, leaf) in zip(names, flat):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise CheckpointMismatchError(
                f"abstract_state leaf {name!r} is a {type(leaf).__name__}; expected an array or jax.ShapeDtypeStruct"
            )
        rec = leaves.get(name)
        if rec is None:
            targets.append(None)
            posts.append(None)
            continue
        is_key = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        shape = tuple(leaf.shape)
        if is_key:
            if "prng_impl" not in rec:
                problems.append(f"{name!r} is a PRNG key in abstract_state but {rec['dtype']} data in the checkpoint")
                continue
            shape = tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)).shape)
        if shape != tuple(rec["shape"]):
            problems.append(f"shape of {name!r}: checkpoint {tuple(rec['shape'])}, abstract_state {tuple(leaf.shape)}")
            continue
        targets.append(jax.ShapeDtypeStruct(shape, jnp.dtype(rec["dtype"]), sharding=getattr(leaf, "sharding", None)))
        if is_key:
            posts.append(lambda x, impl=rec["prng_impl"]: jax.random.wrap_key_data(x, impl=impl))
        elif jnp.dtype(leaf.dtype) != jnp.dtype(rec["dtype"]):
            posts.append(lambda x, dtype=leaf.dtype: x.astype(dtype))
        else:
            posts.append(None)
    if problems:
        raise CheckpointMismatchError(f"{step_dir} does not match abstract_state: " + "; ".join(problems))

    def finish(state: Any) -> Any:
        restored = jax.tree_util.tree_leaves(state)
        return jax.tree_util.tree_unflatten(treedef, [f(x) if f else x for f, x in zip(posts, restored)])

    return jax.tree_util.tree_unflatten(treedef, targets), finish


def _corrupted(step_dir: Path, step: int, files: dict[str, list[Any]] | None, item: str, detail: str) -> Exception:
    """A `CheckpointCorruptedError` naming the damaged files, found by comparing them with their commit digests."""
    damaged: list[str] = []
    if files:
        for rel, (size, digest) in sorted(files.items()):
            path = step_dir / rel
            try:
                if path.stat().st_size != size:
                    damaged.append(f"{path} (size {path.stat().st_size}, {size} when committed)")
                elif _file_digest(path) != digest:
                    damaged.append(f"{path} (contents changed since commit)")
            except OSError:
                damaged.append(f"{path} (missing)")
    if damaged:
        where = "damaged file(s): " + ", ".join(damaged)
        names = [d.split(" (", 1)[0] for d in damaged]
    else:
        where = f"in {step_dir / item}" + ("" if files else " (no file digests recorded for this checkpoint)")
        names = [str(step_dir / item)]
    return CheckpointCorruptedError(f"checkpoint step {step} is corrupted: {detail}; {where}", step=step, files=names)


# State preparation and digests ---------------------------------------------------------------------------------
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="pipekit-digest")
    return _POOL


def _prepare_state(state: Any) -> tuple[Any, dict[str, Any]]:
    """The tree Orbax writes (PRNG keys as key data) and the per-leaf record: shape, dtype, sha256."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise CheckpointError("Checkpointer.save: state has no array leaves")
    names, datas, records = [], [], []
    for path, leaf in flat:
        name = _path_name(path)
        rec: dict[str, Any] = {}
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                rec["prng_impl"] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            if not leaf.is_fully_addressable:
                raise CheckpointError(f"Checkpointer.save: state leaf {name!r} spans processes; single-process only")
        elif not isinstance(leaf, (np.ndarray, np.generic)):
            raise CheckpointError(
                f"Checkpointer.save: state leaf {name!r} is a {type(leaf).__name__}; checkpoint state leaves must be "
                f"arrays (wrap scalars: jnp.asarray({leaf!r:.40}))"
            )
        if np.dtype(leaf.dtype).kind == "O":
            raise CheckpointError(f"Checkpointer.save: state leaf {name!r} is an array of Python objects")
        names.append(name)
        datas.append(leaf)
        rec.update(shape=list(np.shape(leaf)), dtype=str(leaf.dtype))
        records.append(rec)
    if len(set(names)) != len(names):
        raise CheckpointError(f"Checkpointer.save: state has leaves with the same path name: {names}")
    # A real copy: the caller may donate or overwrite its buffers as soon as `save` returns. JAX arrays are
    # copied on their device (Orbax moves them to the host in the background); NumPy arrays are copied here.
    copies = [jnp.array(x, copy=True) if isinstance(x, jax.Array) else np.array(x, copy=True) for x in datas]
    return jax.tree_util.tree_unflatten(treedef, copies), dict(zip(names, records))


def _add_digests(leaves: dict[str, Any], tree: Any) -> None:
    """Record the sha256 of every leaf's bytes (in the order `_prepare_state` listed them)."""
    hosts = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    digests = _pool().map(_leaf_digest, hosts) if sum(h.nbytes for h in hosts) > 1 << 20 else map(_leaf_digest, hosts)
    for rec, digest in zip(leaves.values(), digests):
        rec["sha256"] = digest


def _path_name(path: Iterable[Any]) -> str:
    """A leaf's path as ``a/b/0``, the same for a dict key, an attribute or an index (Orbax restores dicts)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _flatten(tree: Any) -> list[tuple[str, Any]]:
    return [(_path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _leaf_digest(host: np.ndarray) -> str:
    data = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    return hashlib.sha256(memoryview(data)).hexdigest()


def _json_digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_digests(step_dir: Path) -> dict[str, list[Any]]:
    """``{relative path: [size, sha256]}`` of every file in a committed step directory."""
    out = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        out[path.relative_to(step_dir).as_posix()] = [path.stat().st_size, _file_digest(path)]
    return out


# Disk layout: commit markers, manifest, deletion ---------------------------------------------------------------
def _uncommitted_reason(step_dir: Path) -> str | None:
    """``None`` when `step_dir` is a committed checkpoint, else what is missing."""
    if not step_dir.is_dir():
        return "no such directory"
    for rel in (_COMMIT, _STEP_METADATA, *(f"{item}/{_COMMIT}" for item in _ITEMS)):
        if not (step_dir / rel).is_file():
            return f"missing {rel}"
    return None


def _pending(directory: Path) -> str:
    """A note listing interrupted (uncommitted) step directories, for error messages."""
    if not directory.is_dir():
        return " (the directory does not exist)"
    names = sorted(p.name for p in directory.iterdir() if _TMP in p.name or p.name.isdigit())
    stale = [n for n in names if _TMP in n or _uncommitted_reason(directory / n) is not None]
    return f" (uncommitted: {stale})" if stale else ""


def _step(entry: ManifestEntry) -> int:
    return entry.step


def _read_manifest(directory: Path) -> tuple[dict[str, Any], list[ManifestEntry]]:
    data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"not a format-{FORMAT} pipekit manifest")
    header = {k: v for k, v in data.items() if k != "entries"}
    return header, [ManifestEntry.from_json(e) for e in data["entries"]]


def _write_manifest(directory: Path, header: Mapping[str, Any], entries: list[ManifestEntry]) -> None:
    """Replace ``manifest.json`` atomically: write a temporary file, fsync it, rename it over the old one."""
    doc = {"format": FORMAT, **header, "updated": time.time(), "entries": [e.to_json() for e in entries]}
    text = json.dumps(doc, indent=1, allow_nan=False)
    tmp = directory / f".{MANIFEST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for Orbax's files
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _load_entries(directory: Path) -> tuple[dict[str, Any], dict[int, ManifestEntry]]:
    """The manifest's header and entries, plus committed step directories it misses (a crash after commit)."""
    header: dict[str, Any] = {}
    entries: dict[int, ManifestEntry] = {}
    if (directory / MANIFEST).exists():
        try:
            header, listed = _with_io_retry(lambda: _read_manifest(directory))
            entries = {e.step: e for e in listed}
        except (ValueError, TypeError) as e:
            warnings.warn(
                f"{directory / MANIFEST} is unreadable ({e}); rebuilding the list from the checkpoints themselves",
                PipekitTrainWarning,
                stacklevel=3,
            )
    if directory.is_dir():
        for child in directory.iterdir():
            if child.name.isdigit() and int(child.name) not in entries and _uncommitted_reason(child) is None:
                entry = _entry_from_checkpoint(child)
                if entry is not None:
                    entries[entry.step] = entry
    return header, entries


def _entry_from_checkpoint(step_dir: Path) -> ManifestEntry | None:
    import orbax.checkpoint as ocp

    step = int(step_dir.name)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            record = _read_record(reader, step_dir, step, None)
    except CheckpointError as e:
        logger.warning("ignoring %s: %s", step_dir, e)
        return None
    user = record.get("user", {})
    return ManifestEntry(
        step=step,
        epoch=user.get("epoch"),
        stage=user.get("stage"),
        run_id=user.get("run_id"),
        metric=record.get("metric"),
        mode=record.get("mode", "min"),
        score=record.get("score"),
        stop_reason=user.get("stop_reason"),
        time=float(record.get("time", 0.0)),
    )


def _delete_step(step_dir: Path) -> None:
    """Uncommit first (one unlink), then remove: a crash midway leaves an ignored, uncommitted directory."""
    (step_dir / _COMMIT).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=False)


def _with_io_retry(fn: Callable[[], _T], *, attempts: int = 3, backoff: float = 0.1) -> _T:
    """Call `fn`, retrying an `OSError` with a transient errno (EAGAIN, EBUSY, EIO, ...) with backoff."""
    for attempt in range(attempts):
        try:
            return fn()
        except OSError as e:
            if e.errno not in _TRANSIENT_ERRNOS or attempt == attempts - 1:
                raise
            logger.warning("transient I/O error (%s); retry %d of %d", e, attempt + 1, attempts - 1)
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


# Argument checks ---------------------------------------------------------------------------------------------
def _check_step(where: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"{where}: step must be a non-negative int, got {step!r}")
    return int(step)


def _check_json(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise CheckpointError(f"Checkpointer.save: {name} must be a dict of JSON data, got {type(value).__name__}")

    def walk(v: Any, path: str) -> None:
        if v is None or isinstance(v, (bool, int, float, str)):
            return
        if isinstance(v, Mapping):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"Checkpointer.save: {path} has a non-string key {k!r} (JSON keys are str)")
                walk(item, f"{path}[{k!r}]")
            return
        if isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")
            return
        raise CheckpointError(
            f"Checkpointer.save: {path} is a {type(v).__name__}; {name} must be JSON data "
            "(dict, list, str, int, float, bool, None)"
        )

    walk(value, name)


def _optional(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    value = meta.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise CheckpointError(f"Checkpointer.save: meta[{key!r}] must be {kind.__name__} or None, got {value!r}")
    return value


# Averaging ---------------------------------------------------------------------------------------------------
def _selection(directory: Path) -> tuple[dict[int, ManifestEntry], str | None, Mode]:
    header, entries = _load_entries(directory)
    committed = {s: e for s, e in entries.items() if _uncommitted_reason(directory / str(s)) is None}
    monitor = header.get("monitor")
    mode = header.get("mode")
    if monitor is None:
        scored = sorted((e for e in committed.values() if e.score is not None), key=_step)
        monitor, mode = (scored[-1].metric, scored[-1].mode) if scored else (None, "min")
    return committed, monitor, mode or "min"


def _pick(directory: Path, steps: Sequence[int] | Average | Selector) -> tuple[list[int], dict[int, ManifestEntry]]:
    committed, monitor, mode = _selection(directory)
    if isinstance(steps, (Average, Selector)):
        selector = steps.selector if isinstance(steps, Average) else steps
        own = [e for e in committed.values() if e.metric == monitor and e.mode == mode]
        picked = sorted(selector.select(sorted(own, key=_step), mode))
        if not picked:
            raise CheckpointNotFoundError(f"{steps!r} picks no checkpoint in {directory}; steps: {sorted(committed)}")
        return picked, committed
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise CheckpointError(f"steps must be a list of steps or an Average, got {steps!r}")
    picked = sorted({_check_step("average_checkpoints", s) for s in steps})
    if not picked:
        raise CheckpointError("average_checkpoints: steps is empty; name at least one checkpoint")
    missing = [s for s in picked if _uncommitted_reason(directory / str(s)) is not None]
    if missing:
        raise CheckpointNotFoundError(
            f"average_checkpoints: step(s) {missing} are not committed checkpoints in {directory}; "
            f"committed steps: {sorted(committed)}"
        )
    return picked, committed


def average_checkpoints(
    directory: str | os.PathLike[str], steps: Sequence[int] | Average | Selector, abstract_state: Any = None
) -> Any:
    """The uniform mean of the checkpoints `steps` names, as a state tree.

    Floating-point leaves are averaged (accumulated in float64, returned in their own dtype); every other
    leaf (integer counters, PRNG keys) comes from the newest of the checkpoints. Each checkpoint is verified
    against its checksums while it is read.

    Args:
        directory: A checkpoint directory.
        steps: The steps to average, or an `Average` / selector resolved against the directory's manifest.
        abstract_state: As for `Checkpointer.restore`; ``None`` restores the trees as saved.
    """
    directory = Path(directory).absolute()
    picked, committed = _pick(directory, steps)
    sums: list[np.ndarray | None] = []
    treedef = None
    newest: list[Any] = []
    for step in picked:
        entry = committed.get(step)
        state, _, _ = _restore_step(directory, step, abstract_state, entry.files if entry else None)
        leaves, this_def = jax.tree_util.tree_flatten(state)
        if treedef is None:
            treedef = this_def
            sums = [None] * len(leaves)
        elif this_def != treedef:
            raise CheckpointMismatchError(f"step {step} in {directory} holds another tree than step {picked[0]}")
        for i, leaf in enumerate(leaves):
            if _is_inexact(leaf.dtype):
                acc = np.asarray(leaf).astype(np.complex128 if np.iscomplexobj(leaf) else np.float64)
                sums[i] = acc if sums[i] is None else sums[i] + acc
        newest = leaves
    out = []
    for total, leaf in zip(sums, newest):
        if total is None:
            out.append(leaf)
        else:
            mean = (total / len(picked)).astype(leaf.dtype)
            out.append(jax.device_put(mean, leaf.sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_inexact(dtype: Any) -> bool:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jax.dtypes.issubdtype(dtype, np.inexact))


def write_average(
    src_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], steps: Sequence[int] | Average | Selector
) -> int:
    """Average checkpoints of `src_dir` and write the result as an ordinary checkpoint into `out_dir`.

    The new checkpoint takes the newest averaged step's number, epoch, stage and run id; its meta records
    ``{"averaged_from": [steps], "source": src_dir, "weight": "uniform"}`` and its data position is empty
    (averaged weights are a starting point, not a place to resume). `out_dir` must hold no checkpoint yet.

    Returns:
        The step written.
    """
    src, out = Path(src_dir).absolute(), Path(out_dir).absolute()
    if src.resolve() == out.resolve():
        raise CheckpointError(f"write_average: out_dir must differ from src_dir, both are {src}")
    picked, committed = _pick(src, steps)
    state = average_checkpoints(src, picked)
    _, monitor, mode = _selection(src)
    newest = committed.get(picked[-1]) or ManifestEntry(step=picked[-1])
    with Checkpointer(out, keep=(Last(n=1),), monitor=monitor, mode=mode, async_save=False) as writer:
        if writer.steps():
            raise CheckpointError(
                f"write_average: {out} already holds checkpoints {writer.steps()}; write into an empty directory"
            )
        meta = {
            "averaged_from": picked,
            "source": str(src),
            "weight": "uniform",
            "epoch": newest.epoch,
            "stage": newest.stage,
            "run_id": newest.run_id,
            "score": None,
            "stop_reason": None,
        }
        writer.save(picked[-1], state=state, data_iter={}, meta=meta)
    return picked[-1]


# Runs --------------------------------------------------------------------------------------------------------
def list_runs(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The checkpointed runs under `root`, newest first, read from the manifests alone.

    Each row: ``run_id``, ``stage``, ``directory``, ``checkpoints`` (committed ones), ``steps``, ``latest_step``,
    ``best_step``, ``best_score``, ``metric``, ``mode`` and ``last_write`` (``time.time()`` of its newest
    checkpoint). A directory holding checkpoints of several runs gives one row per run.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"run directory not found: {root}")
    rows = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if MANIFEST not in filenames:
            continue
        directory = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not (d.isdigit() or _TMP in d)]  # never walk into checkpoints
        try:
            header, entries = _read_manifest(directory)
        except (OSError, ValueError, TypeError) as e:
            warnings.warn(f"skipping {directory / MANIFEST}: {e}", PipekitTrainWarning, stacklevel=2)
            continue
        committed = [e for e in entries if _uncommitted_reason(directory / str(e.step)) is None]
        by_run: dict[str | None, list[ManifestEntry]] = {}
        for e in entries:
            by_run.setdefault(e.run_id, [])
        for e in committed:
            by_run[e.run_id].append(e)
        for run_id, run_entries in by_run.items():
            mode = header.get("mode", "min")
            own = [e for e in run_entries if e.metric == header.get("monitor", e.metric) and e.mode == mode]
            best = next(iter(Best(k=1).select(own, mode)), None)
            listed = [e for e in entries if e.run_id == run_id]
            rows.append(
                {
                    "run_id": run_id,
                    "stage": next((e.stage for e in reversed(listed) if e.stage), None),
                    "directory": str(directory),
                    "checkpoints": len(run_entries),
                    "steps": [e.step for e in run_entries],
                    "latest_step": run_entries[-1].step if run_entries else None,
                    "best_step": best,
                    "best_score": next((e.score for e in run_entries if e.step == best), None),
                    "metric": header.get("monitor"),
                    "mode": mode,
                    "last_write": max((e.time for e in listed), default=0.0),
                }
            )
    rows.sort(key=lambda r: r["last_write"], reverse=True)
    return rows


def format_runs_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """`list_runs` rows as an aligned text table (what ``pipekit-train runs RUN_DIR`` prints)."""
    if not rows:
        return "no checkpointed runs found"
    header = ("RUN", "STAGE", "CKPTS", "LATEST", "BEST", "METRIC", "LAST WRITE", "DIRECTORY")
    lines = [header]
    for r in rows:
        score = r.get("best_score")
        best = "-" if score is None or not math.isfinite(score) else f"{score:.4g} @ {r['best_step']}"
        metric = f"{r['metric']} ({r['mode']})" if r.get("metric") else "-"
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["last_write"])) if r.get("last_write") else "-"
        latest = "-" if r.get("latest_step") is None else str(r["latest_step"])
        lines.append(
            (
                str(r.get("run_id") or "-"),
                str(r.get("stage") or "-"),
                str(r.get("checkpoints", 0)),
                latest,
                best,
                metric,
                written,
                str(r.get("directory", "")),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
