"""TrainingLoop on the Equinox backend: fidelity, Sequential threading, errors before compiling, compiles."""

from __future__ import annotations

import itertools
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipekit
from pipekit import ConfigError, ShapeError
from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    CrossEntropy,
    EquinoxModel,
    NonFiniteLossError,
    TrainingDataset,
    TrainingLoop,
    Transfer,
    run_settings,
)
from pipekit_train.adapters.equinox._steps import CompileCounter


def _regression(n: int = 256, d: int = 8, seed: int = 0) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d, 1)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


MLP = EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": 16, "depth": 2})


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=MLP,
        dataset=_regression(),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=40,
        batch_size=32,
        log_every_n_steps=10,
        seed=3,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


_HAND_WRITTEN: dict[str, list[np.ndarray]] = {}


def _hand_written(loop: TrainingLoop, hand: Any) -> list[np.ndarray]:
    """The final weights of a hand-written optax + Equinox loop over `loop`'s batches, computed once per optimizer
    configuration: the steps_per_call cases of one optimizer compare against the same reference."""
    name = str(loop.optimizer_config)
    if name in _HAND_WRITTEN:
        return _HAND_WRITTEN[name]
    init_key, _ = jax.random.split(jax.random.key(loop.seed))
    model = MLP.build(init_key)
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = hand()
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            pred = jax.vmap(eqx.combine(p, static))(x)
            return jnp.mean((pred - y) ** 2)

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    batches = loop.dataset.iterator(loop.batch_size, loop.seed)
    for _ in range(loop.max_steps):
        batch = next(batches)
        params, opt_state = step(params, opt_state, batch["x"], batch["y"])
    _HAND_WRITTEN[name] = [np.asarray(x) for x in jax.tree.leaves(params)]
    return _HAND_WRITTEN[name]


@pytest.mark.xdist_group("loop-fidelity")  # one worker: the hand-written reference of each optimizer is run once
@pytest.mark.parametrize(
    "config,hand",
    [
        ({"name": "sgd", "lr": 0.05, "momentum": 0.9}, lambda: optax.sgd(0.05, momentum=0.9)),
        ({"name": "adam", "lr": 0.01}, lambda: optax.adam(0.01)),
    ],
    ids=["sgd-momentum", "adam"],
)
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_fidelity_with_hand_written_loop_is_bitwise(config, hand, steps_per_call):
    """A TrainingLoop and a hand-written optax + Equinox loop over the same batches end bitwise equal."""
    loop = _loop(optimizer_config=config, steps_per_call=steps_per_call)
    with run_settings(store=False):
        trained, _ = loop.run()

    ours = jax.tree.leaves(eqx.filter(trained.module, eqx.is_array))
    theirs = _hand_written(loop, hand)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_training_reduces_loss_and_writes_metrics(tmp_path):
    loop = _loop(max_steps=100, val_dataset=_regression(seed=1), eval_every_n_steps=50)
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        model, artifact = loop.run()
    from pipekit_train import read_jsonl

    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    train = [r for r in records if r["type"] == "metrics" and r["context"] == "train"]
    val = [r for r in records if r["type"] == "metrics" and r["context"] == "validate"]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert [r["step"] for r in val] == [50, 100]
    assert train[-1]["loss"] < train[0]["loss"] / 2
    assert records[-1]["type"] == "finish" and records[-1]["status"] == "completed"
    assert artifact.final_metrics["validate/loss"] == pytest.approx(val[-1]["loss"])
    preds = model(np.zeros((3, 8), np.float32))
    assert preds.shape == (3, 1)


class _Seen(Callback, register=False):
    """Records the encoder weights a stage starts from (test-only, not registered)."""

    def on_train_start(self, ctx):
        _SEEN[ctx.stage] = ctx.model.module


_SEEN: dict[str, object] = {}


_X16 = np.random.default_rng(0).random((200, 16)).astype(np.float32)
AE = EquinoxModel(factory="autoencoder", kwargs={"in_size": 16, "latent_size": 4, "hidden": [8]})


def _pretrain(**kw: Any) -> TrainingLoop:
    """An autoencoder trained on unlabeled data: the first stage of the two-stage tests below, which share its model
    and train step (one program each for both tests)."""
    base: dict[str, Any] = dict(
        model_op=AE,
        dataset=TrainingDataset(source=ArraySource(arrays={"x": _X16})),
        loss=MSE(),
        target_key="x",
        max_steps=30,
        batch_size=20,
        optimizer_config={"name": "adam", "lr": 1e-2},
        name="pretrain",
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


@pytest.mark.xdist_group("loop-autoencoder")  # one worker: it compiles `_pretrain`'s programs for the next test
def test_sequential_threads_the_model_into_the_next_stage():
    rng = np.random.default_rng(0)
    x = rng.random((200, 16)).astype(np.float32)  # `_X16`, what the autoencoder is pretrained on
    y = rng.integers(0, 3, size=200).astype(np.int32)
    labeled = TrainingDataset(source=ArraySource(arrays={"x": x[:60], "y": y[:60]}))
    clf = EquinoxModel(factory="classifier", kwargs={"in_size": 16, "num_classes": 3, "latent_size": 4, "hidden": [8]})
    pretrain = _pretrain()
    finetune = TrainingLoop(
        model_op=clf,
        dataset=labeled,
        loss=CrossEntropy(),
        max_steps=10,
        batch_size=20,
        transfer=Transfer(paths={"encoder": "encoder"}),
        callbacks=(_Seen(),),
        name="finetune",
        progress=False,
    )
    with run_settings(store=False):
        (model, artifact), state = pipekit.Sequential([pretrain, finetune])._apply(None, None)
        pre_model, _ = pretrain.run()
    start = _SEEN["finetune"]
    for a, b in zip(jax.tree.leaves(start.encoder), jax.tree.leaves(pre_model.module.encoder)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert artifact.stage == "finetune" and artifact.parent_ids and state.stage_index == 2
    assert model == clf


@pytest.mark.xdist_group("loop-autoencoder")
def test_stage_with_a_different_model_and_no_transfer_is_refused():
    # Any first stage of another model will do: `_pretrain`'s (one chunk of it) runs programs compiled before.
    first = _pretrain(max_steps=10)
    second = _loop(max_steps=2)
    with run_settings(store=False), pytest.raises(ConfigError, match="say which weights to carry over"):
        pipekit.Sequential([first, second]).run()


def test_shape_mismatch_is_reported_before_compiling():
    bad = EquinoxModel(factory="mlp", kwargs={"in_size": 7, "out_size": 1})
    with CompileCounter() as compiles, run_settings(store=False), pytest.raises(ShapeError) as info:
        _loop(model_op=bad).run()
    message = str(info.value)
    assert "(8,)" in message and "7" in message
    assert compiles.count == 0


def test_loss_target_mismatch_names_both_shapes():
    wide = EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 3})
    # MSE's declared target contract refuses it in pre-flight, on abstract shapes, naming both.
    with (
        run_settings(store=False),
        pytest.raises(ConfigError, match=r"predictions are float32 of shape \(32, 3\).*\(32, 1\)"),
    ):
        _loop(model_op=wide).run()


def test_unknown_input_key_names_the_available_keys():
    with run_settings(store=False), pytest.raises(ConfigError, match=r"input_key is 'image'.*\['x', 'y'\]"):
        _loop(input_key="image").run()


#: Diverges within the first steps; otherwise `_loop`'s optimizer (the learning rate is a value, not part of the
#: program), so the NaN tests run the train steps the other tests compiled.
_DIVERGING = {"name": "sgd", "lr": 1e30, "momentum": 0.9}


def test_nan_loss_names_the_step():
    loop = _loop(optimizer_config=_DIVERGING, max_steps=30)
    with run_settings(store=False), pytest.raises(NonFiniteLossError, match=r"at step \d+ \(epoch 0\)"):
        loop.run()


def test_nan_on_the_one_step_path_names_the_first_non_finite_step():
    """One step per call, where the loop reads a loss early only once in `FINITE_READ_STEPS` steps: the error still
    names the first step whose loss is not finite (the log window checks every step), as the fused path does."""
    fused = _loop(optimizer_config=_DIVERGING, max_steps=30)
    with run_settings(store=False), pytest.raises(NonFiniteLossError) as caught_fused:
        fused.run()
    with run_settings(store=False), pytest.raises(NonFiniteLossError) as caught:
        fused.replace(steps_per_call=1).run()
    first = re.search(r"at step (\d+)", str(caught_fused.value))
    assert first is not None and f"at step {first.group(1)} " in str(caught.value)


def test_the_one_step_path_reads_losses_early_at_most_once_in_finite_read_steps(monkeypatch):
    """The divergence check's early read is a host transfer: one step per call, it happens at most once per
    `FINITE_READ_STEPS` steps (counted, not timed); finite losses are then read only with the log window."""
    from pipekit_train.engine._divergence import Divergence
    from pipekit_train.engine._loop import FINITE_READ_STEPS

    reads: list[int] = []
    real = Divergence._check_finite

    def counting(self: Any, step: int, loss: Any) -> None:
        reads.append(step)
        real(self, step, loss)

    monkeypatch.setattr(Divergence, "_check_finite", counting)
    with run_settings(store=False):
        _loop(max_steps=64, log_every_n_steps=64, steps_per_call=1).run()
    assert len(reads) <= 64 // FINITE_READ_STEPS
    assert all(b - a >= FINITE_READ_STEPS for a, b in itertools.pairwise(reads))


def test_nan_check_can_be_switched_off():
    loop = _loop(optimizer_config=_DIVERGING, max_steps=10, stop_on_nonfinite=False)
    with run_settings(store=False):
        _, artifact = loop.run()
    assert not np.isfinite(artifact.final_metrics["train/loss"])


def test_misspelled_yaml_field_and_optimizer_key_name_the_nearest():
    with pytest.raises(ConfigError, match=r"TrainingLoop has no field 'max_step' \(did you mean 'max_steps'\?\)"):
        pipekit.loads(
            "type: TrainingLoop\nmodel_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 2, out_size: 1}}\n"
            "dataset: {type: TrainingDataset, source: {type: NpzSource, path: d.npz}}\nloss: {type: MSE}\n"
            "max_step: 3\n"
        )
    with run_settings(store=False), pytest.raises(ConfigError, match="weight_decay"):
        _loop(optimizer_config={"name": "adamw", "lr": 1e-3, "weight_decy": 0.1}).run()


def test_unknown_backend_names_the_nearest_and_the_installed_ones():
    with pytest.raises(ConfigError, match=r"backend 'equinx' is not a registered backend \(did you mean 'equinox'\?\)"):
        _loop(backend="equinx")


def test_second_stage_with_the_same_structure_compiles_nothing_new():
    # A width no other test uses, so the first stage really compiles in this process.
    model = EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": 23, "depth": 1})
    first = _loop(model_op=model, max_steps=20, name="a")
    second = _loop(model_op=model, max_steps=20, name="b", seed=4)
    with run_settings(store=False):
        with CompileCounter() as c1:
            _, state = first._apply(None, None)
        with CompileCounter() as c2:
            second._apply(None, state)
    assert c1.count > 0
    assert c2.count == 0


def test_the_step_compiles_once_per_structure():
    from pipekit_train.adapters.equinox._steps import chunk_cache_size

    before = chunk_cache_size()
    with run_settings(store=False):
        _loop(max_steps=30, steps_per_call=1).run()
        _loop(max_steps=30, steps_per_call=1, seed=9).run()
    assert chunk_cache_size() - before <= 1


def test_every_stage_keeps_its_final_weights_loadable_from_the_artifact(tmp_path):
    from pipekit_train import load_model

    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        model, artifact = _loop(max_steps=10).run()  # one chunk of the log cadence: a step compiled before
    loaded = load_model(artifact.model_registry_uri)
    assert loaded == model and loaded.weights_hash() == model.weights_hash() == artifact.trained_model_hash


def test_prefetching_data_trains_bitwise_the_same():
    plain = _loop(max_steps=20)  # chunks of the log cadence, as other tests run: no program of its own
    prefetched = plain.replace(dataset=plain.dataset.replace(prefetch=2))
    with run_settings(store=False):
        a, _ = plain.run()
        b, _ = prefetched.run()
    assert a.weights_hash() == b.weights_hash()
