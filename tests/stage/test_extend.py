"""`extend`: a finished stage continued N steps is bitwise the stage planned N longer (samplers, constant-LR
training); a schedule whose horizon is max_steps is refused in one line, or continued as a recorded new segment."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import Checkpoint, Last, NpzSource, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.stage import extend
from pipekit_train.stage.extension import extended_loop

WARMUP, SAMPLES, MORE, CHAINS, CHUNK = 20, 30, 20, 2, 10
Y = np.random.default_rng(0).normal(1.5, 1.0, size=20).astype(np.float32)
CKPT = Checkpoint(every_n_steps=CHUNK, keep=(Last(n=1),), async_save=False)


@pytest.fixture(autouse=True)
def _data(tmp_path, monkeypatch):
    """The stages read .npz files (their recorded YAML is read back by `extend`), relative to the test's folder."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    np.savez("y.npz", y=Y)
    np.savez("xy.npz", x=x, y=x @ np.array([[1.0], [-2.0], [0.5]], np.float32))


def _sampler(backend: str, samples: int, thinning: int = 1) -> TrainingLoop:
    from pipekit_train.adapters.numpyro import NUTS, BlackjaxModel, NumpyroModel

    model = BlackjaxModel if backend == "blackjax" else NumpyroModel
    kernel = NUTS(num_warmup=WARMUP, num_samples=samples, num_chains=CHAINS, max_tree_depth=3, thinning=thinning)
    return TrainingLoop(
        model_op=model(model="conjugate_normal"),
        dataset=TrainingDataset(source=NpzSource(path="y.npz"), shuffle=False),
        task=kernel,
        backend=backend,
        batch_size=10,
        max_steps=WARMUP + samples,
        steps_per_call=CHUNK,
        log_every_n_steps=CHUNK,
        callbacks=(CKPT,),
        progress=False,
        seed=3,
        name="post",
    )


@pytest.mark.parametrize("backend", ["numpyro-mcmc", "blackjax"])
def test_extended_draws_are_bitwise_the_longer_stages(backend, tmp_path):
    """SAMPLES draws extended by MORE are, byte for byte, a stage of SAMPLES + MORE draws; the extension is a new
    stage (its own final.json) whose parent is the extended stage, whose folder is left as it was."""
    pytest.importorskip("blackjax" if backend == "blackjax" else "numpyro")
    run = tmp_path / "run"
    with run_settings(run_dir=str(run), store=str(tmp_path / "store.db")):
        short, first = _sampler(backend, SAMPLES).run()
    before = (run / "post" / "final.json").read_bytes()
    model, artifact = extend(str(run), "post", MORE, store=str(tmp_path / "store.db"))
    with run_settings(run_dir=str(tmp_path / "long"), store=False):
        longer, _ = _sampler(backend, SAMPLES + MORE).run()
    for site, value in longer.posterior.draws.items():
        assert value.shape == (CHAINS, SAMPLES + MORE)
        assert model.posterior.draws[site].tobytes() == value.tobytes(), site
        assert short.posterior.draws[site].tobytes() == value[:, :SAMPLES].tobytes(), site
    assert artifact.stage == "post-extend1" and artifact.parent_ids == (first.artifact_id,)
    assert artifact.user["extension"] == {
        "stage": "post", "artifact_id": first.artifact_id, "from_step": WARMUP + SAMPLES, "steps": MORE,
        "exact": True, "new_segment": False,
    }  # fmt: skip
    assert json.loads((run / "post-extend1" / "final.json").read_text())["step"] == WARMUP + SAMPLES + MORE
    assert (run / "post" / "final.json").read_bytes() == before
    from pipekit_train.provenance import ArtifactStore

    with ArtifactStore(str(tmp_path / "store.db")) as store:
        assert store.get(artifact.artifact_id).parent_ids == (first.artifact_id,)


def test_a_thinned_sampler_takes_multiples_of_thinning():
    pytest.importorskip("numpyro")
    loop = _sampler("numpyro-mcmc", 10, thinning=2)
    with pytest.raises(
        ConfigError, match=r"^extend: steps must be a multiple of NUTS.thinning \(2\) for stage 'post', got 3;"
    ):
        extended_loop(loop, 3, name="post-extend1")
    assert extended_loop(loop, 4, name="post-extend1").task.num_samples == 14


# Training ------------------------------------------------------------------------------------------------------
def _training(max_steps: int, **optimizer: Any) -> TrainingLoop:
    from pipekit_train import MSE
    from pipekit_train.adapters.equinox import EquinoxModel

    return TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=NpzSource(path="xy.npz"), shuffle=True),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 1e-2, **optimizer},
        backend="equinox",
        batch_size=16,
        max_steps=max_steps,
        steps_per_call=4,
        log_every_n_steps=4,
        callbacks=(Checkpoint(every_n_steps=8, keep=(Last(n=1),), async_save=False),),
        progress=False,
        seed=0,
        name="fit",
    )


def test_a_constant_lr_stage_extended_is_bitwise_the_longer_stage_and_sees_its_batches(tmp_path):
    """12 steps (over epochs of 4 batches, shuffled) extended by 8 give the weights of 20 steps."""
    from pipekit_train.cli._main import main
    from pipekit_train.provenance import load_model

    run = tmp_path / "run"
    with run_settings(run_dir=str(run), store=False):
        _training(12).run()
    assert main(["extend", str(run), "--stage", "fit", "--steps", "8", "--no-store"]) == 0  # the CLI's path
    artifact = json.loads((run / "fit-extend1" / "artifact.json").read_text())
    with run_settings(run_dir=str(tmp_path / "long"), store=False):
        longer, _ = _training(20).run()
    model = load_model(artifact["model_registry_uri"])
    assert model.weights_hash() == longer.weights_hash() == artifact["trained_model_hash"]
    assert artifact["user"]["extension"]["exact"] is True


def test_a_cosine_schedule_over_max_steps_is_refused_then_continued_as_a_new_segment(tmp_path, capsys):
    run = tmp_path / "run"
    with run_settings(run_dir=str(run), store=False):
        _training(12, schedule="warmup_cosine").run()
    from pipekit_train.cli._main import main

    assert main(["extend", str(run), "--stage", "fit", "--steps", "8", "--no-store"]) == 2
    assert capsys.readouterr().err == (
        "pipekit-train: error: refusing to extend stage 'fit' exactly: its warmup_cosine schedule's decay_steps "
        "defaults to max_steps, so it ended at step 12 (where the stage ended) and a stage planned for 20 steps "
        "would have had another learning rate at every step; continue anyway as a new schedule segment with "
        "--new-segment (extend(..., new_segment=True), recorded), or set optimizer_config.decay_steps in a new run\n"
    )
    assert not (run / "fit-extend1").exists()  # refused before anything was written
    model, artifact = extend(str(run), "fit", 8, store=False, new_segment=True)
    assert artifact.user["extension"]["exact"] is False and artifact.user["extension"]["new_segment"] is True
    ended = json.loads((run / "fit" / "artifact.json").read_text())["trained_model_hash"]
    assert model.weights_hash() != ended  # the new segment trained (at lr 0 the weights would not move)
    records = [json.loads(line) for line in (run / "fit-extend1" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r.get("context") == "train" and "lr" in r]
    # The schedule runs again over the 8 new steps (it had ended at 0): halfway at step 16, at its end at 20.
    assert lrs == [pytest.approx(5e-3, rel=1e-5), 0.0]


def test_an_svi_stage_extended_is_bitwise_the_longer_stage():
    pytest.importorskip("numpyro")
    from pipekit_train.adapters.numpyro import NumpyroGuide, Trace_ELBO

    def svi(steps: int) -> TrainingLoop:
        return _training(steps).replace(
            model_op=NumpyroGuide(model="conjugate_normal", guide="AutoNormal"),
            dataset=TrainingDataset(source=NpzSource(path="y.npz"), shuffle=True),
            loss=Trace_ELBO(),
            backend="numpyro-svi",
            batch_size=5,
        )

    with run_settings(run_dir="run", store=False):
        svi(12).run()
    model, _ = extend("run", "fit", 8, store=False)
    with run_settings(run_dir="long", store=False):
        longer, _ = svi(20).run()
    assert model.weights_hash() == longer.weights_hash()
