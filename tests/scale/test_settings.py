"""The `mesh` and `precision` settings in this process (one CPU device): errors, mixed precision, the sharded step.

Multi-device runs are subprocesses (test_data_parallel.py); here a mesh of the one device (``shard_params``) runs
the sharded step, which must give the unsharded step's result bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import MSE, ArraySource, Checkpoint, EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.checkpoint import Checkpointer
from pipekit_train.engine._fingerprint import fingerprint
from pipekit_train.provenance import LocalModelRegistry
from pipekit_train.scale._mesh import check_mesh, mesh_plan
from pipekit_train.scale._precision import check_precision


def _data(n: int = 128) -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(**kw: object) -> TrainingLoop:
    base: dict[str, object] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": 16, "depth": 1}),
        dataset=_data(),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 1e-2},
        max_steps=30,
        batch_size=16,
        log_every_n_steps=5,
        steps_per_call=5,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)  # type: ignore[arg-type]


def _leaves(model_op: object) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(model_op.module) if hasattr(x, "dtype")]  # type: ignore[attr-defined]


# Errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mesh,message",
    [
        ({"shard_param": True}, "TrainingLoop.mesh has no setting 'shard_param' (did you mean 'shard_params'?)"),
        ({"devices": 0}, "TrainingLoop.mesh.devices must be a positive int or 'all', got 0"),
        ({"devices": "many"}, "TrainingLoop.mesh.devices must be a positive int or 'all', got 'many'"),
        ({"shard_params": "yes"}, "TrainingLoop.mesh.shard_params must be true or false, got 'yes'"),
        ([4], "TrainingLoop.mesh must be a mapping"),
    ],
)
def test_bad_mesh_settings_are_one_line_errors(mesh: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _loop(mesh=mesh)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "precision,message",
    [
        ({"compute": "float16"}, "float16 needs loss scaling"),
        ({"params": "bfloat16"}, "TrainingLoop.precision.params must be float32"),
        ({"compute": "bfloat61"}, "got 'bfloat61' (did you mean 'bfloat16'"),
        ({"comput": "bfloat16"}, "no setting 'comput' (did you mean 'compute'?)"),
    ],
)
def test_bad_precision_settings_are_one_line_errors(precision: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _loop(precision=precision)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_more_devices_than_there_are_is_refused_before_training() -> None:
    with pytest.raises(ConfigError, match=r"mesh.devices is 2 but this process has 1 local device"):
        check_mesh(_loop(mesh={"devices": 2}))


def test_backends_without_a_mesh_refuse_one_and_mixed_precision() -> None:
    """NumPyro MCMC trains on one device, Keras and NumPyro SVI in float32: asking for more is a pre-flight error
    (NumPyro SVI trains on a mesh: tests/scale/test_svi_data_parallel.py)."""
    from pipekit_train.backends._registry import get_backend

    def stage(backend: str, **kw: object) -> SimpleNamespace:  # what the checks read of a TrainingLoop
        return SimpleNamespace(backend=backend, adapter=lambda: get_backend(backend), **kw)

    with pytest.raises(ConfigError, match=r"backend 'numpyro-mcmc' trains on one device only"):
        check_mesh(stage("numpyro-mcmc", mesh={"devices": 4}, precision=None))  # type: ignore[arg-type]
    check_mesh(stage("numpyro-mcmc", mesh={"devices": 1}, precision=None))  # type: ignore[arg-type]
    for backend in ("keras", "numpyro-svi"):
        with pytest.raises(ConfigError, match=rf"backend '{backend}' trains in float32 only"):
            check_precision(stage(backend, mesh=None, precision={"compute": "bfloat16"}))


def test_a_batch_the_devices_cannot_split_is_a_preflight_error(tmp_path: Path, xla_cache_env: dict[str, str]) -> None:
    """On 4 virtual devices (a subprocess): `pipekit-train validate` names the batch, the device count, a fix."""
    x = np.zeros((40, 4), np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x[:, :1])
    (tmp_path / "pipe.yaml").write_text(
        "pipekit: 1\ntype: TrainingLoop\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\n"
        "loss: {type: MSE}\nbatch_size: 10\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.update(xla_cache_env)  # the run's persistent compilation cache (tests/conftest.py)
    out = subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli", "validate", "pipe.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 2, out.stderr
    assert "batch_size is 10" in out.stderr and "4 devices" in out.stderr and "multiple of 4" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_default_settings_keep_the_resume_fingerprint() -> None:
    """One device in float32 writes the fingerprint it always did: older checkpoints still resume."""
    assert "mesh" not in fingerprint(_loop()) and "precision" not in fingerprint(_loop())
    assert fingerprint(_loop(precision={"compute": "bfloat16"}))["precision"] == "bfloat16"
    assert fingerprint(_loop(mesh={"shard_params": True}))["mesh"] == {"num_devices": 1, "shard_params": True}


# The sharded step ---------------------------------------------------------------------------------------------
def test_the_sharded_step_on_one_device_is_bitwise_the_unsharded_one(tmp_path: Path) -> None:
    loop = _loop(mesh={"shard_params": True})
    assert mesh_plan(loop) is not None and mesh_plan(_loop()) is None
    with run_settings(run_dir=str(tmp_path / "a"), store=False):
        sharded, artifact = loop.run()
    with run_settings(run_dir=str(tmp_path / "b"), store=False):
        plain, _ = _loop().run()
    assert artifact.backend_info["num_devices"] == 1 and artifact.backend_info["shard_params"] is True
    for a, b in zip(_leaves(sharded), _leaves(plain), strict=True):
        assert np.array_equal(a, b)


def test_a_second_sharded_stage_of_the_same_structure_compiles_nothing(tmp_path: Path) -> None:
    """The sharded step is cached by mesh and static configuration, like the unsharded one (a new seed and a new
    dataset of the same shapes reuse it; the state's placement and the data split are done by the same program)."""
    from pipekit_train.adapters.equinox._steps import CompileCounter

    # A width no other test here uses: the step is keyed by structure (hyperparameters are traced values), so the
    # first run must be the first of its structure in this process to compile at all.
    model = EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": 12, "depth": 1})
    with run_settings(run_dir=str(tmp_path / "a"), store=False), CompileCounter() as first:
        _loop(model_op=model, mesh={"shard_params": True}, max_steps=10, seed=1).run()
    with run_settings(run_dir=str(tmp_path / "b"), store=False), CompileCounter() as second:
        _loop(model_op=model, mesh={"shard_params": True}, max_steps=20, seed=2, dataset=_data(96)).run()
    assert first.count > 0
    assert second.count == 0


# Mixed precision ----------------------------------------------------------------------------------------------
def test_bfloat16_compute_trains_and_keeps_float32_weights_everywhere(tmp_path: Path) -> None:
    callbacks = (Checkpoint(every_n_steps=10, async_save=False),)
    with run_settings(run_dir=str(tmp_path / "bf16"), store=False):
        model, artifact = _loop(precision={"compute": "bfloat16", "params": "float32"}, callbacks=callbacks).run()
    with run_settings(run_dir=str(tmp_path / "f32"), store=False):
        full, _ = _loop().run()
    assert artifact.backend_info["precision"] == "bfloat16"
    # The registered (returned) model and every checkpointed array are float32: the master weights.
    assert {a.dtype for a in _leaves(model)} == {np.dtype("float32")}
    final = json.loads((tmp_path / "bf16" / "stage0" / "final.json").read_text())
    registered = LocalModelRegistry(str(tmp_path / "bf16" / "models")).load(final["model_uri"])
    assert {a.dtype for a in _leaves(registered)} == {np.dtype("float32")}
    ckpt = Checkpointer(tmp_path / "bf16" / "stage0" / "checkpoints")
    assert 30 in ckpt.steps()
    state, _, _ = ckpt.restore(30)
    dtypes = {np.asarray(x).dtype for x in jax.tree.leaves(state) if np.asarray(x).dtype.kind == "f"}
    assert dtypes == {np.dtype("float32")}
    # It trained: the loss went down; and the forward pass really ran in bfloat16 (other weights than float32).
    records = [json.loads(line) for line in (tmp_path / "bf16" / "stage0" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("type") == "metrics" and r.get("context") == "train"]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0]
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(model), _leaves(full), strict=True))


def test_backend_info_lists_the_devices_that_trained(tmp_path: Path, xla_cache_env: dict[str, str]) -> None:
    """On 4 virtual devices a stage with ``mesh: {devices: 1}`` listed all 4 as its devices."""
    script = (
        "import json, numpy as np\n"
        "from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, run_settings\n"
        "x = np.zeros((32, 4), np.float32)\n"
        "data = TrainingDataset(source=ArraySource(arrays={'x': x, 'y': x[:, :1]}))\n"
        "infos = []\n"
        "for mesh in ({'devices': 1}, {'devices': 2}):\n"
        "    loop = TrainingLoop(model_op=EquinoxModel(factory='mlp', kwargs={'in_size': 4, 'out_size': 1}),\n"
        "                        dataset=data, loss=MSE(), max_steps=1, batch_size=8, mesh=mesh, progress=False)\n"
        "    with run_settings(store=False):\n"
        "        infos.append(loop.run()[1].backend_info)\n"
        "print(json.dumps([{k: i.get(k) for k in ('devices', 'available_devices', 'num_devices')} for i in infos]))\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.update(xla_cache_env, PYTHONPATH=src)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    one, two = json.loads(out.stdout.strip().splitlines()[-1])
    every = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert one == {"devices": every[:1], "available_devices": every, "num_devices": 1}
    assert two == {"devices": every[:2], "available_devices": every, "num_devices": 2}
