"""One writer per run directory: an exclusive `fcntl` lock on ``<run_dir>/.lock`` for as long as a run writes there.

The lock belongs to the process: a process that dies (even by SIGKILL) releases it, so a crashed run never blocks
its own resume. The file holds the holder's PID, host and command line, which the refusal quotes. Re-entrant within
a process: the stages of one pipeline share the lock the first stage took.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from pipekit import PipekitError

__all__ = ["DirectoryNotWritableError", "RunDirectoryBusyError", "check_writable", "enclosing_run_dir", "run_dir_lock"]

LOCK_FILE = ".lock"
RUN_FILE = "run.json"  # what marks a run directory (written by the first stage of a run)
_held: dict[str, tuple[int, int]] = {}  # real path -> (file descriptor, depth)
_guard = threading.Lock()


class RunDirectoryBusyError(PipekitError):
    """Another process is writing to the run directory. The message names it."""


class DirectoryNotWritableError(PipekitError):
    """A folder a run must write to is read-only, full or not ours; found before training. The message names it."""


def check_writable(path: str | os.PathLike[str], what: str, remedy: str, *, is_folder: bool = True) -> None:
    """Refuse, naming `path`, when a file cannot be created in the folder `path` (or beside the file `path` when
    `is_folder` is false; when it does not exist yet, in the nearest folder above it that does, where it would be
    created). Writes one byte and removes it; creates nothing.

    A real write, not `os.access`: root ignores permissions but not a read-only mount, and a full disk only shows
    when a block is needed.
    """
    here = os.path.abspath(path)
    if is_folder and os.path.exists(here) and not os.path.isdir(here):
        raise DirectoryNotWritableError(f"{what} {path} is a file, not a folder; nothing was trained. {remedy}")
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here) and here != os.path.abspath(path):  # a file where a folder above `path` must be
        raise DirectoryNotWritableError(
            f"{what} {path} cannot be written ({here} is a file, not a folder); nothing was trained. {remedy}"
        )
    folder = here if os.path.isdir(here) else os.path.dirname(here)
    probe = os.path.join(folder, f".pipekit-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise DirectoryNotWritableError(
            f"{what} {path} cannot be written ({e.strerror or e}: {folder}); nothing was trained. {remedy}"
        ) from None


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            info: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"PID {info.get('pid')} on {info.get('host')} since {since} ({info.get('command', '?')})"


@contextlib.contextmanager
def run_dir_lock(run_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the run directory's lock for the block; refuse at once when another process holds it."""
    key = os.path.realpath(run_dir)
    with _guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
        else:
            path = os.path.join(key, LOCK_FILE)
            try:
                os.makedirs(run_dir, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise DirectoryNotWritableError(
                    f"run directory {run_dir} cannot be written ({e.strerror or e}: {e.filename or path}); "
                    "nothing was trained. Choose another run directory (--run-dir) or make it writable"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunDirectoryBusyError(
                    f"run directory {run_dir} is in use by {_holder(path)}; wait for it to finish (or stop it), "
                    "or choose another run directory"
                ) from None
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.time(),
                "command": " ".join(sys.argv),
            }
            with contextlib.suppress(OSError):  # who holds it is for the message only (a full disk has no room)
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(record).encode())
            _held[key] = (fd, 1)
    try:
        yield
    finally:
        with _guard:
            fd, depth = _held[key]
            if depth > 1:
                _held[key] = (fd, depth - 1)
            else:
                del _held[key]
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def enclosing_run_dir(path: str | os.PathLike[str]) -> str | None:
    """The run directory `path` lies in (itself or the nearest folder above it holding ``run.json``), or ``None``.

    A command that writes into a run directory without being a run (``average -o runs/a/avg``) takes that run
    directory's lock, so it never writes beside a run in progress.
    """
    here = os.path.abspath(path)
    while True:
        if os.path.isfile(os.path.join(here, RUN_FILE)):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
