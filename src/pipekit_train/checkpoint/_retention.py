"""What a `Checkpointer` keeps: after a commit, the manifest lists the new step and then the steps no selector in
``keep`` retains are deleted (that order is what leaves a crash restorable; ``design/checkpoints.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from pathlib import Path
from typing import Any, Literal

from ..scale._distributed import barrier, is_primary
from ._errors import CheckpointSaveError
from ._flat import fsync_dir, retire
from ._layout import _delete_step, _file_digests, _short, _space_note, _uncommitted_reason, _with_io_retry
from ._manifest import MANIFEST, _step, _write_manifest
from ._selectors import ManifestEntry, Mode, Selector, union_select

logger = logging.getLogger("pipekit_train.checkpoint")


class _Retention:
    """The manifest update after a commit and the retention policy's deletions (a part of `Checkpointer`)."""

    directory: Path
    layout: Literal["flat", "orbax"]
    keep: tuple[Selector, ...]
    monitor: str
    mode: Mode
    async_save: bool
    _entries: dict[int, ManifestEntry]
    _lock: threading.Lock
    _manager: Any
    _spare: Path | None

    def _is_own(self, entry: ManifestEntry) -> bool:
        return entry.metric == self.monitor and entry.mode == self.mode

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
