"""The built-in Flax NNX modules: `MLP`, `Stack`, `ConvNet`, `AutoEncoder`, `Classifier`.

They mirror the Equinox backend's modules part for part (``layers[i]``, ``convs[i]``, ``encoder``, ``decoder``,
``head``), so the same `Transfer` paths work on both backends and the weights convert one to one. Inputs are
batches (a leading batch axis), as everywhere in Flax; layers are ``nnx.Linear`` (kernel ``(in, out)``) and
``nnx.Conv`` (channels-last, kernel ``(kh, kw, cin, cout)``), the canonical layout of `pipekit_train.backends.kit`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pipekit import ShapeError

__all__ = ["ACTIVATIONS", "AutoEncoder", "Classifier", "ConvNet", "MLP", "Stack"]

#: The Equinox backend's activations by the same names (``gelu`` is the tanh approximation, `jax.nn.gelu`'s
#: default), so converted models give the same outputs.
ACTIVATIONS: dict[str, Any] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
    "identity": lambda x: x,
}


def _chain(layers: Any, activation: str, x: Any) -> Any:
    fn = ACTIVATIONS[activation]
    for layer in layers[:-1]:
        x = fn(layer(x))
    return layers[-1](x)


def _features(n: int) -> str:
    return f"({n},) (its first Linear layer takes {n} features)"


class Stack(nnx.Module):
    """``nnx.Linear`` layers through `sizes` with the activation between them (none after the last)."""

    def __init__(self, sizes: Sequence[int], activation: str, *, rngs: nnx.Rngs) -> None:
        self.activation = activation
        self.layers = nnx.List([nnx.Linear(int(a), int(b), rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: Any) -> Any:
        return _chain(self.layers, self.activation, x)


class MLP(Stack):
    """The ``mlp`` factory: `Stack` with ``layers[i]`` at the top (as ``equinox.nn.MLP``)."""

    @property
    def expected_input(self) -> str:
        return _features(self.layers[0].in_features)


class AutoEncoder(nnx.Module):
    """``encoder`` then ``decoder`` (both `Stack`); `encode` gives the latent code."""

    def __init__(self, encoder: Stack, decoder: Stack) -> None:
        self.encoder, self.decoder = encoder, decoder

    @property
    def expected_input(self) -> str:
        return _features(self.encoder.layers[0].in_features)

    def encode(self, x: Any) -> Any:
        return self.encoder(x)

    def __call__(self, x: Any) -> Any:
        return self.decoder(self.encoder(x))


class Classifier(nnx.Module):
    """``encoder`` (the autoencoder's) then ``head``; returns logits."""

    def __init__(self, encoder: Stack, head: Stack) -> None:
        self.encoder, self.head = encoder, head

    @property
    def expected_input(self) -> str:
        return _features(self.encoder.layers[0].in_features)

    def __call__(self, x: Any) -> Any:
        return self.head(self.encoder(x))


class ConvNet(nnx.Module):
    """``convs[i]`` (each followed by the activation and 2x2 max-pooling), then a `Stack` ``head``.

    One example is a single-channel square image, flat ``(H*W,)``, ``(H, W)``, ``(1, H, W)`` or ``(H, W, 1)``.
    """

    def __init__(self, image_size: int, convs: Sequence[Any], head: Stack, activation: str, *, rngs: nnx.Rngs):
        """`convs`: the zoo's `Conv` layers; `head`: the dense head."""
        self.image_size = int(image_size)
        self.activation = activation
        self.convs = nnx.List(
            [
                nnx.Conv(
                    c.in_channels,
                    c.out_channels,
                    kernel_size=tuple(c.kernel),
                    strides=c.stride,
                    padding=((c.padding, c.padding), (c.padding, c.padding)),
                    rngs=rngs,
                )
                for c in convs
            ]
        )
        self.head = head

    @property
    def expected_input(self) -> str:
        s = self.image_size
        return f"({s * s},), ({s}, {s}), (1, {s}, {s}) or ({s}, {s}, 1) (a single-channel {s}x{s} image)"

    def __call__(self, x: Any) -> Any:
        s = self.image_size
        example = tuple(x.shape[1:])
        if example not in ((s * s,), (s, s), (1, s, s), (s, s, 1)):
            raise ShapeError(f"ConvNet expects one example of shape {self.expected_input}, got {example}")
        x = jnp.reshape(x, (-1, s, s, 1))
        fn = ACTIVATIONS[self.activation]
        for conv in self.convs:
            x = nnx.max_pool(fn(conv(x)), (2, 2), strides=(2, 2))  # type: ignore[no-untyped-call]
        return self.head(jnp.reshape(x, (x.shape[0], -1)))
