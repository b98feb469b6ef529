"""Sweeps end to end: a 2x2 grid recorded in the store, refusals before any trial, compile reuse across trials,
Optuna TPE with pruning, and a driver killed with SIGKILL mid-sweep that ends with the same table."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests import _forked

from pipekit_train.cli._main import main
from pipekit_train.provenance import ArtifactStore
from pipekit_train.sweep import LocalExecutor, load_sweep, run_sweep, sweep_status
from pipekit_train.sweep._plan import random_params

PIPELINE = """\
pipekit: 1
type: TrainingLoop
model_op: {{type: EquinoxModel, factory: mlp, kwargs: {{in_size: 4, out_size: 1, width_size: {width}, depth: 1}}}}
dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: {root}/train.npz}}}}
val_dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: {root}/val.npz}}}}
loss: {{type: MSE}}
optimizer_config: {{name: adamw, lr: 0.01}}
max_steps: {steps}
batch_size: 16
eval_every_n_steps: {every}
log_every_n_steps: {every}
steps_per_call: 5
progress: false
{extra}"""


#: The model width of the tests that train without counting compiles (TPE, the killed and stopped drivers): one
#: set of compiled programs for all of them (five steps per call and one validation pass, whatever their step counts
#: and cadences, all multiples of five), compiled by the first and loaded by the others, in this process or from the
#: run's persistent XLA cache. The 2x2 grid (7) and the Ray test (6) keep widths of their own: they check what this
#: process compiles.
SHARED_WIDTH = 2


def _files(root: Path, *, width: int = 6, steps: int = 20, every: int = 10, extra: str = "", sweep: str) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 1))).astype(np.float32)
    np.savez(root / "train.npz", x=x[:48], y=y[:48])
    np.savez(root / "val.npz", x=x[48:], y=y[48:])
    (root / "p.yaml").write_text(PIPELINE.format(width=width, root=root, steps=steps, every=every, extra=extra))
    (root / "s.yaml").write_text("pipekit: 1\ntype: Sweep\npipeline: p.yaml\n" + sweep)
    return root / "s.yaml"


GRID = "name: grid4\ngrid: {optimizer_config.lr: [0.003, 0.03], seed: [0, 1]}\nobjective: {metric: validate/loss}\n"


def test_grid_2x2_end_to_end_recorded_and_compiled_once(tmp_path, capsys):
    from pipekit_train.tracking._progress import CompileWatch

    CompileWatch.install()
    path = _files(tmp_path, width=7, sweep=GRID)  # a width no other test compiles
    compiles: list[int] = []
    result = run_sweep(
        load_sweep(str(path)), str(tmp_path / "D"), on_trial=lambda e: compiles.append(CompileWatch.count)
    )

    assert [t["params"] for t in result.trials] == [
        {"optimizer_config.lr": 0.003, "seed": 0},
        {"optimizer_config.lr": 0.003, "seed": 1},
        {"optimizer_config.lr": 0.03, "seed": 0},
        {"optimizer_config.lr": 0.03, "seed": 1},
    ]
    assert [t["state"] for t in result.trials] == ["completed"] * 4
    # Trials that differ only in traced numbers (learning rate, seed) reuse the first trial's compiled programs.
    assert compiles[0] > 0 and compiles[1:] == [compiles[0]] * 3
    with ArtifactStore() as store:
        found = store.query(sweep="grid4")
        assert len(found) == 4
        by_id = {a.artifact_id: a for a in found}
        for t in result.trials:
            (aid,) = t["artifact_ids"]
            art = by_id[aid]
            assert art.sweep == {"name": "grid4", "trial": t["number"], "params": t["params"], "key": t["key"]}
            assert art.final_metrics["validate/loss"] == t["objective"]
            assert art.seed == t["params"]["seed"]
        assert store.query(sweep="other") == []
    objectives = [t["objective"] for t in result.trials]
    assert result.best is not None and result.best["objective"] == min(objectives)
    assert len(set(objectives)) == 4  # every trial trained its own numbers

    # Again: nothing trains, nothing is recorded twice; --status --json prints the same table.
    again = run_sweep(load_sweep(str(path)), str(tmp_path / "D"))
    assert again.trials == result.trials and compiles[-1] == CompileWatch.count
    assert main(["sweep", str(path), "--run-dir", str(tmp_path / "D"), "--status", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == result.to_json()
    assert set(printed["trials"][0]) == {"params", "state", "objective", "artifact_ids"}
    with ArtifactStore() as store:
        assert len(store.query(sweep="grid4")) == 4
    assert main(["artifacts", "query", "--sweep", "grid4", "--json"]) == 0
    assert {a["artifact_id"] for a in json.loads(capsys.readouterr().out)} == {
        t["artifact_ids"][0] for t in result.trials
    }
    png = tmp_path / "sweep.png"
    assert main(["sweep", str(path), "--run-dir", str(tmp_path / "D"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        (
            "grid: {optimizer_config.lr: [0.01], seeed: [0, 1]}\n",
            "Sweep.grid.seeed: TrainingLoop has no field 'seeed' (did you mean 'seed'?)",
        ),
        ("grid: {max_steps: [10, fast]}\n", "Sweep.grid.max_steps"),
        ("grid: {seed: [0]}\nobjective: {metric: validate/acuracy}\n", "no stage logs 'validate/acuracy'"),
        ("grid: {seed: [0]}\nobjective: {metric: test/loss}\n", "no stage logs 'test/loss'"),
        ("sampler: random\ntrials: 2\nspace: {optimizer_config.lr: {log_uniforn: [1e-4, 1e-1]}}\n", "log_uniform"),
        ("sampler: random\ntrials: 2\nspace: {batch_size: {int: [0, 4]}}\n", "Sweep.space.batch_size"),
        ("grid: {seed: [0]}\nexecutor: {type: local, workers: 0}\n", "local.workers must be >= 1, got 0"),
    ],
)
def test_bad_sweeps_are_refused_before_any_trial_runs(tmp_path, capsys, sweep, message):
    path = _files(tmp_path, sweep="name: bad\n" + sweep)
    assert main(["sweep", str(path), "--run-dir", str(tmp_path / "D")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "D").exists()


def test_random_sampler_draws_the_same_values_for_a_trial_number():
    space = {
        "optimizer_config.lr": {"log_uniform": [1e-4, 1e-1]},
        "optimizer_config.weight_decay": {"uniform": [0.0, 0.1]},
        "batch_size": {"int": [8, 32]},
        "optimizer_config.name": {"choice": ["adamw", "sgd"]},
    }
    draws = [random_params(space, 3, i) for i in range(20)]
    assert draws == [random_params(space, 3, i) for i in range(20)]
    assert draws != [random_params(space, 4, i) for i in range(20)]
    for d in draws:
        assert 1e-4 <= d["optimizer_config.lr"] <= 1e-1 and 0 <= d["optimizer_config.weight_decay"] <= 0.1
        assert isinstance(d["batch_size"], int) and 8 <= d["batch_size"] <= 32
    assert {d["optimizer_config.name"] for d in draws} == {"adamw", "sgd"}
    assert len({round(np.log10(d["optimizer_config.lr"])) for d in draws}) >= 3  # spread over the decades


def test_optuna_tpe_sweep_prunes_through_optunas_pruner(tmp_path):
    optuna = pytest.importorskip("optuna")
    sweep = (
        "name: tpe\nsampler: optuna\ntrials: 6\nseed: 0\n"
        "space: {optimizer_config.lr: {log_uniform: [0.0001, 0.1]}}\n"
        "objective: {metric: validate/loss, mode: min}\nprune: {warmup_steps: 0, startup_trials: 2}\n"
    )
    path = _files(tmp_path, width=SHARED_WIDTH, sweep=sweep)
    result = run_sweep(load_sweep(str(path)), str(tmp_path / "O"))
    states = [t["state"] for t in result.trials]
    assert len(states) == 6 and "pruned" in states and states[:2] == ["completed", "completed"]
    study = optuna.load_study(study_name="tpe", storage=f"sqlite:///{tmp_path / 'O' / 'optuna.sqlite'}")
    told = {t.number: t.state.name for t in study.trials}
    assert told == {t["number"]: {"completed": "COMPLETE", "pruned": "PRUNED"}[t["state"]] for t in result.trials}
    with ArtifactStore() as store:
        for t in result.trials:
            art = store.get(t["artifact_ids"][-1])
            assert art.sweep["params"] == t["params"] == study.trials[t["number"]].params
            assert art.status.startswith("stopped: pruned by the sweep") == (t["state"] == "pruned")
            if t["state"] == "pruned":  # stopped at a validation before the end
                assert art.backend_info["steps"] < 20
    assert result.best is not None and result.best["objective"] == study.best_value
    # The study resumes: a second run asks for nothing more.
    again = run_sweep(load_sweep(str(path)), str(tmp_path / "O"))
    assert (
        again.trials == result.trials and len(optuna.load_study(study_name="tpe", storage=study._storage).trials) == 6
    )


def _table(result):
    return [(t["params"], t["state"], t["objective"]) for t in result.trials]


def test_sigkilled_driver_restarts_and_ends_with_the_same_table(tmp_path, xla_cache_env, monkeypatch, capsys):
    sweep = "name: killed\ngrid: {optimizer_config.lr: [0.003, 0.03]}\nobjective: {metric: validate/loss}\n"
    extra = "callbacks: [{type: Checkpoint, every_n_steps: 10, async_save: false}]\n"
    path = _files(tmp_path, width=SHARED_WIDTH, steps=120, every=40, extra=extra, sweep=sweep)
    # The uninterrupted reference runs its trials in two worker processes (executor: {type: local, workers: 2}); the
    # driver records their artifacts.
    for name, value in xla_cache_env.items():
        monkeypatch.setenv(name, value)  # for the spawned workers (this process's JAX is already set up)
    reference = run_sweep(load_sweep(str(path)).replace(executor=LocalExecutor(workers=2)), str(tmp_path / "ref"))
    assert [t["state"] for t in reference.trials] == ["completed", "completed"]

    run_dir = tmp_path / "D"
    cmd = [sys.executable, "-m", "pipekit_train.cli", "sweep", str(path), "--run-dir", str(run_dir)]
    env = {**os.environ, **xla_cache_env}
    proc = _forked.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = run_dir / "sweep.json"
    deadline = time.monotonic() + 120
    killed_in = None
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists():
            trials = json.loads(journal.read_text())["trials"]
            running = [t for t in trials if t["state"] == "running"]
            if running and running[0]["number"] == 1:
                ckpts = Path(running[0]["run_dir"]) / "stage0" / "checkpoints"
                if ckpts.is_dir() and any(p.name.isdigit() or "step" in p.name for p in ckpts.iterdir()):
                    proc.send_signal(signal.SIGKILL)
                    killed_in = running[0]
                    break
        time.sleep(0.01)
    proc.wait(timeout=60)
    assert killed_in is not None, proc.stderr.read().decode() if proc.stderr else ""
    status = sweep_status(load_sweep(str(path)), str(run_dir))
    assert [t["state"] for t in status.trials] == ["completed", "running"]

    # The restart: the command in this process (what is tested is the state the killed process left behind).
    capsys.readouterr()
    with warnings.catch_warnings(record=True):  # not raised as pytest's settings would (a kill leaves a repair to say)
        warnings.simplefilter("default")
        code = main(["sweep", str(path), "--run-dir", str(run_dir)])
    done = capsys.readouterr()
    assert code == 0, done.err
    assert "trial 1: completed" in done.out and "trial 0" not in done.out  # 0 skipped, matched by its key
    final = sweep_status(load_sweep(str(path)), str(run_dir))
    assert _table(final) == _table(reference)  # bitwise: the resumed trial's objective is the uninterrupted one's
    with ArtifactStore() as store:
        mine = [a for a in store.query(sweep="killed") if str(run_dir) in (a.run_dir or "")]
        assert len(mine) == 2  # one per trial: nothing recorded twice
        refs = [store.get(t["artifact_ids"][0]) for t in reference.trials]  # recorded by the driver for its workers
        assert sorted(a.trained_model_hash for a in mine) == sorted(a.trained_model_hash for a in refs)
        assert [a.sweep["trial"] for a in refs] == [0, 1]


@pytest.fixture
def ray_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Ray's temporary directory for one test (``$RAY_TMPDIR``; short: Ray's socket paths under it must stay under
    108 bytes), holding a stale ``ray/ray_current_cluster`` that names a dead address, as any other Ray user of the
    machine may leave in ``/tmp/ray``: nothing may follow it."""
    root = Path(tempfile.mkdtemp(prefix="ray-"))
    (root / "ray").mkdir()
    (root / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    monkeypatch.setenv("RAY_TMPDIR", str(root))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token file under the home directory
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(300)
def test_ray_executor_on_a_local_ray_instance(tmp_path, xla_cache_env, monkeypatch, ray_tmpdir):
    ray = pytest.importorskip("ray")
    from pipekit_train.sweep import RayExecutor

    for name, value in xla_cache_env.items():
        monkeypatch.setenv(name, value)  # inherited by Ray's worker processes
    sweep = "name: onray\ngrid: {optimizer_config.lr: [0.003, 0.03]}\nobjective: {metric: validate/loss}\n"
    sweep += "executor: {type: ray, address: auto, resources_per_trial: {CPU: 1}}\n"
    path = _files(tmp_path, width=6, sweep=sweep)
    assert load_sweep(str(path)).executor == RayExecutor(address="auto", resources_per_trial={"CPU": 1})
    from pipekit_train.tracking._progress import CompileWatch

    CompileWatch.install()
    before = CompileWatch.count
    # A private instance (never a cluster the machine's ray_current_cluster names). One CPU: one worker process runs
    # both trials, one after the other (a second would import JAX again for nothing this test looks at; the trials
    # still run outside the driver, as Ray tasks). `address: auto` uses the Ray this process is connected to.
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=str(ray_tmpdir))
    try:
        result = run_sweep(load_sweep(str(path)), str(tmp_path / "R"))
        assert ray.is_initialized()  # the sweep did not disconnect what it did not connect
    finally:
        ray.shutdown()
    assert CompileWatch.count == before  # nothing trained in the driver's process: the trials ran in Ray's workers
    assert [t["state"] for t in result.trials] == ["completed", "completed"], result.trials
    with ArtifactStore() as store:  # recorded by the driver, from the trials' shared run directories
        found = store.query(sweep="onray")
        assert sorted(a.artifact_id for a in found) == sorted(t["artifact_ids"][0] for t in result.trials)
        for a in found:
            assert a.run_dir.startswith(str(tmp_path / "R" / "trials"))
    # The same objectives as the in-process grid of the same pipeline (the 2x2 test's lr at seed 0 trains the same).
    local = run_sweep(load_sweep(str(path)).replace(executor=LocalExecutor()), str(tmp_path / "L"), store=False)
    assert [t["objective"] for t in local.trials] == [t["objective"] for t in result.trials]


@pytest.mark.timeout(300)
def test_ray_executor_auto_starts_a_local_ray_when_none_answers(ray_tmpdir):
    """``address: auto`` with no Ray connected: the cluster ``ray start`` recorded if it answers, else a private
    local instance, started for the sweep and stopped after it; an address where nothing answers is one line."""
    ray = pytest.importorskip("ray")
    from pipekit import ConfigError
    from pipekit_train.sweep import RayExecutor
    from pipekit_train.sweep._executors import _RayPool

    assert not ray.is_initialized()
    with pytest.raises(ConfigError, match=r"^Sweep.executor.address 127.0.0.1:1: no Ray cluster answers there \("):
        _RayPool(RayExecutor(address="127.0.0.1:1"))  # at once, not after Ray's minutes of retries
    assert not ray.is_initialized()
    with _RayPool(RayExecutor(address="auto")):  # the stale ray_current_cluster names 127.0.0.1:1: not followed
        assert ray.is_initialized()
        assert len(list((ray_tmpdir / "ray").glob("session_2*"))) == 1  # its own, in this test's directory
        assert ray.get(ray.remote(num_cpus=0)(lambda: 41 + 1).remote()) == 42
    assert not ray.is_initialized()


def _sweep_command(path: Path, run_dir: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """``pipekit-train sweep PATH --run-dir RUN_DIR`` in a fresh process (the test's store), bounded in time."""
    cmd = [sys.executable, "-m", "pipekit_train.cli", "sweep", str(path), "--run-dir", str(run_dir), *extra]
    return _forked.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def test_sigint_between_two_trials_names_the_sweep_and_the_command_that_continues_it(tmp_path, xla_cache_env, capsys):
    sweep = "name: paused\ngrid: {optimizer_config.lr: [0.003, 0.03]}\nobjective: {metric: validate/loss}\n"
    path = _files(tmp_path, width=SHARED_WIDTH, steps=10, every=5, sweep=sweep)
    run_dir = tmp_path / "D"
    # The second trial's stage has begun (its run directory made and locked), nothing of it trained yet.
    out = _sweep_command(path, run_dir, {**xla_cache_env, "PIPEKIT_TEST_SIGNAL_AT": "started:SIGINT:2"})
    assert out.returncode == 130, out.stderr
    continuing = f"pipekit-train sweep {path} --run-dir {run_dir}"
    assert out.stderr.splitlines() == [
        f"pipekit-train: sweep paused stopped by SIGINT outside training; continue it with: {continuing}"
    ]
    assert "trial 0: completed" in out.stdout and "trial 1" not in out.stdout
    status = sweep_status(load_sweep(str(path)), str(run_dir))
    assert [t["state"] for t in status.trials] == ["completed", "running"]
    assert not os.path.exists(status.trials[1]["run_dir"])  # begun by the stopped process, nothing kept: removed
    # The command it printed continues the sweep: trial 0 is not trained again.
    capsys.readouterr()
    assert main(continuing.split()[1:]) == 0
    done = capsys.readouterr().out
    assert "trial 1: completed" in done and "trial 0" not in done
    assert [t["state"] for t in sweep_status(load_sweep(str(path)), str(run_dir)).trials] == ["completed"] * 2


#: Two parameters (a kill can fall between their two suggestions); 4 trials: Optuna's TPE samples at random for
#: the first ``min(4, trials)`` (`_optuna.study_of`), and from what finished after.
OPTUNA = (
    "name: {name}\nsampler: optuna\ntrials: {trials}\nseed: 3\n"
    "space: {{optimizer_config.lr: {{log_uniform: [0.001, 0.1]}}, "
    "optimizer_config.weight_decay: {{uniform: [0.0, 0.1]}}}}\n"
    "objective: {{metric: validate/loss, mode: min}}\n"
)


def _study_rows(run_dir: Path, name: str) -> list[tuple[int, str, dict[str, Any], float | None]]:
    import optuna

    study = optuna.load_study(study_name=name, storage=f"sqlite:///{run_dir / 'optuna.sqlite'}")
    return [(t.number, t.state.name, t.params, t.value) for t in study.get_trials(deepcopy=False)]


def _agree(run_dir: Path, path: Path, name: str) -> list[dict[str, Any]]:
    """The sweep's ``--status`` table, after checking that it and Optuna's storage say the same of every trial: each
    trial Optuna holds is a row with the same parameters and state (and value), numbered 0, 1, ... without a gap;
    the only other rows are the ``pending`` trials not asked yet, after them."""
    rows = sweep_status(load_sweep(str(path)), str(run_dir)).trials
    study = _study_rows(run_dir, name) if (run_dir / "optuna.sqlite").exists() else []
    assert [number for number, *_ in study] == list(range(len(study)))
    states = {"RUNNING": "running", "COMPLETE": "completed", "PRUNED": "pruned", "FAIL": "failed"}
    for (number, state, params, value), row in zip(study, rows, strict=False):
        assert (row["number"], row["state"], row["params"]) == (number, states[state], params), (row, state, params)
        if state == "COMPLETE":
            assert row["objective"] == value
    assert [(t["state"], t["params"]) for t in rows[len(study) :]] == [("pending", {})] * (len(rows) - len(study))
    return rows


def test_optuna_sweep_killed_and_restarted_ends_as_the_uninterrupted_one(tmp_path, xla_cache_env, capsys):
    """The sampler's values are a function of the sweep's seed, the trial's number and the trials finished before
    it, never of how many processes asked: no ghost trial, no trial trained twice, the same table."""
    optuna = pytest.importorskip("optuna")
    path = _files(tmp_path, width=SHARED_WIDTH, steps=10, every=5, sweep=OPTUNA.format(name="restarted", trials=3))
    reference = run_sweep(load_sweep(str(path)), str(tmp_path / "ref"), store=False)
    run_dir = tmp_path / "D"
    # Killed as the second trial's stage begins (SIGTERM outside training: the process ends at once, as a kill).
    out = _sweep_command(path, run_dir, {**xla_cache_env, "PIPEKIT_TEST_SIGNAL_AT": "started:SIGTERM:2"}, "--no-store")
    assert out.returncode == 143, out.stderr
    assert [row["state"] for row in _agree(run_dir, path, "restarted")] == ["completed", "running", "pending"]
    capsys.readouterr()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("default")
        assert main(["sweep", str(path), "--run-dir", str(run_dir), "--no-store"]) == 0
    assert "trial 0" not in capsys.readouterr().out
    final = _agree(run_dir, path, "restarted")
    assert _table(reference) == [(t["params"], t["state"], t["objective"]) for t in final]
    assert len({json.dumps(t["params"], sort_keys=True) for t in final}) == 3  # no trial asked twice
    ref_study = optuna.load_study(study_name="restarted", storage=f"sqlite:///{tmp_path / 'ref' / 'optuna.sqlite'}")
    assert _study_rows(run_dir, "restarted") == [
        (t.number, t.state.name, t.params, t.value) for t in ref_study.get_trials(deepcopy=False)
    ]


#: Where the chain below kills the driver (SIGKILL at a named point, `_signals.phase`), one process after another,
#: each continuing what the last left: the first trial asked, one of its two values asked, both asked but the trial
#: not recorded, recorded and its stage begun, trained but its outcome not told, told but not recorded; then the
#: second trial recorded before the third is asked.
KILLS = (
    "optuna-asked:SIGKILL:1",
    "optuna-suggested:SIGKILL:1",
    "trial-begun:SIGKILL:1",
    "started:SIGKILL:1",
    "trial-trained:SIGKILL:1",
    "optuna-told:SIGKILL:1",
    "optuna-recorded:SIGKILL:1",
)


@pytest.mark.slow
def test_optuna_journal_and_study_agree_after_a_kill_at_every_point(tmp_path, xla_cache_env, capsys):
    pytest.importorskip("optuna")
    sweep = OPTUNA.format(name="chain", trials=5) + "prune: {warmup_steps: 0, startup_trials: 2}\n"
    extra = "callbacks: [{type: Checkpoint, every_n_steps: 5, async_save: false}]\n"
    path = _files(tmp_path, width=SHARED_WIDTH, steps=10, every=5, extra=extra, sweep=sweep)
    reference = run_sweep(load_sweep(str(path)), str(tmp_path / "ref"), store=False)
    run_dir = tmp_path / "D"
    seen = []
    for where in KILLS:
        out = _sweep_command(path, run_dir, {**xla_cache_env, "PIPEKIT_TEST_SIGNAL_AT": where}, "--no-store")
        assert out.returncode == -signal.SIGKILL, (where, out.returncode, out.stderr)
        seen.append([(t["state"], bool(t["params"])) for t in _agree(run_dir, path, "chain")])
    assert seen[0][0] == ("running", False) and seen[1][0] == ("running", True)  # asked; then its first value
    assert seen[5][0] == ("completed", True)  # told, not recorded: read as it ended (from its run directory)
    assert seen[-1] == [("completed", True), ("completed", True), *[("pending", False)] * 3]
    # Killed during the third trial's training, after one of its checkpoints (pruning reports at its validations).
    cmd = [sys.executable, "-m", "pipekit_train.cli", "sweep", str(path), "--run-dir", str(run_dir), "--no-store"]
    proc = _forked.Popen(cmd, env={**os.environ, **xla_cache_env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        trials = json.loads((run_dir / "sweep.json").read_text())["trials"]
        if len(trials) == 3 and trials[2]["state"] == "running":
            ckpts = Path(trials[2]["run_dir"]) / "stage0" / "checkpoints"
            if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
                proc.send_signal(signal.SIGKILL)
                break
        time.sleep(0.005)
    proc.wait(timeout=120)
    _agree(run_dir, path, "chain")
    capsys.readouterr()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("default")
        assert main(["sweep", str(path), "--run-dir", str(run_dir), "--no-store"]) == 0
    final = _agree(run_dir, path, "chain")
    assert [(t["params"], t["state"], t["objective"]) for t in final] == _table(reference)
    assert "pruned" in [t["state"] for t in final]  # the pruner's decisions are the uninterrupted run's too
    assert [_trained(t["run_dir"]) for t in final] == [_trained(t["run_dir"]) for t in reference.trials]


def _trained(trial_dir: str) -> tuple[str, Any]:
    """A trial's weights (the model's content hash) and the train and validation metrics it logged, step by step."""
    from pipekit_train.tracking import history

    logged = history(trial_dir)[trial_dir]["stage0"]
    final = json.loads((Path(trial_dir) / "stage0" / "final.json").read_text())
    return final["model_uri"], {context: logged[context] for context in ("train", "validate")}
