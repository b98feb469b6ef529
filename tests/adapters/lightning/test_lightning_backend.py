"""The ``lightning`` backend: the conformance kit, losses, optimizers, hand-offs, converters and what it refuses."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("the lightning extra is not installed", allow_module_level=True)

import jax.numpy as jnp
import torch

import pipekit
from pipekit_train import (
    KL,
    MSE,
    NLL,
    ArraySource,
    Composite,
    CrossEntropy,
    TrainingDataset,
    TrainingLoop,
    Transfer,
    load_model,
    run_settings,
)
from pipekit_train.adapters.conformance import CHECKS
from pipekit_train.adapters.equinox import EquinoxModel
from pipekit_train.adapters.lightning import (
    TorchModel,
    build_torch_optimizer,
    register_torch_model,
    to_torch_loss,
)
from pipekit_train.backends._optax import build_optimizer
from pipekit_train.backends._optax_schedule import learning_rate_at
from pipekit_train.stage.preflight import check

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 4)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
LABELS = (X[:, 0] > 0).astype(np.int32)


# The conformance kit ----------------------------------------------------------------------------------------------
# tests/adapters/test_conformance.py runs every check of the kit over each installed backend, this one included.
def test_the_conformance_kit_runs_for_this_backend():
    from pipekit_train.backends._registry import ENTRY_POINT_GROUP

    installed = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert "lightning" in installed and len(CHECKS) >= 10


def test_reading_a_lightning_pipeline_does_not_import_torch():
    code = (
        "import sys, pipekit, pipekit_train, pipekit_train.adapters.lightning as L\n"
        "op = pipekit.loads(pipekit.dumps(L.TorchModel(factory='mlp', kwargs={'in_size': 4, 'out_size': 1})))\n"
        "assert 'lightning' in pipekit_train.available_backends()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# Models ---------------------------------------------------------------------------------------------------------
def test_factories_are_checked_on_construction_and_round_trip_through_yaml():
    op = TorchModel(factory="classifier", kwargs={"in_size": 64, "num_classes": 10})
    assert pipekit.loads(pipekit.dumps(op)) == op
    with pytest.raises(
        pipekit.ConfigError, match=r"'mpl' is not a registered torch model factory \(did you mean 'mlp'"
    ):
        TorchModel(factory="mpl")
    with pytest.raises(pipekit.ConfigError, match="has no parameter 'width'"):
        TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width": 3})
    with pytest.raises(pipekit.ConfigError, match="activation must be one of"):
        TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "activation": "rleu"})


def test_build_is_seeded_and_weights_are_the_state_dict():
    op = TorchModel(factory="classifier", kwargs={"in_size": 8, "num_classes": 3, "hidden": [6], "latent_size": 4})
    a, b, c = (op.bind(op.build(s)) for s in (0, 0, 1))
    assert a.weights_hash() == b.weights_hash() != c.weights_hash()
    assert list(a.weights())[:3] == ["encoder.layers.0.weight", "encoder.layers.0.bias", "encoder.layers.1.weight"]
    assert op.with_weights(a.weights()).weights_hash() == a.weights_hash()
    assert a(np.ones((2, 8), np.float32)).shape == (2, 3)
    live = a.to_torch()
    assert isinstance(live, torch.nn.Module)
    np.testing.assert_allclose(live(torch.ones(2, 8)).detach().numpy(), a(np.ones((2, 8), np.float32)), rtol=1e-6)
    cnn = TorchModel(factory="cnn", kwargs={"image_size": 8, "out_size": 10})
    assert cnn.bind(cnn.build(0))(np.zeros((3, 64), np.float32)).shape == (3, 10)


def test_check_input_names_the_shapes():
    op = TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2})
    assert op.check_input((4,), "float32").shape == (2,)
    with pytest.raises(pipekit.ShapeError, match=r"input has shape \(5,\).*expects \(4,\)"):
        op.check_input((5,), "float32")


# Training -------------------------------------------------------------------------------------------------------
def _loop(**overrides):
    fields = dict(
        model_op=TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=10,
        batch_size=16,
        backend="lightning",
        progress=False,
        log_every_n_steps=5,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def _train(op, run_dir):
    with run_settings(run_dir=str(run_dir), store=False):
        return op.run()


@register_torch_model("test_torch_dropout")
def _dropout_mlp(in_size: int, out_size: int = 1):
    return torch.nn.Sequential(
        torch.nn.Linear(in_size, 8), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(8, out_size)
    )


def test_a_user_factory_with_dropout_draws_from_seed_and_step(tmp_path):
    model = TorchModel(factory="test_torch_dropout", kwargs={"in_size": 4})
    runs = [
        _train(_loop(model_op=model, steps_per_call=spc, max_steps=6), tmp_path / f"r{i}")
        for i, spc in enumerate((1, 3))
    ]
    assert len({m.weights_hash() for m, _ in runs}) == 1, "the same seed gives other weights (or chunking did)"
    other, _ = _train(_loop(model_op=model, max_steps=6, seed=1), tmp_path / "s1")
    assert other.weights_hash() != runs[0][0].weights_hash()
    assert list(runs[0][0].weights())[:2] == ["0.weight", "0.bias"]


def test_the_learning_rate_scale_is_part_of_the_checkpointed_state():
    from pipekit_train.adapters.lightning._adapter import TorchBackend

    loop = _loop(optimizer_config={"name": "sgd", "lr": 0.1, "schedule": "warmup_cosine", "warmup_steps": 4})
    backend = TorchBackend(loop, loop.model_op.build(0))
    backend.set_lr_scale(0.25)
    assert backend.get_lr_scale() == 0.25
    assert backend.learning_rate(2) == pytest.approx(0.05 * 0.25)
    tree = backend.state_tree()
    backend.set_lr_scale(1.0)
    backend.load_state_tree(tree)
    assert backend.get_lr_scale() == 0.25
    backend.set_lr_scale(0.0)  # a zero scale freezes the weights
    before = backend.bound_model().weights_hash()
    backend.train([{"x": X[:16], "y": Y[:16]}], 5)
    assert backend.bound_model().weights_hash() == before


def test_reduce_lr_on_plateau_and_ema_run(tmp_path):
    from pipekit_train import EMA, ReduceLROnPlateau

    loop = _loop(
        val_dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        eval_every_n_steps=2,
        callbacks=(ReduceLROnPlateau(patience=0, factor=0.5, threshold=10.0), EMA(decay=0.9)),
    )
    model, artifact = _train(loop, tmp_path / "r")
    assert artifact.final_metrics["train/lr"] < 0.05
    assert np.isfinite(artifact.final_metrics["validate/loss"])
    plain, _ = _train(
        loop.replace(callbacks=(ReduceLROnPlateau(patience=0, factor=0.5, threshold=10.0),)), tmp_path / "p"
    )
    assert model.weights_hash() != plain.weights_hash(), "return_ema did not return the EMA weights"


def test_sequential_transfer_hands_the_encoder_over(tmp_path):
    kwargs = {"in_size": 4, "latent_size": 3, "hidden": [5]}
    data = TrainingDataset(source=ArraySource(arrays={"x": X, "y": LABELS}))
    pretrain = _loop(model_op=TorchModel(factory="autoencoder", kwargs=kwargs), target_key="x", dataset=data, name="a")
    finetune = _loop(
        model_op=TorchModel(factory="classifier", kwargs={**kwargs, "num_classes": 2}),
        loss=CrossEntropy(),
        dataset=data,
        transfer=Transfer(paths={"encoder": "encoder"}),
        max_steps=1,
        optimizer_config={"name": "sgd", "lr": 1e-30},
        name="b",
    )
    first, _ = _train(pretrain, tmp_path / "one")
    second, _ = _train(pipekit.Sequential([pretrain, finetune]), tmp_path / "seq")
    encoder = {k: v for k, v in first.weights().items() if k.startswith("encoder")}
    got = {k: v for k, v in second.weights().items() if k.startswith("encoder")}
    assert encoder.keys() == got.keys() and all(np.allclose(encoder[k], got[k]) for k in encoder)
    with pytest.raises(pipekit.ConfigError, match="Transfer: path 'encodr' not found.*did you mean"):
        bad = finetune.replace(transfer=Transfer(paths={"encoder": "encodr"}))
        _train(pipekit.Sequential([pretrain, bad]), tmp_path / "seq3")


def test_load_model_gives_a_usable_torch_module(tmp_path):
    model, artifact = _train(_loop(), tmp_path / "reg")
    loaded = load_model(artifact.model_registry_uri)
    assert isinstance(loaded, TorchModel) and loaded.weights_hash() == model.weights_hash()
    module = loaded.to_torch()
    with torch.no_grad():
        np.testing.assert_array_equal(module(torch.from_numpy(X[:4])).numpy(), model(X[:4]))


def test_sigterm_then_resume_is_bitwise_with_dropout_adamw_and_accumulation(tmp_path):
    import signal

    from pipekit_train import Callback, Checkpoint, Last, TrainingInterrupted

    armed = {"on": True}

    class TermAt7(Callback, register=False):
        def on_step_end(self, ctx, metrics):
            if ctx.step == 7 and armed["on"]:
                os.kill(os.getpid(), signal.SIGTERM)

        def fingerprint(self):
            return None

    ckpt = Checkpoint(every_n_steps=5, keep=(Last(n=1),), async_save=False)
    loop = _loop(
        model_op=TorchModel(factory="test_torch_dropout", kwargs={"in_size": 4}),
        optimizer_config={"name": "adamw", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 3},
        max_steps=12,
        steps_per_call=2,
        accum=2,
        grad_clip_norm=1.0,
        callbacks=(ckpt, TermAt7()),
    )
    armed["on"] = False
    full, _ = _train(loop, tmp_path / "full")
    armed["on"] = True
    with pytest.raises(TrainingInterrupted):
        _train(loop, tmp_path / "part")
    armed["on"] = False
    with run_settings(run_dir=str(tmp_path / "part"), store=False, resume="auto"):
        resumed, _ = loop.run()
    assert resumed.weights_hash() == full.weights_hash()


# Hand-offs between backends -------------------------------------------------------------------------------------
MLP_KWARGS = {"in_size": 4, "out_size": 3, "width_size": 8, "depth": 2, "activation": "gelu"}


# The converters of every factory, in all six directions: tests/adapters/test_zoo.py.


def test_a_stage_takes_an_equinox_mlp_through_the_converter_and_refuses_others(tmp_path):
    from pipekit_train import Callback

    eqx_stage = _loop(model_op=EquinoxModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 1}), backend="equinox")
    torch_stage = _loop(model_op=TorchModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 1}), name="t")
    seen = {}

    class Record(Callback, register=False):
        def on_train_start(self, ctx):
            seen[f"{ctx.stage} start"] = ctx.model(X[:4])

        def on_train_end(self, ctx):
            seen[f"{ctx.stage} end"] = ctx.model(X[:4])

    stages = [eqx_stage.replace(name="e", callbacks=(Record(),)), torch_stage.replace(callbacks=(Record(),))]
    _train(pipekit.Sequential(stages), tmp_path / "s")
    np.testing.assert_allclose(seen["t start"], seen["e end"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(seen["e start"], seen["e end"]), "the Equinox stage did not train"
    # an autoencoder converts, but to a torch autoencoder, not the stage's mlp: refused in pre-flight
    other = eqx_stage.replace(model_op=EquinoxModel(factory="autoencoder", kwargs={"in_size": 4}), target_key="x")
    with pytest.raises(pipekit.ConfigError, match=r"converts to TorchModel\(factory='autoencoder'.*transfer:"):
        _train(pipekit.Sequential([other.replace(name="e"), torch_stage]), tmp_path / "refused")


# Losses ---------------------------------------------------------------------------------------------------------
P2 = RNG.standard_normal((16, 3)).astype(np.float32)
T2 = RNG.standard_normal((16, 3)).astype(np.float32)
LV = (0.3 * RNG.standard_normal((16, 3))).astype(np.float32)
INT = RNG.integers(0, 3, 16).astype(np.int32)
ONE_HOT = np.eye(3, dtype=np.float32)[INT]


@pytest.mark.parametrize(
    ("loss", "predicted", "target"),
    [
        (MSE(), P2, T2),
        (MSE(reduction="sum"), (P2, LV), (T2, T2)),
        (NLL(), (P2, LV), T2),
        (KL(), (P2, LV), (T2, 0.5 * LV)),
        (CrossEntropy(), P2, INT),
        (CrossEntropy(label_smoothing=0.1), P2, INT),
        (CrossEntropy(label_smoothing=0.2), P2, ONE_HOT),
        (Composite(components=((1.0, MSE()), (0.5, MSE(reduction="sum")))), P2, T2),
        (Composite(components=((1.0, CrossEntropy()), (0.1, MSE()))), P2, ONE_HOT),
    ],
    ids=["MSE", "MSE-sum-tree", "NLL", "KL", "CE", "CE-smooth", "CE-onehot", "Composite", "Composite-CE"],
)
def test_each_loss_gives_the_equinox_value_on_the_same_numbers(loss, predicted, target):
    def tree(fn, x):
        return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)

    want_total, want_aux = _split(loss(tree(jnp.asarray, predicted), tree(jnp.asarray, target)))
    got_total, got_aux = _split(to_torch_loss(loss)(tree(torch.from_numpy, predicted), tree(torch.from_numpy, target)))
    assert float(got_total) == pytest.approx(float(want_total), rel=1e-5, abs=1e-6)
    assert got_aux.keys() == want_aux.keys()
    for k in want_aux:
        assert float(got_aux[k]) == pytest.approx(float(want_aux[k]), rel=1e-5, abs=1e-6), k


def _split(out):
    return out if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else (out, {})


def test_a_loss_without_a_torch_version_is_refused_before_training():
    from pipekit_train import Loss

    class Hinge(Loss, register=False):
        def __call__(self, predicted, target):
            return jnp.mean(jnp.maximum(0.0, 1.0 - predicted * target))

    loop = _loop(loss=Hinge())
    with pytest.raises(pipekit.ConfigError, match="backend 'lightning' has no torch version of loss Hinge"):
        check(loop, None, "stage0")


def _jax_l1(predicted, target):
    return jnp.mean(jnp.abs(predicted - target))


def test_a_loss_given_as_a_plain_function_is_refused_before_training_saying_where_it_runs():
    loop = _loop(loss=_jax_l1)
    with pytest.raises(
        pipekit.ConfigError,
        match=r"backend 'lightning' cannot train with LossFunction\(.*_jax_l1\), a loss given as a plain function: "
        r"such a loss runs inside the JAX step of the equinox and keras backends; here write it as a Loss subclass",
    ):
        check(loop, None, "stage0")


# Optimizers -----------------------------------------------------------------------------------------------------
def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]


@pytest.mark.parametrize(
    "config",
    [
        {"name": "adamw", "lr": 0.01, "weight_decay": 0.1, "schedule": "warmup_cosine", "warmup_steps": 3},
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "decay_biases": True},
        {"name": "adam", "lr": 0.05, "b1": 0.8, "schedule": "onecycle"},
    ],
    ids=["adamw-cosine", "sgd-nesterov-decay", "adam-onecycle"],
)
def test_optimizers_follow_the_optax_recipe(config):
    """The same gradients through torch.optim and through the JAX backends' optax chain give the same weights,
    with clipping and accumulation (the mean gradient of 2 steps)."""
    import jax

    params = _params()
    opt = build_torch_optimizer(config, params, max_steps=12, grad_clip_norm=0.5, accum=2)
    optax_opt = build_optimizer(config, max_steps=12, grad_clip_norm=0.5, accum=2)
    ref = [jnp.asarray(p.detach().numpy()) for p in params]
    state = optax_opt.init(ref)
    update = jax.jit(optax_opt.update)
    for step in range(12):
        grads = [np.sin(np.arange(p.numel(), dtype=np.float32).reshape(p.shape) + step) for p in params]
        for p, g in zip(params, grads):
            p.grad += torch.from_numpy(g)
        opt.step(step)
        updates, state = update([jnp.asarray(g) for g in grads], state, ref)
        ref = [a + u for a, u in zip(ref, updates)]
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.detach().numpy(), np.asarray(r), rtol=2e-5, atol=2e-6)


def test_keys_torch_cannot_honour_are_refused_naming_the_backend():
    with pytest.raises(pipekit.ConfigError, match="backend 'lightning' cannot honour optimizer_config.name='lion'"):
        build_torch_optimizer({"name": "lion"}, _params(), max_steps=10)
    with pytest.raises(pipekit.ConfigError, match="backend 'lightning' cannot honour optimizer_config.nesterov"):
        build_torch_optimizer({"name": "rmsprop", "momentum": 0.9, "nesterov": True}, _params(), max_steps=10)
    loop = _loop(optimizer_config={"name": "lion", "lr": 0.001})
    with pytest.raises(pipekit.ConfigError, match="backend 'lightning'"):
        check(loop, None, "stage0")


@pytest.mark.parametrize(
    "config",
    [
        {"lr": 0.1, "schedule": "warmup_cosine", "warmup_steps": 10},
        {"lr": 0.1, "schedule": "exponential", "decay_rate": 0.5, "warmup_steps": 5},
        {"lr": 0.1},
    ],
)
def test_schedules_match_the_jax_backends(config):
    opt = build_torch_optimizer(config, _params(), max_steps=100)
    for step in (0, 3, 10, 50, 99):
        assert opt.lr_at(step) == pytest.approx(learning_rate_at(config, step, 100), rel=1e-6)


def test_biases_are_not_decayed_unless_asked():
    def decayed(decay_biases: bool) -> list[bool]:
        params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
        opt = build_torch_optimizer(
            {"name": "sgd", "lr": 0.1, "weight_decay": 0.5, "decay_biases": decay_biases}, params, max_steps=10
        )
        opt.step(0)  # zero gradients: only weight decay moves anything
        return [bool((p < 1.0).all()) for p in params]

    assert decayed(False) == [True, False]
    assert decayed(True) == [True, True]


# Lightning --------------------------------------------------------------------------------------------------------
def test_build_lightning_module_trains_with_trainer_fit():
    import pytorch_lightning as pl

    from pipekit_train.adapters.lightning import build_lightning_module

    op = TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8})
    module = build_lightning_module(CrossEntropy(), op, {"name": "adamw", "lr": 0.01}, max_steps=4)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(LABELS)), batch_size=16
    )
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, data)
    assert trainer.global_step == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert np.isfinite(float(trainer.callback_metrics["train/loss"]))


# SIGKILL ----------------------------------------------------------------------------------------------------------
_HELPER = '''
import time
from pipekit_train import Callback


class SlowLightningSteps(Callback):
    """Sleeps after each step, so a test can kill the process in the middle of a run."""

    seconds: float = 0.02

    def on_step_end(self, ctx, metrics):
        time.sleep(self.seconds)

    def fingerprint(self):
        return None
'''


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_auto_is_bitwise(tmp_path):
    """A ``pipekit-train run`` subprocess killed with SIGKILL after a seeded random checkpoint (and a random delay,
    so the kill may land in the middle of the next save), then resumed: bitwise the uninterrupted run's weights."""
    import signal
    import time

    from pipekit_train import Checkpoint, Last, NpzSource

    (tmp_path / "slow_lightning_helper.py").write_text(_HELPER)
    sys.path.insert(0, str(tmp_path))
    try:
        import slow_lightning_helper
    finally:
        sys.path.remove(str(tmp_path))
    np.savez(tmp_path / "data.npz", x=X, y=Y)
    loop = _loop(
        model_op=TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 16, "depth": 2}),
        dataset=TrainingDataset(source=NpzSource(path=str(tmp_path / "data.npz"))),
        optimizer_config={"name": "adamw", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 5},
        max_steps=60,
        steps_per_call=2,
        log_every_n_steps=10,
        callbacks=(Checkpoint(every_n_steps=10, keep=(Last(n=2),)), slow_lightning_helper.SlowLightningSteps()),
    )
    (tmp_path / "pipe.yaml").write_text(pipekit.dumps(loop))
    full, _ = _train(loop, tmp_path / "full")

    rng = np.random.default_rng(7)
    wait_for, delay = int(rng.choice([10, 20, 30])), float(rng.uniform(0.0, 0.2))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "pipekit_train.cli", "run", "pipe.yaml", "--run-dir", "part", "--no-store"]
    args += ["--import", "slow_lightning_helper"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = tmp_path / "part" / "stage0" / "checkpoints" / str(wait_for) / "commit_success.txt"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    with run_settings(run_dir=str(tmp_path / "part"), store=False, resume="auto"):
        resumed, artifact = loop.run()
    assert artifact.backend_info["steps"] == 60
    assert resumed.weights_hash() == full.weights_hash()
