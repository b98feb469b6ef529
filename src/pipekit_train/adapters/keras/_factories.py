"""The built-in Keras factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (the Equinox backend's kwargs).

Their kwargs and layers are the backend-neutral descriptions in `pipekit_train.backends._zoo`; `build` makes Keras
layers (the model classes in `_layers`) from a description. Cheap to import: the signatures are what `KerasModel`
checks its ``kwargs`` against when a pipeline is read, and Keras is imported only when a factory runs.
"""

from __future__ import annotations

from typing import Any

from pipekit_train.backends.kit import ZOO, Architecture, factory

from ._model import register_keras_model

__all__ = ["build"]


def build(arch: Architecture, key: Any = None) -> Any:
    """The built Keras model of `arch` (under the caller's seed; `key` is unused): `MLP`, `ConvNet`,
    `AutoEncoder` or `Classifier`, with a batch input of the first layer's width."""
    from . import _layers as k

    act = arch.activation
    if arch.factory == "mlp":
        model = k.MLP(arch.sizes("layers"), act, name="mlp")
        in_size = arch.sizes("layers")[0]
    elif arch.factory == "cnn":
        image = arch.image()
        model = k.ConvNet(image.size, arch.part("convs"), arch.sizes("head"), act, name="cnn")
        in_size = image.size**2 * image.channels
    else:
        encoder = k.Stack(arch.sizes("encoder"), act, name="encoder")
        other = arch.parts()[1]  # "decoder" | "head"
        second = k.Stack(arch.sizes(other), act, name=other)
        cls = k.AutoEncoder if arch.factory == "autoencoder" else k.Classifier
        model = cls(encoder, second, name=arch.factory)
        in_size = arch.sizes("encoder")[0]
    model.build((None, in_size))
    return model


for _name in ZOO:
    register_keras_model(_name)(factory(_name, build, __name__))
