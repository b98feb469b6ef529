"""Models as operators: `ModelOp`, `EquinoxModel` over a registry of factories, and `Transfer` of sub-trees.

An operator's fields describe the *architecture*; the weights are bound separately (`ModelOp.bind`) and are never
a field, so they never reach YAML and operator equality is architecture equality. Factories are registered by
name (`register_model`) and a YAML file can only choose among registered names, never import one.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError, Operator, PipekitError, ShapeError, closest, field

__all__ = [
    "ACTIVATIONS",
    "AutoEncoder",
    "Classifier",
    "ConvNet",
    "EquinoxModel",
    "ModelOp",
    "Stack",
    "Transfer",
    "get_activation",
    "register_model",
    "registered_models",
]

#: Activations by name. Models refer to them by these names, never by an import path.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
    "identity": lambda x: x,
}


def _did_you_mean(name: str, names: Sequence[str]) -> str:
    hits = closest(name, names)
    return f" (did you mean {' or '.join(repr(h) for h in hits)}?)" if hits else ""


def get_activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activation function registered as `name` in `ACTIVATIONS`."""
    fn = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ConfigError(
            f"activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}{_did_you_mean(str(name), ACTIVATIONS)}"
        )
    return fn


def _as_key(key: Any) -> jax.Array:
    return jax.random.key(key) if isinstance(key, int) else key


# Model registry -------------------------------------------------------------------------------------------
_MODELS: dict[str, Callable[..., eqx.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., eqx.Module]], Callable[..., eqx.Module]]:
    """Register a model factory ``fn(key, **kwargs) -> eqx.Module`` under `name`, for `EquinoxModel(factory=name)`.

    Example:
        >>> import equinox as eqx
        >>> @register_model("doc_linear")
        ... def doc_linear(key, in_size: int, out_size: int = 1):
        ...     return eqx.nn.Linear(in_size, out_size, key=key)
        >>> EquinoxModel(factory="doc_linear", kwargs={"in_size": 3})
        EquinoxModel(factory='doc_linear', kwargs={'in_size': 3})
    """

    def decorator(fn: Callable[..., eqx.Module]) -> Callable[..., eqx.Module]:
        params = list(inspect.signature(fn).parameters.values())
        if not params or params[0].name != "key":
            raise ConfigError(f"register_model({name!r}): the factory's first parameter must be `key`, got {fn!r}")
        old = _MODELS.get(name)
        if old is not None and old is not fn and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ConfigError(
                f"model factory {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
                "choose another name"
            )
        _MODELS[name] = fn
        return fn

    return decorator


def registered_models() -> list[str]:
    """The names `EquinoxModel.factory` accepts, sorted."""
    return sorted(_MODELS)


# Operators ------------------------------------------------------------------------------------------------
@eqx.filter_jit
def _batched_call(module: eqx.Module, x: Any) -> Any:
    return jax.vmap(lambda xi: module(xi))(x)


def _expects(module: Any) -> str:
    """What `module` expects of one example, in words, for shape-mismatch messages."""
    described = getattr(module, "expected_input", None)
    if isinstance(described, str):
        return described
    first = next(
        (
            leaf
            for leaf in jax.tree.leaves(module, is_leaf=lambda n: isinstance(n, (eqx.nn.Linear, eqx.nn.Conv)))
            if isinstance(leaf, (eqx.nn.Linear, eqx.nn.Conv))
        ),
        None,
    )
    if isinstance(first, eqx.nn.Linear):
        shape = "()" if first.in_features == "scalar" else f"({first.in_features},)"
        return f"{shape} (its first Linear has in_features={first.in_features})"
    if isinstance(first, eqx.nn.Conv):
        return (
            f"({first.in_channels}, ...) with {first.num_spatial_dims} spatial dimension(s) "
            f"(its first Conv has in_channels={first.in_channels})"
        )
    return "an input it could not trace (no Linear or Conv layer found to describe)"


class ModelOp(Operator, register=False):
    """A model architecture as an operator, optionally bound to weights.

    Subclasses implement `build`. Weights are bound with `bind` and live on a private attribute, not a field:
    they never reach YAML, and ``==`` / ``hash`` compare architectures only.

    Copies: `bind` returns a bound copy; ``copy.copy`` / ``copy.deepcopy`` keep the binding (the arrays are
    immutable, so they are shared, not duplicated); `replace` and YAML loading return **unbound** operators,
    because weights belong to one architecture and a changed field may no longer fit them — rebind explicitly
    with ``op.replace(...).bind(op.module)`` when they do.
    """

    def build(self, key: Any) -> eqx.Module:
        """A freshly initialised Equinox module; `key` is a PRNG key (an int seed is accepted too)."""
        raise NotImplementedError

    @property
    def module(self) -> eqx.Module | None:
        """The bound Equinox module, or ``None`` when no weights are bound."""
        return self.__dict__.get("_module")

    def bind(self, module: eqx.Module, *, check: bool = True) -> ModelOp:
        """A copy of this operator bound to `module` (this operator is unchanged).

        With `check`, the module's array leaves must have the paths, shapes and dtypes `build` produces;
        otherwise a `pipekit.ShapeError` names the first difference.
        """
        if not isinstance(module, eqx.Module):
            raise ConfigError(f"{type(self).__name__}.bind expects an equinox Module, got {type(module).__name__}")
        if check:
            expected = _leaf_specs(eqx.filter_eval_shape(self.build, jax.random.key(0)))
            got = _leaf_specs(module)
            if expected != got:
                raise ShapeError(f"{self!r}.bind: the module does not fit the architecture: {_diff(got, expected)}")
        new = copy.copy(self)
        object.__setattr__(new, "_module", module)
        return new

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed. The copy is unbound: see the class docstring."""
        return super().replace(**changes)

    def _bound(self, what: str) -> eqx.Module:
        module = self.module
        if module is None:
            raise PipekitError(
                f"{self!r}.{what}: no weights are bound; use op.bind(op.build(key)) or the model a TrainingLoop "
                "returned (replace() and YAML loading give unbound operators)"
            )
        return module

    def __call__(self, x: Any) -> Any:
        """Run the bound module on a batch: the module maps one example, this maps it over the leading axis."""
        return _batched_call(self._bound("__call__"), x)

    def weights_hash(self) -> str:
        """``"sha256:<hex>"`` over the bound arrays' tree paths, shapes, dtypes and bytes."""
        arrays = eqx.filter(self._bound("weights_hash"), eqx.is_array)
        digest = hashlib.sha256()
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
            host = np.asarray(leaf)
            digest.update(f"{jax.tree_util.keystr(path)}|{host.shape}|{host.dtype.name};".encode())
            digest.update(np.ascontiguousarray(host).tobytes())
        return f"sha256:{digest.hexdigest()}"

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """The output `jax.ShapeDtypeStruct` (or pytree of them) for one example of `shape` and `dtype`.

        Nothing is compiled or run: the bound module (or, when unbound, an abstract `build`) is traced with
        `jax.eval_shape`. When the example does not fit, a `pipekit.ShapeError` names the data's per-example
        shape and what the model expects.
        """
        module = self.module
        if module is None:
            module = eqx.filter_eval_shape(self.build, jax.random.key(0))
        example = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
        try:
            return eqx.filter_eval_shape(lambda m, x: m(x), module, example)
        except Exception as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ShapeError(
                f"the data's per-example input has shape {tuple(shape)} and dtype {jnp.dtype(dtype)}, but {self!r} "
                f"expects {_expects(module)}; tracing one example failed with: {first_line}"
            ) from e


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    arrays = eqx.filter(tree, lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    return {
        jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]
    }


def _fmt(spec: tuple[tuple[int, ...], str] | None) -> str:
    return "missing" if spec is None else f"{spec[0]} {spec[1]}"


def _diff(got: dict[str, Any], expected: dict[str, Any]) -> str:
    if set(got) != set(expected):
        return (
            f"its arrays are at {', '.join(list(got)[:4]) or 'nowhere'}{'...' if len(got) > 4 else ''} but the "
            f"architecture has them at {', '.join(list(expected)[:4])}{'...' if len(expected) > 4 else ''}"
        )
    for path in expected:
        if got.get(path) != expected.get(path):
            return f"{path or '<root>'}: got {_fmt(got.get(path))}, expected {_fmt(expected.get(path))}"
    return "the structures differ"


class EquinoxModel(ModelOp):
    """An Equinox model built by a registered factory: ``factory(key, **kwargs)``.

    Built-in factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (see their docstrings). Register more
    with `register_model`.

    Args:
        factory: a name registered with `register_model`.
        kwargs: keyword arguments for the factory, checked against its signature on construction.

    Example:
        >>> import jax.numpy as jnp
        >>> op = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2})
        >>> op.bind(op.build(0))(jnp.zeros((3, 4))).shape
        (3, 2)
    """

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def example(cls) -> EquinoxModel:
        return cls(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8})

    def validate(self) -> None:
        fn = _MODELS.get(self.factory)
        if fn is None:
            names = registered_models()
            raise ConfigError(
                f"EquinoxModel.factory {self.factory!r} is not a registered model factory"
                f"{_did_you_mean(self.factory, names)}; registered: {', '.join(names)}"
            )
        params = list(inspect.signature(fn).parameters.values())[1:]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for name in self.kwargs:
            if name not in accepted:
                raise ConfigError(
                    f"EquinoxModel.kwargs: factory {self.factory!r} has no parameter {name!r}"
                    f"{_did_you_mean(name, accepted)}; it accepts: {', '.join(accepted)}"
                )
        required = [p.name for p in params if p.name in accepted and p.default is p.empty]
        missing = [n for n in required if n not in self.kwargs]
        if missing:
            raise ConfigError(
                f"EquinoxModel.kwargs: factory {self.factory!r} needs {', '.join(repr(m) for m in missing)}; "
                f"required: {', '.join(required)}; it accepts: {', '.join(accepted)}"
            )

    def build(self, key: Any) -> eqx.Module:
        module = _MODELS[self.factory](_as_key(key), **self.kwargs)
        if not isinstance(module, eqx.Module):
            raise ConfigError(
                f"model factory {self.factory!r} returned {type(module).__name__}; it must return an equinox Module"
            )
        return module


# Transfer -------------------------------------------------------------------------------------------------
_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*")
_STEP = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+)\]")


def _parse_path(path: str) -> list[str | int]:
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise ConfigError(
            f"Transfer.paths: {path!r} is not an attribute path; write it like 'encoder', 'layers[0]' "
            "or 'encoder.layers[1].weight'"
        )
    return [name if name else int(index) for name, index in _STEP.findall(path)]


def _resolve(tree: Any, steps: list[str | int], path: str, role: str) -> Any:
    node = tree
    for i, step in enumerate(steps):
        where = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[:i]).lstrip(".") or "<root>"
        if isinstance(step, int):
            if not isinstance(node, (list, tuple)) or step >= len(node):
                size = f"of length {len(node)}" if isinstance(node, (list, tuple)) else type(node).__name__
                raise ConfigError(f"Transfer: path {path!r} not found in the {role} model: {where} is {size}")
            node = node[step]
        else:
            if not hasattr(node, step) or callable(getattr(type(node), step, None)):
                names = [n for n in getattr(node, "__dataclass_fields__", {}) if not n.startswith("_")]
                raise ConfigError(
                    f"Transfer: path {path!r} not found in the {role} model: {type(node).__name__} at {where} has "
                    f"no attribute {step!r}{_did_you_mean(step, names)}; it has: {', '.join(names)}"
                )
            node = getattr(node, step)
    return node


class Transfer(Operator):
    """Copy sub-trees of a source model (e.g. a trained autoencoder) into a target model (a fresh classifier).

    Args:
        paths: ``{target_path: source_path}``. Keys are attribute paths in the *target* model and values are
            paths in the *source* model, so each target part receives exactly one source (``encoder``,
            ``layers[0]``, ``encoder.layers[1]``). Empty (the default, ``Transfer()``) copies nothing: the
            target keeps its fresh weights, which is how a stage says "start fresh" explicitly.

    Example:
        >>> Transfer(paths={"encoder": "encoder"})
        Transfer(paths={'encoder': 'encoder'})
    """

    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def example(cls) -> Transfer:
        return cls(paths={"encoder": "encoder", "head.layers[0]": "decoder.layers[0]"})

    def validate(self) -> None:
        for target_path, source_path in self.paths.items():
            _parse_path(target_path)
            _parse_path(source_path)

    def apply(self, source: Any, target: Any) -> Any:
        """`target` with each ``paths`` entry replaced by the source's sub-tree (the same arrays, bit for bit).

        `source` and `target` are Equinox modules (or bound `ModelOp`\\ s, whose modules are used). A path that
        does not exist raises `pipekit.ConfigError`; sub-trees whose array paths, shapes or dtypes differ raise
        `pipekit.ShapeError` naming the path and both shapes.
        """
        if isinstance(source, ModelOp):
            source = source._bound("Transfer source")
        if isinstance(target, ModelOp):
            target = target._bound("Transfer target")
        out = target
        for target_path, source_path in self.paths.items():
            t_steps, s_steps = _parse_path(target_path), _parse_path(source_path)
            src = _resolve(source, s_steps, source_path, "source")
            dst = _resolve(out, t_steps, target_path, "target")
            src_specs, dst_specs = _leaf_specs(src), _leaf_specs(dst)
            if src_specs != dst_specs:
                raise ShapeError(
                    f"Transfer: source {source_path!r} does not fit target {target_path!r}: "
                    f"{_pair_diff(src_specs, dst_specs)}"
                )
            if jax.tree.structure(eqx.filter(src, eqx.is_array)) != jax.tree.structure(eqx.filter(dst, eqx.is_array)):
                raise ShapeError(
                    f"Transfer: source {source_path!r} and target {target_path!r} have equal shapes but different "
                    f"structure (static fields such as the activation differ): {type(src).__name__} vs "
                    f"{type(dst).__name__}"
                )
            out = eqx.tree_at(lambda m, steps=t_steps, p=target_path: _resolve(m, steps, p, "target"), out, src)
        return out


def _pair_diff(src: dict[str, Any], dst: dict[str, Any]) -> str:
    for path in [*dst, *src]:
        if src.get(path) != dst.get(path):
            return (
                f"at {path or '<root>'} the source has {_fmt(src.get(path))} and the target has {_fmt(dst.get(path))}"
            )
    return "the structures differ"


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
    final = image_size // 2 ** len(channels)
    if final < 1:
        raise ConfigError(
            f"cnn: image_size={image_size} is too small for {len(channels)} conv+pool stages (channels={channels}); "
            f"it must be at least {2 ** len(channels)}"
        )
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
