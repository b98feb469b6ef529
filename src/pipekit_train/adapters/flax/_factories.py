"""The built-in Flax factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``, and the transformers
``transformer`` and ``transformer_classifier`` (``_transformer.py``), with the Equinox backend's kwargs.

Their kwargs and layers are the backend-neutral descriptions of the kit's zoo (`pipekit_train.backends.kit.ZOO`);
`build` makes NNX modules (`_layers`) from a description. Registering them imports neither JAX nor Flax (a
pipeline file naming ``factory: mlp`` is checked without them); `build` imports `_layers` when it runs. The
transformers' weights are described in `pipekit_train.backends.kit.transformer_weights`, which their converters to
and from Equinox go through.
"""

from __future__ import annotations

from typing import Any

from pipekit_train.backends.kit import TRANSFORMERS, ZOO, Architecture, factory, transformer_factory

from ._model import register_flax_model

__all__ = ["build", "build_transformer"]


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


def build_transformer(arguments: dict[str, Any], rngs: Any) -> Any:
    """The NNX `LanguageModel` or `SequenceClassifier` of `arguments` (`transformer_factory`'s), from `rngs`."""
    from ._transformer import LanguageModel, SequenceClassifier

    kwargs = dict(arguments)
    model = SequenceClassifier if kwargs.pop("factory") == "transformer_classifier" else LanguageModel
    return model(**kwargs, rngs=rngs)


for _name in TRANSFORMERS:
    register_flax_model(_name)(transformer_factory(_name, build_transformer, __name__))
