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
import functools
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pipekit import ConfigError

from .._warnings import PipekitTrainWarning
from ..scale._distributed import is_primary, process_count
from ._errors import CheckpointError, CheckpointNotFoundError
from ._layout import (
    HeldState,
    _check_json,
    _check_step,
    _never_committed,
    _optional,
    _pending,
    _prepare_state,
    _uncommitted_after,
    _uncommitted_reason,
)
from ._manifest import MANIFEST, _scan, _step, _write_manifest
from ._selectors import Best, Last, ManifestEntry, Mode, Selector, finite_score, union_select
from ._settings import _check_keep, check_layout
from ._writer import _finish_at_exit, _Job, _submit, _Writer

logger = logging.getLogger("pipekit_train.checkpoint")

Layout = Literal["auto", "flat", "orbax"]


# The checkpointer --------------------------------------------------------------------------------------------
class Checkpointer(_Writer):
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


def _json_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of checked JSON data (any `Mapping` becomes a dict, as it is written)."""

    def as_dict(obj: Any) -> Any:
        if isinstance(obj, Mapping):
            return dict(obj)
        raise TypeError(f"{type(obj).__name__} is not JSON data")  # `_check_json` refused it already

    return json.loads(json.dumps(value, default=as_dict))  # type: ignore[no-any-return]
