"""NumPyro SVI data parallel over 4 virtual CPU devices (in a subprocess) against the same fit on one device.

Why a tolerance and not bitwise: on 4 devices each device sums the log-likelihood of its quarter of the batch and
XLA all-reduces the partial gradients; on one device it is one sum. Float addition is not associative, so the
guide's parameters differ in the last bits after the 20 Adam steps (a few float32 ulps per step; 1e-4 relative
leaves room), while a wrong split (a quarter of the data, a likelihood scale off by the device count) moves them
by percent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.xdist_group("scale-devices"), pytest.mark.slow]

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: svi
backend: numpyro-svi
model_op: {type: NumpyroGuide, model: linear_regression, guide: AutoNormal}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
loss: {type: Trace_ELBO, num_particles: 1}
optimizer_config: {name: adam, lr: 0.05}
max_steps: 20
batch_size: 32
steps_per_call: 10
log_every_n_steps: 10
progress: false
"""


def _guide_params(run: Path) -> dict[str, np.ndarray]:
    from pipekit_train.provenance import LocalModelRegistry

    final = json.loads((run / "svi" / "final.json").read_text())
    guide = LocalModelRegistry(str(run / "models")).load(final["model_uri"])
    return {k: np.asarray(v) for k, v in guide.params.items()}


def test_svi_on_four_devices_fits_the_one_device_guide_within_float_tolerance(
    tmp_path: Path, xla_cache_env: dict[str, str]
) -> None:
    pytest.importorskip("numpyro")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3 + 0.1 * rng.normal(size=128)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=y[:, None])
    (tmp_path / "pipe.yaml").write_text(PIPELINE)
    args = ["run", "pipe.yaml", "--no-store", "--run-dir"]
    runs = {1: tmp_path / "d1", 4: tmp_path / "d4"}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4", **xla_cache_env)
    command = [sys.executable, "-m", "pipekit_train.cli", *args, str(runs[4])]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    from pipekit_train.cli._main import main

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # one device: this process's own
        assert main([*args, str(runs[1])]) == 0
    finally:
        os.chdir(cwd)
    info = json.loads((runs[4] / "svi" / "artifact.json").read_text())["backend_info"]
    assert (info["num_devices"], info["num_processes"]) == (4, 1)
    assert json.loads((runs[1] / "svi" / "artifact.json").read_text())["backend_info"]["num_devices"] == 1
    one, four = _guide_params(runs[1]), _guide_params(runs[4])
    assert one.keys() == four.keys() and one
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # It did fit: the weights' means left the AutoNormal start (0) towards (1, -2, 0.5), by far more than the tolerance.
    assert np.array_equal(np.sign(one["w_auto_loc"]), [1.0, -1.0, 1.0]) and np.abs(one["w_auto_loc"]).min() > 0.1
