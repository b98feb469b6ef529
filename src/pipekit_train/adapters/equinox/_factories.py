"""The built-in Equinox factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``, and the transformers
``transformer`` and ``transformer_classifier`` (``_transformer.py``; their signature is the kit's
`transformer_factory`, the one the Flax backend registers too).

Their kwargs and layers are the backend-neutral descriptions in `pipekit_train.backends._zoo`; `build` makes
Equinox layers from a description. Registering them imports neither JAX nor Equinox (a pipeline file naming
``factory: mlp`` is checked without them); `build` imports `_modules` (Equinox, JAX) when it runs.

The keys follow the description's parts: the key is split once per top-level part when there are several
(``convs`` / ``head``, ``encoder`` / ``decoder``), and each part's key once per layer, so a classifier's encoder
has exactly the autoencoder's weights for the same key.
"""

from __future__ import annotations

from typing import Any

from pipekit_train.backends.kit import TRANSFORMERS, ZOO, Architecture, factory, transformer_factory

from ._model import register_model

__all__ = ["build", "build_transformer"]


def build(arch: Architecture, key: Any) -> Any:
    """The Equinox module of `arch`: ``equinox.nn.MLP``, `ConvNet`, `AutoEncoder` or `Classifier` (`_modules`)."""
    import equinox as eqx
    import jax

    from . import _modules as m

    parts = arch.parts()
    keys = dict(zip(parts, jax.random.split(key, len(parts)) if len(parts) > 1 else [key], strict=True))
    if arch.factory == "mlp":
        sizes = arch.sizes("layers")
        depth = len(sizes) - 2
        width = sizes[1] if depth else arch.kwargs["width_size"]
        kw = arch.kwargs
        return eqx.nn.MLP(
            kw["in_size"], kw["out_size"], width, depth, activation=m.get_activation(arch.activation), key=key
        )
    stacks = {p: m.Stack(arch.sizes(p), arch.activation, key=keys[p]) for p in parts if p != "convs"}
    if arch.factory == "cnn":
        convs = arch.part("convs")
        conv_keys = jax.random.split(keys["convs"], len(convs))
        return m.ConvNet(
            convs=tuple(
                eqx.nn.Conv2d(
                    c.in_channels, c.out_channels, kernel_size=c.kernel, stride=c.stride, padding=c.padding, key=k
                )
                for c, k in zip(convs, conv_keys, strict=True)
            ),
            head=stacks["head"],
            image_size=arch.image().size,
            activation=arch.activation,
        )
    if arch.factory == "autoencoder":
        return m.AutoEncoder(encoder=stacks["encoder"], decoder=stacks["decoder"])
    return m.Classifier(encoder=stacks["encoder"], head=stacks["head"])


for _name in ZOO:
    register_model(_name)(factory(_name, build, __name__, key=True))


def build_transformer(arguments: dict[str, Any], key: Any) -> Any:
    """The Equinox `LanguageModel` or `SequenceClassifier` of `arguments` (`transformer_factory`'s), from `key`."""
    from ._transformer import LanguageModel, SequenceClassifier

    kwargs = dict(arguments)
    model = SequenceClassifier if kwargs.pop("factory") == "transformer_classifier" else LanguageModel
    return model(**kwargs, key=key)


for _name in TRANSFORMERS:
    register_model(_name)(transformer_factory(_name, build_transformer, __name__))
