"""The backend-neutral zoo: one description per built-in factory, and converters for every factory kind in all
directions among Equinox, Keras, Lightning and (with the ``flax`` extra) Flax that keep the model's function (the
flatten order included)."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None or importlib.util.find_spec("torch") is None:
    # not importorskip: Keras must not be imported before the adapter sets its backend
    pytest.skip("the keras and lightning extras are not installed", allow_module_level=True)

from pipekit_train.backends._convert import convert_model, registered_converters
from pipekit_train.backends._zoo import ZOO, Conv, Dense, Flatten, describe

pytestmark = pytest.mark.xdist_group("zoo")  # one worker (--dist loadgroup): the twelve models are built once

BACKENDS = ("equinox", "keras", "lightning") + (("flax",) if importlib.util.find_spec("flax") is not None else ())

#: Small kwargs of each kind; the cnn's 2x2x3 feature map makes the flatten order matter.
KWARGS = {
    "mlp": {"in_size": 5, "out_size": 3, "width_size": 6, "depth": 2, "activation": "tanh"},
    "cnn": {"image_size": 8, "out_size": 4, "channels": (2, 3), "hidden": 6, "activation": "gelu"},
    "autoencoder": {"in_size": 6, "latent_size": 2, "hidden": (5, 4), "activation": "silu"},
    "classifier": {"in_size": 6, "num_classes": 3, "latent_size": 2, "hidden": (4,), "head_hidden": (5,)},
}
IN_SIZE = {"mlp": 5, "cnn": 64, "autoencoder": 6, "classifier": 6}


def _op(backend: str, factory: str):
    if backend == "equinox":
        from pipekit_train.adapters.equinox import EquinoxModel as cls
    elif backend == "keras":
        from pipekit_train.adapters.keras import KerasModel as cls
    elif backend == "flax":
        from pipekit_train.adapters.flax import FlaxModel as cls
    else:
        from pipekit_train.adapters.lightning import TorchModel as cls
    return cls(factory=factory, kwargs=KWARGS[factory])


def _weight_specs(op) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The names, shapes and dtypes of `op`'s weights, in the order of ``weights()``: `models` replaces every value.

    Equinox reads them from its architecture traced abstractly (what its ``with_weights`` fills), so the program that
    draws its initial weights is not compiled (4 programs, about 3.5 s of CPU); the same specs, in the same order,
    so `models` draws the same weights. Keras, Flax and torch fill weights into a model of the architecture built in
    this process (once per architecture), so the build here compiles nothing that ``with_weights`` would not."""
    if op.backend == "equinox":
        from pipekit_train.adapters.equinox._tree import abstract, leaf_specs

        return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in leaf_specs(abstract(op)).items()}
    return {name: (v.shape, v.dtype) for name, v in op.bind(op.build(1)).weights().items()}


@pytest.fixture(scope="module")
def models():
    """Each (backend, factory) bound to non-trivial weights (biases too), and one random batch per factory."""
    rng = np.random.default_rng(0)
    out = {}
    for backend, factory in itertools.product(BACKENDS, ZOO):
        op = _op(backend, factory)
        weights = {k: rng.normal(0, 0.5, shape).astype(dtype) for k, (shape, dtype) in _weight_specs(op).items()}
        out[backend, factory] = op.with_weights(weights)
    batches = {f: rng.normal(size=(3, IN_SIZE[f])).astype(np.float32) for f in ZOO}
    return out, batches


def test_every_factory_converts_in_all_directions():
    registered = set(registered_converters())
    for src, dst in itertools.permutations(BACKENDS, 2):
        for factory in ZOO:
            assert (src, dst, factory) in registered


@pytest.mark.parametrize("factory", list(ZOO))
@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(BACKENDS, 2)))
def test_a_converted_model_computes_the_same_function(models, src, dst, factory):
    built, batches = models
    model = built[src, factory]
    converted = convert_model(model, dst)
    assert converted.backend == dst and converted.factory == factory and converted.kwargs == model.kwargs
    x = batches[factory]
    np.testing.assert_allclose(np.asarray(converted(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-5)
    # and back: the same arrays, bit for bit (transposes and permutations only)
    back = convert_model(converted, src).weights()
    for name, array in model.weights().items():
        np.testing.assert_array_equal(back[name], array)


def test_a_description_lists_the_layers_in_order():
    arch = describe("cnn", {"image_size": 8, "channels": (2, 3), "hidden": 6, "out_size": 4})
    convs = [layer for layer in arch.layers if isinstance(layer, Conv)]
    assert [(c.path, c.in_channels, c.out_channels, c.kernel) for c in convs] == [
        (("convs", 0), 1, 2, (3, 3)),
        (("convs", 1), 2, 3, (3, 3)),
    ]
    assert Flatten(3, 2, 2) in arch.layers
    dense = [layer for layer in arch.layers if isinstance(layer, Dense)]
    assert [(d.path, d.in_size, d.out_size, d.activation) for d in dense] == [
        (("head", "layers", 0), 12, 6, "relu"),
        (("head", "layers", 1), 6, 4, None),
    ]
    assert describe("autoencoder", {"in_size": 6, "hidden": (5,), "latent_size": 2}).sizes("decoder") == [2, 5, 6]
