"""The built-in Equinox modules and factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``; activations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from pipekit import ConfigError, ShapeError, suggestion

from .._shared import cnn_feature_size
from ._model import register_model

__all__ = ["ACTIVATIONS", "AutoEncoder", "Classifier", "ConvNet", "Stack", "get_activation"]

#: Activations by name. Models refer to them by these names, never by an import path.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
    "identity": lambda x: x,
}


def get_activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activation function registered as `name` in `ACTIVATIONS`."""
    fn = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ConfigError(
            f"activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}{suggestion(str(name), ACTIVATIONS)}"
        )
    return fn


# Built-in modules and factories ---------------------------------------------------------------------------
class Stack(eqx.Module):
    """Linear layers with an activation between them (none after the last): one example ``(in,) -> (out,)``."""

    layers: tuple[eqx.nn.Linear, ...]
    activation: str = eqx.field(static=True)

    def __init__(self, sizes: Sequence[int], activation: str, *, key: Any) -> None:
        get_activation(activation)  # validate the name
        sizes = [int(s) for s in sizes]
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys))
        self.activation = activation

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        fn = ACTIVATIONS[self.activation]
        for layer in self.layers[:-1]:
            x = fn(layer(x))
        return self.layers[-1](x)


class AutoEncoder(eqx.Module):
    """``encoder`` then ``decoder``; `encode` gives the latent code."""

    encoder: Stack
    decoder: Stack

    def encode(self, x: jax.Array) -> jax.Array:
        return self.encoder(x)

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        return self.decoder(self.encoder(x))


class Classifier(eqx.Module):
    """``encoder`` (the autoencoder's) then ``head``; returns logits."""

    encoder: Stack
    head: Stack

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        return self.head(self.encoder(x))


class ConvNet(eqx.Module):
    """Small conv net for single-channel square images, input flat ``(H*W,)``, ``(H, W)`` or ``(1, H, W)``."""

    convs: tuple[eqx.nn.Conv2d, ...]
    head: Stack
    image_size: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)

    @property
    def expected_input(self) -> str:
        s = self.image_size
        return f"({s * s},), ({s}, {s}) or (1, {s}, {s}) (a single-channel {s}x{s} image)"

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        s = self.image_size
        if x.shape not in ((s * s,), (s, s), (1, s, s)):
            raise ShapeError(f"ConvNet expects {self.expected_input}, got shape {x.shape}")
        x = jnp.reshape(x, (1, s, s))
        fn = ACTIVATIONS[self.activation]
        pool = eqx.nn.MaxPool2d(kernel_size=2, stride=2)
        for conv in self.convs:
            x = pool(fn(conv(x)))
        return self.head(jnp.ravel(x))


def _encoder(key: Any, in_size: int, latent_size: int, hidden: Sequence[int], activation: str) -> Stack:
    return Stack([in_size, *hidden, latent_size], activation, key=key)


@register_model("mlp")
def mlp(key: Any, in_size: int, out_size: int, width_size: int = 64, depth: int = 2, activation: str = "relu") -> Any:
    """`equinox.nn.MLP` with `depth` hidden layers of `width_size` and a named activation."""
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
    k_enc, k_dec = jax.random.split(key)
    return AutoEncoder(
        encoder=_encoder(k_enc, in_size, latent_size, hidden, activation),
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
    k_enc, k_head = jax.random.split(key)
    return Classifier(
        encoder=_encoder(k_enc, in_size, latent_size, hidden, activation),
        head=Stack([latent_size, *head_hidden, num_classes], activation, key=k_head),
    )
