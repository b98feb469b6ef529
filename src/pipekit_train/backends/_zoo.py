"""The built-in model zoo, backend-neutral: one description per factory kind (``mlp``, ``cnn``, ``autoencoder``,
``classifier``), and the converters between the Equinox, Keras, Lightning and Flax backends derived from it.

A description (`Architecture`) is the factory's layers in order, computed from its kwargs: `Image` (reshape one
example to an image), `Conv` (``kh x kw``, ``cin -> cout``), `MaxPool`, `Flatten`, `Dense` (``in -> out``), each
weighted layer with its attribute path (``("encoder", "layers", 0)``) and the activation after it. The signatures
of the functions here are the factories' kwargs on every backend; each backend's ``_factories`` registers them
(`factory`) with a builder that makes its own layer types from the description.

Converting a model is ``to_canonical(source) -> from_canonical(destination)``: each backend's weights are read into
one canonical form per layer (dense: kernel ``(in, out)`` and bias ``(out,)``; conv: kernel ``(kh, kw, cin, cout)``
and bias ``(cout,)``; the rows of the first dense layer after a `Flatten` in channel-major ``(c, h, w)`` order) and
written back in the other's. Keras and Flax flatten channels-last feature maps (``(h, w, c)``), Equinox and torch
channel-major ones, so the rows of that dense layer are permuted and the converted model computes the same function.

Cheap to import: the standard library only; NumPy and the frameworks are imported when a converter runs.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._convert import register_converter
from ._shared import BUILTIN_FACTORIES, cnn_feature_size

__all__ = [
    "ZOO",
    "Architecture",
    "Conv",
    "Dense",
    "Flatten",
    "Image",
    "MaxPool",
    "convert",
    "converted_op",
    "describe",
    "factory",
    "from_canonical",
    "to_canonical",
]

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Dense:
    """A fully connected layer ``in_size -> out_size`` at `path`, then `activation` (``None``: linear)."""

    path: Path
    in_size: int
    out_size: int
    activation: str | None


@dataclass(frozen=True)
class Conv:
    """A 2-D convolution ``kernel[0] x kernel[1]``, ``in_channels -> out_channels`` at `path`, with `stride` and
    `padding` pixels on each side, then `activation`."""

    path: Path
    kernel: tuple[int, int]
    in_channels: int
    out_channels: int
    stride: int
    padding: int
    activation: str | None


@dataclass(frozen=True)
class Image:
    """One example (flat ``(size * size * channels,)`` or an image) reshaped to a ``channels x size x size`` image."""

    size: int
    channels: int


@dataclass(frozen=True)
class MaxPool:
    """Max-pooling over ``size x size`` windows with `stride`."""

    size: int
    stride: int


@dataclass(frozen=True)
class Flatten:
    """A ``channels x height x width`` feature map flattened to a vector (each backend in its own order)."""

    channels: int
    height: int
    width: int


Layer = Dense | Conv | Image | MaxPool | Flatten


@dataclass(frozen=True)
class Architecture:
    """A built-in factory's layers in order (`layers`), its name and the one `activation` it uses."""

    factory: str
    activation: str
    layers: tuple[Layer, ...]
    #: What a backend's model records beyond the layers (``mlp``: ``width_size``, kept by ``equinox.nn.MLP`` even
    #: at ``depth=0``).
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def weighted(self) -> list[Dense | Conv]:
        """The layers with weights, in order."""
        return [layer for layer in self.layers if isinstance(layer, (Dense, Conv))]

    def parts(self) -> list[str]:
        """The top-level attributes that hold weights, in order (``["encoder", "decoder"]``; ``["layers"]``)."""
        names: list[str] = []
        for layer in self.weighted():
            top = str(layer.path[0])
            if top not in names:
                names.append(top)
        return names

    def part(self, name: str) -> list[Any]:
        """The weighted layers under the top-level attribute `name`, in order."""
        return [layer for layer in self.weighted() if layer.path[0] == name]

    def sizes(self, name: str) -> list[int]:
        """The widths through the dense part `name`: its input, then each layer's output."""
        dense: list[Dense] = self.part(name)
        return [dense[0].in_size, *(d.out_size for d in dense)]

    def image(self) -> Image:
        """The input image of a conv net."""
        return next(layer for layer in self.layers if isinstance(layer, Image))


def _stack(path: Path, sizes: Sequence[int], activation: str) -> list[Layer]:
    """Dense layers ``sizes[0] -> sizes[1] -> ...`` at ``path + (i,)``, the activation after all but the last."""
    n = len(sizes) - 1
    return [
        Dense((*path, i), int(a), int(b), activation if i < n - 1 else None)
        for i, (a, b) in enumerate(itertools.pairwise(sizes))
    ]


def _check_activation(activation: str) -> str:
    from ._model import check_activation

    return check_activation(activation)


# The factory kinds ------------------------------------------------------------------------------------------------
def mlp(in_size: int, out_size: int, width_size: int = 64, depth: int = 2, activation: str = "relu") -> Architecture:
    """`depth` hidden layers of `width_size` and a named activation: ``layers[i]`` (on Equinox ``equinox.nn.MLP``)."""
    act = _check_activation(activation)
    sizes = [int(in_size), *([int(width_size)] * int(depth)), int(out_size)]
    kwargs = {"in_size": in_size, "out_size": out_size, "width_size": width_size, "depth": depth}
    return Architecture("mlp", act, tuple(_stack(("layers",), sizes, act)), kwargs)


def cnn(
    image_size: int = 8,
    out_size: int = 10,
    channels: Sequence[int] = (8, 16),
    hidden: int = 64,
    activation: str = "relu",
) -> Architecture:
    """3x3 convolutions (each followed by the activation and 2x2 max-pooling), then a one-hidden-layer ``head``.

    One example is a single-channel square image. For 8x8 digits the defaults give 8x8 → 4x4 → 2x2 feature maps;
    for 28x28 images, 14x14 → 7x7.
    """
    act = _check_activation(activation)
    widths = [1, *(int(c) for c in channels)]
    final = cnn_feature_size(image_size, widths[1:])
    layers: list[Layer] = [Image(int(image_size), 1)]
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [Conv(("convs", i), (3, 3), a, b, 1, 1, act), MaxPool(2, 2)]
    layers.append(Flatten(widths[-1], final, final))
    layers += _stack(("head", "layers"), [widths[-1] * final * final, int(hidden), int(out_size)], act)
    return Architecture("cnn", act, tuple(layers))


def autoencoder(
    in_size: int, latent_size: int = 16, hidden: Sequence[int] = (128,), activation: str = "relu"
) -> Architecture:
    """``encoder``: in → hidden… → latent; ``decoder``: latent → reversed hidden… → in (linear output)."""
    act = _check_activation(activation)
    hidden = [int(h) for h in hidden]
    encoder = _stack(("encoder", "layers"), [int(in_size), *hidden, int(latent_size)], act)
    decoder = _stack(("decoder", "layers"), [int(latent_size), *reversed(hidden), int(in_size)], act)
    return Architecture("autoencoder", act, (*encoder, *decoder))


def classifier(
    in_size: int,
    num_classes: int,
    latent_size: int = 16,
    hidden: Sequence[int] = (128,),
    head_hidden: Sequence[int] = (),
    activation: str = "relu",
) -> Architecture:
    """``encoder`` exactly as `autoencoder`'s (same arguments: it takes that encoder's weights), then a ``head``."""
    act = _check_activation(activation)
    hidden = [int(h) for h in hidden]
    encoder = _stack(("encoder", "layers"), [int(in_size), *hidden, int(latent_size)], act)
    head = _stack(("head", "layers"), [int(latent_size), *(int(h) for h in head_hidden), int(num_classes)], act)
    return Architecture("classifier", act, (*encoder, *head))


#: The description of each built-in factory kind, by name.
ZOO: dict[str, Callable[..., Architecture]] = {
    "mlp": mlp,
    "cnn": cnn,
    "autoencoder": autoencoder,
    "classifier": classifier,
}
assert tuple(ZOO) == BUILTIN_FACTORIES


def describe(name: str, kwargs: Mapping[str, Any]) -> Architecture:
    """The `Architecture` of built-in factory `name` for `kwargs`."""
    return ZOO[name](**kwargs)


def factory(
    name: str,
    build: Callable[[Any, Any], Any],
    module: str,
    *,
    key: bool = False,
    describe: Callable[..., Any] | None = None,
) -> Any:
    """Backend factory `name`: ``build(describe(**kwargs), key)``, with the description's signature (a leading
    ``key`` when `key`) and docstring, so a backend's registry checks kwargs against the zoo. `describe` is the
    zoo's description of `name` unless given (the transformers': `transformer_factory`)."""
    describe_fn = describe or ZOO[name]

    if key:

        def fn(key: Any, **kwargs: Any) -> Any:
            return build(describe_fn(**kwargs), key)

    else:

        def fn(**kwargs: Any) -> Any:  # type: ignore[misc]
            return build(describe_fn(**kwargs), None)

    signature = inspect.signature(describe_fn)
    params = list(signature.parameters.values())
    if key:
        params = [inspect.Parameter("key", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params]
    fn.__signature__ = signature.replace(parameters=params, return_annotation=Any)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    fn.__doc__ = describe_fn.__doc__
    return fn


# Canonical weights -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """How one backend names and lays out a built-in's weights."""

    model: tuple[str, str]  # the model operator: (module, class)
    kernel: str  # the name of a layer's kernel: "weight" | "kernel"
    dotted: bool  # torch: "encoder.layers.0"; else ".encoder.layers[0]"
    in_out: bool  # a dense kernel is (in, out) (Keras), else (out, in)
    channels_last: bool  # conv kernels (kh, kw, cin, cout) and flatten (h, w, c) (Keras); else (cout, cin, kh, kw)
    conv_bias_11: bool  # a conv bias is (cout, 1, 1) (Equinox), else (cout,)

    def name(self, path: Path, leaf: str) -> str:
        if self.dotted:
            return ".".join(str(s) for s in (*path, leaf))
        return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in (*path, leaf))


_LAYOUTS: dict[str, _Layout] = {
    "equinox": _Layout(("pipekit_train.adapters.equinox", "EquinoxModel"), "weight", False, False, False, True),
    "keras": _Layout(("pipekit_train.adapters.keras", "KerasModel"), "kernel", False, True, True, False),
    "lightning": _Layout(("pipekit_train.adapters.lightning", "TorchModel"), "weight", True, False, False, False),
    # Flax NNX: nnx.Linear / nnx.Conv kernels as Keras lays them out, channels-last feature maps.
    "flax": _Layout(("pipekit_train.adapters.flax", "FlaxModel"), "kernel", False, True, True, False),
}


def _flatten_before(arch: Architecture) -> Iterator[tuple[Dense | Conv, Flatten | None]]:
    """Each weighted layer with the `Flatten` just before it (``None`` when there is none)."""
    pending: Flatten | None = None
    for layer in arch.layers:
        if isinstance(layer, Flatten):
            pending = layer
        elif isinstance(layer, (Dense, Conv)):
            yield layer, pending
            pending = None


def _rows_to_chw(kernel: Any, flat: Flatten) -> Any:
    c, h, w = flat.channels, flat.height, flat.width
    return kernel.reshape(h, w, c, -1).transpose(2, 0, 1, 3).reshape(c * h * w, -1)


def _rows_to_hwc(kernel: Any, flat: Flatten) -> Any:
    c, h, w = flat.channels, flat.height, flat.width
    return kernel.reshape(c, h, w, -1).transpose(1, 2, 0, 3).reshape(c * h * w, -1)


def to_canonical(backend: str, arch: Architecture, weights: Mapping[str, Any]) -> dict[Path, tuple[Any, Any]]:
    """`weights` (a model of `backend`, by its names) as ``{path: (kernel, bias)}`` in the canonical layout."""
    import numpy as np

    layout = _LAYOUTS[backend]
    out: dict[Path, tuple[Any, Any]] = {}
    for layer, flat in _flatten_before(arch):
        kernel = np.asarray(weights[layout.name(layer.path, layout.kernel)])
        bias = np.asarray(weights[layout.name(layer.path, "bias")])
        if isinstance(layer, Dense):
            kernel = kernel if layout.in_out else kernel.T
            if flat is not None and layout.channels_last:
                kernel = _rows_to_chw(kernel, flat)
        else:
            kernel = kernel if layout.channels_last else kernel.transpose(2, 3, 1, 0)
            bias = bias.reshape(-1)
        out[layer.path] = (np.ascontiguousarray(kernel), np.ascontiguousarray(bias))
    return out


def from_canonical(backend: str, arch: Architecture, canonical: Mapping[Path, tuple[Any, Any]]) -> dict[str, Any]:
    """The canonical ``{path: (kernel, bias)}`` as the weights of a `backend` model, by its names."""
    import numpy as np

    layout = _LAYOUTS[backend]
    out: dict[str, Any] = {}
    for layer, flat in _flatten_before(arch):
        kernel, bias = canonical[layer.path]
        if isinstance(layer, Dense):
            if flat is not None and layout.channels_last:
                kernel = _rows_to_hwc(kernel, flat)
            kernel = kernel if layout.in_out else kernel.T
        else:
            kernel = kernel if layout.channels_last else kernel.transpose(3, 2, 0, 1)
            bias = bias.reshape(-1, 1, 1) if layout.conv_bias_11 else bias
        out[layout.name(layer.path, layout.kernel)] = np.ascontiguousarray(kernel)
        out[layout.name(layer.path, "bias")] = np.ascontiguousarray(bias)
    return out


def converted_op(model: Any, dst_backend: str) -> Any:
    """The unbound model op of `dst_backend` that `convert` makes of `model`: the same factory and kwargs."""
    import importlib

    module, cls = _LAYOUTS[dst_backend].model
    return getattr(importlib.import_module(module), cls)(factory=model.factory, kwargs=dict(model.kwargs))


def convert(model: Any, dst_backend: str) -> Any:
    """A bound built-in `model` as a bound model of `dst_backend`: the same factory, kwargs and function."""
    arch = describe(model.factory, model.kwargs)
    canonical = to_canonical(model.backend, arch, model.weights())
    return converted_op(model, dst_backend).with_weights(from_canonical(dst_backend, arch, canonical))


def _converter(src: str, dst: str, name: str) -> Callable[[Any], Any]:
    def fn(model: Any) -> Any:
        return convert(model, dst)

    fn.architecture = lambda model: converted_op(model, dst)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = f"{src}_{name}_to_{dst}"
    fn.__doc__ = f"A {src} ``{name}`` as a {dst} ``{name}``: the same kwargs, the weights in its layout."
    return fn


for _src in _LAYOUTS:
    for _dst in _LAYOUTS:
        if _src != _dst:
            for _name in ZOO:
                register_converter(_src, _dst, _name)(_converter(_src, _dst, _name))
