"""The built-in Equinox factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``, and the transformers
``transformer`` and ``transformer_classifier`` (``_transformer.py``; Equinox only: no zoo description, no converter).

Their kwargs and layers are the backend-neutral descriptions in `pipekit_train.backends._zoo`; `build` makes
Equinox layers from a description. Registering them imports neither JAX nor Equinox (a pipeline file naming
``factory: mlp`` is checked without them); `build` imports `_modules` (Equinox, JAX) when it runs.

The keys follow the description's parts: the key is split once per top-level part when there are several
(``convs`` / ``head``, ``encoder`` / ``decoder``), and each part's key once per layer, so a classifier's encoder
has exactly the autoencoder's weights for the same key.
"""

from __future__ import annotations

from typing import Any

from pipekit_train.backends.kit import ZOO, Architecture, factory

from ._model import register_model

__all__ = ["build"]


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


@register_model("transformer")
def transformer(
    key: Any,
    vocab_size: int,
    d_model: int,
    num_heads: int,
    num_layers: int,
    max_len: int,
    mlp_ratio: int = 4,
    causal: bool = True,
    dropout: float = 0.0,
    pad_id: int | None = None,
    remat: bool = False,
) -> Any:
    """A pre-norm transformer language model: token ids `(T,)` to next-token logits `(T, vocab_size)`; parts
    ``embed``, ``blocks[i]`` (``attention``, ``mlp.up``, ``mlp.down``), ``norm``, ``lm_head``.

    `pad_id` (default 258, the ``PAD`` of the byte tokenizer and of a trained BPE; ``vocab_size - 1`` for a vocabulary
    of 258 ids or fewer) is never attended to; `remat` recomputes each block in the backward pass.
    """
    from ._transformer import LanguageModel

    return LanguageModel(
        vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, causal, dropout, pad_id, remat, key=key
    )


@register_model("transformer_classifier")
def transformer_classifier(
    key: Any,
    vocab_size: int,
    d_model: int,
    num_heads: int,
    num_layers: int,
    max_len: int,
    num_classes: int,
    mlp_ratio: int = 4,
    causal: bool = True,
    dropout: float = 0.0,
    pad_id: int | None = None,
    remat: bool = False,
) -> Any:
    """``transformer``'s ``embed`` and ``blocks`` (same arguments: they take a pretrained language model's weights),
    then ``norm`` and a ``head`` on the mean of the states over the non-padding tokens: class logits.
    """
    from ._transformer import SequenceClassifier

    return SequenceClassifier(
        vocab_size,
        d_model,
        num_heads,
        num_layers,
        max_len,
        num_classes,
        mlp_ratio,
        causal,
        dropout,
        pad_id,
        remat,
        key=key,
    )
