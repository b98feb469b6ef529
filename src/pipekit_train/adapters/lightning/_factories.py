"""The built-in torch factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (the Equinox backend's kwargs).

Cheap to import: the signatures are what `TorchModel` checks its ``kwargs`` against when a pipeline is read, and
torch is imported only when a factory runs (the modules live in `_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._models import ACTIVATION_NAMES, check_activation
from .._shared import cnn_feature_size
from ._model import register_torch_model

__all__ = ["ACTIVATION_NAMES", "autoencoder", "check_activation", "classifier", "cnn", "mlp"]


@register_torch_model("mlp")
def mlp(in_size: int, out_size: int, width_size: int = 64, depth: int = 2, activation: str = "relu") -> Any:
    """`depth` hidden ``Linear`` layers of `width_size` and a named activation (like ``equinox.nn.MLP``):
    ``layers[i]`` in order, weights ``(out, in)`` as Equinox's."""
    from ._layers import Stack

    return Stack([int(in_size), *([int(width_size)] * int(depth)), int(out_size)], check_activation(activation))


@register_torch_model("cnn")
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
    return ConvNet(int(image_size), channels, int(hidden), int(out_size), check_activation(activation))


@register_torch_model("autoencoder")
def autoencoder(in_size: int, latent_size: int = 16, hidden: Sequence[int] = (128,), activation: str = "relu") -> Any:
    """``encoder``: in → hidden… → latent; ``decoder``: latent → reversed hidden… → in (linear output)."""
    from ._layers import AutoEncoder, Stack

    act = check_activation(activation)
    encoder = Stack([int(in_size), *(int(h) for h in hidden), int(latent_size)], act)
    decoder = Stack([int(latent_size), *(int(h) for h in reversed(list(hidden))), int(in_size)], act)
    return AutoEncoder(encoder, decoder)


@register_torch_model("classifier")
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

    act = check_activation(activation)
    encoder = Stack([int(in_size), *(int(h) for h in hidden), int(latent_size)], act)
    head = Stack([int(latent_size), *(int(h) for h in head_hidden), int(num_classes)], act)
    return Classifier(encoder, head)
