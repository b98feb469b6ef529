"""Device-resident training data: the same batches as the host path, the same data position, exact resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    EquinoxModel,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.data import Normalize, OneHot, Transform, _device
from pipekit_train.data._device import ResidentBatches, check_forced, resident_reason


def _arrays(n: int = 100, d: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    return {"x": x, "y": (x.sum(axis=1, keepdims=True) > 0).astype(np.float32), "label": np.arange(n) % 3}


def _dataset(**kw: Any) -> TrainingDataset:
    return TrainingDataset(source=ArraySource(arrays=_arrays()), **kw)


class _Clip(Transform, register=False):
    """A user transform that does not say it is per-record: it keeps the stage on the host path."""

    def apply(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**batch, "x": np.clip(batch["x"], -1, 1)}

    def spec(self, spec: Any) -> Any:
        return spec


class _PerRecordClip(_Clip, register=False):
    per_record = True


# Which path ----------------------------------------------------------------------------------------------------
def test_the_device_path_is_chosen_only_where_it_is_exact(monkeypatch):
    ds = _dataset()
    assert resident_reason(ds, 8, backend_ok=True) is None
    assert resident_reason(ds.replace(transforms=(Normalize(key="x", mean=0.0, std=2.0),)), 8, True) is None
    assert resident_reason(ds.replace(transforms=(_PerRecordClip(),)), 8, True) is None
    reasons = {
        "device_resident is false": resident_reason(ds.replace(device_resident=False), 8, True),
        "backend or mesh": resident_reason(ds, 8, backend_ok=False),
        "transform _Clip must run on the host": resident_reason(ds.replace(transforms=(_Clip(),)), 8, True),
        "prefetch is 2": resident_reason(ds.replace(prefetch=2), 8, True),
        "short last batch of 4": resident_reason(ds.replace(drop_remainder=False), 8, True),
    }
    for expected, reason in reasons.items():
        assert reason is not None and expected in reason, (expected, reason)
    monkeypatch.setattr(_device, "DEVICE_RESIDENT_MAX_BYTES", 1024)
    too_big = resident_reason(ds, 8, True)
    assert too_big is not None and "2800 bytes, above the 1024 bytes threshold" in too_big  # 100 x (16 + 4 + 8) bytes
    assert resident_reason(ds.replace(device_resident=True), 8, True) is None  # forced: the size is the user's call


def test_forcing_the_device_path_where_it_cannot_be_is_one_error_naming_the_reason():
    ds = _dataset(device_resident=True, transforms=(_Clip(),))
    with pytest.raises(ConfigError, match=r"device_resident is true but .*transform _Clip must run on the host"):
        check_forced(ds, resident_reason(ds, 8, True))
    with pytest.raises(ConfigError, match=r"TrainingDataset.device_resident must be bool or one of 'auto'"):
        _dataset(device_resident="yes")


# Same batches, same position -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_device_windows_hold_the_host_batches_across_epochs(shuffle):
    """Windows of 7 steps over 12-batch epochs (crossing epochs) slice exactly the host iterator's batches, one
    by one (`take`, the one-step call's) and all at once (`stacked`, a fused chunk's)."""
    ds = _dataset(shuffle=shuffle, transforms=(OneHot(key="label", num_classes=3),))
    host = ds.iterator(8, seed=5)
    resident = ResidentBatches(ds, 8, seed=5, max_steps_per_window=7)
    take = jax.jit(lambda window, i: window.take(i))
    stacked = jax.jit(lambda window: window.stacked(7))
    for _ in range(6):  # 42 steps: three and a half epochs
        assert resident.get_state() == host.get_state()
        window = resident.window(7)
        together = stacked(window)
        for i in range(7):
            expected = next(host)
            got = take(window, np.int32(i))
            assert set(got) == set(expected) == set(together)
            for key in expected:
                np.testing.assert_array_equal(np.asarray(got[key]), expected[key])
                np.testing.assert_array_equal(np.asarray(together[key][i]), expected[key])
    assert resident.get_state() == host.get_state() == {"epoch": 3, "batch": 6}
    with pytest.raises(ValueError, match=r"8 steps, but windows of 1 to 7 were planned"):
        resident.window(8)  # past the rows it ordered: refused, never a clamped slice of other rows


def test_the_compiled_gather_of_other_devices_orders_the_rows_as_numpy_does_on_the_cpu():
    """Off the CPU the epoch's rows are ordered by a compiled gather on the device (on the CPU by NumPy, which
    compiles nothing): both give the same arrays, crossing into the next epoch."""
    ds = _dataset(transforms=(OneHot(key="label", num_classes=3),))
    numpy_path = ResidentBatches(ds, 8, seed=3, max_steps_per_window=5)
    device_path = ResidentBatches(ds, 8, seed=3, max_steps_per_window=5)
    assert numpy_path._on_cpu
    device_path._on_cpu = False  # as on a GPU
    for _ in range(4):  # 20 steps over 12-batch epochs
        a, b = numpy_path.window(5), device_path.window(5)
        assert int(a.first) == int(b.first)
        for key in a.arrays:
            np.testing.assert_array_equal(np.asarray(a.arrays[key]), np.asarray(b.arrays[key]))


def test_the_data_position_means_the_same_on_both_paths():
    ds = _dataset()
    resident = ResidentBatches(ds, 8, seed=1, max_steps_per_window=4)
    host = ds.iterator(8, seed=1)
    resident.set_state({"epoch": 2, "batch": 11})
    host.set_state({"epoch": 2, "batch": 11})
    for _ in range(3):  # crosses into epoch 3
        np.testing.assert_array_equal(next(resident)["x"], next(host)["x"])
    assert resident.get_state() == host.get_state() == {"epoch": 3, "batch": 2}
    with pytest.raises(ConfigError, match=r"batch must be below the 12 batches per epoch, got 12"):
        resident.set_state({"epoch": 0, "batch": 12})
    with pytest.raises(ConfigError, match=r"expects \{'epoch': int, 'batch': int\}"):
        resident.set_state({"next_index": 3})


# Training --------------------------------------------------------------------------------------------------------
MLP = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 12, "depth": 1})


def _loop(dataset: TrainingDataset, **kw: Any) -> TrainingLoop:
    base: dict[str, Any] = dict(
        model_op=MLP,
        dataset=dataset,
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=50,
        batch_size=8,
        log_every_n_steps=10,
        seed=4,
        input_key="x",
        target_key="y",
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _weights(model: Any) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model.module, eqx.is_array))]


def _assert_bitwise(a: Any, b: Any) -> None:
    for u, v in zip(_weights(a), _weights(b), strict=True):
        np.testing.assert_array_equal(u, v)


def test_training_on_the_device_path_is_bitwise_the_host_path():
    data = TrainingDataset(source=ArraySource(arrays={k: v for k, v in _arrays().items() if k != "label"}))
    with run_settings(store=False):
        device, device_artifact = _loop(data).run()
        host, host_artifact = _loop(data.replace(device_resident=False)).run()
        single, _ = _loop(data.replace(device_resident=False), steps_per_call=1).run()
        device_single, device_single_artifact = _loop(data, steps_per_call=1).run()
    assert device_artifact.backend_info["data"] == "device" and host_artifact.backend_info["data"] == "host"
    assert device_artifact.backend_info["steps_per_call"] == 10
    assert device_single_artifact.backend_info["data"] == "device"
    _assert_bitwise(device, host)
    _assert_bitwise(device, single)
    _assert_bitwise(device, device_single)  # one step a call: each batch one slice of the epoch's ordered rows


class _StopAt(Callback, register=False):
    """Asks the run to stop after step `at` (a graceful stop between checkpoints); not part of the fingerprint."""

    at: int = 23

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if ctx.step == self.at:
            ctx.request_stop("test stop")

    def fingerprint(self) -> Any:
        return None


def test_a_run_stopped_and_resumed_on_the_device_path_ends_bitwise_equal(tmp_path):
    data = TrainingDataset(source=ArraySource(arrays={k: v for k, v in _arrays().items() if k != "label"}))
    checkpoint = Checkpoint(every_n_steps=20)
    with run_settings(store=False, run_dir=str(tmp_path / "whole")):
        whole, _ = _loop(data, callbacks=(checkpoint,)).run()
    with run_settings(store=False, run_dir=str(tmp_path / "cut")):
        _, stopped = _loop(data, callbacks=(checkpoint, _StopAt())).run()
    assert stopped.backend_info["steps"] == 23 and stopped.backend_info["data"] == "device"
    with run_settings(store=False, run_dir=str(tmp_path / "cut"), resume="auto"):
        resumed, artifact = _loop(data, callbacks=(checkpoint,)).run()
    assert artifact.backend_info["data"] == "device" and artifact.backend_info["steps"] == 50
    _assert_bitwise(resumed, whole)
