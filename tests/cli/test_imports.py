"""``--import MODULE`` and ``$PIPEKIT_IMPORT``: user modules imported before the pipeline is read, recorded in the
artifact, imported again by ``reproduce``; a module that cannot be imported is one line naming it and the reason.

Every command runs as a real ``pipekit-train`` process; the user module lives in the test's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

USER_MODULE = '''\
"""A user's module: a loss and a callback that pipeline files name by type."""

import jax.numpy as jnp

import pipekit_train


class Huber(pipekit_train.Loss):
    delta: float = 1.0

    def __call__(self, predicted, target):
        err = jnp.abs(predicted - target)
        quad = jnp.minimum(err, self.delta)
        return jnp.mean(0.5 * quad**2 + self.delta * (err - quad))


class CountSteps(pipekit_train.Callback):
    out: str = "steps.txt"

    def initial_state(self):
        return {"steps": 0}

    def on_step_end(self, ctx, metrics):
        ctx.state_of(self)["steps"] += 1

    def on_train_end(self, ctx):
        with open(self.out, "w") as f:
            f.write(str(ctx.state_of(self)["steps"]))
'''

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
loss: {type: Huber, delta: 0.5}
callbacks: [{type: CountSteps, out: steps.txt}]
optimizer_config: {name: adam, lr: 1e-2}
max_steps: 20
batch_size: 8
progress: false
"""


#: The installed console script, as users run it (``python -m`` would put the working directory on sys.path).
_SCRIPT = Path(sys.executable).with_name("pipekit-train")
COMMAND = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "pipekit_train.cli"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory with the user module (in ``mods/``, not the working directory), data and a pipeline file."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "user_mod.py").write_text(USER_MODULE)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text(PIPELINE)
    return tmp_path


def _cli(cwd: Path, *args: str, pythonpath: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "JAX_PLATFORMS": "cpu", **_XLA_CACHE, **env}
    full.pop("PYTHONPATH", None)
    if "PIPEKIT_IMPORT" not in env:
        full.pop("PIPEKIT_IMPORT", None)
    if pythonpath is not None:
        full["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [*COMMAND, *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


_XLA_CACHE: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _xla_cache(xla_cache_env: dict[str, str]) -> None:
    """The processes share the run's persistent compilation cache (tests/conftest.py): one compiles, the rest load."""
    _XLA_CACHE.update(xla_cache_env)


def _one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_run_with_import_trains_with_the_user_loss_and_callback_and_records_the_module(project: Path):
    mods = project / "mods"
    args = ["run", "pipe.yaml", "--import", "user_mod", "--store", "s.sqlite", "--run-dir", "R"]
    out = _cli(project, *args, pythonpath=mods)
    assert out.returncode == 0, out.stderr
    assert (project / "steps.txt").read_text() == "20"  # the user's callback ran at every step
    from pipekit_train.provenance._store import ArtifactStore

    [artifact] = ArtifactStore(project / "s.sqlite").query()
    digest = hashlib.sha256((mods / "user_mod.py").read_bytes()).hexdigest()
    expected = {"module": "user_mod", "file": str(mods / "user_mod.py"), "sha256": digest}
    assert artifact.imports == (expected,)
    assert "type: Huber" in artifact.training_pipeline_yaml and "delta: 0.5" in artifact.training_pipeline_yaml
    assert json.loads((project / "R" / "fit" / "artifact.json").read_text())["imports"] == [expected]
    show = _cli(project, "artifacts", "show", artifact.artifact_id[:10], "--store", "s.sqlite")
    assert show.returncode == 0, show.stderr
    assert f"imports    user_mod  {mods / 'user_mod.py'}  sha256 {digest}\n" in show.stdout
    query = _cli(project, "artifacts", "query", "--imported", "user_mod", "--store", "s.sqlite", "--json")
    assert [a["artifact_id"] for a in json.loads(query.stdout)] == [artifact.artifact_id]

    # reproduce imports the recorded module again, found this time in the working directory (no PYTHONPATH), and
    # says when the file is not the one that was recorded
    (project / "user_mod.py").write_text(USER_MODULE + "# edited\n")
    again = _cli(project, "reproduce", artifact.artifact_id, "--store", "s.sqlite", "--run-dir", "R2")
    assert again.returncode == 0, again.stderr
    assert "re-imported the recorded module(s) user_mod before rebuilding the pipeline" in again.stdout
    now = hashlib.sha256((project / "user_mod.py").read_bytes()).hexdigest()
    assert f"module 'user_mod' is not the recorded one: {project / 'user_mod.py'} has sha256 {now}" in again.stderr
    [newest, _] = ArtifactStore(project / "s.sqlite").query()
    assert newest.imports == ({"module": "user_mod", "file": str(project / "user_mod.py"), "sha256": now},)


def test_validate_needs_the_module_and_finds_it_through_either_way_of_naming_it(project: Path):
    mods = project / "mods"
    without = _cli(project, "validate", "pipe.yaml", pythonpath=mods)
    assert without.returncode == 2
    line = _one_error_line(without)
    assert "pipe.yaml:6:" in line and "unknown operator type 'Huber'" in line
    assert line.endswith("import it first with --import MODULE or $PIPEKIT_IMPORT")
    for args, env in [
        (["--import", "user_mod"], {}),
        ([], {"PIPEKIT_IMPORT": " user_mod ,"}),
        (["--import", "user_mod", "--import", "json"], {"PIPEKIT_IMPORT": "user_mod"}),
    ]:
        out = _cli(project, "validate", "pipe.yaml", *args, pythonpath=mods, **env)
        assert out.returncode == 0, (args, env, out.stderr)
        assert "pipe.yaml: ok (1 training stage, 20 steps in all)" in out.stdout


NOT_FOUND = "on PYTHONPATH, among the installed packages or in the working directory {cwd}"
CASES = {
    "missing": (
        None,
        ["--import", "no_such_mod"],
        {},
        "--import no_such_mod: cannot import module 'no_such_mod': no module named 'no_such_mod' " + NOT_FOUND,
    ),
    "missing-from-env": (
        None,
        [],
        {"PIPEKIT_IMPORT": "user_mod,no_such_mod"},
        "$PIPEKIT_IMPORT no_such_mod: cannot import module 'no_such_mod': no module named 'no_such_mod' " + NOT_FOUND,
    ),
    "raises": (
        "import pipekit_train\nratio = 1 / 0\n",
        ["--import", "bad_mod"],
        {},
        "--import bad_mod: importing module 'bad_mod' failed: ZeroDivisionError: division by zero "
        "(at {mods}/bad_mod.py:2)",
    ),
    "imports-a-missing-package": (
        "import not_installed_pkg\n",
        ["--import", "bad_mod"],
        {},
        "--import bad_mod: importing module 'bad_mod' failed: ModuleNotFoundError: No module named "
        "'not_installed_pkg' (at {mods}/bad_mod.py:1)",
    ),
    "syntax-error": (
        "def broken(:\n",
        ["--import", "bad_mod"],
        {},
        "--import bad_mod: importing module 'bad_mod' failed: SyntaxError: invalid syntax (at {mods}/bad_mod.py:1)",
    ),
    "a-path": (
        None,
        ["--import", "mods/user_mod.py"],
        {},
        "--import expects a module name such as my_models (found on PYTHONPATH or in the working directory), not a "
        "file path; got 'mods/user_mod.py'",
    ),
    "bad-name": (
        None,
        ["--import", "user-mod"],
        {},
        "--import expects a dotted module name (letters, digits, '_' and '.'), got 'user-mod'",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_module_that_cannot_be_imported_is_one_line_naming_it_and_why(project: Path, case: str):
    module_text, args, env, message = CASES[case]
    mods = project / "mods"
    if module_text is not None:
        (mods / "bad_mod.py").write_text(module_text)
    out = _cli(project, "validate", "pipe.yaml", *args, pythonpath=mods, **env)
    assert out.returncode == 2
    assert _one_error_line(out) == "pipekit-train: error: " + message.format(cwd=project, mods=mods)
    assert out.stdout == ""


REGISTERING_MODULE = '''\
"""A user's module that registers a model factory, a dataset and a backend by name."""

import equinox as eqx
import numpy as np

import pipekit_train


@pipekit_train.register_model("user_linear")
def user_linear(key, in_size: int, out_size: int = 1):
    return eqx.nn.Linear(in_size, out_size, key=key)


@pipekit_train.register_dataset("user_sums")
def user_sums(n: int = 32):
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x.sum(axis=1, keepdims=True)}


pipekit_train.register_backend("user-equinox", "pipekit_train.adapters.equinox")
'''

REGISTERED_PIPELINE = """\
pipekit: 1
type: TrainingLoop
model_op: {type: EquinoxModel, factory: user_linear, kwargs: {in_size: 3}}
dataset: {type: TrainingDataset, source: {type: RegisteredSource, name: user_sums, kwargs: {n: 24}}}
loss: {type: MSE}
max_steps: 5
batch_size: 8
"""


def test_imported_model_dataset_and_backend_registrations_are_known_to_the_file(tmp_path: Path):
    (tmp_path / "registering.py").write_text(REGISTERING_MODULE)
    (tmp_path / "reg.yaml").write_text(REGISTERED_PIPELINE)
    out = _cli(tmp_path, "validate", "reg.yaml", "--import", "registering")  # found in the working directory
    assert out.returncode == 0, out.stderr
    assert "reg.yaml: ok (1 training stage, 5 steps in all)" in out.stdout
    without = _cli(tmp_path, "validate", "reg.yaml")
    assert without.returncode == 2 and "'user_linear'" in _one_error_line(without)
    # the backend name is known once the module registered it: the check moves on to whether the model fits it
    known = _cli(tmp_path, "validate", "reg.yaml", "--set", "backend=user-equinox", "--import", "registering")
    assert known.returncode == 2
    line = _one_error_line(known)
    assert "not a registered backend" not in line and "TrainingLoop.backend is 'user-equinox'" in line
