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


@register_flax_model("transformer")
def transformer(
    rngs: Any,
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
    """A pre-norm transformer language model: token ids `(B, T)` to next-token logits `(B, T, vocab_size)`; parts
    ``embed``, ``blocks[i]`` (``attention``, ``mlp.up``, ``mlp.down``), ``norm``, ``lm_head``.

    `pad_id` (default ``vocab_size - 1``, the byte tokenizer's ``PAD``) is never attended to; `remat` recomputes
    each block in the backward pass (``nnx.remat``).
    """
    from ._transformer import LanguageModel

    return LanguageModel(
        vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, causal, dropout, pad_id, remat, rngs=rngs
    )


@register_flax_model("transformer_classifier")
def transformer_classifier(
    rngs: Any,
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
        rngs=rngs,
    )
