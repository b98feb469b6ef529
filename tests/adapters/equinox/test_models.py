"""Model operators: factories, binding, hashing, shape checks before compiling, and weight transfer."""

from __future__ import annotations

import copy
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError, PipekitError, ShapeError
from pipekit_train import ModelOp, Transfer
from pipekit_train.adapters.equinox import (
    EquinoxModel,
    apply_transfer,
    get_activation,
    register_model,
    registered_models,
)

FACTORIES = {
    "mlp": ({"in_size": 6, "out_size": 3, "width_size": 8, "depth": 2, "activation": "tanh"}, (6,), (3,)),
    "cnn8": ({"image_size": 8, "out_size": 10}, (8, 8), (10,)),
    "cnn8_flat": ({"image_size": 8, "out_size": 10, "channels": [4]}, (64,), (10,)),
    "cnn28": ({"image_size": 28, "out_size": 4, "channels": [2, 3], "hidden": 8}, (28, 28), (4,)),
    "autoencoder": ({"in_size": 12, "latent_size": 3, "hidden": [8, 5], "activation": "gelu"}, (12,), (12,)),
    "classifier": ({"in_size": 12, "num_classes": 4, "latent_size": 3, "head_hidden": [6]}, (12,), (4,)),
}


def _op(name):
    kwargs, _, _ = FACTORIES[name]
    factory = "cnn" if name.startswith("cnn") else name
    return EquinoxModel(factory=factory, kwargs=kwargs)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_factory_builds_runs_one_example_and_a_batch(name):
    _, in_shape, out_shape = FACTORIES[name]
    op = _op(name)
    module = op.build(jax.random.key(0))
    assert isinstance(module, eqx.Module)
    # Drawn with NumPy: the input is any data, and a `jax.random` draw compiles a program for every input shape.
    x = np.random.default_rng(1).normal(size=(5, *in_shape)).astype(np.float32)
    one = eqx.filter_jit(lambda m, xi: m(xi, key=None))(module, x[0])
    assert one.shape == out_shape
    bound = op.bind(module)
    batch = bound(x)
    assert batch.shape == (5, *out_shape)
    np.testing.assert_allclose(batch[0], one, rtol=1e-5, atol=1e-6)
    assert op.check_input(in_shape, jnp.float32) == jax.ShapeDtypeStruct(out_shape, jnp.float32)
    assert bound.check_input(in_shape, jnp.float32) == jax.ShapeDtypeStruct(out_shape, jnp.float32)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_yaml_round_trip_gives_an_equal_unbound_op(name):
    op = _op(name)
    bound = op.bind(op.build(0))
    loaded = pipekit.loads(pipekit.dumps(bound))
    assert loaded == op == bound
    assert loaded.module is None
    assert "weight" not in pipekit.dumps(bound)


def test_example_round_trips():
    assert pipekit.loads(pipekit.dumps(EquinoxModel.example())) == EquinoxModel.example()
    assert pipekit.loads(pipekit.dumps(Transfer.example())) == Transfer.example()
    assert pipekit.loads(pipekit.dumps(Transfer())) == Transfer()


def test_an_int_seed_is_accepted_as_a_key():
    op = _op("mlp")
    a, b = op.bind(op.build(3)), op.bind(op.build(jax.random.key(3)))
    assert a.weights_hash() == b.weights_hash()


def test_weights_hash_tracks_the_weights_only():
    op = _op("mlp")
    a = op.bind(op.build(0))
    h = a.weights_hash()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", h)
    assert a.weights_hash() == h
    assert op.bind(op.build(0)).weights_hash() == h  # same weights, rebuilt
    assert op.bind(op.build(1)).weights_hash() != h
    module = a.module
    nudged = eqx.tree_at(lambda m: m.layers[1].bias, module, module.layers[1].bias.at[0].add(1e-6))
    assert op.bind(nudged).weights_hash() != h
    # the same bytes under another dtype are other weights
    as_int = eqx.tree_at(
        lambda m: m.layers[0].bias, module, jax.lax.bitcast_convert_type(module.layers[0].bias, jnp.int32)
    )
    assert op.bind(as_int, check=False).weights_hash() != h


def test_equality_and_hash_ignore_weights():
    op = _op("mlp")
    a, b = op.bind(op.build(0)), op.bind(op.build(1))
    assert a == b == op
    assert hash(a) == hash(b) == hash(op)
    assert a != op.replace(kwargs={**op.kwargs, "width_size": 9})
    assert op.module is None
    assert a.module is not b.module


def test_bind_returns_a_copy_and_copies_keep_the_binding_but_replace_does_not():
    op = _op("mlp")
    module = op.build(0)
    bound = op.bind(module)
    assert op.module is None
    assert bound.module is module
    assert copy.copy(bound).module is module
    assert copy.deepcopy(bound).weights_hash() == bound.weights_hash()
    replaced = bound.replace(kwargs={**op.kwargs, "depth": 1})
    assert replaced.module is None
    with pytest.raises(PipekitError, match=r"no weights are bound.*replace\(\) and YAML loading give unbound"):
        replaced(jnp.zeros((1, 6)))


def test_unbound_op_refuses_to_run_or_hash():
    op = _op("mlp")
    with pytest.raises(PipekitError, match=r"EquinoxModel\(.*\).__call__: no weights are bound"):
        op(jnp.zeros((2, 6)))
    with pytest.raises(PipekitError, match=r"weights_hash: no weights are bound"):
        op.weights_hash()


def test_bind_checks_the_module_fits_the_architecture():
    op = _op("mlp")
    other = _op("mlp").replace(kwargs={**op.kwargs, "width_size": 7})
    with pytest.raises(ShapeError, match=r"\.layers\[0\]\.weight: got \(7, 6\) float32, expected \(8, 6\) float32"):
        op.bind(other.build(0))
    with pytest.raises(ShapeError, match=r"its arrays are at \.encoder"):
        op.bind(_op("autoencoder").build(0))
    with pytest.raises(ConfigError, match="bind expects an equinox Module, got ndarray"):
        op.bind(np.zeros(3))


_TRACES = []


class _Counting(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        _TRACES.append(x.shape)
        return self.linear(x)


@register_model("test_counting")
def _counting(key, in_size: int = 2):
    return _Counting(eqx.nn.Linear(in_size, 1, key=key))


def test_batch_call_compiles_once_per_structure():
    op = EquinoxModel(factory="test_counting")
    bound = op.bind(op.build(0))
    _TRACES.clear()
    bound(jnp.ones((4, 2)))
    bound(jnp.zeros((4, 2)))
    op.bind(op.build(1))(jnp.ones((4, 2)))  # other weights, same structure
    assert _TRACES == [(2,)]
    bound(jnp.ones((3, 2)))  # a new batch size is a new shape
    assert len(_TRACES) == 2


def test_check_input_names_the_data_shape_and_what_the_model_expects():
    with pytest.raises(
        ShapeError,
        match=r"per-example input has shape \(8, 8\) and dtype float32, but EquinoxModel\(factory='mlp'.*\) "
        r"expects \(6,\) \(its first Linear has in_features=6\)",
    ):
        _op("mlp").check_input((8, 8), jnp.float32)
    with pytest.raises(ShapeError, match=r"shape \(10,\).*expects \(12,\) \(its first Linear has in_features=12\)"):
        _op("autoencoder").check_input((10,), jnp.float32)
    with pytest.raises(ShapeError, match=r"shape \(28, 28\).*expects \(64,\), \(8, 8\) or \(1, 8, 8\)"):
        _op("cnn8").check_input((28, 28), jnp.float32)


def test_check_input_describes_a_conv_first_layer():
    @register_model("test_conv_only")
    def conv_only(key, channels: int = 3):
        return eqx.nn.Conv2d(channels, 2, kernel_size=3, key=key)

    op = EquinoxModel(factory="test_conv_only")
    assert op.check_input((3, 5, 5), jnp.float32).shape == (2, 3, 3)
    with pytest.raises(ShapeError, match=r"shape \(1, 5, 5\).*\(its first Conv has in_channels=3\)"):
        op.check_input((1, 5, 5), jnp.float32)


def test_classifier_encoder_is_the_autoencoders_encoder():
    ae = _op("autoencoder").build(0)
    kw = FACTORIES["autoencoder"][0]
    clf = EquinoxModel(
        factory="classifier",
        kwargs={k: kw[k] for k in ("in_size", "latent_size", "hidden", "activation")} | {"num_classes": 4},
    ).build(0)
    assert jax.tree.structure(ae.encoder) == jax.tree.structure(clf.encoder)
    for a, b in zip(jax.tree.leaves(ae.encoder), jax.tree.leaves(clf.encoder)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # same key → same encoder weights


def test_transfer_moves_encoder_weights_bitwise():
    ae = _op("autoencoder")
    kw = ae.kwargs
    clf = EquinoxModel(
        factory="classifier",
        kwargs={k: kw[k] for k in ("in_size", "latent_size", "hidden", "activation")} | {"num_classes": 4},
    )
    trained = ae.bind(ae.build(1))
    fresh = clf.build(2)
    moved = apply_transfer(Transfer(paths={"encoder": "encoder"}), trained.module, fresh)
    for a, b in zip(jax.tree.leaves(trained.module.encoder), jax.tree.leaves(moved.encoder)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    for a, b in zip(jax.tree.leaves(fresh.head), jax.tree.leaves(moved.head)):
        np.testing.assert_array_equal(a, b)  # the head is untouched
    assert clf.bind(moved)(jnp.ones((2, 12))).shape == (2, 4)
    # bound ModelOps are accepted too, and one layer can be addressed by index
    one = apply_transfer(Transfer(paths={"encoder.layers[1]": "encoder.layers[1]"}), trained, clf.bind(fresh))
    np.testing.assert_array_equal(one.encoder.layers[1].weight, trained.module.encoder.layers[1].weight)
    np.testing.assert_array_equal(one.encoder.layers[0].weight, fresh.encoder.layers[0].weight)


def test_empty_transfer_keeps_the_fresh_weights():
    fresh = _op("classifier").build(0)
    assert apply_transfer(Transfer(), _op("autoencoder").build(1), fresh) is fresh


def test_transfer_errors():
    ae = _op("autoencoder").build(0)
    clf = _op("classifier").build(0)
    with pytest.raises(ConfigError, match=r"path 'encodr' not found in the target model: .*did you mean 'encoder'"):
        apply_transfer(Transfer(paths={"encodr": "encoder"}), ae, clf)
    with pytest.raises(ConfigError, match=r"path 'encoder.layers\[7\]' not found in the source model: .*length 3"):
        apply_transfer(Transfer(paths={"encoder": "encoder.layers[7]"}), ae, clf)
    with pytest.raises(
        ShapeError,
        match=r"source 'decoder' does not fit target 'encoder': at \.layers\[0\]\.weight the source has "
        r"\(5, 3\) float32 and the target has \(128, 12\) float32",
    ):
        apply_transfer(Transfer(paths={"encoder": "decoder"}), ae, clf)
    with pytest.raises(ConfigError, match=r"Transfer.paths: 'encoder\.' is not an attribute path"):
        Transfer(paths={"encoder.": "encoder"})
    other = EquinoxModel(factory="autoencoder", kwargs={**FACTORIES["autoencoder"][0], "activation": "relu"}).build(0)
    with pytest.raises(ShapeError, match="equal shapes but different structure"):
        apply_transfer(Transfer(paths={"encoder": "encoder"}), ae, other)


def test_equinox_model_config_errors():
    with pytest.raises(ConfigError, match=r"factory 'mpl' is not a registered model factory \(did you mean 'mlp'\?\)"):
        EquinoxModel(factory="mpl")
    with pytest.raises(
        ConfigError,
        match=r"factory 'mlp' has no parameter 'widht_size' \(did you mean 'width_size'.*it accepts: in_size, out_size",
    ):
        EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 1, "widht_size": 4})
    with pytest.raises(ConfigError, match=r"factory 'mlp' needs 'out_size'; required: in_size, out_size"):
        EquinoxModel(factory="mlp", kwargs={"in_size": 2})
    with pytest.raises(ConfigError, match=r"activation must be one of relu, gelu, tanh, silu, identity, got 'rleu'"):
        EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 1, "activation": "rleu"}).build(0)
    with pytest.raises(ConfigError, match=r"cnn: image_size=2 is too small for 2 conv\+pool stages"):
        EquinoxModel(factory="cnn", kwargs={"image_size": 2}).build(0)
    with pytest.raises(ConfigError, match=r"test.yaml:\d+:\d+: EquinoxModel.factory 'nope' is not a registered"):
        pipekit.loads("pipekit: 1\ntype: EquinoxModel\nfactory: nope\n", source="test.yaml")


def test_register_model_rules():
    assert {"mlp", "cnn", "autoencoder", "classifier"} <= set(registered_models())
    with pytest.raises(ConfigError, match=r"first parameter must be `key`"):
        register_model("test_bad")(lambda rng, n=1: None)
    with pytest.raises(
        ConfigError, match=r"model factory 'mlp' is already registered by pipekit_train.adapters.equinox._factories.mlp"
    ):
        register_model("mlp")(lambda key: None)

    @register_model("test_not_a_module")
    def not_a_module(key):
        return [1, 2]

    with pytest.raises(ConfigError, match=r"'test_not_a_module' returned list; it must return an equinox Module"):
        EquinoxModel(factory="test_not_a_module").build(0)


def test_factories_with_var_kwargs_accept_any_kwarg():
    @register_model("test_var_kwargs")
    def var_kwargs(key, **kwargs):
        return eqx.nn.Linear(kwargs.get("n", 2), 1, key=key)

    assert EquinoxModel(factory="test_var_kwargs", kwargs={"n": 3}).build(0).in_features == 3


def test_activations_by_name():
    x = jnp.array([-1.0, 0.0, 2.0])
    np.testing.assert_allclose(get_activation("relu")(x), [0.0, 0.0, 2.0])
    np.testing.assert_allclose(get_activation("identity")(x), x)
    np.testing.assert_allclose(get_activation("tanh")(x), np.tanh(x), rtol=1e-6)
    with pytest.raises(ConfigError, match=r"got 'jax.nn.relu'"):
        get_activation("jax.nn.relu")


def test_model_op_is_abstract():
    assert "ModelOp" not in pipekit.registered()
    with pytest.raises(NotImplementedError):
        ModelOp().build(0)
