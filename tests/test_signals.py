"""SIGINT / SIGTERM outside training (`pipekit_train._signals`): real processes get real signals at named points of
start-up (``$PIPEKIT_TEST_SIGNAL_AT``, the process signals itself there) and must print one line, exit 130 / 143,
never train, and leave nothing that blocks running the same command again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("signals")

STAGE = """\
- type: TrainingLoop
  name: {name}
  model_op: {{type: EquinoxModel, factory: mlp, kwargs: {{in_size: 4, out_size: 1, width_size: 8, depth: 1}}}}
  dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: data.npz}}}}
  loss: {{type: MSE}}
  optimizer_config: {{name: adam, lr: 1e-2}}
  max_steps: 4
  batch_size: 8
  progress: false
"""


def _workspace(tmp_path: Path, *stages: str) -> Path:
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    text = "pipekit: 1\ntype: Sequential\nstages:\n" + "".join(STAGE.format(name=s) for s in stages)
    (tmp_path / "pipe.yaml").write_text(text)
    return tmp_path


_XLA_CACHE: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _xla_cache(xla_cache_env: dict[str, str]) -> None:
    """The processes share the run's persistent compilation cache (tests/conftest.py): one compiles, the rest load."""
    _XLA_CACHE.update(xla_cache_env)


def _run(work: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipekit_train.cli", "run", "pipe.yaml", "--run-dir", "runs/exp", "--no-store"]
    return subprocess.run(
        [*command, *extra],
        cwd=work,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **_XLA_CACHE, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "where",
    ["loaded:SIGINT", "preflight:SIGTERM", "built:SIGINT", "started:SIGTERM"],
    ids=["after-loading", "pre-flight-importing-jax", "after-building", "after-backend-start"],
)
def test_a_signal_during_start_up_is_one_line_and_128_plus_the_signal(tmp_path: Path, where: str):
    work = _workspace(tmp_path, "fit")
    out = _run(work, {"PIPEKIT_TEST_SIGNAL_AT": where})
    signum = getattr(signal, where.split(":")[1])
    assert out.returncode == 128 + signum, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"pipekit-train: stopped by {signal.Signals(signum).name} before training; nothing was")
    assert "Traceback" not in out.stderr and "step" not in out.stdout  # nothing trained, no summary
    assert not (work / "runs" / "exp").exists()  # a run directory it began and kept nothing in is removed
    if where.startswith("started"):  # the directory existed and was locked: the same command runs again
        again = _run(work, {})
        assert again.returncode == 0, again.stderr
        assert json.loads((work / "runs" / "exp" / "fit" / "final.json").read_text())["step"] == 4


def test_a_signal_before_the_second_stage_keeps_the_first_and_resume_continues(tmp_path: Path):
    work = _workspace(tmp_path, "pre", "fit")
    out = _run(work, {"PIPEKIT_TEST_SIGNAL_AT": "started:SIGINT:2"})  # the second stage's start: the first finished
    assert out.returncode == 130, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "what finished is kept in" in lines[0] and "--resume auto" in lines[0], out.stderr
    assert (work / "runs" / "exp" / "pre" / "final.json").is_file()
    assert not (work / "runs" / "exp" / "fit" / "final.json").exists()
    again = _run(work, {}, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert json.loads((work / "runs" / "exp" / "fit" / "final.json").read_text())["step"] == 4


WATCHED = """
import os, signal, sys, time
from pipekit_train._signals import stop_on_signals
with stop_on_signals():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the main thread never sees it: as inside XLA
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_signal_while_the_main_thread_is_inside_native_code_still_ends_the_process(tmp_path: Path):
    """The watcher thread ends the process when the main thread cannot run the handler (a long compile)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHED], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # the main thread sleeps 600 s: only the watcher can end it in time
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        "pipekit-train: stopped by SIGINT before training; nothing was kept: the same command runs again"
    ]


#: The console script pip writes for ``pipekit-train = "pipekit_train.cli:main"`` (its template, word for word).
CONSOLE_SCRIPT = """\
#!{python}
import sys
from pipekit_train.cli import main
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
"""

#: ``sitecustomize`` for the command's process (Python imports it at start-up): it signals the process itself
#: (``MODULE:SIGNAL`` in ``$SIGNAL_AT_IMPORT``) when the import of MODULE begins: a signal at an exact instant of
#: start-up, however fast the machine.
AT_IMPORT = """
import atexit, os, sys
module, name = os.environ["SIGNAL_AT_IMPORT"].split(":")
signum = {"SIGINT": 2, "SIGTERM": 15}[name]
sent = []
def hook(event, args):
    if event == "import" and args[0] == module and not sent:
        sent.append(True)
        os.kill(os.getpid(), signum)
sys.addaudithook(hook)
if module == "atexit":  # the last exit handler: the interpreter is ending, after the command returned
    atexit.register(os.kill, os.getpid(), signum)
"""

#: Modules the command imports on its way to `main`, in order: from the first thing ``import pipekit_train`` imports
#: after `_signals` (the first line of the console script, ``from pipekit_train.cli import main``, starts there) to
#: the last command module; then `main` parses and runs (`phase("loaded")` is the next named point). An import's
#: audit event comes before its parent package is imported: the event of ``pipekit_train.cli`` (or of
#: ``pipekit_train._signals``) is earlier than any code of the package, Python's own start-up.
EARLY = ("pipekit_train._lazy", "pipekit_train.cli._main", "argparse", "pipekit_train.cli._sweep")


def _command(
    work: Path, at: str, *argv: str, ignore_sigint: bool = False, env: dict[str, str] | None = None, how: str = "script"
) -> subprocess.CompletedProcess[str]:
    """``pipekit-train ARGV`` in `work`, started as the console script pip writes (``how="script"``) or as ``python -m
    pipekit_train.cli``, signalled at the import `at` names (`AT_IMPORT`)."""
    script = work / "pipekit-train"
    script.write_text(CONSOLE_SCRIPT.format(python=sys.executable))
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(AT_IMPORT)
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])

    start = [str(script)] if how == "script" else ["-m", "pipekit_train.cli"]
    command = [sys.executable, *start, *argv]
    if ignore_sigint:  # as a shell does for a background job when job control is off (``cmd &`` in a script)
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    return subprocess.run(
        command,
        cwd=work,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "SIGNAL_AT_IMPORT": at, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


#: Each early point once, each signal and each way of starting the command at two of them (a process per case: the
#: points are where the handlers must already be installed, whichever signal and start-up reach them).
FIRST_INSTANTS = [
    (EARLY[0], "SIGINT", "script"),
    (EARLY[1], "SIGTERM", "-m"),
    (EARLY[2], "SIGTERM", "script"),
    (EARLY[3], "SIGINT", "-m"),
]


@pytest.mark.parametrize(("module", "sig", "how"), FIRST_INSTANTS)
def test_a_signal_in_the_first_instants_of_the_command_is_one_line_and_128_plus_the_signal(tmp_path, module, sig, how):
    """From the console script's first line on, before `main` runs: no traceback, no silent death by the signal."""
    work = _workspace(tmp_path, "fit")
    out = _command(work, f"{module}:{sig}", "run", "pipe.yaml", "--run-dir", "runs/exp", "--no-store", how=how)
    assert out.returncode == 128 + getattr(signal, sig), (how, out.returncode, out.stderr)
    assert out.stderr.splitlines() == [
        f"pipekit-train: stopped by {sig} before training; nothing was kept: the same command runs again"
    ]
    assert out.stdout == "" and not (work / "runs").exists()  # nothing left behind


def test_a_signal_while_the_command_exits_says_it_had_finished(tmp_path):
    work = _workspace(tmp_path, "fit")
    out = _command(work, "atexit:SIGTERM", "run", "pipe.yaml", "--print-config")
    assert out.returncode == 143 and "type: TrainingLoop" in out.stdout, out.stderr
    assert out.stderr.splitlines() == [
        "pipekit-train: stopped by SIGTERM while exiting; the command had finished (exit code 0)"
    ]


def test_an_inherited_ignored_sigint_stays_ignored(tmp_path):
    """A background job of a non-interactive shell starts with SIGINT ignored: the command keeps it so while it
    starts and runs its command (SIGTERM still stops it)."""
    work = _workspace(tmp_path, "fit")
    argv = ("run", "pipe.yaml", "--print-config")  # loads the pipeline (``phase("loaded")``), prints it, exit 0
    loaded = {"PIPEKIT_TEST_SIGNAL_AT": "loaded:SIGINT"}  # inside the command's `stop_on_signals`
    for how, module in (("script", "pipekit_train._lazy"), ("-m", "argparse")):
        out = _command(work, f"{module}:SIGINT", *argv, ignore_sigint=True, env=loaded, how=how)
        assert out.returncode == 0 and out.stderr == "" and "type: TrainingLoop" in out.stdout, (how, out.stderr)
    out = _command(work, "argparse:SIGTERM", *argv, ignore_sigint=True)
    assert out.returncode == 143 and len(out.stderr.splitlines()) == 1, out.stderr
    out = _command(work, "argparse:SIGINT", *argv, env=loaded)
    assert out.returncode == 130, out.stderr  # not ignored: it stops the command


#: Named like the console script, so that Python started on it is the command: its handlers are installed by
#: ``import pipekit_train``; a worker it spawns (which imports this file again, with the parent's ``sys.argv``) is
#: not the command and keeps Python's own.
SPAWNS = """
import signal
import pipekit_train

def handler():
    h = signal.getsignal(signal.SIGTERM)
    return "default" if h == signal.SIG_DFL else getattr(h, "__name__", repr(h))

if __name__ == "__main__":
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(handler(), pool.apply(handler))
"""


def test_only_the_command_itself_installs_its_handlers_at_import(tmp_path):
    script = tmp_path / "pipekit-train"
    script.write_text(SPAWNS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.stdout.split() == ["_handler", "default"], out.stderr
    library = "import sys; sys.argv[0] = 'pipekit-train'; import pipekit_train, signal; print(signal.getsignal(15)==0)"
    out = subprocess.run([sys.executable, "-c", library], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr  # imported by a program, not the command: SIG_DFL
