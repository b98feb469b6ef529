"""``pipekit-train launch --num-processes N PIPELINE.yaml [run arguments]``: N processes of one run on this host.

Each process is ``pipekit-train run PIPELINE.yaml [run arguments]`` with `jax.distributed`'s settings in its
environment (``PIPEKIT_COORDINATOR`` on a free localhost port, ``PIPEKIT_NUM_PROCESSES``, ``PIPEKIT_PROCESS_ID``;
`pipekit_train.scale._distributed`), and, with ``--devices-per-process K``, ``K`` virtual CPU devices each
(``XLA_FLAGS=--xla_force_host_platform_device_count=K``). The launcher

- streams every process's output line by line, each line prefixed with ``[p/N]``;
- forwards SIGINT and SIGTERM to every process once (they agree on the step to stop at, save, and exit 130 / 143);
- when one process fails or is lost (killed by a signal: SIGKILL, the out-of-memory killer), kills the others at
  once with SIGKILL (a multi-process step cannot go on without it: they would wait in a collective, or at a
  barrier of their next save, for ever; a graceful SIGTERM stop would need the lost process's agreement) and ends
  with one line naming the process, its exit code or signal and its last line of error output; the exit code is
  that process's (1 for a signal). Checkpoints commit by one rename after every process wrote its part, so the
  killed ones leave at most an uncommitted temporary directory, which resume sets aside.

It is for testing and for one machine; on a cluster, start one ``pipekit-train run`` per host with the same
variables (or ``PIPEKIT_DISTRIBUTED=auto``, JAX's cluster detection): docs/scale.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from . import _common
from ._common import EXIT_ERROR, EXIT_OK, UsageError, guarded, run_commands

__all__ = ["add_launch_commands", "main"]

_XLA_DEVICES = "--xla_force_host_platform_device_count"
#: Set in every process `launch` starts (the "continue with" hint of a stopped run names `launch` then).
LAUNCHED = "PIPEKIT_LAUNCHED"


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(base: dict[str, str], port: int, count: int, index: int, devices: int | None) -> dict[str, str]:
    """The environment of process `index` of `count`: the distributed settings and, optionally, its CPU devices."""
    from pipekit_train.scale._distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

    env = dict(base)
    env.update({COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(count), PROCESS_ID: str(index)})
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    env[LAUNCHED] = "1"
    if _common.debug_enabled():
        env["PIPEKIT_DEBUG"] = "1"
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_XLA_DEVICES)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{_XLA_DEVICES}={devices}"])
    return env


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the launcher dies (Linux), so no process outlives a killed run."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Relay(threading.Thread):
    """Copies one child's stream to ours line by line with a ``[p/N] `` prefix; keeps the last line it saw."""

    def __init__(self, source: IO[bytes], target: IO[bytes], prefix: str) -> None:
        super().__init__(daemon=True)
        self.source, self.target, self.prefix = source, target, prefix.encode()
        self.last = ""

    def run(self) -> None:
        for line in iter(self.source.readline, b""):
            text = line.rstrip(b"\n")
            if text.strip():
                self.last = text.decode(errors="replace")
            with contextlib.suppress(OSError, ValueError):
                self.target.write(self.prefix + text + b"\n")
                self.target.flush()


def launch(
    pipeline: str, run_args: Sequence[str], num_processes: int, devices: int | None, port: int | None = None
) -> int:
    """Run the N processes to the end; the exit code (see the module docstring)."""
    port = port or _free_port()
    command = [sys.executable, "-m", "pipekit_train.cli", "run", pipeline, *run_args]
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[tuple[_Relay, _Relay]] = []
    forwarded: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        forwarded.append(signum)
        for p in procs:
            with contextlib.suppress(OSError):
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(num_processes):
            proc = subprocess.Popen(
                command,
                env=child_env(dict(os.environ), port, num_processes, index, devices),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a terminal's Ctrl+C reaches the launcher only, which forwards it once
                preexec_fn=_die_with_parent,
            )
            procs.append(proc)
            prefix = f"[{index}/{num_processes}] "
            assert proc.stdout is not None and proc.stderr is not None
            pair = (_Relay(proc.stdout, sys.stdout.buffer, prefix), _Relay(proc.stderr, sys.stderr.buffer, prefix))
            for relay in pair:
                relay.start()
            relays.append(pair)
        pids = ", ".join(str(p.pid) for p in procs)
        print(
            f"pipekit-train launch: {num_processes} processes (pids {pids}), coordinator 127.0.0.1:{port}",
            file=sys.stderr,
            flush=True,
        )
        return _supervise(procs, relays, forwarded)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.kill()
            p.wait()
        for pair in relays:
            for relay in pair:
                relay.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(procs: list[subprocess.Popen[bytes]], relays: list[tuple[_Relay, _Relay]], forwarded: list[int]) -> int:
    """Wait for every process; on the first failure (not a forwarded signal's graceful stop) kill the rest."""
    count = len(procs)
    while True:
        codes = [p.poll() for p in procs]
        failed = next(
            (i for i, c in enumerate(codes) if c is not None and c != 0 and c != 128 + (forwarded or [0])[-1]), None
        )
        if failed is not None:
            code = codes[failed]
            assert code is not None
            others = [i for i, c in enumerate(codes) if c is None]
            for i in others:
                with contextlib.suppress(OSError):
                    procs[i].kill()
            for p in procs:
                p.wait()
            for relay in relays[failed]:
                relay.join(timeout=5)
            last = relays[failed][1].last or relays[failed][0].last or "(no output)"
            how = f"exited with code {code}"
            if code < 0:  # lost (SIGKILL, out of memory): the others would wait for it in a collective forever
                how = (
                    f"(pid {procs[failed].pid}) was killed by {signal.Signals(-code).name}, so the run cannot go on; "
                    "its last committed checkpoint is intact (continue with --resume auto)"
                )
            stopped = f"; stopped the other {len(others)}" if others else ""
            print(
                f"pipekit-train launch: process {failed} of {count} {how}{stopped}. Its last line: {last}",
                file=sys.stderr,
                flush=True,
            )
            return code if code > 0 else EXIT_ERROR
        if all(c is not None for c in codes):
            return int(codes[0] or 0)
        time.sleep(0.05)


def relaunch_command() -> str:
    """How this run's processes were started, for a "continue with" hint: ``run `` or ``launch --num-processes N ``."""
    from pipekit_train.scale._distributed import process_count

    count = process_count()
    if count == 1 or not os.environ.get(LAUNCHED):  # one process, or started by a cluster's own launcher
        return "run "
    import jax

    devices = f"--devices-per-process {jax.local_device_count()} " if jax.default_backend() == "cpu" else ""
    return f"launch --num-processes {count} {devices}"


def cmd_launch(args: argparse.Namespace) -> int:
    if args.num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {args.num_processes}")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise UsageError(f"--devices-per-process must be at least 1, got {args.devices_per_process}")
    if not os.path.isfile(args.pipeline):
        raise UsageError(f"pipeline file {args.pipeline} does not exist")
    run_args = list(args.run_args)
    if run_args[:1] == ["--"]:
        run_args = run_args[1:]
    code = launch(args.pipeline, run_args, args.num_processes, args.devices_per_process, args.port)
    return code if code else EXIT_OK


def add_launch_commands(subparsers: Any) -> None:
    """Add ``launch`` to a CLI's subparsers."""
    p = subparsers.add_parser(
        "launch",
        help="train with N processes on this host (jax.distributed)",
        description=(
            "Start N processes of 'pipekit-train run PIPELINE.yaml [run arguments]' on this host, connected with "
            "jax.distributed (a localhost coordinator). Output lines are prefixed [process/N]; SIGINT and SIGTERM "
            "are forwarded; if a process fails the others are stopped."
        ),
    )
    p.add_argument("--num-processes", type=int, required=True, metavar="N", help="how many processes")
    p.add_argument(
        "--devices-per-process",
        type=int,
        metavar="K",
        help="virtual CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count=K)",
    )
    p.add_argument("--port", type=int, help="the coordinator's localhost port (default: a free one)")
    p.add_argument("pipeline", metavar="PIPELINE.yaml")
    p.add_argument("run_args", nargs=argparse.REMAINDER, metavar="...", help="arguments of pipekit-train run")
    p.set_defaults(func=guarded("launch", cmd_launch))


def main(argv: Sequence[str] | None = None) -> int:
    return run_commands(add_launch_commands, argv)
