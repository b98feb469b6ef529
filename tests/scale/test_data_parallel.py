"""Data parallel over 4 virtual CPU devices, in subprocesses: the same parameters as one device, exact resume.

The test process itself keeps its one CPU device (the bitwise tests elsewhere mean one device); every multi-device
run is a ``python -m pipekit_train.cli run`` subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``.

Why a tolerance and not bitwise against one device: on 4 devices each device computes the gradient of its quarter
of the batch and XLA all-reduces the partial sums; on one device the same sum is one reduction over the whole
batch. Floating-point addition is not associative, so the two sums differ in the last bits, and 12 Adam steps carry
that on. The tolerance (1e-5 relative, 1e-6 absolute, on float32 weights of order 0.1-1) is a few hundred ulps:
far below what a wrong split of the batch (a gradient of a quarter of the data, a mean off by the device count)
would give, which moves the weights by percent after one step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("scale-devices")  # one worker; the launches are in group "scale"

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
  max_steps: 12
  batch_size: 16
  log_every_n_steps: 2
  steps_per_call: 2
  progress: false
  callbacks:
  - {type: Checkpoint, every_n_steps: 4, async_save: false, keep: [{type: Last, n: 2}]}
"""

TIMEOUT = 240


_XLA_CACHE: dict[str, str] = {}


def _env(devices: int) -> dict[str, str]:
    """The subprocesses share a persistent XLA compilation cache (a loaded program is the compiled one, bit for
    bit): the killed and the resumed 4-device runs load what the uninterrupted one compiled."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **_XLA_CACHE)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _args(run: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipekit_train.cli", "run", "pipe.yaml", "--run-dir", run, "--store", f"{run}.sqlite"]


def _run(work: Path, run: str, devices: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_args(run), *extra], cwd=work, env=_env(devices), capture_output=True, text=True, timeout=TIMEOUT
    )


def _in_process(work: Path, run: str, *extra: str) -> int:
    """The CLI in this process (one CPU device): no interpreter start-up and no second import of JAX."""
    from pipekit_train.cli._main import main

    cwd = os.getcwd()
    os.chdir(work)
    try:
        return main([*_args(run)[3:], *extra])
    finally:
        os.chdir(cwd)


def _weights(work: Path, run: str) -> dict[str, np.ndarray]:
    from pipekit_train.provenance import LocalModelRegistry

    final = json.loads((work / run / "fit" / "final.json").read_text())
    model = LocalModelRegistry(str(work / run / "models")).load(final["model_uri"])
    flat = jax.tree_util.tree_flatten_with_path(model.module)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if hasattr(x, "dtype")}


def _backend_info(work: Path, run: str) -> dict[str, Any]:
    from pipekit_train.provenance import ArtifactStore

    final = json.loads((work / run / "fit" / "final.json").read_text())
    with ArtifactStore(str(work / f"{run}.sqlite")) as store:
        return dict(store.get(final["artifact_id"]).backend_info)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, xla_cache_env: dict[str, str]) -> Path:
    root = tmp_path_factory.mktemp("dp")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (root / "pipe.yaml").write_text(PIPELINE)
    _XLA_CACHE.update(xla_cache_env)  # the run's cache (tests/conftest.py)
    out = _run(root, "four", 4)
    assert out.returncode == 0, out.stderr
    assert _in_process(root, "one") == 0
    return root


def test_four_devices_reach_the_one_device_parameters_within_float_tolerance(work: Path) -> None:
    one, four = _weights(work, "one"), _weights(work, "four")
    assert one.keys() == four.keys() and one
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # They did train: 12 Adam steps of lr 1e-2 move the weights by far more than the tolerance.
    from pipekit_train.adapters.equinox import EquinoxModel

    init_key = jax.random.split(jax.random.key(0))[0]  # how a stage of seed 0 draws its initial weights
    fresh = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 16, "depth": 1})
    flat = jax.tree_util.tree_flatten_with_path(fresh.build(init_key))[0]
    start = {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if hasattr(x, "dtype")}
    assert start.keys() == one.keys()
    assert max(float(np.abs(one[n] - start[n]).max()) for n in one) > 1e-2
    info = _backend_info(work, "four")
    assert (info["num_devices"], info["num_processes"], info["shard_params"]) == (4, 1, False)
    assert _backend_info(work, "one")["num_devices"] == 1


def test_sigkill_and_resume_on_four_devices_is_bitwise_the_uninterrupted_run(work: Path) -> None:
    run = "killed"
    proc = subprocess.Popen(
        _args(run), cwd=work, env=_env(4), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    ckdir, started = work / run / "fit" / "checkpoints", time.monotonic()
    while not (ckdir / "8" / "commit_success.txt").exists() and not (ckdir / "4" / "commit_success.txt").exists():
        assert proc.poll() is None, (
            f"the run ended before its first checkpoint: {proc.stderr.read() if proc.stderr else ''}"
        )
        assert time.monotonic() - started < TIMEOUT, "no checkpoint within the time limit"
        time.sleep(0.01)
    proc.kill()
    proc.wait(timeout=30)
    assert not (work / run / "fit" / "final.json").exists(), "killed too late: the run had finished"
    shutil.copytree(work / run, work / "moved")
    shutil.copy(work / f"{run}.sqlite", work / "moved.sqlite")
    resumed = _run(work, run, 4, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    got, want = _weights(work, run), _weights(work, "four")
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_resume_on_another_device_count_continues_and_is_recorded(work: Path) -> None:
    """The 4-device checkpoint of the killed run, resumed here on one device: an elastic resume (no --force-resume;
    docs/reliability.md). The data position is global (one iterator of global batches), so the run takes the same
    batches and ends within the float tolerance (the all-reduce order differs); the artifact records the change."""
    assert (work / "moved").is_dir(), "needs the killed run of the test before"
    # A kill right after a commit leaves a manifest to repair, which warns: record the warnings, do not raise them.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _in_process(work, "moved", "--resume", "auto") == 0
    assert not any("--force-resume" in str(w.message) for w in seen)
    info = _backend_info(work, "moved")
    assert info["num_devices"] == 1
    ((change),) = info["topology_changes"]
    assert change["from"] == {"num_devices": 4, "num_processes": 1}
    assert change["to"] == {"num_devices": 1, "num_processes": 1} and change["step"] in (4, 8)
    want = _weights(work, "four")
    for name, value in _weights(work, "moved").items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
