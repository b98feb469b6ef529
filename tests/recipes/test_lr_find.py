"""`lr_find` and `pipekit-train lr-find`: the exponential sweep on the stage's own compiled step, recording nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    MSE,
    ArraySource,
    EquinoxModel,
    ParamGroup,
    TrainingDataset,
    TrainingLoop,
    lr_find,
    read_jsonl,
    run_settings,
)
from pipekit_train.adapters.equinox._steps import CompileCounter, chunk_cache_size
from pipekit_train.sweep._lr_find import suggest


def _data(n: int = 256) -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 19, "depth": 1}),
        dataset=_data(),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 5},
        max_steps=50,
        batch_size=16,
        log_every_n_steps=1,
        progress=False,
        name="fit",
    )
    base.update(kw)
    return TrainingLoop(**base)


def test_sweep_grows_geometrically_diverges_and_suggests_a_rate_inside_it(tmp_path):
    before = set(os.listdir(tmp_path))
    compiled = chunk_cache_size()
    result = lr_find(_loop(), min_lr=1e-4, max_lr=100.0, steps=60)
    assert chunk_cache_size() - compiled <= 1  # one step program: the rate changes through the multiplier
    with CompileCounter() as again:
        lr_find(_loop(), min_lr=1e-3, max_lr=1.0, steps=10)
    assert again.count == 0  # another sweep of the same stage compiles nothing
    lrs = np.asarray(result.lrs)
    np.testing.assert_allclose(lrs[1:] / lrs[:-1], (100.0 / 1e-4) ** (1 / 59), rtol=1e-9)
    assert result.stop_reason.startswith("diverged at step") or "became" in result.stop_reason
    assert len(lrs) < 60  # sgd at lr 10+ on this problem blows up before the end
    assert result.method == "steepest" and 1e-3 < result.suggestion < 10.0
    assert min(result.losses) < 0.5 * result.losses[0]
    assert "<- suggested" in result.table()
    assert set(os.listdir(tmp_path)) == before  # no run directory, no store, no checkpoint


def test_the_sweep_steps_the_stage_s_own_model_loss_and_data_bitwise(tmp_path):
    """At a constant rate the real stage takes the sweep's first step: same batch, same loss, same update."""
    lr = 1e-3
    result = lr_find(_loop(), min_lr=lr, max_lr=lr * 1.0001, steps=10)
    real = _loop(optimizer_config={"name": "sgd", "lr": lr}, max_steps=2)
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        real.run()
    records = read_jsonl(str(tmp_path / "run" / "fit" / "metrics.jsonl"))
    losses = [r["loss"] for r in records if r.get("context") == "train" and "loss" in r]
    assert losses[0] == result.losses[0]  # the loss before any update: the same model, batch and loss
    assert losses[1] == result.losses[1]  # after one update at `lr`: the same optimizer step


def test_a_later_stage_starts_from_the_earlier_stages(tmp_path):
    pretrain = _loop(name="pre", max_steps=30, optimizer_config={"name": "adam", "lr": 0.01})
    pipe = pipekit.Sequential([pretrain, _loop(name="tune")])
    fresh = lr_find(pipe, "pre", min_lr=1e-4, max_lr=1.0, steps=10)
    after = lr_find(pipe, 1, min_lr=1e-4, max_lr=1.0, steps=10)
    assert after.stage == "tune" and "trained the earlier stage(s) pre first" in after.notes[0]
    assert after.losses[0] < 0.5 * fresh.losses[0]  # the pretrained model starts far lower
    assert not os.path.exists(tmp_path / "runs")
    # From a finished run: the same starting model, read (not trained) from it.
    with run_settings(run_dir=str(tmp_path / "done"), store=False):
        pretrain.run()
    listing = sorted(os.listdir(tmp_path / "done" / "pre"))
    read = lr_find(pipe, "tune", min_lr=1e-4, max_lr=1.0, steps=10, from_run=str(tmp_path / "done"))
    assert read.losses == after.losses
    assert sorted(os.listdir(tmp_path / "done" / "pre")) == listing  # nothing written into the run
    with pytest.raises(ConfigError, match=r"--from-run .*empty: stage 'pre' has not finished there"):
        os.makedirs(tmp_path / "empty")
        lr_find(pipe, "tune", from_run=str(tmp_path / "empty"))


def test_gradual_unfreezing_trains_from_the_first_step_of_the_sweep():
    loop = _loop(param_groups=(ParamGroup(pattern="layers.0.*", frozen=True, unfreeze_at=40),))
    result = lr_find(loop, min_lr=1e-3, max_lr=1.0, steps=10)
    assert "unfreezes at step 40 in the stage; it trains from the sweep's first step" in result.notes[0]


def test_suggestion_falls_back_to_a_tenth_of_the_minimum_without_a_descent():
    lrs = [10.0 ** (-6 + i / 4) for i in range(20)]
    # Rising from the start: a tenth of the rate at the lowest point after the first tenth of the sweep.
    assert suggest(lrs, [1.0 + 0.1 * i for i in range(20)]) == (pytest.approx(lrs[2] / 10), "min/10")
    falling = [5.0 - i * (0.5 if 8 <= i <= 10 else 0.05) for i in range(20)]
    lr, method = suggest(lrs, falling)
    assert method == "steepest" and lrs[8] <= lr <= lrs[10]


def test_errors_name_the_argument_and_the_stages():
    pipe = pipekit.Sequential([_loop(name="pretrain"), _loop(name="finetune")])
    with pytest.raises(
        ConfigError,
        match=r"--stage 2 is out of range: the pipeline has 2 training stage\(s\) \(0: pretrain, 1: finetune\)",
    ):
        lr_find(pipe, 2)
    with pytest.raises(
        ConfigError, match=r"--stage 'finetun': no training stage has that name \(did you mean 'finetune'\?\)"
    ):
        lr_find(pipe, "finetun")
    with pytest.raises(ConfigError, match=r"--max-lr must be a number > --min-lr \(0.1\), got 0.01"):
        lr_find(pipe, min_lr=0.1, max_lr=0.01)
    with pytest.raises(ConfigError, match=r"--steps must be an int >= 10 .*got 3"):
        lr_find(pipe, steps=3)


def test_cli_prints_the_table_and_the_suggestion_and_plots(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x[:, :1] * 2.0)
    (tmp_path / "pipe.yaml").write_text(
        "pipekit: 1\ntype: TrainingLoop\nname: fit\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\n"
        "loss: {type: MSE}\noptimizer_config: {name: sgd, lr: 0.01}\nmax_steps: 100\nbatch_size: 16\n"
    )
    from pipekit_train.cli._main import main

    # In-process, as `pipekit-train` runs it; the store and model registry would land under tmp_path (conftest).
    argv = ["lr-find", "pipe.yaml", "--min-lr", "1e-4", "--steps", "30"]
    assert main([*argv, "--plot", "lr.png"]) == 0
    out = capsys.readouterr().out
    assert "lr-find: stage 'fit'" in out and "suggested learning rate: " in out
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["data.npz", "lr.png", "pipe.yaml"]  # nothing else: no runs, no store
    assert main([*argv, "--stage", "fitt"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "pipekit-train lr-find: error: --stage 'fitt': no training stage has that name (did you mean 'fit'?); "
        "stages: 0: fit"
    ]


def test_a_noisy_plateau_does_not_make_the_suggestion():
    """A small, noisy stage once got 7e-6 from a wiggle of the plateau. The suggestion now lies in the real
    descent for every one of these noisy curves (a plateau at 1, a fall of 0.5 around 3e-3, then divergence)."""
    n = 100
    lrs = 1e-6 * 1e6 ** (np.arange(n) / (n - 1))
    t = np.log10(lrs)
    true = 1.0 - 0.5 / (1 + np.exp(-(t + 2.5) * 3)) + np.where(t > -0.7, 2 * (t + 0.7) ** 2, 0.0)
    for seed in range(10):
        raw = true + np.random.default_rng(seed).normal(scale=0.5, size=n)
        smoothed, avg = [], 0.0
        for i, loss in enumerate(raw):  # the sweep's own running mean (beta 0.9, bias-corrected)
            avg = 0.9 * avg + 0.1 * loss
            smoothed.append(avg / (1 - 0.9 ** (i + 1)))
        lr, method = suggest(lrs, smoothed)
        assert method == "steepest" and 1e-4 < lr < 0.3, (seed, lr)
