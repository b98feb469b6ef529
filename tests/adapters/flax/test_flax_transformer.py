"""The zoo's ``transformer`` and ``transformer_classifier`` on the Flax backend: the Equinox backend's kwargs and
part names, converters to and from Equinox (bitwise back, the same outputs to float rounding), causal attention
that never looks at padding, ``remat`` with the same numbers, a tiny language model that learns, dropout drawn from
``(seed, step)``, and the language model's ``embed`` and ``blocks`` handed to a classifier by `Transfer`."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

pytest.importorskip("flax")

import pipekit
from pipekit import ConfigError, ShapeError
from pipekit_train import TrainingDataset, TrainingLoop, available_backends, register_backend, run_settings
from pipekit_train.adapters.flax import FlaxModel, apply_transfer
from pipekit_train.backends import Transfer, convert_model
from pipekit_train.data import ArraySource
from pipekit_train.losses import CrossEntropy, NextTokenCrossEntropy
from pipekit_train.tracking import history

pytestmark = pytest.mark.xdist_group("kit-flax")  # one worker: Flax imported and the steps compiled once

if "flax" not in available_backends():  # a checkout whose installed metadata predates the entry point
    register_backend("flax", "pipekit_train.adapters.flax:backend")

PAD = 10
LM = {"vocab_size": 11, "d_model": 16, "num_heads": 2, "num_layers": 2, "max_len": 12}
CLF = {**LM, "num_classes": 3}
KWARGS = {"transformer": LM, "transformer_classifier": CLF}
SMALL = {**LM, "num_layers": 1}  # what trains: one block compiles faster


def _ids(n: int, t: int = 12, seed: int = 0) -> np.ndarray:
    """Rows counting up mod 10 from a random start (a pattern a language model learns in a few steps); every other
    row ends in padding."""
    rng = np.random.default_rng(seed)
    ids = ((rng.integers(0, 10, (n, 1)) + np.arange(t)) % 10).astype(np.int32)
    ids[::2, t - 3 :] = PAD
    return ids


def _random_weights(model, seed: int = 0):
    """The bound `model` with non-trivial weights (biases and norms too) in place of its own."""
    rng = np.random.default_rng(seed)
    return model.with_weights({k: rng.normal(0, 0.3, v.shape).astype(v.dtype) for k, v in model.weights().items()})


def _flax_factory(name):
    from pipekit_train.adapters.flax._model import FACTORIES

    return FACTORIES.get(name)


def _equinox_factory(name):
    from pipekit_train.adapters.equinox._model import FACTORIES

    return FACTORIES.get(name)


@pytest.fixture(scope="module")
def models():
    """Each transformer on each backend bound to non-trivial weights: ``{(backend, factory): model}``.

    Only the Flax models are built: an Equinox model is the Flax one converted, then given draws of its own
    (`EquinoxModel.with_weights` fills the architecture's abstract skeleton, checking names, shapes and dtypes):
    the same arrays as drawn over an Equinox build, without compiling the Equinox builder."""
    models = {}
    for factory, kwargs in KWARGS.items():
        op = FlaxModel(factory=factory, kwargs=kwargs)
        flax = models["flax", factory] = _random_weights(op.bind(op.build(1)))
        models["equinox", factory] = _random_weights(convert_model(flax, "equinox"))
    return models


# Kwargs, parts, input checks --------------------------------------------------------------------------------------
@pytest.mark.parametrize("factory", list(KWARGS))
def test_the_flax_transformers_take_the_equinox_kwargs_and_have_its_parts(models, factory):
    def params(fn):
        return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]

    assert params(_flax_factory(factory)) == params(_equinox_factory(factory))

    def parts(backend):  # the weights' module paths, without the leaf's name (``kernel`` here, ``weight`` there)
        return sorted({name.rsplit(".", 1)[0] for name in models[backend, factory].weights()})

    flax_parts = parts("flax")
    assert flax_parts == parts("equinox")
    assert ".blocks[1].attention.query_proj" in flax_parts and ".blocks[0].mlp.down" in flax_parts
    op = FlaxModel(factory=factory, kwargs=KWARGS[factory])
    out = op.check_input((12,), np.int32)
    assert out.shape == ((12, 11) if factory == "transformer" else (3,))
    with pytest.raises(ShapeError, match=r"expects \(12,\) or shorter integer token ids"):
        op.check_input((13,), np.int32)
    with pytest.raises(ConfigError, match=r"d_model \(10\) must be a multiple of num_heads \(4\)"):
        FlaxModel(factory=factory, kwargs={**KWARGS[factory], "d_model": 10, "num_heads": 4}).build(0)


# Converters -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factory", list(KWARGS))
@pytest.mark.parametrize("src", ["flax", "equinox"])
def test_the_transformers_convert_to_equinox_and_back(models, src, factory):
    """The same function to float rounding (padding included), and back the same arrays bit for bit."""
    ids = _ids(3)
    model = models[src, factory]
    other = convert_model(model, "equinox" if src == "flax" else "flax")
    assert other.factory == factory and other.kwargs == model.kwargs
    np.testing.assert_allclose(np.asarray(other(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    back = convert_model(other, src).weights()
    assert list(back) == list(model.weights())
    for name, array in model.weights().items():
        np.testing.assert_array_equal(back[name], array)


# Attention: causal, padding never attended; remat ----------------------------------------------------------------
def test_the_flax_transformer_is_causal_and_never_attends_to_padding(models):
    lm = models["flax", "transformer"]
    ids = _ids(3)  # the converters' batch (one prediction program): row 1 is unpadded
    changed = ids.copy()
    changed[1, 5] = (changed[1, 5] + 3) % 10
    out, out_changed = np.asarray(lm(ids)), np.asarray(lm(changed))
    np.testing.assert_array_equal(out[:, :5], out_changed[:, :5])  # positions before 5 never see token 5
    assert not np.allclose(out[:, 5:], out_changed[:, 5:])
    causal = models["flax", "transformer_classifier"]
    bidirectional = FlaxModel(factory="transformer_classifier", kwargs={**CLF, "causal": False})
    short = np.array([[3, 4, 5] + [PAD] * 9], np.int32)
    for clf in (causal, bidirectional.with_weights(causal.weights())):
        np.testing.assert_allclose(np.asarray(clf(short)), np.asarray(clf(short[:, :3])), rtol=1e-5, atol=1e-6)


def test_remat_recomputes_each_block_with_the_same_numbers(models):
    import jax
    from flax import nnx

    ids = _ids(4)
    plain = models["flax", "transformer"]
    grads, jaxprs = [], []
    for model in (plain, FlaxModel(factory="transformer", kwargs={**LM, "remat": True}).with_weights(plain.weights())):
        state = model.module

        def loss(params, state=state):  # new variables inside the trace, as the backend's step merges them
            fresh = jax.tree.map(lambda x: x, (state.rngs, state.rest))
            return nnx.merge(state.graphdef, params, *fresh)(ids).astype("float32").sum()

        jaxprs.append(str(jax.make_jaxpr(jax.grad(loss))(state.params)))
        grads.append(jax.tree.leaves(jax.jit(jax.grad(loss))(state.params)))
    assert "remat" in jaxprs[1] and "remat" not in jaxprs[0]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# Training: a language model, dropout, transfer to a classifier ---------------------------------------------------
def _lm_loop(**overrides) -> TrainingLoop:
    fields = dict(
        name="pretrain",
        model_op=FlaxModel(factory="transformer", kwargs={**SMALL, "dropout": 0.1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": _ids(64)})),
        loss=NextTokenCrossEntropy(pad_id=PAD),
        target_key="x",
        optimizer_config={"name": "adamw", "lr": 0.01},
        max_steps=24,
        batch_size=16,
        backend="flax",
        progress=False,
        log_every_n_steps=4,
        steps_per_call=4,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def _train(loop, run_dir):
    with run_settings(run_dir=str(run_dir), store=False):
        return loop.run()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The tiny language model trained once (dropout 0.1, 4 steps a call): ``(model, run_dir)``."""
    run_dir = tmp_path_factory.mktemp("flax-lm") / "run"
    model, _ = _train(_lm_loop(), run_dir)
    return model, run_dir


def test_a_tiny_flax_language_model_learns_and_its_dropout_follows_seed_and_step(pretrained, tmp_path):
    model, run_dir = pretrained
    loss = history([str(run_dir)])[str(run_dir)]["pretrain"]["train"]["loss"]["values"]
    assert len(loss) == 6 and loss[-1] < 0.6 * loss[0], loss
    # the dropout masks are a function of (seed, step), kept in the module's streams and reseeded every step: one
    # step a call gives the weights of four steps a call, bit for bit
    one, _ = _train(_lm_loop(steps_per_call=1), tmp_path / "one")
    assert one.weights_hash() == model.weights_hash()
    # dropout is on in training mode (the streams advance), off in inference mode; the module called through
    # `nnx.jit` (which hands the advanced streams back to it): one compiled program, not an eager compile per op,
    # and on one row, whose masks' program XLA compiles in about half the time two rows' take
    from flax import nnx

    ids = _ids(1)
    module = model.to_nnx()
    module.train()
    call = nnx.jit(lambda module, ids: module(ids))
    assert not np.allclose(np.asarray(call(module, ids)), np.asarray(call(module, ids)))
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(model(ids)))


def test_a_flax_language_models_embed_and_blocks_go_to_a_classifier(pretrained, tmp_path):
    lm, _ = pretrained
    # no dropout in the classifier: what is checked (the trunk handed over, then a step too small to move it) does
    # not depend on it, and its random masks are most of what a step with dropout takes to compile
    clf_op = FlaxModel(factory="transformer_classifier", kwargs={**SMALL, "num_classes": 3})
    clf = clf_op.bind(clf_op.build(0))
    moved = clf_op.bind(apply_transfer(Transfer(paths={"embed": "embed", "blocks": "blocks"}), lm, clf))
    trunk = {k: v for k, v in lm.weights().items() if k.startswith((".embed", ".blocks"))}
    assert trunk and all(np.array_equal(moved.weights()[k], v) for k, v in trunk.items())
    assert all(np.array_equal(moved.weights()[k], v) for k, v in clf.weights().items() if k.startswith(".head"))
    # the same from a pipeline: the classifier stage starts from the language model's trunk (then one step of a
    # learning rate too small to move it)
    ids = _ids(32)
    finetune = _lm_loop(
        name="finetune",
        model_op=clf_op,
        dataset=TrainingDataset(source=ArraySource(arrays={"x": ids, "y": (ids[:, 0] % 3).astype(np.int32)})),
        loss=CrossEntropy(),
        target_key="y",
        transfer=Transfer(paths={"embed": "embed", "blocks": "blocks"}),
        max_steps=1,
        steps_per_call=1,
        optimizer_config={"name": "sgd", "lr": 1e-30},
    )
    tuned, _ = _train(pipekit.Sequential([_lm_loop(), finetune]), tmp_path / "seq")
    got = tuned.weights()
    for name, value in trunk.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-20)
