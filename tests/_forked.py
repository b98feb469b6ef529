"""Training subprocesses forked from a process that has already imported JAX, for the tests whose point is a process
boundary (SIGKILL, SIGTERM, a resume in a new process, the CLI's exit codes) but not a process's start-up.

A fresh ``python -m pipekit_train.cli run ...`` of the tests' 20-step pipelines spends about a third of its CPU
importing JAX, Equinox, optax, Orbax and Grain (1.2 of 3.5 s here). `Popen` here is `subprocess.Popen` whose child,
when it can be, is forked from a *zygote*: one process per test process, started on first use, that imported those
libraries once and then only forks. The child is a real process of its own (its own pid, address space, open files
and signal dispositions; SIGKILL and SIGTERM reach it and it dies of them, its exit status comes back as
`returncode`), running ``-m module`` or ``-c code`` with the given arguments, working directory, environment and
standard streams, and exiting through the interpreter's own shutdown (``atexit``, non-daemon threads), as the fresh
process would.

What a forked child cannot be is a process whose *start* differs: so a request is forked only when it runs this
interpreter with ``-m`` or ``-c`` and nothing else `Popen` would do differently (no ``preexec_fn``, ``pass_fds``,
new session, user, group or umask, ``close_fds=False``, ``shell``), and its environment is the test process's except
for `_PER_CALL` variables (which nothing the zygote imported reads). Anything else, a ``PYTHONPATH`` with a
``sitecustomize``, another ``$XLA_FLAGS``, ``-u``, is started the ordinary way, transparently. The children share the
zygote's string-hash seed (a fresh process draws its own), which no exactness test relies on either way; NumPy's and
`random`'s global generators are reseeded in each.

Only a test that asks for it uses this (``from tests import _forked``). A test of what a process imports or does
before its first line (start-up cost, imported modules, signals during start-up) must keep `subprocess`: a forked
child has the zygote's modules loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

#: Variables a child may have that the zygote did not (or with other values): pytest's per-test marker, our own
#: settings and those of libraries the zygote does not import, which nothing it imported reads.
_PER_CALL = ("PYTEST_CURRENT_TEST", "PIPEKIT_", "KERAS_", "MLFLOW_", "RAY_")

#: The zygote: import the libraries every training process imports first, then fork a child per request received on
#: the Unix socket (argv, cwd, env as JSON; stdin, stdout, stderr as file descriptors), answer its pid, and when it
#: exits its wait status. Exits when its stdin (a pipe from the test process) closes. A child returns from `serve`
#: into `become`, which sets up the process and runs the request's module or code as ``__main__``.
_ZYGOTE = r"""
import os, sys, json, socket, struct, selectors, threading
import numpy, jax, jax.numpy, equinox, optax, orbax.checkpoint, grain, yaml, msgpack  # noqa: F401
from jax._src import xla_bridge
assert not xla_bridge._backends, "a backend started in the zygote: a fork would inherit its threads"
assert threading.active_count() == 1, threading.enumerate()

def serve(listener):
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "quit")
    conns, pidfds = [], []
    while True:
        for key, _ in sel.select():
            if key.data == "quit":  # the test process is done with this zygote: no new children
                if not os.read(key.fd, 4096):
                    sel.unregister(key.fd); sel.unregister(listener)
                    if not pidfds:
                        os._exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                sys.stdout.flush(); sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close(); listener.close()
                    for other in conns:
                        other.close()
                    for other in pidfds:
                        os.close(other)
                    conn.close()
                    return json.loads(msg), fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(struct.pack("q", pid))
                pidfd = os.pidfd_open(pid)
                conns.append(conn); pidfds.append(pidfd)
                sel.register(pidfd, selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                sel.unregister(key.fd); os.close(key.fd); pidfds.remove(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(struct.pack("q", status))
                except OSError:
                    pass  # the test process stopped listening
                conns.remove(conn); conn.close()
                if not pidfds and listener.fileno() not in sel.get_map():
                    os._exit(0)  # closed, and the last child's status answered

def become(request, fds):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    numpy.random.seed()  # NumPy's global generator from fresh entropy, as a fresh process's (random's reseeds itself)
    zygote = globals()
    def without_the_zygote(kind, value, tb):  # a traceback shows the child's frames only, as a fresh process's
        while tb is not None and tb.tb_frame.f_globals is zygote:
            tb = tb.tb_next
        sys.__excepthook__(kind, value.with_traceback(tb), tb)
    sys.excepthook = without_the_zygote
    import types
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    flag, target, *rest = request["argv"]
    if flag == "-m":
        import runpy
        sys.argv = ["-m", *rest]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target, alter_argv=True)
    else:
        sys.argv = ["-c", *rest]
        sys.path[0] = ""
        exec(compile(target, "<string>", "exec"), main.__dict__)

listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(64)
print("ready", flush=True)
request, fds = serve(listener)
del serve, listener
become(request, fds)
"""

_EXECUTE_CHILD = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]
#: `Popen` keyword settings under which the child is not what a fork from the zygote makes.
_NOT_FORKABLE = {
    "close_fds": True,
    "preexec_fn": None,
    "pass_fds": (),
    "shell": False,
    "gid": None,
    "gids": None,
    "uid": None,
    "umask": -1,
    "start_new_session": False,
    "process_group": -1,
}


def _comparable(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_PER_CALL)}


class _Zygote:
    """A process that imported JAX, Equinox, optax, Orbax and Grain and forks a child per request (`_ZYGOTE`)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.folder = tempfile.mkdtemp(prefix="pk-zygote-")
        self.path = os.path.join(self.folder, "socket")
        log = os.path.join(self.folder, "stderr")
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE, self.path],
                env=self.env,
                cwd=self.folder,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            self.proc.kill()
            self.proc.wait()
            with open(log, errors="replace") as err:
                raise RuntimeError(f"the tests' zygote did not start: {err.read()[-2000:]}")

    def fork(self, argv: list[str], cwd: str, env: Mapping[str, str], fds: list[int]) -> tuple[int, socket.socket]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        request = json.dumps({"argv": argv, "cwd": cwd, "env": dict(env)}).encode()
        socket.send_fds(conn, [request], fds)
        (pid,) = struct.unpack("q", _read_exactly(conn, 8))
        return pid, conn

    def close(self, wait: bool = True) -> None:
        """No new children; the zygote exits once its running children are answered (`wait`: wait for that, at
        most 10 s, then kill it)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if wait and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode is not None and self.proc.stdout:
            self.proc.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("the test zygote closed the connection")
        data += part
    return data


_zygote: _Zygote | None = None
_lock = threading.Lock()
#: Counts of forked and ordinary starts, for the tests of this module.
starts = {"forked": 0, "ordinary": 0}


def _zygote_for(env: Mapping[str, str]) -> _Zygote | None:
    """A zygote whose children are what a fresh process with `env` would be, or None: `env` must be this test
    process's environment but for `_PER_CALL` (a test's own ``PYTHONPATH`` or ``XLA_FLAGS`` is started the ordinary
    way). The zygote has this process's environment at its start; when that has changed since (an import set a
    variable for the rest of the run), it is replaced: the old one answers its running children, then exits."""
    global _zygote
    wanted = _comparable(env)
    if wanted != _comparable(os.environ):
        return None
    with _lock:
        if _zygote is not None and _comparable(_zygote.env) != wanted:
            _zygote.close(wait=False)
            _zygote = None
        if _zygote is None:
            _zygote = _Zygote(os.environ)
            atexit.register(_zygote.close)
        return _zygote


def _stdio(fd: int, own: int) -> int:
    return own if fd == -1 else fd


class Popen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen`, its child forked from the zygote when the request allows it (`forked` says which)."""

    forked = False
    _conn: socket.socket | None = None
    _pidfd: int | None = None

    def _execute_child(self, *args: Any) -> None:  # type: ignore[override]
        given = dict(zip(_EXECUTE_CHILD, args, strict=True))
        argv = given["args"]
        env = os.environ if given["env"] is None else given["env"]
        forkable = (
            not isinstance(argv, (str, bytes))
            and len(argv) >= 2
            and str(argv[0]) == sys.executable
            and str(argv[1]) in ("-m", "-c")
            and given["executable"] is None
            and all(given[k] == v or (k == "pass_fds" and not given[k]) for k, v in _NOT_FORKABLE.items())
        )
        zygote = _zygote_for({str(k): str(v) for k, v in env.items()}) if forkable else None
        if zygote is None:
            starts["ordinary"] += 1
            super()._execute_child(*args)
            return
        fds = [
            _stdio(given["p2cread"], 0),
            _stdio(given["c2pwrite"], 1),
            _stdio(given["errwrite"], 2),
        ]
        cwd = os.path.abspath(os.fspath(given["cwd"])) if given["cwd"] is not None else os.getcwd()
        self.pid, self._conn = zygote.fork([str(a) for a in argv[1:]], cwd, env, fds)
        self.forked = True
        try:  # signals go through a pidfd: never to another process that took the pid after the zygote reaped it
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._pidfd = None  # already exited and reaped: its status is on the way
        starts["forked"] += 1
        self._close_pipe_fds(
            given["p2cread"],
            given["p2cwrite"],
            given["c2pread"],
            given["c2pwrite"],
            given["errread"],
            given["errwrite"],
        )

    def send_signal(self, sig: int) -> None:
        if not self.forked:
            super().send_signal(sig)
            return
        self.poll()
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                signal.pidfd_send_signal(self._pidfd, sig)

    def _status(self, block: bool) -> int | None:
        """The child's wait status from the zygote, or None while it runs (``block=False``)."""
        assert self._conn is not None
        self._conn.setblocking(block)
        try:
            data = _read_exactly(self._conn, 8)
        except BlockingIOError:
            return None
        finally:
            self._conn.setblocking(True)
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return int(struct.unpack("q", data)[0])

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:  # type: ignore[override]
        if not self.forked:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if not self.forked:
            return super()._try_wait(wait_flags)
        status = self._status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)


def run(
    args: list[str],
    *,
    input: bytes | str | None = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` with `Popen`."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
    retcode = process.poll()
    assert retcode is not None
    if check and retcode:
        raise subprocess.CalledProcessError(retcode, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)
