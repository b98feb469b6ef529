"""The built-in Equinox factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``.

Registering them imports neither JAX nor Equinox (a pipeline file naming ``factory: mlp`` is checked without them);
each factory imports `_modules` (Equinox, JAX) when it builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._shared import cnn_feature_size
from ._model import register_model

if TYPE_CHECKING:
    from ._modules import AutoEncoder, Classifier, ConvNet

__all__ = ["autoencoder", "classifier", "cnn", "mlp"]


@register_model("mlp")
def mlp(key: Any, in_size: int, out_size: int, width_size: int = 64, depth: int = 2, activation: str = "relu") -> Any:
    """`equinox.nn.MLP` with `depth` hidden layers of `width_size` and a named activation."""
    import equinox as eqx

    from ._modules import get_activation

    return eqx.nn.MLP(in_size, out_size, width_size, depth, activation=get_activation(activation), key=key)


@register_model("cnn")
def cnn(
    key: Any,
    image_size: int = 8,
    out_size: int = 10,
    channels: Sequence[int] = (8, 16),
    hidden: int = 64,
    activation: str = "relu",
) -> ConvNet:
    """3x3 convolutions (each followed by the activation and 2x2 max-pooling), then a one-hidden-layer head.

    For 8x8 digits the defaults give 8x8 → 4x4 → 2x2 feature maps; for 28x28 images, 14x14 → 7x7.
    """
    import equinox as eqx
    import jax

    from ._modules import ConvNet, Stack

    channels = [int(c) for c in channels]
    final = cnn_feature_size(image_size, channels)
    k_conv, k_head = jax.random.split(key)
    widths = [1, *channels]
    convs = tuple(
        eqx.nn.Conv2d(a, b, kernel_size=3, padding=1, key=k)
        for a, b, k in zip(widths[:-1], widths[1:], jax.random.split(k_conv, len(channels)))
    )
    head = Stack([widths[-1] * final * final, hidden, out_size], activation, key=k_head)
    return ConvNet(convs=convs, head=head, image_size=image_size, activation=activation)


@register_model("autoencoder")
def autoencoder(
    key: Any, in_size: int, latent_size: int = 16, hidden: Sequence[int] = (128,), activation: str = "relu"
) -> AutoEncoder:
    """``encoder``: in → hidden… → latent; ``decoder``: latent → reversed hidden… → in (linear output)."""
    import jax

    from ._modules import AutoEncoder, Stack, encoder

    k_enc, k_dec = jax.random.split(key)
    return AutoEncoder(
        encoder=encoder(k_enc, in_size, latent_size, hidden, activation),
        decoder=Stack([latent_size, *reversed(list(hidden)), in_size], activation, key=k_dec),
    )


@register_model("classifier")
def classifier(
    key: Any,
    in_size: int,
    num_classes: int,
    latent_size: int = 16,
    hidden: Sequence[int] = (128,),
    head_hidden: Sequence[int] = (),
    activation: str = "relu",
) -> Classifier:
    """``encoder`` exactly as `autoencoder`'s (same arguments, same key → same weights), then a ``head``."""
    import jax

    from ._modules import Classifier, Stack, encoder

    k_enc, k_head = jax.random.split(key)
    return Classifier(
        encoder=encoder(k_enc, in_size, latent_size, hidden, activation),
        head=Stack([latent_size, *head_hidden, num_classes], activation, key=k_head),
    )
