"""SIGINT and SIGTERM outside training: one line, exit code 128 + signal, nothing left that blocks a rerun.

Training has its own handlers (`checkpoint._resume`: the step finishes, a checkpoint is committed, the stage stops,
exit 130 / 143). Before it (loading, pre-flight, building, compiling) and between stages, `stop_on_signals` makes a
signal end the process at once: it prints one line, removes a run directory this process began in which nothing
was kept yet (so the same command runs again; one with finished stages is kept, for ``--resume auto``), and exits
without running anything else: no traceback, no ``KeyboardInterrupt`` caught and swallowed inside a JAX callback,
no training that continues. The run-directory lock is released by the exit itself.

A signal is noticed by the main thread's handler when the main thread runs Python code, and otherwise (the main
thread inside a long call into XLA, a compile) by a watcher thread woken through `signal.set_wakeup_fd`, which
ends the process if the main thread has not within half a second. While training's own handlers are installed
both stand aside.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["note_run_dir", "phase", "stop_on_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Run directories this process named, and whether it began them (they did not exist when first named).
_RUN_DIRS: dict[str, bool] = {}
_exiting = threading.Lock()
_prog = "pipekit-train"
#: Files a run directory holds before anything of value: a run directory with only these is removed on a signal.
_NOTHING_KEPT = frozenset({"run.json", ".lock"})


def note_run_dir(path: str) -> None:
    """Record that this process writes in the run directory `path` (and whether it began it), before creating it."""
    path = os.path.abspath(path)
    _RUN_DIRS.setdefault(path, not os.path.exists(path))


def _kept(run_dir: str) -> bool:
    """Whether `run_dir` holds anything besides its metadata, its lock and empty stage folders."""
    return any(set(files) - _NOTHING_KEPT for _, _, files in os.walk(run_dir))


def _handler(signum: int, frame: Any) -> None:
    _exit(signum)


def _exit(signum: int) -> None:
    """Print the one line, remove what this process began and kept nothing in, and end the process."""
    _exiting.acquire()  # the other path (main thread or watcher) may be here already: it ends the process
    name = signal.Signals(signum).name
    removed, kept = [], []
    for run_dir, began in _RUN_DIRS.items():
        if not os.path.isdir(run_dir):
            continue
        if _kept(run_dir):
            kept.append(run_dir)
        elif began:
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(run_dir)
    if kept:
        line = (
            f"{_prog}: stopped by {name} outside training; what finished is kept in {kept[0]}: continue with "
            f"--run-dir {os.path.relpath(kept[0])} --resume auto"
        )
    else:
        note = f" (removed the run directory {os.path.relpath(removed[0])} it had begun)" if removed else ""
        line = f"{_prog}: stopped by {name} before training; nothing was kept{note}: the same command runs again"
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())
    os._exit(128 + signum)


def _watch(read_fd: int) -> None:
    """The watcher thread: a signal that arrives while the main thread is inside a long native call."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return  # the pipe was closed: `stop_on_signals` is over
        for signum in data:
            if signum not in _SIGNALS or signal.getsignal(signum) is not _handler:
                continue  # training's handlers are installed: they stop the stage after a checkpoint
            time.sleep(0.5)  # in Python code the main thread runs `_handler` itself, at once
            if signal.getsignal(signum) is _handler:
                _exit(signum)


@contextlib.contextmanager
def stop_on_signals(prog: str = "pipekit-train") -> Iterator[None]:
    """Within: SIGINT and SIGTERM outside training end the process as the module docstring says.

    A no-op outside the main thread (signal handlers can only be set there). The previous handlers and wakeup fd
    are restored on leaving, so a command run in-process (tests) leaves its caller's handling as it was.
    """
    global _prog
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _prog = prog
    previous = {sig: signal.signal(sig, _handler) for sig in _SIGNALS}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="pipekit-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        watcher.join(timeout=5)
        os.close(read_fd)
        _RUN_DIRS.clear()


_PHASES_SEEN: dict[str, int] = {}


def phase(name: str) -> None:
    """A named point of start-up (``loaded``, ``preflight``, ``built``, ``started``): with
    ``$PIPEKIT_TEST_SIGNAL_AT=<name>:<SIGINT|SIGTERM>[:<n>]`` the process signals itself there, the `n`-th time it
    passes (default the first; tests of the above)."""
    wanted = os.environ.get("PIPEKIT_TEST_SIGNAL_AT", "")
    if not wanted:
        return
    where, sig, nth = ([*wanted.split(":"), "1"])[:3]
    _PHASES_SEEN[name] = _PHASES_SEEN.get(name, 0) + 1
    if where == name and sig in ("SIGINT", "SIGTERM") and str(_PHASES_SEEN[name]) == nth:
        os.kill(os.getpid(), getattr(signal, sig))
