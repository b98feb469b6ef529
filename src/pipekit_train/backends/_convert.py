"""Moving a trained model between backends: `register_converter`, `find_converter`, `convert_model`.

A stage of one backend refuses the model of another unless a converter is registered for the pair (and the source
model's factory). Backends register their converters when their package is imported (the built-in factories convert
in all twelve directions among Equinox, Keras, Lightning and Flax: `pipekit_train.backends._zoo`; the transformers
between Equinox and Flax: `pipekit_train.backends._zoo_transformer`). A converter takes a bound model operator and
returns a bound one of the other backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipekit import ConfigError

__all__ = [
    "convert_model",
    "converted_architecture",
    "find_converter",
    "refuse_foreign",
    "register_converter",
    "registered_converters",
]

Converter = Callable[[Any], Any]
_CONVERTERS: dict[tuple[str, str, str | None], Converter] = {}


def register_converter(
    src_backend: str, dst_backend: str, factory: str | None = None
) -> Callable[[Converter], Converter]:
    """Register ``fn(bound_model_op) -> bound model op of dst_backend``, for models of `factory` (``None``: any).

    A converter that knows what it will produce without weights may carry ``fn.architecture(model_op)`` returning
    that unbound model op; pre-flight then refuses a hand-off into a stage of another architecture.

    Example:
        >>> @register_converter("doc-src", "keras", "mlp")
        ... def doc_convert(op):
        ...     raise NotImplementedError
        >>> ("doc-src", "keras", "mlp") in registered_converters()
        True
    """

    def decorator(fn: Converter) -> Converter:
        _CONVERTERS[(src_backend, dst_backend, factory)] = fn
        return fn

    return decorator


def _builtin_converters() -> None:
    """Register the zoo's converters (every built-in factory, all twelve directions among Equinox, Keras,
    Lightning and Flax; the transformers between Equinox and Flax) the first time a converter is looked up: `_zoo`
    and `_zoo_transformer` import no framework."""
    from . import _zoo, _zoo_transformer  # noqa: F401


def registered_converters() -> list[tuple[str, str, str | None]]:
    """``(src_backend, dst_backend, factory)`` of every registered converter."""
    _builtin_converters()
    return sorted(_CONVERTERS, key=lambda k: (k[0], k[1], k[2] or ""))


def converted_architecture(model: Any, dst_backend: str) -> Any:
    """The unbound model op the converter for `model` into `dst_backend` will produce, when it says so (a converter
    may carry ``fn.architecture(model)``, as the built-in ones do); ``None`` when it does not. Needs no weights: it
    lets pre-flight refuse a hand-off into another architecture before anything trains."""
    fn = find_converter(model, dst_backend)
    architecture = getattr(fn, "architecture", None)
    return architecture(model) if architecture is not None else None


def find_converter(model: Any, dst_backend: str) -> Converter | None:
    """The converter for a bound model op into `dst_backend` (by its factory first, then any), or ``None``."""
    _builtin_converters()
    src, factory = model.backend, model.factory_name()
    return _CONVERTERS.get((src, dst_backend, factory)) or _CONVERTERS.get((src, dst_backend, None))


def convert_model(model: Any, dst_backend: str) -> Any:
    """`model` (a bound model op) as a bound model op of `dst_backend`, through a registered converter."""
    src = getattr(model, "backend", "")
    if src == dst_backend:
        return model
    fn = find_converter(model, dst_backend)
    if fn is None:
        pairs = ", ".join(f"{s} -> {d} ({f or 'any'})" for s, d, f in registered_converters()) or "none"
        raise ConfigError(
            f"no converter moves {model!r} (backend {src!r}) to backend {dst_backend!r}; registered: {pairs}. "
            "Register one with pipekit_train.register_converter(src_backend, dst_backend, factory)"
        )
    model.require_module(f"conversion to {dst_backend}")
    out = fn(model)
    if getattr(out, "backend", None) != dst_backend or out.module is None:
        raise ConfigError(f"the converter {fn.__qualname__} returned {out!r}, not a bound model of {dst_backend!r}")
    return out


def refuse_foreign(model: Any, backend: str, stage: str) -> ConfigError:
    """The error for a stage of `backend` handed a model of another backend that no converter moves."""
    return ConfigError(
        f"stage {stage!r} (backend {backend!r}) cannot start from the previous stage's {model!r}, a model of "
        f"backend {getattr(model, 'backend', '?')!r}; weights move between backends only through a registered "
        f"converter (pipekit_train.register_converter({getattr(model, 'backend', '?')!r}, "
        f"{backend!r}, factory)); registered: "
        + (", ".join(f"{s} -> {d} ({f or 'any'})" for s, d, f in registered_converters()) or "none")
    )
