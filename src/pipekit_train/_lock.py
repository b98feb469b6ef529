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
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from pipekit import PipekitError

__all__ = ["RunDirectoryBusyError", "run_dir_lock"]

LOCK_FILE = ".lock"
_held: dict[str, tuple[int, int]] = {}  # real path -> (file descriptor, depth)
_guard = threading.Lock()


class RunDirectoryBusyError(PipekitError):
    """Another process is writing to the run directory. The message names it."""


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
    os.makedirs(run_dir, exist_ok=True)
    key = os.path.realpath(run_dir)
    with _guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
        else:
            path = os.path.join(key, LOCK_FILE)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
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
