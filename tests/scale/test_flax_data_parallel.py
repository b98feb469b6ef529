"""The Flax backend on 4 virtual CPU devices (a subprocess) against one device (this process): same weights within
float tolerance (the gradient all-reduce sums in another order; see test_data_parallel.py), topology recorded,
parameter sharding refused (the variables stay replicated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pipekit import ConfigError

pytest.importorskip("flax")
pytestmark = pytest.mark.xdist_group("scale-devices")  # one worker; the launches are in group "scale"

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
backend: flax
model_op: {type: FlaxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
loss: {type: MSE}
optimizer_config: {name: adam, lr: 1e-2}
max_steps: 12
batch_size: 16
log_every_n_steps: 4
steps_per_call: 2
progress: false
"""

#: Registers the backend in a checkout whose installed metadata predates the ``flax`` entry point (``--import``).
HELPER = """\
import pipekit_train

if "flax" not in pipekit_train.available_backends():
    pipekit_train.register_backend("flax", "pipekit_train.adapters.flax:backend")
import pipekit_train.adapters.flax  # noqa: F401  the FlaxModel operator type
"""


def _weights(run_dir: Path) -> list[np.ndarray]:
    from pipekit_train.provenance import LocalModelRegistry

    final = json.loads((run_dir / "fit" / "final.json").read_text())
    model = LocalModelRegistry(str(run_dir / "models")).load(final["model_uri"])
    return [np.asarray(x) for x in jax.tree.leaves(model.weights())]


def test_flax_on_four_devices_matches_one_device(tmp_path: Path, xla_cache_env: dict[str, str]) -> None:
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text(PIPELINE)
    (tmp_path / "flax_helper.py").write_text(HELPER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4", **xla_cache_env)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    args = ["run", "pipe.yaml", "--run-dir", "four", "--no-store", "--import", "flax_helper"]
    out = subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    from pipekit_train.cli._main import main

    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["run", str(tmp_path / "pipe.yaml"), "--run-dir", str(tmp_path / "one"), "--no-store",
                     "--import", "flax_helper"]) == 0  # fmt: skip
    finally:
        sys.path.remove(str(tmp_path))
    info = json.loads((tmp_path / "four" / "fit" / "artifact.json").read_text())["backend_info"]
    assert (info["num_devices"], info["num_processes"]) == (4, 1)
    one, four = _weights(tmp_path / "one"), _weights(tmp_path / "four")
    assert len(one) == len(four) == 4
    for a, b in zip(one, four, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_flax_refuses_parameter_sharding() -> None:
    import pipekit
    import pipekit_train
    from pipekit_train.scale._mesh import check_mesh

    exec(HELPER, {})
    loop = pipekit.loads(PIPELINE.replace("progress: false", "progress: false\nmesh: {shard_params: true}"))
    assert isinstance(pipekit_train.TrainingLoop, type) and loop.backend == "flax"
    with pytest.raises(ConfigError, match=r"backend 'flax' keeps its variables replicated"):
        check_mesh(loop)
