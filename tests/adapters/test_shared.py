"""What the supervised adapters share (`pipekit_train.adapters._shared`): the factory registry and the Transfer path
walk, on plain objects (each backend's own tests run them on its models)."""

from __future__ import annotations

import pytest

from pipekit import ConfigError
from pipekit_train.adapters._shared import MISSING, FactoryRegistry, resolve_path
from pipekit_train.adapters.equinox._model import FACTORIES as EQUINOX
from pipekit_train.adapters.keras._model import FACTORIES as KERAS
from pipekit_train.adapters.lightning._model import FACTORIES as LIGHTNING


class Node:
    def __init__(self, **children):
        self.children = children


def _walk(root, path, steps):
    return resolve_path(
        root,
        steps,
        path,
        "target",
        child=lambda node, name: node.children.get(name, MISSING),
        names=lambda node: sorted(node.children),
    )


def test_resolve_path_walks_names_and_indices_and_names_what_is_missing():
    leaf = Node()
    root = Node(encoder=Node(layers=[Node(), leaf]), head=Node())
    assert _walk(root, "encoder.layers[1]", ["encoder", "layers", 1]) is leaf
    with pytest.raises(ConfigError, match=r"at <root> has no sub-layer 'encodr' \(did you mean 'encoder'\?\); it has"):
        _walk(root, "encodr", ["encodr"])
    with pytest.raises(ConfigError, match=r"path 'encoder.layers\[5\]' not found in the target model: .*length 2"):
        _walk(root, "encoder.layers[5]", ["encoder", "layers", 5])


def test_the_three_supervised_backends_share_one_registry_type_and_the_builtin_zoo():
    for registry in (EQUINOX, KERAS, LIGHTNING):
        assert isinstance(registry, FactoryRegistry)
        assert {"mlp", "cnn", "autoencoder", "classifier"} <= set(registry.names())
        with pytest.raises(ConfigError, match=rf"{registry.owner}.factory 'mpl' is not a registered .*'mlp'"):
            registry.get("mpl")
        with pytest.raises(ConfigError, match="activation must be one of"):
            registry.check_kwargs("mlp", {"in_size": 2, "out_size": 1, "activation": "rleu"})


def test_a_registry_refuses_another_factory_under_a_taken_name():
    registry = FactoryRegistry("ToyModel", "toy factory", "pipekit_train.adapters._shared")

    def one(size: int): ...

    registry.register("one", "register_toy")(one)
    registry.register("one", "register_toy")(one)  # the same function again: a no-op
    with pytest.raises(ConfigError, match="toy factory 'one' is already registered by"):
        registry.register("one", "register_toy")(lambda size: None)
    with pytest.raises(ConfigError, match=r"register_toy\('two'\): expected a function"):
        registry.register("two", "register_toy")(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ToyModel.kwargs: factory 'one' has no parameter 'sise'"):
        registry.check_kwargs("one", {"sise": 1})
