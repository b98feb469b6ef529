"""What start-up imports: ``import pipekit_train`` and the inspection commands never load JAX or its libraries.

The commands run in fresh processes against a real artifact store and a real run directory with checkpoints
(made once, by training a tiny two-stage pipeline in an earlier process), and each process then lists the modules
it imported. The inspection commands share one process, the pipelines with a mistake another (`CHECK_MANY`): what
a process imported stays imported, so a command that loaded JAX is seen in its own report and every later one.
Counted, never timed: the start-up times are measured and reported in ``docs/performance.md``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pipekit_train

pytestmark = pytest.mark.xdist_group("cli-startup")  # one worker (--dist loadgroup): the module fixture is built once

HEAVY = ("jax", "jaxlib", "equinox", "optax", "grain", "orbax")

#: Runs ``pipekit-train ARGS`` in-process, then reports on stderr which heavy packages got imported.
CHECK = f"""
import sys
from pipekit_train.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # --help and --version leave through argparse
    rc = e.code
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
print('HEAVY', heavy, file=sys.stderr)
sys.exit(rc)
"""

#: Runs several ``pipekit-train`` commands, one after the other, in one fresh process (a JSON list of ``[cwd, env,
#: argv]`` as its argument) and prints, for each, its exit code, stdout, stderr and the heavy packages imported so
#: far. The set only grows: a command that imported JAX shows it in its own report and every later one, so when
#: every report is empty, no command imported any (as in a fresh process each: imports are never undone).
CHECK_MANY = f"""
import contextlib, io, json, os, sys
from pipekit_train.cli import main
reports = []
for cwd, env, argv in json.loads(sys.argv[1]):
    os.chdir(cwd)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
    reports.append([rc, out.getvalue(), err.getvalue(), heavy])
print(json.dumps(reports))
"""

PIPELINE = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: pre
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 10
  batch_size: 8
  progress: false
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  val_dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: false}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 20
  batch_size: 8
  eval_every_n_steps: 10
  progress: false
  callbacks: [{type: Checkpoint, every_n_steps: 10, async_save: false}]
"""


_XLA_CACHE: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _xla_cache(xla_cache_env: dict[str, str]) -> None:
    """The processes that do load JAX (the training run, `average`, `validate` of a good pipeline) share the run's
    persistent compilation cache (tests/conftest.py); a variable in the environment imports nothing."""
    _XLA_CACHE.update(xla_cache_env)


def _env(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PIPEKIT_ARTIFACT_STORE": str(root / "default-store.sqlite"),
        "PIPEKIT_MODEL_REGISTRY": str(root / "models"),
        **_XLA_CACHE,
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, xla_cache_env: dict[str, str]) -> dict[str, str]:
    """A store holding the artifacts of a real two-stage run, and that run's directory with checkpoints."""
    root = tmp_path_factory.mktemp("startup")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (root / "pipe.yaml").write_text(PIPELINE)
    run = ["run", "pipe.yaml", "--store", "store.sqlite", "--run-dir", "runs/exp"]
    out = subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli", *run],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    from pipekit_train.provenance._store import ArtifactStore

    by_stage = {a.stage: a.artifact_id for a in ArtifactStore(root / "store.sqlite").query()}
    assert sorted(by_stage) == ["fit", "pre"]
    assert (root / "runs" / "exp" / "fit" / "checkpoints" / "manifest.json").is_file()
    return {"root": str(root), "store": str(root / "store.sqlite"), **by_stage}


def _check(root: str, *argv: str) -> tuple[int, str, list[str]]:
    """Run ``pipekit-train ARGV`` in a fresh process: (exit code, stdout, the heavy packages it imported)."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK, *argv],
        cwd=root,
        env=_env(Path(root)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert last.startswith("HEAVY "), out.stderr
    return out.returncode, out.stdout, ast.literal_eval(last[len("HEAVY ") :])


def _check_many(commands: list[tuple[str, list[str]]]) -> list[tuple[int, str, str, list[str]]]:
    """Run ``pipekit-train ARGV`` for each ``(cwd, argv)`` of `commands`, in order, in ONE fresh process (the
    environment of `_env` for each cwd): (exit code, stdout, stderr, the heavy packages imported so far) for each."""
    plan = [
        [cwd, {k: v for k, v in _env(Path(cwd)).items() if k.startswith("PIPEKIT_")}, argv] for cwd, argv in commands
    ]
    out = subprocess.run(
        [sys.executable, "-c", CHECK_MANY, json.dumps(plan)],
        cwd=commands[0][0],
        env=_env(Path(commands[0][0])),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


def test_import_pipekit_train_imports_no_jax():
    code = (
        f"import sys, pipekit_train; heavy = set({HEAVY!r}); assert pipekit_train.__version__; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_checker_sees_jax_when_a_command_loads_it(recorded):
    """The check can fail: `average` restores checkpoints, so it does load JAX."""
    rc, out, heavy = _check(recorded["root"], "average", "runs/exp", "--last", "2", "-o", "avg")
    assert rc == 0, out
    assert "jax" in heavy


def test_version_prints_the_package_version(recorded):
    rc, out, heavy = _check(recorded["root"], "--version")
    assert (rc, out, heavy) == (0, f"pipekit-train {pipekit_train.__version__}\n", [])
    assert pipekit_train.__version__ == "0.1.0"


def _case(command: str, *expected: str) -> object:
    return pytest.param(command.split(), list(expected), id=command.split(" --store")[0])


INSPECTION = [
    _case("--help", "run PIPELINE.yaml", "artifacts list", "--version", "--import MODULE"),
    _case("run --help", "--import MODULE", "--store PATH"),
    _case("validate --help", "--import MODULE"),
    _case("reproduce --help", "--import MODULE"),
    _case("average --help", "--last K"),
    _case("artifacts --help", "list", "lineage"),
    _case("artifacts list --store {store}", "{pre12}", "{fit12}", "completed"),
    _case("artifacts list --json --store {store}", '"artifact_id": "{fit}"'),
    _case("artifacts show {fit} --store {store}", "artifact   {fit}", "parents    {pre}", "imports    -"),
    _case("artifacts lineage {fit12} --store {store}", "  {pre12}  pre", "* {fit12}  fit"),
    _case("artifacts query --stage fit --metric train/loss<1e9 --store {store}", "{fit12}"),
    _case("artifacts diff {pre} {fit} --store {store}", "a: {pre}", "b: {fit}", "+max_steps: 20"),
    _case("runs runs", "fit", "validate/loss"),
    _case("runs runs/exp --json", '"stage": "fit"', '"latest_step": 20'),
]


def _names(recorded: dict[str, str]) -> dict[str, str]:
    return {**recorded, "pre12": recorded["pre"][:12], "fit12": recorded["fit"][:12]}


@pytest.fixture(scope="module")
def inspected(recorded: dict[str, str]) -> dict[str, tuple[int, str, str, list[str]]]:
    """Every command of `INSPECTION`, in one fresh process (`_check_many`), by its argv."""
    names = _names(recorded)
    argvs = [[a.format(**names) for a in case.values[0]] for case in INSPECTION]  # type: ignore[attr-defined]
    reports = _check_many([(recorded["root"], argv) for argv in argvs])
    return {" ".join(argv): report for argv, report in zip(argvs, reports, strict=True)}


@pytest.mark.parametrize("argv,expected", INSPECTION)
def test_inspection_commands_import_no_jax(recorded, inspected, argv, expected):
    names = _names(recorded)
    rc, out, err, heavy = inspected[" ".join(a.format(**names) for a in argv)]
    assert rc == 0, out + err
    for text in expected:
        assert text.format(**names) in out, (text, out)
    assert heavy == [], f"pipekit-train {' '.join(argv)} imported {heavy}"


def test_artifacts_list_on_an_empty_store_imports_no_jax(tmp_path: Path):
    from pipekit_train.provenance._store import ArtifactStore

    assert len(ArtifactStore(tmp_path / "empty.sqlite")) == 0
    rc, out, heavy = _check(str(tmp_path), "artifacts", "list", "--store", "empty.sqlite")
    assert (rc, out, heavy) == (0, "no artifacts match\n", [])
    rows = json.loads(_check(str(tmp_path), "artifacts", "list", "--store", "empty.sqlite", "--json")[1])
    assert rows == []


def _mistake(tmp_path: Path, old: str, new: str) -> str:
    """`PIPELINE` with one mistake (`old` replaced by `new`) and its data, in `tmp_path`; the file's name."""
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    assert old in PIPELINE
    (tmp_path / "pipe.yaml").write_text(PIPELINE.replace(old, new, 1))
    return "pipe.yaml"


MISTAKES = {
    "field": (
        "validate",
        "max_steps: 10",
        "max_stepz: 10",
        r"pipe\.yaml:\d+:\d+: TrainingLoop has no field 'max_stepz' "
        r"\(did you mean 'max_steps'\?\)",
    ),
    "type": ("validate", "type: MSE", "type: MSEE", r"unknown operator type 'MSEE' \(did you mean 'MSE'"),
    "value": ("validate", "max_steps: 10", "max_steps: ten", r"TrainingLoop\.max_steps must be"),
    "factory": ("validate", "factory: mlp", "factory: mpl", r"EquinoxModel\.factory 'mpl' .*did you mean 'mlp'"),
    "data-path": ("validate", "path: data.npz}}\n  loss", "path: dat.npz}}\n  loss", r"file not found: 'dat\.npz'"),
    "batch-size": ("validate", "batch_size: 8\n  progress", "batch_size: 400\n  progress", r"batch_size 400 is larger"),
    "reused-run-dir": ("run", "max_steps: 10", "max_steps: 10", r"run directory runs/exp already holds run 'r1'"),
    "store-is-a-folder": ("run", "max_steps: 10", "max_steps: 10", r"--store store\.sqlite: is a directory"),
}


@pytest.fixture(scope="module")
def mistaken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, list[str]]]:
    """Every case of `MISTAKES` in a directory of its own, the commands run one after the other in one fresh
    process (`_check_many`): its report by case."""
    commands = []
    for case, (command, old, new, message) in MISTAKES.items():
        folder = tmp_path_factory.mktemp(f"mistake-{case}")
        pipe = _mistake(folder, old, new)
        (folder / "runs" / "exp").mkdir(parents=True)
        (folder / "runs" / "exp" / "run.json").write_text('{"run_id": "r1"}')
        (folder / "store.sqlite").mkdir() if "store" in message else None
        extra = ["--run-dir", "runs/exp", "--store", "store.sqlite"] if command == "run" else []
        commands.append((str(folder), [command, pipe, *extra]))
    return dict(zip(MISTAKES, _check_many(commands), strict=True))


@pytest.mark.parametrize("case", list(MISTAKES))
def test_mistakes_that_need_no_jax_are_reported_before_importing_it(mistaken, case):
    """A typo is reported by a process that never imported JAX (counted, not timed): one line, exit code 2."""
    import re

    message = MISTAKES[case][3]
    rc, _, err, heavy = mistaken[case]
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert re.search(message, lines[0]) and lines[0].startswith("pipekit-train: error: "), lines[0]
    assert heavy == [], lines[0]


def test_validate_of_a_good_pipeline_does_import_jax(tmp_path):
    """The check above can fail: a pipeline with no mistake goes on to pre-flight, which imports JAX."""
    rc, out, heavy = _check(str(tmp_path), "validate", _mistake(tmp_path, "max_steps: 10", "max_steps: 10"))
    assert rc == 0 and "pipe.yaml: ok (2 training stages" in out, out
    assert "jax" in heavy
