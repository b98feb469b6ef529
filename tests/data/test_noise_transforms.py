"""Denoising pretext transforms: `GaussianNoise` and `MaskInputs`, drawn per record and position so resume is exact."""

from __future__ import annotations

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import MSE, Checkpoint, EquinoxModel, TrainingLoop, read_jsonl, run_settings
from pipekit_train.data import ArraySource, GaussianNoise, MaskInputs, TrainingDataset
from pipekit_train.data._noise import hashed_uniform


def _dataset(n: int = 40, width: int = 16, **kwargs) -> TrainingDataset:
    x = np.linspace(0.0, 1.0, n * width, dtype=np.float32).reshape(n, width)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "id": np.arange(n)}), **kwargs)


def _noise() -> GaussianNoise:
    return GaussianNoise(key="x", std=0.5, clean_key="x_clean")


def test_gaussian_noise_has_the_asked_level_and_keeps_the_clean_copy():
    x = np.zeros((2000, 32), np.float32)
    out = GaussianNoise(key="x", std=0.5, clean_key="x_clean").apply({"x": x})
    assert out["x"].dtype == np.float32
    assert abs(float(out["x"].mean())) < 0.01
    assert abs(float(out["x"].std()) - 0.5) < 0.01
    assert out["x_clean"] is x  # the clean input, untouched
    assert not x.any()
    clipped = GaussianNoise(key="x", std=0.5, clip=(0.0, 1.0)).apply({"x": x})["x"]
    assert clipped.min() == 0.0 and clipped.max() <= 1.0 and 0.45 < (clipped > 0).mean() < 0.55


def test_masking_drops_the_asked_fraction():
    x = np.ones((1000, 64), np.float32)
    out = MaskInputs(key="x", rate=0.25, value=-1.0, clean_key="x_clean").apply({"x": x})
    masked = out["x"] == -1.0
    assert abs(float(masked.mean()) - 0.25) < 0.01
    assert set(np.unique(out["x"])) == {-1.0, 1.0}
    np.testing.assert_array_equal(out["x_clean"], x)


def test_noise_depends_on_record_epoch_and_seed_only():
    t = _noise()
    x = np.zeros((4, 16), np.float32)
    records = np.array([3, 9, 1, 7])
    a = t.apply_at({"x": x}, records, epoch=2, seed=5)["x"]
    # The same record gets the same noise in any batch (another batch size, another position in it).
    b = t.apply_at({"x": x[:2]}, np.array([7, 3]), epoch=2, seed=5)["x"]
    np.testing.assert_array_equal(a[3], b[0])
    np.testing.assert_array_equal(a[0], b[1])
    # Another epoch, iterator seed or transform seed: other noise.
    for other in (
        t.apply_at({"x": x}, records, epoch=3, seed=5)["x"],
        t.apply_at({"x": x}, records, epoch=2, seed=6)["x"],
        t.replace(seed=1).apply_at({"x": x}, records, epoch=2, seed=5)["x"],
    ):
        assert not np.any(other == a)
    # Positions within a record and records are not correlated.
    u = hashed_uniform((64,), np.arange(500), (0, 0, 0))
    corr = np.corrcoef(u[:, 0], u[:, 1])[0, 1]
    assert abs(corr) < 0.15 and abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("prefetch", [0, 2])
def test_iterator_resumes_to_the_same_noisy_batches(prefetch):
    ds = _dataset(transforms=(_noise(), MaskInputs(key="x", rate=0.3)), prefetch=prefetch)
    it = ds.iterator(batch_size=8, seed=4)
    batches = [next(it) for _ in range(12)]  # 5 batches per epoch: crosses two epoch boundaries
    plain = _dataset(transforms=ds.transforms).iterator(batch_size=8, seed=4)
    for b in batches:
        np.testing.assert_array_equal(next(plain)["x"], b["x"])  # with or without Grain's prefetching
    for i in range(12):
        resumed = ds.iterator(batch_size=8, seed=4)
        resumed.set_state({"epoch": i // 5, "batch": i % 5})
        got = next(resumed)
        np.testing.assert_array_equal(got["x"], batches[i]["x"])
        np.testing.assert_array_equal(got["x_clean"], batches[i]["x_clean"])
        resumed.close()
    it.close()
    # Fresh noise each epoch: record 0 is seen once per epoch, never with the same noise.
    seen = [b["x"][list(b["id"]).index(0)] for b in batches[:10] if 0 in b["id"]]
    assert len(seen) == 2 and not np.array_equal(seen[0], seen[1])


def test_evaluation_batches_are_deterministic():
    ds = _dataset(transforms=(_noise(),))
    first = [b["x"] for b in ds.epoch_batches(16)]
    second = [b["x"] for b in ds.epoch_batches(16)]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_spec_and_errors():
    ds = _dataset(transforms=(_noise(),))
    assert ds.element_spec()["x_clean"] == ((16,), np.dtype(np.float32))
    with pytest.raises(ConfigError, match=r"GaussianNoise.std must be a finite number > 0, got 0"):
        GaussianNoise(key="x", std=0.0)
    with pytest.raises(
        ConfigError, match=r"GaussianNoise.clip must be \[low, high\] with low < high, got \[1.0, 0.0\]"
    ):
        GaussianNoise(key="x", std=0.1, clip=(1.0, 0.0))
    with pytest.raises(ConfigError, match=r"MaskInputs.rate must be in \(0, 1\).*got 1.5"):
        MaskInputs(key="x", rate=1.5)
    with pytest.raises(ConfigError, match=r"MaskInputs.clean_key must be null or a new key other than key 'x'"):
        MaskInputs(key="x", rate=0.5, clean_key="x")
    with pytest.raises(ConfigError, match=r"clean_key 'id' is already a key of the batch"):
        _dataset(transforms=(GaussianNoise(key="x", std=0.1, clean_key="id"),)).element_spec()
    with pytest.raises(ConfigError, match=r"key 'z' is not in the batch.*available keys: x, id"):
        _dataset(transforms=(MaskInputs(key="z", rate=0.5),)).element_spec()
    with pytest.raises(ConfigError, match=r"<string>:3:1: GaussianNoise has no field 'stdev' \(did you mean 'std'\?\)"):
        pipekit.loads("type: GaussianNoise\nkey: x\nstdev: 0.1\n")


def test_an_interrupted_denoising_stage_resumes_bitwise(interrupted_and_resumed):
    """4 batches per epoch: the crash and the resume cross an epoch boundary, where the noise changes."""
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="autoencoder", kwargs={"in_size": 16, "latent_size": 4, "hidden": [8]}),
        dataset=_dataset(n=64, transforms=(_noise(), MaskInputs(key="x", rate=0.2))),
        loss=MSE(),
        target_key="x_clean",
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=10,
        batch_size=16,
        log_every_n_steps=5,
        progress=False,
        callbacks=(Checkpoint(every_n_steps=4, async_save=False),),
    )
    reference, resumed = interrupted_and_resumed(loop, crash_at=7)
    assert resumed.weights_hash() == reference.weights_hash()


def test_a_denoising_autoencoder_stage_learns_to_reconstruct_the_clean_input(tmp_path):
    ds = _dataset(n=64, transforms=(GaussianNoise(key="x", std=0.2, clean_key="x_clean"),))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="autoencoder", kwargs={"in_size": 16, "latent_size": 4, "hidden": [16]}),
        dataset=ds,
        loss=MSE(),
        target_key="x_clean",
        optimizer_config={"name": "adamw", "lr": 0.01},
        max_steps=60,
        batch_size=16,
        log_every_n_steps=20,
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    records = read_jsonl(str(tmp_path / "run" / "stage0" / "metrics.jsonl"))
    losses = [r["loss"] for r in records if r.get("context") == "train" and "loss" in r]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0]
