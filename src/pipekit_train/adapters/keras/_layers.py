"""The built-in Keras models (Keras 3, JAX backend): `MLP`, `Stack`, `AutoEncoder`, `Classifier`, `ConvNet`.

They mirror the Equinox backend's modules part for part (``encoder``, ``decoder``, ``head``, ``layers[i]``), so the
same `Transfer` paths work on both backends and the weights of an ``mlp`` convert one to one. Inputs are batches
(a leading batch axis), as everywhere in Keras.
"""

# Keras has no type information: its classes are `Any` to the checker, so subclassing them is allowed here.
# mypy: disable-error-code="misc,name-defined,no-untyped-def"
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipekit import ShapeError

from ._env import import_keras

keras = import_keras()
ops = keras.ops

__all__ = ["ACTIVATIONS", "AutoEncoder", "Classifier", "ConvNet", "MLP", "Stack", "activation_fn"]

#: The Equinox backend's activations by the same names, written with `keras.ops` (``gelu`` is the tanh
#: approximation, as `jax.nn.gelu`'s default, so converted models give the same outputs).
ACTIVATIONS: dict[str, Any] = {
    "relu": ops.relu,
    "gelu": lambda x: ops.gelu(x, approximate=True),
    "tanh": ops.tanh,
    "silu": ops.silu,
    "identity": lambda x: x,
}


def activation_fn(name: str) -> Any:
    return ACTIVATIONS[name]


def _build_chain(layers: Sequence[Any], input_shape: Any) -> Any:
    shape = tuple(input_shape)
    for layer in layers:
        layer.build(shape)
        shape = tuple(layer.compute_output_shape(shape))
    return shape


class Stack(keras.layers.Layer):
    """``Dense`` layers with an activation between them (none after the last): ``(batch, in) -> (batch, out)``."""

    def __init__(self, sizes: Sequence[int], activation: str = "relu", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sizes = [int(s) for s in sizes]
        self.activation_name = activation
        self.layers = [keras.layers.Dense(s, name=f"layers_{i}") for i, s in enumerate(self.sizes[1:])]

    def build(self, input_shape: Any) -> None:
        _build_chain(self.layers, input_shape)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (*tuple(input_shape)[:-1], self.sizes[-1])

    def call(self, x: Any) -> Any:
        fn = activation_fn(self.activation_name)
        for layer in self.layers[:-1]:
            x = fn(layer(x))
        return self.layers[-1](x)


class MLP(keras.Model):
    """``Dense`` layers through `sizes` (``[in, width, ..., out]``), like ``equinox.nn.MLP``: ``model.layers[i]`` are
    the Dense layers in order (kernels ``(in, out)``, the transposes of Equinox's ``weight``)."""

    def __init__(self, sizes: Sequence[int], activation: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.in_size = int(sizes[0])
        self.activation_name = activation
        self._dense = [keras.layers.Dense(int(s), name=f"layers_{i}") for i, s in enumerate(sizes[1:])]

    @property
    def expected_input(self) -> str:
        return f"({self.in_size},) (its first Dense layer takes {self.in_size} features)"

    def build(self, input_shape: Any) -> None:
        _build_chain(self._dense, input_shape)

    def call(self, x: Any, training: bool = False) -> Any:
        fn = activation_fn(self.activation_name)
        for layer in self._dense[:-1]:
            x = fn(layer(x))
        return self._dense[-1](x)


class AutoEncoder(keras.Model):
    """``encoder`` then ``decoder`` (both `Stack`); `encode` gives the latent code."""

    def __init__(self, encoder: Stack, decoder: Stack, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder

    @property
    def expected_input(self) -> str:
        n = self.encoder.sizes[0]
        return f"({n},) (the encoder's first Dense layer takes {n} features)"

    def build(self, input_shape: Any) -> None:
        self.encoder.build(input_shape)
        self.decoder.build(self.encoder.compute_output_shape(input_shape))

    def encode(self, x: Any) -> Any:
        return self.encoder(x)

    def call(self, x: Any, training: bool = False) -> Any:
        return self.decoder(self.encoder(x))


class Classifier(keras.Model):
    """``encoder`` (the autoencoder's) then ``head``; returns logits."""

    def __init__(self, encoder: Stack, head: Stack, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = encoder
        self.head = head

    @property
    def expected_input(self) -> str:
        n = self.encoder.sizes[0]
        return f"({n},) (the encoder's first Dense layer takes {n} features)"

    def build(self, input_shape: Any) -> None:
        self.encoder.build(input_shape)
        self.head.build(self.encoder.compute_output_shape(input_shape))

    def call(self, x: Any, training: bool = False) -> Any:
        return self.head(self.encoder(x))


class ConvNet(keras.Model):
    """3x3 ``Conv2D`` (each followed by the activation and 2x2 max-pooling), then a `Stack` ``head``.

    One example is a single-channel square image, flat ``(H*W,)``, ``(H, W)``, ``(1, H, W)`` or ``(H, W, 1)``.
    """

    def __init__(self, image_size: int, convs: Sequence[Any], head: Sequence[int], activation: str, **kw):
        """`convs`: the zoo's `Conv` layers (``"same"`` padding); `head`: the sizes through the head `Stack`."""
        super().__init__(**kw)
        self.image_size = int(image_size)
        self.activation_name = activation
        self.convs = [
            keras.layers.Conv2D(c.out_channels, c.kernel, strides=c.stride, padding="same", name=f"convs_{i}")
            for i, c in enumerate(convs)
        ]
        self.head = Stack(head, activation, name="head")

    @property
    def expected_input(self) -> str:
        s = self.image_size
        return f"({s * s},), ({s}, {s}), (1, {s}, {s}) or ({s}, {s}, 1) (a single-channel {s}x{s} image)"

    def _image(self, x: Any) -> Any:
        s = self.image_size
        example = tuple(x.shape[1:])
        if example not in ((s * s,), (s, s), (1, s, s), (s, s, 1)):
            raise ShapeError(f"ConvNet expects one example of shape {self.expected_input}, got {example}")
        return ops.reshape(x, (-1, s, s, 1))

    def build(self, input_shape: Any) -> None:
        s = self.image_size
        shape: tuple[Any, ...] = (input_shape[0], s, s, 1)
        for conv in self.convs:
            conv.build(shape)
            shape = (shape[0], shape[1] // 2, shape[2] // 2, conv.filters)
        self.head.build((input_shape[0], shape[1] * shape[2] * shape[3]))

    def call(self, x: Any, training: bool = False) -> Any:
        fn = activation_fn(self.activation_name)
        x = self._image(x)
        for conv in self.convs:
            x = ops.max_pool(fn(conv(x)), pool_size=2, strides=2)
        return self.head(ops.reshape(x, (ops.shape(x)[0], -1)))
