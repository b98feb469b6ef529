"""Two processes x two CPU devices on localhost (`pipekit-train launch`, jax.distributed with gloo collectives).

Every multi-process run is a real ``pipekit-train launch`` subprocess tree; the test process itself never initializes
`jax.distributed`. What is asserted:

- the uninterrupted 2x2 run records exactly one artifact, naming 2 processes and 4 devices, and its checkpoints hold
  each process's data position;
- every process SIGKILLed after the first checkpoint, then ``--resume auto`` with the same topology: the final
  parameters are **bitwise** those of the uninterrupted 2x2 run (same devices, same all-reduce order, same batches:
  nothing is left to differ), and the store holds one artifact for the run;
- the killed run's checkpoint resumed by one process with one device continues (an elastic resume) within float
  tolerance of the uninterrupted run, the topology change recorded in the artifact;
- a failing process makes `launch` stop the others and end with one line naming it;
- one process SIGKILLs itself after step 10 (a test callback, `killer.py`, imported with ``--import``): `launch`
  stops the survivor at once with one line naming the lost process and the signal, no step directory is left
  half-committed, and ``--resume auto`` ends bitwise where the uninterrupted run ended;
- the same kill without `launch` (two ``pipekit-train run`` started by hand): the survivor, stuck in a collective,
  is stopped by JAX's coordination service once the lost process misses its heartbeats
  (``PIPEKIT_HEARTBEAT_TIMEOUT``), naming the lost task.

Against one process with 4 devices the 2x2 run agrees within float tolerance only: gloo's cross-process all-reduce
adds the partial gradients in another order than XLA's in-process one (measured: 6e-8 at most after 24 steps).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.xdist_group("scale"), pytest.mark.slow]  # the gloo launches: one module at a time

PIPELINE = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 24
  batch_size: 16
  log_every_n_steps: 2
  steps_per_call: 2
  progress: false
  callbacks:
  - {type: Checkpoint, every_n_steps: 4, async_save: true, keep: [{type: Last, n: 2}]}
"""

TIMEOUT = 240
_CACHE: dict[str, str] = {}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("PIPEKIT_")}
    env.update(JAX_PLATFORMS="cpu", **_CACHE)
    return env


def _launch_args(run: str, *extra: str, processes: int = 2, pipeline: str = "pipe.yaml") -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipekit_train.cli",
        "launch",
        "--num-processes",
        str(processes),
        "--devices-per-process",
        "2",
        pipeline,
        "--run-dir",
        run,
        "--store",
        f"{run}.sqlite",
        *extra,
    ]


def _launch(
    work: Path, run: str, *extra: str, pipeline: str = "pipe.yaml", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _launch_args(run, *extra, pipeline=pipeline),
        cwd=work,
        env={**_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _weights(work: Path, run: str) -> dict[str, np.ndarray]:
    import jax

    from pipekit_train.provenance import LocalModelRegistry

    final = json.loads((work / run / "fit" / "final.json").read_text())
    model = LocalModelRegistry(str(work / run / "models")).load(final["model_uri"])
    flat = jax.tree_util.tree_flatten_with_path(model.module)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if hasattr(x, "dtype")}


def _artifacts(work: Path, run: str) -> list[dict[str, Any]]:
    import sqlite3

    with sqlite3.connect(work / f"{run}.sqlite") as conn:
        rows = conn.execute("SELECT artifact_id FROM artifacts").fetchall()
    from pipekit_train.provenance import ArtifactStore

    with ArtifactStore(str(work / f"{run}.sqlite")) as store:
        return [dict(store.get(r[0]).backend_info) for r in rows]


#: A test-only callback: process `process` SIGKILLs itself after step `step`, when $KILL_PROCESS_AT is set.
KILLER = """\
import os
import signal

from pipekit_train import Callback


class KillProcessAt(Callback):
    step: int = 10
    process: int = 1

    def on_step_end(self, ctx, metrics):
        import jax

        if os.environ.get("KILL_PROCESS_AT") and ctx.step >= self.step and jax.process_index() == self.process:
            os.kill(os.getpid(), signal.SIGKILL)

    def fingerprint(self):
        return None  # observes only: the resumed run (without $KILL_PROCESS_AT) is the same training
"""
KILL = "  - {type: KillProcessAt, step: 10, process: 1}\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, xla_cache_env: dict[str, str]) -> Path:
    root = tmp_path_factory.mktemp("mp")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (root / "pipe.yaml").write_text(PIPELINE)
    (root / "pipe_kill.yaml").write_text(PIPELINE + KILL)
    (root / "killer.py").write_text(KILLER)
    _CACHE.update(xla_cache_env)  # the run's persistent compilation cache (tests/conftest.py)
    out = _launch(root, "full")
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def test_two_processes_record_one_artifact_naming_the_topology(work: Path) -> None:
    (info,) = _artifacts(work, "full")  # exactly one artifact: process 0 records, process 1 does not
    assert (info["num_processes"], info["num_devices"], info["shard_params"]) == (2, 4, False)
    # Each process's data position is in the checkpoint, keyed by process index.
    latest = max(int(p.name) for p in (work / "full" / "fit" / "checkpoints").iterdir() if p.name.isdigit())
    data_iter = json.loads((work / "full" / "fit" / "checkpoints" / str(latest) / "data_iter" / "metadata").read_text())
    assert data_iter["num_processes"] == 2 and len(data_iter["by_process"]) == 2
    # 24 steps of 4 batches per epoch (64 records, global batch 16): the next batch is batch 0 of epoch 6.
    assert data_iter["by_process"] == [{"epoch": 6, "batch": 0}] * 2
    # One metrics file, written by process 0 only, with one finish record.
    records = [json.loads(line) for line in (work / "full" / "fit" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["type"] == "finish" for r in records) == 1


def test_sigkill_every_process_and_resume_is_bitwise_the_uninterrupted_run(work: Path) -> None:
    run = "killed"
    proc = subprocess.Popen(
        _launch_args(run), cwd=work, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()
    found = re.search(r"pids ([\d, ]+)\)", first)
    assert found, first
    pids = [int(p) for p in found.group(1).split(", ")]
    ckdir, started = work / run / "fit" / "checkpoints", time.monotonic()
    while not (ckdir / "4" / "commit_success.txt").exists():
        assert proc.poll() is None, f"the run ended before its first checkpoint: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() - started < TIMEOUT, "no checkpoint within the time limit"
        time.sleep(0.01)
    for pid in [*pids, proc.pid]:  # every process of the run, and the launcher
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    assert not (work / run / "fit" / "final.json").exists(), "killed too late: the run had finished"
    shutil.copytree(work / run, work / "moved")  # for the topology test below
    resumed = _launch(work, run, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _weights(work, run), _weights(work, "full")
    assert got.keys() == want.keys() and want
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    (info,) = _artifacts(work, run)
    assert (info["num_processes"], info["num_devices"]) == (2, 4)


def _committed_or_set_aside(ckdir: Path) -> list[int]:
    """The committed steps of a checkpoint directory, asserting that nothing else looks like a step."""
    steps = []
    for entry in ckdir.iterdir():
        if entry.name.isdigit():  # a step directory exists only after its commit rename
            assert (entry / "commit_success.txt").is_file() and (entry / "_CHECKPOINT_METADATA").is_file(), entry
            steps.append(int(entry.name))
        else:
            assert entry.name == "manifest.json" or ".orbax-checkpoint-tmp" in entry.name, entry
    return sorted(steps)


def test_one_process_sigkilled_stops_the_other_and_resumes_bitwise(work: Path) -> None:
    run = "lost"
    out = _launch(work, run, "--import", "killer", pipeline="pipe_kill.yaml", env={"KILL_PROCESS_AT": "1"})
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert re.match(
        r"pipekit-train launch: process 1 of 2 \(pid \d+\) was killed by SIGKILL, so the run cannot go on", last
    )
    assert "--resume auto" in last and "stopped the other 1" in last, last
    assert not (work / run / "fit" / "final.json").exists()
    steps = _committed_or_set_aside(work / run / "fit" / "checkpoints")
    assert steps and max(steps) <= 10, steps  # killed after step 10: step 12 was never reached

    resumed = _launch(work, run, "--import", "killer", "--resume", "auto", pipeline="pipe_kill.yaml")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _weights(work, run), _weights(work, "full")
    assert got.keys() == want.keys() and want
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_one_process_sigkilled_without_launch_stops_the_other_by_heartbeat(work: Path) -> None:
    """No supervisor: JAX's coordination service stops the survivor once the lost process misses its heartbeats; or,
    when the kill lands while the survivor is inside a compiled collective with it, gloo's transport does first (it
    reads the dead peer's half-sent message: "Received data size doesn't match expected size"), a race of the
    host's timing seen once under the full suite's load. Either way the survivor ends on the lost peer."""
    from pipekit_train.cli._launch import _free_port, child_env

    port, procs = _free_port(), []
    for index in (0, 1):
        env = child_env({**_env(), "KILL_PROCESS_AT": "1", "PIPEKIT_HEARTBEAT_TIMEOUT": "3"}, port, 2, index, 2)
        command = [sys.executable, "-m", "pipekit_train.cli", "run", "pipe_kill.yaml", "--import", "killer"]
        command += ["--run-dir", "unsupervised", "--store", "unsupervised.sqlite"]
        procs.append(subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errors = [p.communicate(timeout=TIMEOUT)[1].decode(errors="replace") for p in procs]
    assert procs[1].returncode == -signal.SIGKILL, errors[1][-2000:]
    assert procs[0].returncode not in (0, None), errors[0][-2000:]  # stopped, not hanging (TIMEOUT bounds it)
    heartbeat = r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b"
    collective = r"gloo::(EnforceNotMet|IoException)[\s\S]*(Received data size|Connection (closed|reset) by peer)"
    assert re.search(f"{heartbeat}|{collective}", errors[0]), errors[0][-2000:]


def test_resume_with_another_process_count_continues_and_is_recorded(work: Path) -> None:
    """The killed 2x2 run's checkpoint resumed here, by one process with one device: an elastic resume, within float
    tolerance of the uninterrupted 2x2 run, the change recorded (tests/scale/test_elastic.py compares the batches)."""
    assert (work / "moved").is_dir(), "needs the killed run of the test before"
    from pipekit_train.checkpoint._layout import _uncommitted_reason
    from pipekit_train.cli._main import main

    # The kill lands within a poll of step 4's commit: before or after the manifest listed it, as the host's speed
    # has it. A committed step left out is listed again, and said so; otherwise nothing is said.
    ckdir = work / "moved" / "fit" / "checkpoints"
    manifest = ckdir / "manifest.json"
    listed = {e["step"] for e in json.loads(manifest.read_text())["entries"]} if manifest.exists() else set()
    committed = {int(p.name) for p in ckdir.iterdir() if p.name.isdigit() and _uncommitted_reason(p) is None}
    unlisted = sorted(committed - listed)  # (the kill may also have left a manifest's temporary file)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(["run", "pipe.yaml", "--run-dir", "moved", "--store", "moved.sqlite", "--resume", "auto"])
    finally:
        os.chdir(cwd)
    # (A kill after the manifest update but before the retention's deletions is said in its own words.)
    kinds = ("were committed but missing from manifest.json", "were dropped by the retention policy")
    repaired = [str(w.message) for w in caught if any(kind in str(w.message) for kind in kinds)]
    lists = [re.search(r"step\(s\) \[([\d, ]*)\]", m) for m in repaired]
    said = sorted(int(n) for found in lists if found for n in found.group(1).split(", "))
    assert said == unlisted and all(lists), (unlisted, repaired)
    assert code == 0
    (info,) = _artifacts(work, "moved")
    ((change),) = info["topology_changes"]
    assert (change["from"], change["to"]) == (
        {"num_devices": 4, "num_processes": 2},
        {"num_devices": 1, "num_processes": 1},
    )
    got, want = _weights(work, "moved"), _weights(work, "full")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_failing_process_stops_the_others_with_one_line(tmp_path: Path) -> None:
    """`launch`'s supervisor with real processes: one fails at once, the other would run for a minute."""
    from pipekit_train.cli._launch import _Relay, _supervise

    code = "import sys, time; sys.stderr.write('boom: the data file is missing\\n'); sys.exit(3)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ),
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE),
    ]
    sink = open(tmp_path / "out", "wb")  # noqa: SIM115 - closed below
    relays = []
    for i, p in enumerate(procs):
        assert p.stdout is not None and p.stderr is not None
        pair = (_Relay(p.stdout, sink, f"[{i}/2] "), _Relay(p.stderr, sink, f"[{i}/2] "))
        for r in pair:
            r.start()
        relays.append(pair)
    started = time.monotonic()
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _supervise(procs, relays, []) == 3
    sink.close()
    assert time.monotonic() - started < 30, "the sleeping process was not stopped"
    assert procs[0].returncode == -signal.SIGKILL
    line = err.getvalue().strip()
    assert line.count("\n") == 0, line
    assert "process 1 of 2 exited with code 3; stopped the other 1" in line
    assert "boom: the data file is missing" in line
    assert b"[1/2] boom" in (tmp_path / "out").read_bytes()


def test_launch_reports_a_bad_run_argument_in_one_line(work: Path) -> None:
    out = _launch(work, "bad", "--resume", "sometimes")
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pipekit-train launch: process ") and "exited with code 2" in last, out.stderr
    assert "unknown value for --resume 'sometimes'" in last


def test_environment_settings_and_their_errors() -> None:
    from pipekit import ConfigError
    from pipekit_train.scale._distributed import settings_from_env

    assert settings_from_env({}) is None
    assert settings_from_env({"PIPEKIT_NUM_PROCESSES": "1", "PIPEKIT_PROCESS_ID": "0",
                              "PIPEKIT_COORDINATOR": "h:1"}) is None  # fmt: skip
    full = {"PIPEKIT_COORDINATOR": "10.0.0.1:1234", "PIPEKIT_NUM_PROCESSES": "4", "PIPEKIT_PROCESS_ID": "3"}
    assert settings_from_env(full) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert settings_from_env({"PIPEKIT_DISTRIBUTED": "auto"}) == {}  # JAX detects the cluster
    # JAX's own variable alone: JAX reads the process count and id (its variables or the cluster's).
    assert settings_from_env({"JAX_COORDINATOR_ADDRESS": "h:9"}) == {"coordinator_address": "h:9"}
    assert settings_from_env({**full, "PIPEKIT_DISTRIBUTED": "off"}) is None
    with pytest.raises(ConfigError, match=r"\$PIPEKIT_PROCESS_ID not set"):
        settings_from_env({"PIPEKIT_COORDINATOR": "h:1", "PIPEKIT_NUM_PROCESSES": "2"})
    with pytest.raises(ConfigError, match=r"\$PIPEKIT_PROCESS_ID must be below \$PIPEKIT_NUM_PROCESSES \(2\), got 2"):
        settings_from_env({**full, "PIPEKIT_NUM_PROCESSES": "2", "PIPEKIT_PROCESS_ID": "2"})
    with pytest.raises(ConfigError, match=r"\$PIPEKIT_NUM_PROCESSES must be an int of at least 1, got 'two'"):
        settings_from_env({**full, "PIPEKIT_NUM_PROCESSES": "two"})
    with pytest.raises(ConfigError, match=r"\$PIPEKIT_COORDINATOR must be host:port, got 'localhost'"):
        settings_from_env({**full, "PIPEKIT_COORDINATOR": "localhost"})
    with pytest.raises(ConfigError, match=r"\$PIPEKIT_DISTRIBUTED must be 'auto' .* got 'yes'"):
        settings_from_env({"PIPEKIT_DISTRIBUTED": "yes"})
    assert settings_from_env({**full, "PIPEKIT_HEARTBEAT_TIMEOUT": "5"})["heartbeat_timeout_seconds"] == 5
    with pytest.raises(ConfigError, match=r"\$PIPEKIT_HEARTBEAT_TIMEOUT must be an int of at least 1, got '0'"):
        settings_from_env({**full, "PIPEKIT_HEARTBEAT_TIMEOUT": "0"})


def test_each_process_reads_its_part_of_every_global_batch() -> None:
    """The processes' batches, put side by side, are exactly the one-process batches (shuffled, over epochs)."""
    from pipekit_train.data._dataset import TrainingDataset
    from pipekit_train.data._sources import ArraySource

    ds = TrainingDataset(source=ArraySource(arrays={"x": np.arange(40.0), "y": np.arange(40)}))
    whole = ds.iterator(batch_size=8, seed=3)
    parts = [ds.iterator(batch_size=8, seed=3, shard=(p, 2)) for p in range(2)]
    for _ in range(12):  # 5 batches per epoch: crosses two epoch ends
        want = next(whole)
        got = [next(it) for it in parts]
        assert all(len(g["y"]) == 4 for g in got)
        np.testing.assert_array_equal(np.concatenate([g["y"] for g in got]), want["y"])
    assert parts[0].get_state() == parts[1].get_state() == whole.get_state()
    from pipekit import ConfigError

    with pytest.raises(ConfigError, match=r"shard \(0, 3\) must be .* count dividing batch_size 8"):
        ds.iterator(batch_size=8, seed=0, shard=(0, 3))


def test_a_checkpoint_data_position_for_each_topology() -> None:
    from pipekit import ConfigError
    from pipekit_train.scale._distributed import local_data_state

    assert local_data_state({"epoch": 1, "batch": 2}, "here") == {"epoch": 1, "batch": 2}  # one process wrote it
    same = {"num_processes": 2, "by_process": [{"epoch": 1, "batch": 2}] * 2}
    assert local_data_state(same, "here") == {"epoch": 1, "batch": 2}  # global position: any count resumes it
    apart = {"num_processes": 2, "by_process": [{"epoch": 1, "batch": 2}, {"epoch": 1, "batch": 3}]}
    with pytest.raises(ConfigError, match=r"here: the checkpoint was written by 2 processes.*this run has 1"):
        local_data_state(apart, "here")
