"""SIGINT and SIGTERM outside training: one line, exit code 128 + signal, nothing left that blocks a rerun.

Training has its own handlers (`engine._stop`: the step finishes, a checkpoint is committed, the stage stops,
exit 130 / 143). Everywhere else in the ``pipekit-train`` command a signal ends the process at once: it prints one
line, removes a run directory this process began in which nothing was kept yet (so the same command runs again;
one with finished stages is kept, for ``--resume auto``), and exits without running anything else: no traceback,
no ``KeyboardInterrupt`` caught and swallowed inside a JAX callback, no training that continues. The run-directory
lock is released by the exit itself. A command that says how it is continued (``sweep``: `note_continuation`)
names that command instead of a run directory.

This holds from the command's first instants: ``import pipekit_train`` calls `stop_at_command_start` before
anything else, which installs the handlers when this process is the ``pipekit-train`` command (the console script,
or ``python -m pipekit_train.cli``), so a signal while the command's modules load (about half a second) is one line
too, never a ``KeyboardInterrupt`` traceback or a silent death by SIGTERM. Imported as a library nothing is
installed. Only Python's own start-up and the search for the ``pipekit_train`` package come before. For that, this
module imports nothing at its top that Python has not loaded already (``_signal`` and ``_thread`` are the C halves
of `signal` and `threading`); the rest is imported when needed. The handlers stay until the process ends: a signal
after the command returned (the interpreter's exit) says the command had finished, with its exit code.

`stop_on_signals` (around each command) adds a watcher: a signal is noticed by the main thread's handler when the
main thread runs Python code, and otherwise (the main thread inside a long call into XLA, a compile) by a watcher
thread woken through `signal.set_wakeup_fd`, which ends the process if the main thread has not within half a
second. While training's own handlers are installed both stand aside.

A signal the process inherited as ignored stays ignored (a background job of a non-interactive shell starts with
SIGINT ignored, so that the terminal's Ctrl-C does not reach it): neither the start nor `stop_on_signals` installs
a handler for it.
"""

from __future__ import annotations

import _thread
import os
import sys

TYPE_CHECKING = False  # `typing` costs more to import than this module: mypy reads this name as typing's
if TYPE_CHECKING:
    import signal as _signal  # what mypy knows of `_signal`: the same functions and numbers, typed
    from types import TracebackType
    from typing import Any
else:
    import _signal

__all__ = ["note_continuation", "note_run_dir", "phase", "stop_at_command_start", "stop_on_signals"]

_SIGNALS = (_signal.SIGINT, _signal.SIGTERM)
_NAMES: dict[int, str] = {_signal.SIGINT: "SIGINT", _signal.SIGTERM: "SIGTERM"}
#: Run directories this process named, and whether it began them (they did not exist when first named).
_RUN_DIRS: dict[str, bool] = {}
_exiting = _thread.allocate_lock()
_prog = "pipekit-train"
#: Files a run directory holds before anything of value: a run directory with only these is removed on a signal.
_NOTHING_KEPT = frozenset({"run.json", ".lock"})
#: ``(what, command)`` set by `note_continuation`: the line names `what` and the command that continues it.
_CONTINUATION: list[tuple[str, str]] = []
#: The exit code of the command once `main` has returned (`command_finished`); a signal after it says so.
_FINISHED: list[int] = []


def _is_the_command() -> bool:
    """Whether this process is the ``pipekit-train`` command: Python was started on its console script, or with
    ``-m pipekit_train.cli`` (``sys.orig_argv``, the interpreter's own command line: a process spawned by the
    command, a ``multiprocessing`` worker that copies its ``sys.argv``, is not the command)."""
    args = sys.orig_argv[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-m"):
            module = arg[2:] or (args[i + 1] if i + 1 < len(args) else "")
            return module == "pipekit_train.cli" or module.startswith("pipekit_train.cli.")
        if arg.startswith("-c") or arg == "-":
            return False
        if not arg.startswith("-"):  # the script
            return os.path.basename(arg).removesuffix(".exe") == "pipekit-train"
        i += 2 if arg in ("-X", "-W", "--check-hash-based-pycs") else 1
    return False


def stop_at_command_start() -> None:
    """In the ``pipekit-train`` command only: install the handlers now, for the whole process (``import
    pipekit_train`` calls this first; a library import installs nothing)."""
    if not _is_the_command():
        return
    for sig in _SIGNALS:
        if _signal.getsignal(sig) != _signal.SIG_IGN:  # inherited as ignored: stays ignored
            _signal.signal(sig, _handler)


def note_run_dir(path: str) -> None:
    """Record that this process writes in the run directory `path` (and whether it began it), before creating it."""
    path = os.path.abspath(path)
    _RUN_DIRS.setdefault(path, not os.path.exists(path))


def note_continuation(what: str, command: str) -> None:
    """Until `stop_on_signals` is left: a signal outside training prints that `what` (``sweep grid4``) stopped and
    that `command` continues it, instead of naming the run directories its trials began."""
    _CONTINUATION[:] = [(what, command)]


def command_finished(code: int) -> None:
    """`main` returned `code`: a signal from now on (the interpreter's exit) says the command had finished."""
    _FINISHED[:] = [code]


def _kept(run_dir: str) -> bool:
    """Whether `run_dir` holds anything besides its metadata, its lock and empty stage folders."""
    return any(set(files) - _NOTHING_KEPT for _, _, files in os.walk(run_dir))


def _handler(signum: int, frame: Any) -> None:
    _exit(signum)


def _exit(signum: int) -> None:
    """Print the one line, remove what this process began and kept nothing in, and end the process."""
    _exiting.acquire()  # the other path (main thread or watcher) may be here already: it ends the process
    name = _NAMES.get(signum, str(signum))
    removed, kept = [], []
    for run_dir, began in _RUN_DIRS.items():
        if not os.path.isdir(run_dir):
            continue
        if _kept(run_dir):
            kept.append(run_dir)
        elif began:
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(run_dir)
    if _FINISHED:
        line = f"{_prog}: stopped by {name} while exiting; the command had finished (exit code {_FINISHED[0]})"
    elif _CONTINUATION:
        what, command = _CONTINUATION[0]
        line = f"{_prog}: {what} stopped by {name} outside training; continue it with: {command}"
    elif kept:
        line = (
            f"{_prog}: stopped by {name} outside training; what finished is kept in {kept[0]}: continue with "
            f"--run-dir {os.path.relpath(kept[0])} --resume auto"
        )
    else:
        note = f" (removed the run directory {os.path.relpath(removed[0])} it had begun)" if removed else ""
        line = f"{_prog}: stopped by {name} before training; nothing was kept{note}: the same command runs again"
    try:  # noqa: SIM105  (no `contextlib` here: it may not be imported yet, and this runs in a signal handler)
        sys.stdout.flush()
    except Exception:
        pass
    try:  # noqa: SIM105
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
    os._exit(128 + signum)


def _watch(read_fd: int) -> None:
    """The watcher thread: a signal that arrives while the main thread is inside a long native call."""
    import time

    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return  # the pipe was closed: `stop_on_signals` is over
        for signum in data:
            if signum not in _SIGNALS or _signal.getsignal(signum) is not _handler:
                continue  # training's handlers are installed: they stop the stage after a checkpoint
            time.sleep(0.5)  # in Python code the main thread runs `_handler` itself, at once
            if _signal.getsignal(signum) is _handler:
                _exit(signum)


class stop_on_signals:  # a context manager named as the function it replaced: ``with stop_on_signals():``
    """Within: SIGINT and SIGTERM outside training end the process as the module docstring says.

    A no-op outside the main thread (signal handlers can only be set there). A signal ignored on entry stays
    ignored. The previous handlers and wakeup fd are restored on leaving, so a command run in-process (tests)
    leaves its caller's handling as it was.
    """

    def __init__(self, prog: str = "pipekit-train") -> None:
        self.prog = prog
        self.previous: dict[int, Any] = {}
        self.pipe: tuple[int, int] | None = None

    def __enter__(self) -> None:
        global _prog
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        _prog = self.prog
        del _FINISHED[:]
        for sig in _SIGNALS:
            if _signal.getsignal(sig) != _signal.SIG_IGN:
                self.previous[sig] = _signal.signal(sig, _handler)
        read_fd, write_fd = self.pipe = os.pipe()
        os.set_blocking(write_fd, False)
        self.old_fd = _signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.watcher = threading.Thread(target=_watch, args=(read_fd,), name="pipekit-signals", daemon=True)
        self.watcher.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.pipe is None:
            return
        read_fd, write_fd = self.pipe
        _signal.set_wakeup_fd(self.old_fd)
        for sig, handler in self.previous.items():
            _signal.signal(sig, handler)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        self.watcher.join(timeout=5)
        os.close(read_fd)
        _RUN_DIRS.clear()
        del _CONTINUATION[:]


_PHASES_SEEN: dict[str, int] = {}


def phase(name: str) -> None:
    """A named point of the command (``loaded``, ``preflight``, ``built``, ``started``; a sweep's ``trial``,
    ``asked``, ...): with ``$PIPEKIT_TEST_SIGNAL_AT=<name>:<SIGINT|SIGTERM|SIGKILL>[:<n>]`` the process signals
    itself there, the `n`-th time it passes (default the first; tests of the above and of resuming after a kill)."""
    wanted = os.environ.get("PIPEKIT_TEST_SIGNAL_AT", "")
    if not wanted:
        return
    where, sig, nth = ([*wanted.split(":"), "1"])[:3]
    _PHASES_SEEN[name] = _PHASES_SEEN.get(name, 0) + 1
    if where == name and sig in ("SIGINT", "SIGTERM", "SIGKILL") and str(_PHASES_SEEN[name]) == nth:
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(_signal, sig))
