"""The built-in torch modules: `Stack`, `AutoEncoder`, `Classifier`, `ConvNet`.

They mirror the Equinox backend's modules part for part (``encoder``, ``decoder``, ``head``, ``layers[i]``), so the
same `Transfer` paths work on every backend and the weights of an ``mlp`` convert one to one (a ``Linear`` weight is
``(out, in)`` in both). Inputs are batches (a leading batch axis), as everywhere in torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipekit import ShapeError

__all__ = ["ACTIVATIONS", "AutoEncoder", "Classifier", "ConvNet", "Stack"]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # jax.nn.gelu's default, so converted models give the same outputs


#: The Equinox backend's activations by the same names.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": _gelu,
    "tanh": torch.tanh,
    "silu": F.silu,
    "identity": _identity,
}


class Stack(nn.Module):
    """``Linear`` layers with an activation between them (none after the last): ``(batch, in) -> (batch, out)``."""

    def __init__(self, sizes: Sequence[int], activation: str = "relu") -> None:
        super().__init__()
        sizes = [int(s) for s in sizes]
        self.activation = activation
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        self.expected_input = f"({sizes[0]},) (its first Linear layer takes {sizes[0]} features)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = ACTIVATIONS[self.activation]
        layers = list(self.layers)
        for layer in layers[:-1]:
            x = fn(layer(x))
        out: torch.Tensor = layers[-1](x)
        return out


class AutoEncoder(nn.Module):
    """``encoder`` then ``decoder``; `encode` gives the latent code."""

    def __init__(self, encoder: Stack, decoder: Stack) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.expected_input = encoder.expected_input

    def encode(self, x: torch.Tensor) -> Any:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> Any:
        return self.decoder(self.encoder(x))


class Classifier(nn.Module):
    """``encoder`` (the autoencoder's) then ``head``; returns logits."""

    def __init__(self, encoder: Stack, head: Stack) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.expected_input = encoder.expected_input

    def forward(self, x: torch.Tensor) -> Any:
        return self.head(self.encoder(x))


class ConvNet(nn.Module):
    """Small conv net for single-channel square images; input ``(B, H*W)``, ``(B, H, W)`` or ``(B, 1, H, W)``."""

    def __init__(self, image_size: int, convs: Sequence[Any], head: Sequence[int], activation: str) -> None:
        """`convs`: the zoo's `Conv` layers; `head`: the sizes through the head `Stack`."""
        super().__init__()
        self.image_size = image_size
        self.activation = activation
        self.convs = nn.ModuleList(
            nn.Conv2d(c.in_channels, c.out_channels, kernel_size=c.kernel, stride=c.stride, padding=c.padding)
            for c in convs
        )
        self.head = Stack(head, activation)
        s = image_size
        self.expected_input = f"({s * s},), ({s}, {s}) or (1, {s}, {s}) (a single-channel {s}x{s} image)"

    def forward(self, x: torch.Tensor) -> Any:
        s = self.image_size
        if tuple(x.shape[1:]) not in ((s * s,), (s, s), (1, s, s)):
            raise ShapeError(f"ConvNet expects {self.expected_input} per example, got shape {tuple(x.shape[1:])}")
        x = x.reshape(x.shape[0], 1, s, s)
        fn = ACTIVATIONS[self.activation]
        for conv in self.convs:
            x = F.max_pool2d(fn(conv(x)), kernel_size=2, stride=2)
        return self.head(torch.flatten(x, 1))
