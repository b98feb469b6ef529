"""The built-in torch factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (the Equinox backend's kwargs).

Their kwargs and layers are the backend-neutral descriptions in `pipekit_train.backends._zoo`; `build` makes torch
modules (`_layers`) from a description: ``layers[i]`` in order, ``Linear`` weights ``(out, in)`` as Equinox's.
Cheap to import: the signatures are what `TorchModel` checks its ``kwargs`` against when a pipeline is read, and
torch is imported only when a factory runs.
"""

from __future__ import annotations

from typing import Any

from pipekit_train.backends.kit import ZOO, Architecture, factory

from ._model import register_torch_model

__all__ = ["build"]


def build(arch: Architecture, key: Any = None) -> Any:
    """The torch module of `arch` (under the caller's seed; `key` is unused): `Stack` (``mlp``), `ConvNet`,
    `AutoEncoder` or `Classifier`."""
    from . import _layers as t

    act = arch.activation
    if arch.factory == "mlp":
        return t.Stack(arch.sizes("layers"), act)
    if arch.factory == "cnn":
        return t.ConvNet(arch.image().size, arch.part("convs"), arch.sizes("head"), act)
    encoder = t.Stack(arch.sizes("encoder"), act)
    second = t.Stack(arch.sizes(arch.parts()[1]), act)
    cls = t.AutoEncoder if arch.factory == "autoencoder" else t.Classifier
    return cls(encoder, second)


for _name in ZOO:
    register_torch_model(_name)(factory(_name, build, __name__))
