"""The tests' forked training processes (`tests/_forked.py`) behave as the fresh processes they stand for: their own
process, arguments, working directory, environment and streams, exit status (a signal's included), interpreter
shutdown and tracebacks; and anything a fork cannot stand for is started the ordinary way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from tests import _forked

pytestmark = pytest.mark.xdist_group("forked")  # one worker: one zygote for the module

CHILD = """\
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PIPEKIT_PROBE"), flush=True)
print("fds", sorted(int(f) for f in os.listdir("/proc/self/fd") if int(f) > 2), file=sys.stderr, flush=True)
print("jax loaded", "jax" in sys.modules, "pid", os.getpid(), "parent", os.getppid(), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_child_is_its_own_process_with_the_requested_arguments_directory_environment_and_streams(tmp_path):
    env = {**os.environ, "PIPEKIT_PROBE": "seen"}
    out = _forked.run([sys.executable, "-c", CHILD, "3", "x"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 3, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["argv"] == f"['3', 'x'] cwd {tmp_path} env seen"
    # JAX came with the fork (what saves the import), the child is neither this process nor the zygote
    loaded, _, pid, _, parent = lines["jax"].split()[1:]
    assert loaded == "True" and int(pid) not in (os.getpid(), int(parent)) and int(parent) != os.getpid()
    # the interpreter's own shutdown: atexit and non-daemon threads, as a fresh process's; only 0, 1, 2 inherited
    assert lines["atexit"] == "ran" and lines["thread"] == "joined"
    fds = [line for line in out.stderr.splitlines() if line.startswith("fds ")]
    assert fds == ["fds [3]"], out.stderr  # 3: the listing's own directory


def test_a_module_runs_as_main_from_the_working_directory_and_a_failure_shows_only_its_own_frames(tmp_path):
    (tmp_path / "mine.py").write_text("import sys\nprint(__name__, sys.argv)\nraise ValueError('from mine')\n")
    out = _forked.run([sys.executable, "-m", "mine", "a"], cwd=tmp_path, capture_output=True, text=True)
    fresh = subprocess.run([sys.executable, "-m", "mine", "a"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == fresh.returncode == 1
    assert out.stdout == fresh.stdout == f"__main__ ['{tmp_path / 'mine.py'}', 'a']\n"
    assert out.stderr == fresh.stderr and out.stderr.count("File ") == 3, out.stderr  # runpy's two and mine's


def test_signals_reach_the_child_and_its_death_is_the_returncode(tmp_path):
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
        proc = _forked.Popen(
            [sys.executable, "-c", "import time\nprint('up', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE
        )
        assert proc.forked and proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert proc.poll() is None
        try:
            proc.wait(timeout=0.05)
            raise AssertionError("the child ended by itself")
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig  # SIGINT too: an unhandled KeyboardInterrupt exits by the signal
        proc.stdout.close()


def test_what_a_fork_cannot_stand_for_is_started_the_ordinary_way(tmp_path):
    before = dict(_forked.starts)
    code = [sys.executable, "-c", "import sys; print('jax' in sys.modules)"]
    other_env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # a sitecustomize there would act at start-up
    for kwargs in ({"env": other_env}, {"start_new_session": True}, {"umask": 0o022}):
        proc = _forked.Popen(code, stdout=subprocess.PIPE, **kwargs)  # type: ignore[arg-type]
        assert not proc.forked and proc.communicate()[0] == b"False\n" and proc.returncode == 0
    unbuffered = _forked.Popen([sys.executable, "-u", "-c", "pass"])
    assert not unbuffered.forked and unbuffered.wait() == 0
    assert _forked.starts["ordinary"] - before["ordinary"] == 4


def test_many_children_at_once_each_get_their_own_status():
    procs = [_forked.Popen([sys.executable, "-c", f"import sys; sys.exit({n})"]) for n in range(6)]
    assert all(p.forked for p in procs)
    assert [p.wait(timeout=60) for p in reversed(procs)] == list(reversed(range(6)))


def test_a_child_starts_its_own_backend():
    """The zygote imported JAX without starting a backend (it refuses to serve otherwise: a fork of a process with
    XLA's threads running could deadlock), so each child starts its own, as a fresh process does."""
    code = "import jax; print(jax.devices()[0].platform, jax.numpy.arange(4.0).sum())"
    out = _forked.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "cpu 6.0\n"


def test_a_change_of_the_test_process_environment_replaces_the_zygote_and_the_old_one_answers_its_children(
    monkeypatch,
):
    running = _forked.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    assert running.forked
    monkeypatch.setenv("SOME_LIBRARY_SETTING", "set by an import")  # for the rest of the run, say
    forked = _forked.starts["forked"]
    seen = _forked.run(
        [sys.executable, "-c", "import os; print(os.environ['SOME_LIBRARY_SETTING'])"], capture_output=True
    )
    assert seen.stdout == b"set by an import\n" and seen.returncode == 0
    assert _forked.starts["forked"] == forked + 1 and _forked._zygote is not None
    assert _forked._zygote.env["SOME_LIBRARY_SETTING"] == "set by an import"
    assert running.wait(timeout=60) == 0  # from the zygote it was forked from, which has stopped taking requests


def test_children_draw_their_own_global_random_numbers_as_fresh_processes_do():
    code = "import random, numpy; print(random.random(), numpy.random.random())"
    draws = [_forked.run([sys.executable, "-c", code], capture_output=True, check=True).stdout for _ in range(2)]
    first, second = (d.split() for d in draws)
    assert first[0] != second[0] and first[1] != second[1], draws
