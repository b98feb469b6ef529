"""The ``keras`` backend: the conformance kit, losses, optimizers, hand-offs, converters and what it refuses."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:  # not importorskip: Keras must not be imported before the adapter
    pytest.skip("the keras extra is not installed", allow_module_level=True)

import equinox as eqx
import jax
import jax.numpy as jnp

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
from pipekit_train.adapters.equinox import EquinoxModel, register_model
from pipekit_train.adapters.keras import (
    KerasModel,
    build_keras_optimizer,
    register_keras_model,
    to_keras_loss,
)
from pipekit_train.stage.preflight import check

#: One xdist worker with the kit's Keras checks (tests/adapters/test_conformance.py): Keras imported (it is imported
#: on first use, not when this module is collected) and its programs compiled on one worker, not on both.
pytestmark = pytest.mark.xdist_group("kit-keras")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 4)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
LABELS = (X[:, 0] > 0).astype(np.int32)
#: The MLP of the hand-offs and the losses' comparisons, and of the tests that need some Keras MLP: its layers'
#: initialisers and steps compile once for all of them.
MLP_KWARGS = {"in_size": 4, "out_size": 3, "width_size": 8, "depth": 2, "activation": "gelu"}


# The conformance kit --------------------------------------------------------------------------------------------
# tests/adapters/test_conformance.py runs every check of the kit over each installed backend, this one included.
def test_the_conformance_kit_runs_for_this_backend():
    from pipekit_train.backends._registry import ENTRY_POINT_GROUP

    installed = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert "keras" in installed and len(CHECKS) >= 10


# Import cost and KERAS_BACKEND ----------------------------------------------------------------------------------
def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_reading_a_keras_pipeline_does_not_import_keras():
    code = (
        "import sys, pipekit, pipekit_train, pipekit_train.adapters.keras as k\n"
        "op = pipekit.loads(pipekit.dumps(k.KerasModel(factory='mlp', kwargs={'in_size': 4, 'out_size': 1})))\n"
        "assert 'keras' in pipekit_train.available_backends()\n"
        "assert 'keras' not in sys.modules, 'keras was imported'\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr


def test_another_keras_backend_is_refused_with_the_fix():
    code = (
        "from pipekit_train.adapters.keras import KerasModel\n"
        "KerasModel(factory='mlp', kwargs={'in_size': 4, 'out_size': 1}).build(0)\n"
    )
    proc = _python(code, KERAS_BACKEND="torch")
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "KERAS_BACKEND is 'torch'" in proc.stderr
    assert "KERAS_BACKEND=jax" in proc.stderr


# Models ---------------------------------------------------------------------------------------------------------
def test_factories_are_checked_on_construction_and_round_trip_through_yaml():
    op = KerasModel(factory="classifier", kwargs={"in_size": 64, "num_classes": 10})
    assert pipekit.loads(pipekit.dumps(op)) == op
    with pytest.raises(
        pipekit.ConfigError, match=r"'mpl' is not a registered Keras model factory \(did you mean 'mlp'"
    ):
        KerasModel(factory="mpl")
    with pytest.raises(pipekit.ConfigError, match="has no parameter 'width'"):
        KerasModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width": 3})
    with pytest.raises(pipekit.ConfigError, match="activation must be one of"):
        KerasModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "activation": "rleu"})


def test_build_is_seeded_and_weights_are_named_by_attribute_path():
    # The classifier of the transfer test below: its layers' initialisers are compiled once.
    op = KerasModel(factory="classifier", kwargs={"in_size": 4, "latent_size": 3, "hidden": [5], "num_classes": 2})
    a, b, c = (op.bind(op.build(s)) for s in (0, 0, 1))
    assert a.weights_hash() == b.weights_hash() != c.weights_hash()
    assert list(a.weights())[:3] == [
        ".encoder.layers[0].kernel",
        ".encoder.layers[0].bias",
        ".encoder.layers[1].kernel",
    ]
    assert op.with_weights(a.weights()).weights_hash() == a.weights_hash()
    assert a(np.ones((2, 4), np.float32)).shape == (2, 2)
    live = a.to_keras()
    np.testing.assert_allclose(live(np.ones((2, 4), np.float32)), a(np.ones((2, 4), np.float32)), rtol=1e-6)


def test_a_user_factory_with_dropout_draws_from_seed_and_step(tmp_path):
    @register_keras_model("test_dropout_mlp")
    def dropout_mlp(in_size: int, out_size: int = 1):
        import keras

        return keras.Sequential(
            [keras.Input((in_size,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(out_size)]
        )

    model = KerasModel(factory="test_dropout_mlp", kwargs={"in_size": 4})
    # Logged every 3 steps, so the chunked run is two calls of 3 (one program, not one of 3, 2 and 1 steps).
    runs = [
        _train(_loop(model_op=model, steps_per_call=spc, max_steps=6, log_every_n_steps=3), tmp_path / f"r{i}")
        for i, spc in enumerate((1, 1, 3))
    ]
    hashes = {m.weights_hash() for m, _ in runs}
    assert len(hashes) == 1, "the same seed gives other weights (or chunking changed the randomness)"
    assert list(runs[0][0].weights())[:2] == [".layers[0].kernel", ".layers[0].bias"]


def test_check_input_names_the_shapes():
    op = KerasModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 2})
    assert op.check_input((4,), "float32").shape == (2,)
    with pytest.raises(pipekit.ShapeError, match=r"input has shape \(5,\).*expects \(4,\)"):
        op.check_input((5,), "float32")


# Training -------------------------------------------------------------------------------------------------------
def _loop(**overrides):
    fields = dict(
        model_op=KerasModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=10,
        batch_size=16,
        backend="keras",
        progress=False,
        log_every_n_steps=5,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def _train(op, run_dir):
    with run_settings(run_dir=str(run_dir), store=False):
        return op.run()


def test_the_step_compiles_once_across_runs(tmp_path):
    from pipekit_train.adapters.keras._steps import _PROGRAMS

    loop = _loop(optimizer_config={"name": "adam", "lr": 0.01})
    _train(loop, tmp_path / "a")
    programs = [p for p in _PROGRAMS.values() if p.optimizer.__class__.__name__ == "Adam"]
    before = sum(p.compiled_count() for p in programs)
    _train(loop.replace(seed=3), tmp_path / "b")
    assert sum(p.compiled_count() for p in programs) == before


def test_the_learning_rate_scale_is_part_of_the_checkpointed_state(tmp_path):
    from pipekit_train.adapters.keras._adapter import KerasBackend

    loop = _loop(optimizer_config={"name": "sgd", "lr": 0.1, "schedule": "warmup_cosine", "warmup_steps": 4})
    backend = KerasBackend(loop, loop.model_op.build(0), jax.random.key(1))
    backend.set_lr_scale(0.25)
    assert backend.get_lr_scale() == 0.25
    assert backend.learning_rate(2) == pytest.approx(0.05 * 0.25)
    tree = backend.state_tree()
    backend.set_lr_scale(1.0)
    backend.load_state_tree(tree)
    assert backend.get_lr_scale() == 0.25
    backend.set_lr_scale(0.0)  # a zero scale freezes the weights
    before = backend.bound_model().weights_hash()
    batch = {"x": X[:16], "y": Y[:16]}
    backend.train([batch], 5)
    assert backend.bound_model().weights_hash() == before


def test_reduce_lr_on_plateau_and_ema_run(tmp_path):
    from pipekit_train import EMA, ReduceLROnPlateau

    loop = _loop(
        val_dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        eval_every_n_steps=2,
        callbacks=(ReduceLROnPlateau(patience=0, factor=0.5, threshold=10.0), EMA(decay=0.9)),
    )
    _, artifact = _train(loop, tmp_path / "r")
    assert artifact.final_metrics["train/lr"] < 0.05
    assert np.isfinite(artifact.final_metrics["validate/loss"])


def test_sequential_transfer_hands_the_encoder_over(tmp_path):
    kwargs = {"in_size": 4, "latent_size": 3, "hidden": [5]}
    data = TrainingDataset(source=ArraySource(arrays={"x": X, "y": LABELS}))
    pretrain = _loop(model_op=KerasModel(factory="autoencoder", kwargs=kwargs), target_key="x", dataset=data, name="a")
    finetune = _loop(
        model_op=KerasModel(factory="classifier", kwargs={**kwargs, "num_classes": 2}),
        loss=CrossEntropy(),
        dataset=data,
        transfer=Transfer(paths={"encoder": "encoder"}),
        max_steps=1,
        optimizer_config={"name": "sgd", "lr": 1e-30},
        name="b",
    )
    with run_settings(run_dir=str(tmp_path / "seq"), store=False):
        first, _ = pretrain.run()
        second, _ = _train(pipekit.Sequential([pretrain, finetune]), tmp_path / "seq2")
    encoder = {k: v for k, v in first.weights().items() if k.startswith(".encoder")}
    got = {k: v for k, v in second.weights().items() if k.startswith(".encoder")}
    assert encoder.keys() == got.keys() and all(np.allclose(encoder[k], got[k]) for k in encoder)
    with pytest.raises(pipekit.ConfigError, match="Transfer: path 'encodr' not found.*did you mean"):
        bad = finetune.replace(transfer=Transfer(paths={"encoder": "encodr"}))
        _train(pipekit.Sequential([pretrain, bad]), tmp_path / "seq3")


def test_load_model_gives_a_usable_keras_model(tmp_path):
    # The Keras stage of the hand-offs below: its step is compiled once for the three tests.
    model, artifact = _train(
        _loop(model_op=KerasModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 1})), tmp_path / "reg"
    )
    loaded = load_model(artifact.model_registry_uri)
    assert isinstance(loaded, KerasModel) and loaded.weights_hash() == model.weights_hash()
    np.testing.assert_allclose(loaded.to_keras().predict(X[:4], verbose=0), model(X[:4]), rtol=1e-6)


# Hand-offs between backends -------------------------------------------------------------------------------------
# The converters of every factory, in all six directions: tests/adapters/test_zoo.py.


def test_a_stage_takes_an_equinox_mlp_through_the_converter_and_refuses_others(tmp_path):
    eqx_stage = _loop(model_op=EquinoxModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 1}), backend="equinox")
    keras_stage = _loop(model_op=KerasModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 1}), name="k")
    first, _ = _train(eqx_stage.replace(name="e"), tmp_path / "one")
    starts = []

    from pipekit_train import Callback

    class Record(Callback, register=False):
        def on_train_start(self, ctx):
            starts.append(ctx.model(X[:4]))

    _train(
        pipekit.Sequential([eqx_stage.replace(name="e"), keras_stage.replace(callbacks=(Record(),))]), tmp_path / "s"
    )
    np.testing.assert_allclose(starts[0], first(X[:4]), rtol=1e-5, atol=1e-6)

    # an autoencoder converts, but to a Keras autoencoder, not the stage's mlp: refused in pre-flight
    ae = EquinoxModel(factory="autoencoder", kwargs={"in_size": 4})
    other = eqx_stage.replace(model_op=ae, target_key="x", name="e")
    with pytest.raises(pipekit.ConfigError, match=r"converts to KerasModel\(factory='autoencoder'.*transfer:"):
        _train(pipekit.Sequential([other, keras_stage]), tmp_path / "refused")

    @register_model("test_no_converter")
    def _plain(key, in_size: int = 4, out_size: int = 1):
        return eqx.nn.Linear(in_size, out_size, key=key)

    unconvertible = eqx_stage.replace(model_op=EquinoxModel(factory="test_no_converter"), name="e")
    with pytest.raises(pipekit.ConfigError, match="backend 'equinox'.*registered converter"):
        _train(pipekit.Sequential([unconvertible, keras_stage]), tmp_path / "no-converter")


# Losses ---------------------------------------------------------------------------------------------------------
class _GaussEqx(eqx.Module):
    mean: eqx.nn.Linear
    log_var: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        return self.mean(x), self.log_var(x)


@register_model("test_gauss")
def _gauss_eqx(key, in_size: int = 4, out_size: int = 1):
    k1, k2 = jax.random.split(key)
    return _GaussEqx(eqx.nn.Linear(in_size, out_size, key=k1), eqx.nn.Linear(in_size, out_size, key=k2))


@register_keras_model("test_gauss")
def _gauss_keras(in_size: int = 4, out_size: int = 1):
    import keras

    inputs = keras.Input((in_size,))
    outputs = (keras.layers.Dense(out_size)(inputs), keras.layers.Dense(out_size)(inputs))
    return keras.Model(inputs, outputs)


def _same_weights(eqx_op, keras_op):
    """The Equinox model of `eqx_op` and the Keras model of `keras_op` holding the same Linear/Dense weights."""
    eqx_bound = eqx_op.bind(eqx_op.build(0))
    src = list(eqx_bound.weights().values())
    names = list(keras_op.bind(keras_op.build(0)).weights())
    arrays = {n: (a.T.copy() if a.ndim == 2 else a) for n, a in zip(names, src)}
    return eqx_bound, keras_op.with_weights(arrays)


def _eval_metrics(loop, model):
    """The metrics the backend's own eval step computes for the bound `model` on the first 16 records."""
    if loop.backend == "keras":
        from pipekit_train.adapters.keras._adapter import KerasBackend

        backend = KerasBackend(loop, model.module, jax.random.key(0))
    else:
        from pipekit_train.adapters.equinox._adapter import EquinoxBackend

        backend = EquinoxBackend(loop, model, model.module, jax.random.key(0))
    batch = {k: v[:16] for k, v in loop.dataset.source.arrays.items()}
    return {k: float(v) for k, v in backend.evaluate(batch).items()}


@pytest.mark.parametrize(
    ("loss", "factory", "target"),
    [
        (MSE(), "mlp", "y"),
        (CrossEntropy(label_smoothing=0.1), "mlp", "labels"),
        (Composite(components=((1.0, MSE()), (0.5, MSE(reduction="sum")))), "mlp", "y"),
        (NLL(), "test_gauss", "y"),
    ],
    ids=["MSE", "CrossEntropy", "Composite", "NLL"],
)
def test_each_loss_gives_the_equinox_value_on_the_same_numbers(loss, factory, target):
    out = 2 if target == "labels" else 1
    kwargs = {"in_size": 4, "out_size": out} if factory == "test_gauss" else {**MLP_KWARGS, "out_size": out}
    eqx_op, keras_op = EquinoxModel(factory=factory, kwargs=kwargs), KerasModel(factory=factory, kwargs=kwargs)
    eqx_model, keras_model = _same_weights(eqx_op, keras_op)
    data = TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y, "labels": LABELS}))
    loop = _loop(model_op=keras_op, loss=loss, dataset=data, target_key=target)
    got = _eval_metrics(loop, keras_model)
    want = _eval_metrics(loop.replace(backend="equinox", model_op=eqx_op), eqx_model)
    assert got.keys() == want.keys() and len(got) >= 1
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


def test_kl_gives_the_equinox_value_on_the_same_outputs():
    kwargs = {"in_size": 4, "out_size": 1}  # the models of the NLL case above, built (and compiled) once
    eqx_model, keras_model = _same_weights(
        EquinoxModel(factory="test_gauss", kwargs=kwargs), KerasModel(factory="test_gauss", kwargs=kwargs)
    )
    prior = (jnp.zeros((16, 1)), jnp.zeros((16, 1)))
    want = float(KL()(eqx_model(X[:16]), prior))
    got = float(jax.jit(lambda q: KL()(q, prior))(keras_model(X[:16])))
    assert got == pytest.approx(want, rel=1e-5)


def _plain_l1(predicted, target):
    return jnp.mean(jnp.abs(predicted - target))


def test_a_loss_given_as_a_plain_function_trains_in_the_keras_step(tmp_path):
    """The Keras backend calls the loss inside its JAX step: a plain function trains as the same Loss subclass."""
    from pipekit_train import Loss

    class ClassL1(Loss, register=False):
        def __call__(self, predicted, target):
            return jnp.mean(jnp.abs(predicted - target))

    by_function, _ = _train(_loop(loss=_plain_l1), tmp_path / "f")
    by_class, _ = _train(_loop(loss=ClassL1()), tmp_path / "c")
    same = [np.array_equal(a, b) for a, b in zip(by_function.weights().values(), by_class.weights().values())]
    assert same and all(same)


@pytest.mark.parametrize("loss", [MSE(), CrossEntropy(), Composite(components=((1.0, CrossEntropy()),)), NLL()])
def test_to_keras_loss_gives_the_same_scalar(loss):
    if isinstance(loss, NLL):
        predicted, target = (jnp.asarray(Y), jnp.asarray(Y * 0.5)), Y
    elif isinstance(loss, MSE):
        predicted, target = jnp.asarray(Y + 1.0), Y
    else:
        predicted, target = jnp.asarray(X[:, :2]), LABELS
    want = loss(predicted, target)
    want = want[0] if isinstance(want, tuple) else want
    assert float(to_keras_loss(loss)(target, predicted)) == pytest.approx(float(want), rel=1e-6)


def test_to_keras_loss_trains_with_model_fit():
    import keras

    model = KerasModel(factory="mlp", kwargs={**MLP_KWARGS, "out_size": 2}).new_keras_model()
    model.compile(optimizer="sgd", loss=to_keras_loss(CrossEntropy()))
    history = model.fit(X, LABELS, epochs=2, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"][-1]) and isinstance(model, keras.Model)


# Optimizers -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "cls", "attrs"),
    [
        ({"name": "adamw", "weight_decay": 0.01, "eps": 1e-7}, "AdamW", {"weight_decay": 0.01, "epsilon": 1e-7}),
        ({"name": "adam", "b1": 0.8}, "Adam", {"beta_1": 0.8}),
        ({"name": "sgd", "momentum": 0.9, "nesterov": True}, "SGD", {"momentum": 0.9, "nesterov": True}),
        ({"name": "rmsprop", "b2": 0.95, "momentum": 0.5}, "RMSprop", {"rho": 0.95, "momentum": 0.5}),
        ({"name": "lion", "weight_decay": 0.1}, "Lion", {"beta_2": 0.99, "weight_decay": 0.1}),
    ],
)
def test_optimizer_config_maps_onto_keras(config, cls, attrs):
    opt = build_keras_optimizer(config, max_steps=100, grad_clip_norm=1.5, accum=4)
    assert type(opt).__name__ == cls
    for name, value in attrs.items():
        assert getattr(opt, name) == pytest.approx(value), name
    assert opt.global_clipnorm == 1.5 and opt.gradient_accumulation_steps == 4


def test_a_key_keras_cannot_honour_is_refused_naming_the_backend():
    with pytest.raises(pipekit.ConfigError, match="backend 'keras' cannot honour optimizer_config.nesterov"):
        build_keras_optimizer({"name": "rmsprop", "momentum": 0.9, "nesterov": True}, max_steps=10)
    loop = _loop(optimizer_config={"name": "rmsprop", "momentum": 0.9, "nesterov": True})
    with pytest.raises(pipekit.ConfigError, match="backend 'keras'"):
        check(loop, None, "stage0")


@pytest.mark.parametrize(
    "config",
    [
        {"lr": 0.1, "schedule": "warmup_cosine", "warmup_steps": 10},
        {"lr": 0.1, "schedule": "onecycle"},
        {"lr": 0.1, "schedule": "exponential", "decay_rate": 0.5, "warmup_steps": 5},
        {"lr": 0.1},
    ],
)
def test_schedules_match_the_jax_backends(config):
    from pipekit_train.backends._optax_schedule import learning_rate_at

    opt = build_keras_optimizer(config, max_steps=100)
    schedule = opt._learning_rate
    for step in (0, 3, 10, 50, 99):
        assert float(schedule(step)) == pytest.approx(learning_rate_at(config, step, 100), rel=1e-6)


def test_biases_are_not_decayed_unless_asked():
    import keras

    def decayed(decay_biases: bool) -> list[bool]:
        kernel, bias = keras.Variable(np.ones((2, 2), np.float32)), keras.Variable(np.ones(2, np.float32))
        opt = build_keras_optimizer(
            {"name": "sgd", "lr": 0.1, "weight_decay": 0.5, "decay_biases": decay_biases},
            max_steps=10,
            variables=[kernel, bias],
        )
        values, _ = opt.stateless_apply(
            [v.value for v in opt.variables], [jnp.zeros((2, 2)), jnp.zeros(2)], [kernel.value, bias.value]
        )
        return [bool(np.all(np.asarray(v) < 1.0)) for v in values]

    assert decayed(False) == [True, False]
    assert decayed(True) == [True, True]


def test_sigterm_then_resume_is_bitwise_with_dropout_and_adamw(tmp_path):
    """The kit's resume check on a model with randomness and a scheduled AdamW (the same callbacks both times)."""
    import signal

    from pipekit_train import Callback, Checkpoint, Last, TrainingInterrupted

    armed = {"on": True}

    class TermAt7(Callback, register=False):
        def on_step_end(self, ctx, metrics):
            if ctx.step == 7 and armed["on"]:
                os.kill(os.getpid(), signal.SIGTERM)

    @register_keras_model("test_dropout_resume")
    def dropout_resume(in_size: int):
        import keras

        return keras.Sequential(
            [keras.Input((in_size,)), keras.layers.Dense(8), keras.layers.Dropout(0.3), keras.layers.Dense(1)]
        )

    ckpt = Checkpoint(every_n_steps=5, keep=(Last(n=1),), async_save=False)
    loop = _loop(
        model_op=KerasModel(factory="test_dropout_resume", kwargs={"in_size": 4}),
        optimizer_config={"name": "adamw", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 3},
        max_steps=12,
        steps_per_call=2,
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


def test_a_keras_mlp_hands_off_to_an_equinox_stage_through_the_converter(tmp_path):
    # The two stages of the hand-off above, in the other order: their steps are compiled already.
    kwargs = {**MLP_KWARGS, "out_size": 1}
    first = _loop(model_op=KerasModel(factory="mlp", kwargs=kwargs), name="k")
    second = _loop(model_op=EquinoxModel(factory="mlp", kwargs=kwargs), backend="equinox", name="e")
    model, _ = _train(pipekit.Sequential([first, second]), tmp_path / "r")
    assert model.backend == "equinox" and model.module is not None
