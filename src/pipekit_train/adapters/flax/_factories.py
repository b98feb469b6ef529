"""The built-in Flax factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (the Equinox backend's kwargs).

Their kwargs and layers are the backend-neutral descriptions of the kit's zoo (`pipekit_train.backends.kit.ZOO`);
`build` makes NNX modules (`_layers`) from a description. Registering them imports neither JAX nor Flax (a
pipeline file naming ``factory: mlp`` is checked without them); `build` imports `_layers` when it runs.
"""

from __future__ import annotations

from typing import Any

from pipekit_train.backends.kit import ZOO, Architecture, factory

from ._model import register_flax_model

__all__ = ["build"]


def build(arch: Architecture, rngs: Any) -> Any:
    """The NNX module of `arch` with weights drawn from `rngs` (an ``nnx.Rngs``): `MLP`, `ConvNet`, `AutoEncoder`
    or `Classifier`."""
    from . import _layers as m

    act = arch.activation
    if arch.factory == "mlp":
        return m.MLP(arch.sizes("layers"), act, rngs=rngs)
    stacks = {p: m.Stack(arch.sizes(p), act, rngs=rngs) for p in arch.parts() if p != "convs"}
    if arch.factory == "cnn":
        return m.ConvNet(arch.image().size, arch.part("convs"), stacks["head"], act, rngs=rngs)
    if arch.factory == "autoencoder":
        return m.AutoEncoder(stacks["encoder"], stacks["decoder"])
    return m.Classifier(stacks["encoder"], stacks["head"])


for _name in ZOO:
    register_flax_model(_name)(factory(_name, build, __name__, key=True))
