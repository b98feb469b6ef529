"""Shared test setup: JAX on CPU, quiet progress, runs written under a temporary directory, and nothing read from
what the machine's other users, the developer's shell or home directory hold (`_private_machine_state`)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
from typing import Any, ClassVar

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Environment variables the code under test (or a library it drives) reads, which a developer's shell, a CI job or
#: a git hook may set: each would change what a test sees (a $PIPEKIT_IMPORT, $MLFLOW_TRACKING_URI or $RAY_ADDRESS
#: pointing elsewhere, $JAX_ENABLE_X64 or $XLA_FLAGS changing numbers or devices, a $GIT_DIR or $GIT_INDEX_FILE of
#: the hook's repository). Removed for the whole run, before JAX is imported; a test that needs one sets it.
_FROM_THE_SHELL = ("PIPEKIT_", "MLFLOW_", "RAY_", "JAX_", "XLA_", "GIT_", "KERAS_", "MPL", "MATPLOTLIB")
#: What makes JAX keep every compiled program in ``$JAX_COMPILATION_CACHE_DIR`` (however fast it compiled), and the
#: variable that hands the run's cache directory to the xdist workers (`_private_machine_state`).
XLA_CACHE = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
_XLA_CACHE_FROM = "PYTEST_PIPEKIT_XLA_CACHE"


def _private_machine_state() -> None:
    """Clear `_FROM_THE_SHELL` (but ``JAX_PLATFORMS``) and point what libraries read from shared places at one
    private directory per test process: Ray's temporary directory (``/tmp/ray/ray_current_cluster``, left by any
    Ray user of the machine, names a cluster ``ray.init`` would join; short, for Ray's socket paths), Keras' and
    Matplotlib's configuration (``~/.keras/keras.json``, ``~/.config/matplotlib``), git's global and system
    configuration (``~/.gitconfig``: a ``commit.gpgsign`` there breaks the tests' commits), and Ray's token file
    (``~/.ray``: ``RAY_AUTH_MODE=disabled``). Subprocesses inherit all of it.

    And one persistent XLA compilation cache for the whole run (`XLA_CACHE`), made by the process pytest was started
    in and handed to its xdist workers: the same program (a model's initial weights, a step of one structure, an
    evaluation) compiles once per run instead of once per test and per training subprocess. A loaded program is the
    compiled one, bit for bit, so no result changes; a load is still a backend compile to `jax.monitoring` (JAX
    times ``compile_or_get_cached`` as one), so the tests that count compiles count the same. Removed with the
    private directory of the process that made it, which outlives its workers."""
    handed_down = os.environ.get(_XLA_CACHE_FROM) if os.environ.get("PYTEST_XDIST_WORKER") else None
    for name in list(os.environ):
        if name.startswith(_FROM_THE_SHELL) and name != "JAX_PLATFORMS":
            del os.environ[name]
    private = tempfile.mkdtemp(prefix="pk-")
    atexit.register(shutil.rmtree, private, True)
    for sub in ("ray", "keras", "matplotlib"):
        os.mkdir(os.path.join(private, sub))
    cache = handed_down if handed_down and os.path.isdir(handed_down) else os.path.join(private, "xla-cache")
    os.makedirs(cache, exist_ok=True)
    os.environ.update(
        RAY_TMPDIR=os.path.join(private, "ray"),
        RAY_AUTH_MODE="disabled",
        KERAS_HOME=os.path.join(private, "keras"),
        MPLCONFIGDIR=os.path.join(private, "matplotlib"),
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        **{_XLA_CACHE_FROM: cache},
        **XLA_CACHE,
        JAX_COMPILATION_CACHE_DIR=cache,
    )


_private_machine_state()

# A test run started in the background of a non-interactive shell (``make test &``, nohup, some CI runners) inherits
# SIGINT ignored, and so would every process a test starts: the tests of what SIGINT does (and of an inherited
# ignored SIGINT, which sets it so itself) need Python's own handling, as an interactive run has.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_run_dirs(tmp_path, monkeypatch):
    """Each test writes runs, artifact stores and model registries under its own tmp dir."""
    monkeypatch.setenv("PIPEKIT_ARTIFACT_STORE", str(tmp_path / "store" / "artifacts.sqlite"))
    monkeypatch.setenv("PIPEKIT_MODEL_REGISTRY", str(tmp_path / "models"))
    # `LogToExperiment` sets it for the process (MLflow's file store needs it): undone after each test, so it never
    # reaches the next one (tests/test_machine_state.py checks what the tests' processes see).
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture(scope="session")
def xla_cache_env() -> dict[str, str]:
    """The environment variables of the run's persistent XLA compilation cache (`_private_machine_state`), for a
    test that builds a subprocess's environment from scratch: the training processes the tests start (kill and
    resume, the CLI, several processes or devices) then load what this run compiled before instead of compiling it
    again, which is most of a small process's CPU time."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"], **XLA_CACHE}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Make ``--dist loadgroup`` honour ``xdist_group`` marks again.

    pytest-xdist 3.8 groups tests by appending ``@<group>`` to ``item._nodeid``, which pytest 9.2 no longer reads
    (a node's id lives in ``item._id``), so every ``xdist_group`` mark was silently ignored and the module fixtures
    of a group were built once per worker. This does what xdist means to; it is a no-op when xdist already did it or
    when tests run without ``--dist loadgroup``.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        if not hasattr(item, "_id"):
            continue
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture
def interrupted_and_resumed(tmp_path):
    """``run(loop, crash_at) -> (reference, resumed)`` trained models: `loop` run uninterrupted in ``tmp_path/ref``;
    then in ``tmp_path/cut`` with a callback that raises at step `crash_at` (after the checkpoints `loop` writes
    before it), and once more there with ``resume="auto"``. For "a resumed run is bitwise the uninterrupted one"."""
    from pipekit_train import run_settings
    from pipekit_train.callbacks import Callback

    class CrashAt(Callback, register=False):
        armed: ClassVar[list[bool]] = [False]

        def fingerprint(self) -> None:  # not part of what a resume must match
            return None

        def on_step_end(self, ctx, metrics):
            if self.armed[0] and ctx.step == crash_step[0]:
                raise RuntimeError("crash")

    crash_step = [0]

    def run(loop, crash_at):
        crash_step[0] = crash_at
        loop = loop.replace(callbacks=(*loop.callbacks, CrashAt()))
        with run_settings(run_dir=str(tmp_path / "ref"), store=False):
            reference, _ = loop.run()
        CrashAt.armed[0] = True
        with run_settings(run_dir=str(tmp_path / "cut"), store=False), pytest.raises(RuntimeError, match="crash"):
            loop.run()
        CrashAt.armed[0] = False
        with run_settings(run_dir=str(tmp_path / "cut"), store=False, resume="auto"):
            resumed, _ = loop.run()
        return reference, resumed

    return run
