"""The built-in Equinox modules (`Stack`, `AutoEncoder`, `Classifier`, `ConvNet`) and activations by name.

The factories that build them (`_factories.build`) import this module when they are called, not when they register."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from pipekit import ConfigError, ShapeError, suggestion

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
