"""The built-in Keras factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (the Equinox backend's kwargs).

Cheap to import: the signatures are what `KerasModel` checks its ``kwargs`` against when a pipeline is read, and
Keras is imported only when a factory runs (the model classes live in `_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._models import ACTIVATION_NAMES, check_activation
from .._shared import cnn_feature_size
from ._model import register_keras_model

__all__ = ["ACTIVATION_NAMES", "autoencoder", "check_activation", "classifier", "cnn", "mlp"]


@register_keras_model("mlp")
def mlp(in_size: int, out_size: int, width_size: int = 64, depth: int = 2, activation: str = "relu") -> Any:
    """`depth` hidden ``Dense`` layers of `width_size` and a named activation (like ``equinox.nn.MLP``)."""
    from ._layers import MLP

    model = MLP(in_size, out_size, width_size, depth, check_activation(activation), name="mlp")
    model.build((None, int(in_size)))
    return model


@register_keras_model("cnn")
def cnn(
    image_size: int = 8,
    out_size: int = 10,
    channels: Sequence[int] = (8, 16),
    hidden: int = 64,
    activation: str = "relu",
) -> Any:
    """3x3 convolutions (each followed by the activation and 2x2 max-pooling), then a one-hidden-layer head."""
    from ._layers import ConvNet

    channels = [int(c) for c in channels]
    cnn_feature_size(image_size, channels)
    model = ConvNet(image_size, channels, hidden, out_size, check_activation(activation), name="cnn")
    model.build((None, int(image_size) ** 2))
    return model


def _encoder(in_size: int, latent_size: int, hidden: Sequence[int], activation: str) -> Any:
    from ._layers import Stack

    return Stack([in_size, *hidden, latent_size], check_activation(activation), name="encoder")


@register_keras_model("autoencoder")
def autoencoder(in_size: int, latent_size: int = 16, hidden: Sequence[int] = (128,), activation: str = "relu") -> Any:
    """``encoder``: in → hidden… → latent; ``decoder``: latent → reversed hidden… → in (linear output)."""
    from ._layers import AutoEncoder, Stack

    encoder = _encoder(in_size, latent_size, hidden, activation)
    decoder = Stack([latent_size, *reversed(list(hidden)), in_size], activation, name="decoder")
    model = AutoEncoder(encoder, decoder, name="autoencoder")
    model.build((None, int(in_size)))
    return model


@register_keras_model("classifier")
def classifier(
    in_size: int,
    num_classes: int,
    latent_size: int = 16,
    hidden: Sequence[int] = (128,),
    head_hidden: Sequence[int] = (),
    activation: str = "relu",
) -> Any:
    """``encoder`` exactly as `autoencoder`'s (same arguments: it takes that encoder's weights), then a ``head``."""
    from ._layers import Classifier, Stack

    encoder = _encoder(in_size, latent_size, hidden, activation)
    head = Stack([latent_size, *head_hidden, num_classes], activation, name="head")
    model = Classifier(encoder, head, name="classifier")
    model.build((None, int(in_size)))
    return model
