"""Resume on real runs: kill and resume bitwise, graceful stops, refusals, restore_best, corruption.

Processes that die are real ``python -m pipekit_train.cli run`` subprocesses, killed with SIGKILL (or stopped with
SIGTERM) at points drawn from a seeded generator, each bounded in time. A resumed run must end bitwise equal to an
uninterrupted one: its final weights, its last train metrics record and every checkpoint it kept (every leaf's
digest, the data position, the callbacks' state). Grain's ``assert_equal_output_after_checkpoint`` idea is
applied to the data position at every step of a short run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from tests import _forked

from pipekit_train import (
    MSE,
    Best,
    Checkpoint,
    Checkpointer,
    EquinoxModel,
    Every,
    Last,
    LocalModelRegistry,
    NpzSource,
    PipekitTrainWarning,
    TrainingDataset,
    TrainingLoop,
    read_jsonl,
    run_settings,
)
from pipekit_train import cli as train_cli

# Tests sharing a module fixture run on one xdist worker (``--dist loadgroup``); without xdist the mark is unknown.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    GROUP_A = pytest.mark.xdist_group("resume-a")
    GROUP_B = pytest.mark.xdist_group("resume-b")
    GROUP_C = pytest.mark.xdist_group("resume-c")

PROCESS_TIMEOUT = 120  # seconds any one training process may take before the test fails
POLL = 0.002  # seconds between looks at a running process's files

# Variant A: one step per dispatch, validation (against targets the model cannot fit, so the monitored loss gets
# worse and EarlyStopping / ReduceLROnPlateau count), EMA, a warmup-cosine schedule, retention by Best/Last/Every.
PIPE_A = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: train.npz}}
val_dataset: {type: TrainingDataset, source: {type: NpzSource, path: val.npz}, shuffle: false}
loss: {type: MSE}
optimizer_config: {name: adamw, lr: 0.02, schedule: warmup_cosine, warmup_steps: 20}
max_steps: 150
batch_size: 8
steps_per_call: 1
eval_every_n_steps: 10
log_every_n_steps: 5
progress: false
callbacks:
- type: Checkpoint
  every_n_steps: 5
  async_save: true
  keep: [{type: Best, k: 2}, {type: Last, n: 2}, {type: Every, n: 25}]
  layout: orbax
- {type: EMA, decay: 0.9}
- {type: EarlyStopping, patience: 12}
- {type: ReduceLROnPlateau, patience: 2, factor: 0.5}
"""

# Variant A's checkpoints are in the orbax layout (what several processes write); variant B's in the default flat
# layout, on a slow disk (`SLOW_DISK`), so that a kill can land during its few-millisecond write.
# Variant B: five steps per dispatch (a scan), epochs of 7 steps (chunks split at 5- and 7-step boundaries).
PIPE_B = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: train.npz}}
loss: {type: MSE}
optimizer_config: {name: adam, lr: 0.01}
max_steps: 150
steps_per_epoch: 7
batch_size: 8
steps_per_call: 5
log_every_n_steps: 5
progress: false
callbacks:
- {type: Checkpoint, every_n_steps: 5, async_save: true, keep: [{type: Last, n: 2}]}
"""

# Two stages; the second carries the first one's model over.
PIPE_TWO = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: pre
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: train.npz}}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 0.01}
  max_steps: 20
  batch_size: 8
  log_every_n_steps: 5
  progress: false
  callbacks: [{type: Checkpoint, every_n_steps: 10, keep: [{type: Last, n: 1}]}]
- type: TrainingLoop
  name: post
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: train.npz}}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 0.003}
  max_steps: 60
  batch_size: 8
  log_every_n_steps: 5
  progress: false
  callbacks: [{type: Checkpoint, every_n_steps: 5, keep: [{type: Last, n: 2}]}]
"""


# Helpers ---------------------------------------------------------------------------------------------------
def _write_data(work: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    np.savez(work / "train.npz", x=x, y=x.sum(axis=1, keepdims=True))
    xv = rng.normal(size=(24, 4)).astype(np.float32)
    np.savez(work / "val.npz", x=xv, y=-xv.sum(axis=1, keepdims=True))  # the opposite rule: val loss rises
    xo = rng.normal(size=(60, 4)).astype(np.float32)
    np.savez(work / "other.npz", x=xo, y=xo.sum(axis=1, keepdims=True))


# Imported first by every training subprocess of a workspace made with slow_disk=True: each fsync and fdatasync takes
# 20 ms more (the flat writer syncs its files with fdatasync, its directories with fsync).
SLOW_DISK = """\
import os, time
def _slowed(sync):
    def slow(fd):
        time.sleep(0.02)
        sync(fd)
    return slow
os.fsync = _slowed(os.fsync)
if hasattr(os, "fdatasync"):
    os.fdatasync = _slowed(os.fdatasync)
"""


def _workspace(root: Path, pipeline: str, slow_disk: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _write_data(root)
    (root / "pipe.yaml").write_text(pipeline)
    if slow_disk:
        (root / "slow-disk").mkdir(exist_ok=True)
        (root / "slow-disk" / "sitecustomize.py").write_text(SLOW_DISK)
    return root


_XLA_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_compilation_cache(xla_cache_env: dict[str, str]) -> Iterator[None]:
    """The training subprocesses share the run's persistent XLA compilation cache (tests/conftest.py): they compile
    the same few programs, so all but the first load them, which halves a process's CPU time. A loaded program is
    the compiled one, bit for bit, so results do not change (the uninterrupted reference run compiles; resumed runs
    mostly load)."""
    _XLA_CACHE.update(xla_cache_env)
    yield
    _XLA_CACHE.clear()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """New directories for the killed runs, in memory (``/dev/shm``) where there is one.

    Every checkpoint commit fsyncs its files, the manifest and the directory; on a busy disk that is most of a
    training process's wall time here. A SIGKILL leaves the same files in memory as on disk (the page cache
    outlives the process; only a power cut needs the fsyncs), so these tests mean the same there.
    """
    shm, made = Path("/dev/shm"), []

    def make(name: str) -> Path:
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1 << 30:
            made.append(Path(tempfile.mkdtemp(prefix=f"pipekit-{name}-", dir=shm)))
            return made[-1]
        return tmp_path_factory.mktemp(name)

    yield make
    for directory in made:
        shutil.rmtree(directory, ignore_errors=True)


def _env(xla_cache: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **(_XLA_CACHE if xla_cache else {}))
    return env


class _Process:
    """One ``pipekit-train run`` subprocess, its output going to log files in the workspace."""

    def __init__(self, work: Path, run: str, *extra: str, resume: bool = False, xla_cache: bool = True) -> None:
        self.work = work
        self.run_dir = work / run
        args = [sys.executable, "-m", "pipekit_train.cli", "run", "pipe.yaml", "--run-dir", run, "--no-store"]
        args += [*extra, *(["--resume", "auto"] if resume else [])]
        n = len(list(work.glob(f"{run}.*.out")))
        self.out_path, self.err_path = work / f"{run}.{n}.out", work / f"{run}.{n}.err"
        env = _env(xla_cache)
        start: type[subprocess.Popen[bytes]] = _forked.Popen  # forked from a process that imported JAX
        if (work / "slow-disk").is_dir():  # its sitecustomize works at a process's start: a fresh one
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "slow-disk"), env.get("PYTHONPATH")]))
            start = subprocess.Popen
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = start(args, cwd=work, env=env, stdout=out, stderr=err)
        self.started = time.monotonic()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, PROCESS_TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.run_dir} did not finish within {PROCESS_TIMEOUT}s:\n{self.stderr}") from None

    def when(self, ready: Callable[[], bool], then: Callable[[], None]) -> None:
        """Poll `ready` while the process runs; once it holds, call `then` (kill, signal)."""
        while self.proc.poll() is None:
            if ready():
                then()
                return
            if time.monotonic() - self.started > PROCESS_TIMEOUT:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.run_dir}: no progress within {PROCESS_TIMEOUT}s:\n{self.stderr}")
            time.sleep(POLL)
        raise AssertionError(f"{self.run_dir} exited ({self.proc.returncode}) before the trigger:\n{self.stderr}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def _train_steps_after(path: Path, skip: int) -> list[int]:
    """The steps of train metrics records among the complete lines of `path` after the first `skip`."""
    try:
        lines = path.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return []
    steps = []
    for line in lines[skip:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "metrics" and record.get("context") == "train":
            steps.append(record["step"])
    return steps


def _complete_lines(path: Path) -> int:
    return len(path.read_text().split("\n")) - 1 if path.exists() else 0


def _step_dirs(ckdir: Path) -> tuple[list[int], list[int]]:
    """(steps whose directory is committed, steps being written) in a checkpoint directory."""
    try:
        names = os.listdir(ckdir)
    except FileNotFoundError:
        return [], []
    committed = [int(n) for n in names if n.isdigit() and (ckdir / n / "commit_success.txt").exists()]
    writing = [int(n.split(".")[0]) for n in names if ".orbax-checkpoint-tmp" in n and n.split(".")[0].isdigit()]
    writing += [int(n.split("-")[2]) for n in names if n.startswith(".pipekit-tmp-")]  # the flat layout's
    return committed, writing


def _trigger(proc: _Process, stage: str, kind: str, step: int) -> Callable[[], bool]:
    """When to act on `proc`: a train record at `step` or later ("step"), a checkpoint write of such a step
    starting ("save": the kill lands during the write) or just committed ("commit": before or during the manifest
    update and the rotation)."""
    metrics, ckdir = proc.run_dir / stage / "metrics.jsonl", proc.run_dir / stage / "checkpoints"
    if kind == "step":
        skip = _complete_lines(metrics)  # records a previous process wrote do not count
        sizes = [-1]

        def reached() -> bool:
            size = metrics.stat().st_size if metrics.exists() else 0
            if size == sizes[-1]:
                return False  # nothing new written: do not parse the file again
            sizes.append(size)
            return any(s >= step for s in _train_steps_after(metrics, skip))

        return reached
    index = {"commit": 0, "save": 1}[kind]
    return lambda: any(s >= step for s in _step_dirs(ckdir)[index])


def _kill_and_resume(work: Path, run: str, kills: list[tuple[str, int]], stage: str = "fit") -> list[str]:
    """Start a run, SIGKILL it at each of `kills` (resuming with ``--resume auto`` after each), then let the last
    resumed process finish. Returns what each kill left on disk (for failure messages)."""
    proc = _Process(work, run)
    seen = []
    for kind, step in kills:
        proc.when(_trigger(proc, stage, kind, step), proc.kill)
        committed, writing = _step_dirs(work / run / stage / "checkpoints")
        seen.append(f"{kind}@{step}: committed {sorted(committed)}, being written {writing}")
        proc = _Process(work, run, resume=True)
    rc = proc.wait()
    assert rc == 0, f"the resumed run failed ({rc}) after {seen}:\n{proc.stderr}"
    return seen


def _flat(tree: Any) -> dict[str, np.ndarray]:
    """Leaves by path name (``layers/0/weight``), the same for a module and for a restored dict."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out["/".join(parts)] = np.asarray(leaf)
    return out


def _outcome(run_dir: Path, stage: str = "fit") -> dict[str, Any]:
    """Everything a resumed run must reproduce exactly: final weights, last train record, kept checkpoints."""
    final = json.loads((run_dir / stage / "final.json").read_text())
    model = LocalModelRegistry(str(run_dir / "models")).load(final["model_uri"])
    records = read_jsonl(run_dir / stage / "metrics.jsonl")
    train = [r for r in records if r["type"] == "metrics" and r["context"] == "train"]
    ckpt = Checkpointer(run_dir / stage / "checkpoints")
    kept = {}
    for step in ckpt.steps():
        state, data_iter, meta = ckpt.restore(step)  # verified against the digests recorded when it was saved
        kept[step] = {
            "leaves": {path: hashlib.sha256(leaf.tobytes()).hexdigest() for path, leaf in _flat(state).items()},
            "data_iter": data_iter,
            "callbacks": meta["callbacks"],
            "score": meta["score"],
            "stop_reason": meta["stop_reason"],
        }
    return {
        "step": final["step"],
        "weights": model.weights_hash(),
        "last_train": {k: v for k, v in train[-1].items() if k != "time"},
        "checkpoints": kept,
    }


def _three_kinds_plan(seed: int, low: int, high: int) -> list[tuple[str, int]]:
    """Deterministic kill points for one chain of three SIGKILLs, at least 15 steps apart: one of each kind (step,
    save, commit), in a seeded order. The kinds two chains of two kills covered, in four processes instead of six."""
    rng = np.random.default_rng(seed)
    first = int(rng.integers(low, high - 30))
    second = int(rng.integers(first + 15, high - 14))
    third = int(rng.integers(second + 15, high + 1))
    kinds = [str(k) for k in rng.permutation(["step", "save", "commit"])]
    return list(zip(kinds, (first, second, third)))


def _kill_plan(seed: int, chains: int, low: int, high: int) -> list[list[tuple[str, int]]]:
    """Deterministic kill points: per chain two kills, at least 15 steps apart, of kinds step/save/commit, with
    a kill during a checkpoint write in every chain."""
    rng = np.random.default_rng(seed)
    plans = []
    for _ in range(chains):
        first = int(rng.integers(low, high - 15))
        second = int(rng.integers(first + 15, high + 1))
        other = str(rng.choice(["step", "commit"]))
        kinds = ["save", other] if rng.random() < 0.5 else [other, "save"]
        plans.append([(kinds[0], first), (kinds[1], second)])
    return plans


def _tree_digest(directory: Path) -> dict[str, str]:
    """Every file's digest; the run-directory lock records who last ran there, which is not the run's data."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


# Kill and resume, bitwise ----------------------------------------------------------------------------------
def _run_uninterrupted(work: Path, run: str) -> None:
    """The uninterrupted reference run, through the same CLI entry point as the training processes but in this
    process: nothing is killed in it, so no process boundary is part of what it shows, and a training process's
    start-up (Python, JAX, Orbax) is most of its CPU time here. Its compiled programs go to the run's persistent
    cache, where the killed and resumed processes load them."""
    with _cwd(work):
        assert train_cli.main(["run", "pipe.yaml", "--run-dir", run, "--no-store"]) == 0


@pytest.fixture(scope="module")
def variant_a(scratch: Callable[[str], Path], _shared_compilation_cache: None) -> dict[str, Any]:
    """Variant A run once uninterrupted and once killed (three SIGKILLs: after a step, during a checkpoint write and
    after a commit) and resumed to the end."""
    work = _workspace(scratch("variant-a"), PIPE_A)
    _run_uninterrupted(work, "ref")
    kills = _three_kinds_plan(seed=11, low=12, high=110)
    runs = {"chain0": (kills, _kill_and_resume(work, "chain0", kills))}
    return {"work": work, "reference": _outcome(work / "ref"), "runs": runs}


@pytest.fixture(scope="module")
def variant_b(scratch: Callable[[str], Path], _shared_compilation_cache: None) -> dict[str, Any]:
    """Variant B's workspace and its uninterrupted run."""
    work = _workspace(scratch("variant-b"), PIPE_B, slow_disk=True)
    _run_uninterrupted(work, "ref")
    return {"work": work, "reference": _outcome(work / "ref")}


@pytest.mark.slow
@GROUP_A
def test_sigkilled_runs_resume_bitwise_one_step_per_call_with_validation_and_ema(variant_a):
    reference = variant_a["reference"]
    assert reference["step"] < 150, "EarlyStopping was meant to stop variant A early"
    for name, (kills, seen) in variant_a["runs"].items():
        got = _outcome(variant_a["work"] / name)
        assert got["weights"] == reference["weights"], f"{name} killed at {kills}: {seen}"
        assert got == reference, f"{name} killed at {kills}: {seen}"


@pytest.mark.slow
@GROUP_A
def test_early_stopping_and_plateau_counters_survive_kill_and_resume(variant_a):
    reference = variant_a["reference"]["checkpoints"]
    states = [s["callbacks"] for s in reference.values()]
    # The counters are not trivial: the learning rate was cut and validation passes went without improvement.
    assert any(cb.get("reductions") for state in states for cb in state.values())
    assert any(cb.get("bad_evals", 0) > 2 for state in states for cb in state.values())
    for name, (kills, seen) in variant_a["runs"].items():
        got = _outcome(variant_a["work"] / name)["checkpoints"]
        assert sorted(got) == sorted(reference), f"{name}: kept other checkpoints ({kills}: {seen})"
        for step in reference:
            assert got[step]["callbacks"] == reference[step]["callbacks"], f"{name} at step {step} ({kills})"
        final = json.loads((variant_a["work"] / name / "fit" / "final.json").read_text())
        assert final["step"] == variant_a["reference"]["step"]  # stopped early at the same step


@pytest.mark.slow
@GROUP_B
def test_sigkilled_run_resumes_bitwise_five_steps_per_call(variant_b):
    work = variant_b["work"]
    (kills,) = _kill_plan(seed=5, chains=1, low=12, high=130)
    seen = _kill_and_resume(work, "chain", kills)
    assert _outcome(work / "chain") == variant_b["reference"], f"killed at {kills}: {seen}"


@pytest.mark.slow
@GROUP_B
def test_sigterm_stops_gracefully_and_resume_auto_finishes_bitwise(variant_b):
    work = variant_b["work"]
    proc = _Process(work, "term")
    proc.when(_trigger(proc, "fit", "step", 40), lambda: proc.proc.send_signal(signal.SIGTERM))
    assert proc.wait() == 128 + signal.SIGTERM == 143
    stderr = proc.stderr
    assert "stopped by SIGTERM after a committed checkpoint" in stderr
    assert "pipekit-train run pipe.yaml --run-dir term --resume auto" in stderr
    ckdir = work / "term" / "fit" / "checkpoints"
    last = Checkpointer(ckdir).manifest()[-1]
    assert last.stop_reason == "SIGTERM" and last.step >= 40
    records = read_jsonl(work / "term" / "fit" / "metrics.jsonl")
    assert records[-1]["type"] == "finish" and records[-1]["status"] == "stopped: SIGTERM"
    assert records[-1]["step"] == last.step
    assert not (work / "term" / "fit" / "final.json").exists()
    assert _Process(work, "term", resume=True).wait() == 0
    assert _outcome(work / "term") == variant_b["reference"]


@pytest.mark.slow
def test_resume_of_a_sequential_killed_in_stage_two_skips_stage_one(scratch):
    work = _workspace(scratch("two-stages"), PIPE_TWO)
    proc = _Process(work, "run")
    proc.when(_trigger(proc, "post", "step", 27), proc.kill)
    pre, post = work / "run" / "pre", work / "run" / "post"
    before = {
        name: ((pre / name).read_bytes(), (pre / name).stat().st_mtime_ns)
        for name in os.listdir(pre)
        if (pre / name).is_file()
    }
    assert "final.json" in before and not (post / "final.json").exists()
    with warnings.catch_warnings():  # the kill may land between a commit and the manifest write: that step is
        warnings.simplefilter("ignore", PipekitTrainWarning)  # listed again, with a warning (test_crash_windows.py)
        resumed_from = Checkpointer(post / "checkpoints").latest_step()
    assert resumed_from is not None and 0 < resumed_from < 60
    lines_before = _complete_lines(post / "metrics.jsonl")
    assert _Process(work, "run", resume=True).wait() == 0
    after = {name: ((pre / name).read_bytes(), (pre / name).stat().st_mtime_ns) for name in before}
    assert after == before  # stage 1 was not trained again: its metrics, final.json, artifact untouched
    records = read_jsonl(post / "metrics.jsonl")
    assert sum(r["type"] == "params" for r in records) == 1  # stage 2 started once, then continued
    assert _train_steps_after(post / "metrics.jsonl", lines_before)[0] == resumed_from + 5
    assert records[-1]["status"] == "completed" and records[-1]["step"] == 60
    assert json.loads((post / "final.json").read_text())["step"] == 60


# Data position ---------------------------------------------------------------------------------------------
def _tiny_loop(work: Path, **overrides: Any) -> TrainingLoop:
    # The variants' model (width 16): its initial weights and, where the settings agree, its steps and evaluation
    # compile once for these in-process runs and the pipelines above.
    fields: dict[str, Any] = {
        "model_op": EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 16, "depth": 1}),
        "dataset": TrainingDataset(source=NpzSource(path=str(work / "train.npz"))),
        "loss": MSE(),
        "optimizer_config": {"name": "adam", "lr": 0.01},
        "max_steps": 20,
        "batch_size": 8,
        "log_every_n_steps": 5,
        "progress": False,
        "name": "fit",
    }
    fields.update(overrides)
    return TrainingLoop(**fields)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_data_position_restored_at_every_step_gives_the_remaining_batches(tmp_path, prefetch):
    _write_data(tmp_path)
    dataset = TrainingDataset(source=NpzSource(path=str(tmp_path / "train.npz")), prefetch=prefetch)
    per_epoch = dataset.num_batches(16)  # 3 batches per epoch: the run crosses 4 epoch boundaries
    loop = _tiny_loop(
        tmp_path,
        dataset=dataset,
        batch_size=16,
        max_steps=12,
        seed=3,
        callbacks=(Checkpoint(every_n_steps=1, keep=(Every(n=1),)),),
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    with dataset.iterator(16, 3) as it:
        expected = [next(it) for _ in range(20)]  # the uninterrupted sequence, past the end of training
    ckpt = Checkpointer(tmp_path / "run" / "fit" / "checkpoints")
    assert ckpt.steps() == list(range(1, 13))
    for step in ckpt.steps():
        _, data_iter, meta = ckpt.restore(step)
        assert meta["step"] == step
        assert data_iter == {"epoch": step // per_epoch, "batch": step % per_epoch}
        with dataset.iterator(16, 3) as fresh:
            fresh.set_state(data_iter)
            for i, want in enumerate(expected[step:]):
                got = next(fresh)
                assert got.keys() == want.keys()
                for key in want:
                    assert np.array_equal(got[key], want[key]), f"restored at step {step}: batch {step + i}, {key}"


# Refusal and weight-only starts ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def unfinished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An in-process run of variant B (20 steps) whose stage did not finish: checkpoints, no final.json."""
    work = _workspace(tmp_path_factory.mktemp("unfinished"), PIPE_B)
    with _cwd(work):
        code = train_cli.main(["run", "pipe.yaml", "--run-dir", "src", "--no-store", "--set", "max_steps=20"])
    assert code == 0
    (work / "src" / "fit" / "final.json").unlink()  # as if stopped by SIGTERM: an artifact, status "stopped"
    record = json.loads((work / "src" / "fit" / "artifact.json").read_text())
    (work / "src" / "fit" / "artifact.json").write_text(json.dumps({**record, "status": "stopped: SIGTERM"}))
    return work


@GROUP_C
@pytest.mark.parametrize(
    ("override", "changed"),
    [
        ("optimizer_config.lr=0.05", r'-\s+"lr": 0.01,\n\+\s+"lr": 0.05'),
        ("model_op.kwargs.width_size=32", r'-\s+"width_size": 16\n\+\s+"width_size": 32'),
        ("dataset.source.path=other.npz", r'-\s+"dataset_hash": "sha256:\w+",\n\+\s+"dataset_hash": "sha256:\w+"'),
    ],
    ids=["lr", "width", "dataset"],
)
def test_resume_refuses_a_changed_configuration_with_a_readable_diff(unfinished_run, capsys, override, changed):
    work = unfinished_run
    before = _tree_digest(work / "src")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with _cwd(work):
        code = train_cli.main(
            [
                "run",
                "pipe.yaml",
                "--run-dir",
                "src",
                "--no-store",
                "--resume",
                "auto",
                "--set",
                "max_steps=20",
                "--set",
                override,
            ]
        )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("pipekit-train: error: refusing to resume stage 'fit' from step 20")
    assert "the configuration changed since that checkpoint was written" in err
    assert re.search(changed, err), err
    assert "init_from: src/fit/checkpoints@20" in err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # handlers restored
    assert _tree_digest(work / "src") == before  # a refusal writes nothing


@GROUP_C
def test_init_from_starts_a_new_run_from_the_weights_and_records_the_parent(unfinished_run):
    work = unfinished_run
    source_artifact = json.loads((work / "src" / "fit" / "artifact.json").read_text())["artifact_id"]
    # A learning rate too small to move float32 weights: the new run ends on the weights it started from.
    with _cwd(work):
        code = train_cli.main(
            [
                "run",
                "pipe.yaml",
                "--run-dir",
                "warm",
                "--no-store",
                "--set",
                "max_steps=5",
                "--set",
                "init_from=src/fit@latest",
                "--set",
                "optimizer_config={name: sgd, lr: 1.0e-30}",
            ]
        )
    assert code == 0
    artifact = json.loads((work / "warm" / "fit" / "artifact.json").read_text())
    assert source_artifact in artifact["parent_ids"]
    final = json.loads((work / "warm" / "fit" / "final.json").read_text())
    model = LocalModelRegistry(str(work / "warm" / "models")).load(final["model_uri"])
    state, _, _ = Checkpointer(work / "src" / "fit" / "checkpoints").restore("latest")
    started = {**_flat(state["params"]), **_flat(state["consts"])}
    ended = _flat(eqx.filter(model.module, eqx.is_array))
    assert ended.keys() == started.keys()
    for path, value in started.items():
        np.testing.assert_allclose(ended[path], value, rtol=1e-6, err_msg=path)


# restore_best ----------------------------------------------------------------------------------------------
def test_restore_best_returns_the_best_scored_checkpoints_weights(tmp_path):
    _write_data(tmp_path)
    loop = _tiny_loop(
        tmp_path,
        val_dataset=TrainingDataset(source=NpzSource(path=str(tmp_path / "val.npz")), shuffle=False),
        max_steps=30,
        eval_every_n_steps=5,
        restore_best=True,
        callbacks=(Checkpoint(every_n_steps=5, keep=(Best(k=2), Last(n=1))),),
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        model, _ = loop.run()
    ckpt = Checkpointer(tmp_path / "run" / "fit" / "checkpoints")
    best, latest = ckpt.best_step(), ckpt.latest_step()
    assert best is not None and best != latest  # the validation loss got worse: the best is an early step
    final = _flat(eqx.filter(model.module, eqx.is_array))
    for which, should_match in ((best, True), (latest, False)):
        state, _, _ = ckpt.restore(which)
        saved = {**_flat(state["params"]), **_flat(state["consts"])}
        assert saved.keys() == final.keys()
        same = all(np.array_equal(saved[p], final[p]) for p in saved)
        assert same is should_match, f"step {which}: {'differs from' if should_match else 'equals'} the result"


# Corruption ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_from_a_corrupted_checkpoint_fails_naming_the_file_and_loses_nothing(tmp_path):
    work = _workspace(tmp_path / "corrupt", PIPE_B)
    with _cwd(work):
        assert train_cli.main(["run", "pipe.yaml", "--run-dir", "run", "--no-store", "--set", "max_steps=20"]) == 0
    for end in ("final.json", "artifact.json"):  # as if stopped before the stage recorded its end
        (work / "run" / "fit" / end).unlink()
    step_dir = work / "run" / "fit" / "checkpoints" / "20"
    victim = step_dir / "state.bin"  # the default (flat) layout: every leaf's bytes
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = _tree_digest(work / "run")
    proc = _Process(work, "run", resume=True, xla_cache=False)  # its stderr is checked line by line
    assert proc.wait() == 1
    stderr = proc.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("pipekit-train: error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("pipekit-train: error: checkpoint step 20 is corrupted")
    assert f"{victim} (contents changed since commit)" in errors[0]
    assert _tree_digest(work / "run") == before  # nothing written, nothing deleted
    assert Checkpointer(work / "run" / "fit" / "checkpoints").steps() == [15, 20]
    # Orbax's failed restore leaves tensorstore callbacks that raise "Event loop is closed" as unraisable
    # exceptions; the CLI drops exactly those, so the error is the only line.
    noise = [line for line in stderr.splitlines() if line != errors[0]]
    assert not noise, stderr


# Nothing to resume -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_checkpoint", [True, False], ids=["checkpointed", "no-checkpoint-callback"])
def test_resume_auto_with_nothing_to_resume_starts_fresh_with_a_warning(tmp_path, with_checkpoint):
    _write_data(tmp_path)
    callbacks = (Checkpoint(every_n_steps=5),) if with_checkpoint else ()
    loop = _tiny_loop(tmp_path, max_steps=10, callbacks=callbacks)
    where = "checkpoints" if with_checkpoint else "it has no Checkpoint callback"
    expected = rf"resume='auto': nothing to resume in .*{where}.*starting fresh"
    with (
        run_settings(run_dir=str(tmp_path / "run"), store=False, resume="auto"),
        pytest.warns(PipekitTrainWarning, match=expected),
    ):
        _, artifact = loop.run()
    assert artifact.status == "completed"
    records = read_jsonl(tmp_path / "run" / "fit" / "metrics.jsonl")
    assert records[0]["type"] == "params" and records[-1]["step"] == 10


def test_kill_plan_is_deterministic_and_always_kills_during_a_write():
    plans = _kill_plan(seed=11, chains=2, low=12, high=110)
    assert plans == _kill_plan(seed=11, chains=2, low=12, high=110)
    for kills in plans:
        assert [kind for kind, _ in kills].count("save") == 1
        assert kills[1][1] - kills[0][1] >= 15
    three = _three_kinds_plan(seed=11, low=12, high=110)
    assert three == _three_kinds_plan(seed=11, low=12, high=110)
    assert sorted(kind for kind, _ in three) == ["commit", "save", "step"]
    steps = [step for _, step in three]
    assert steps[0] >= 12 and steps[1] - steps[0] >= 15 and steps[2] - steps[1] >= 15 and steps[2] <= 110
