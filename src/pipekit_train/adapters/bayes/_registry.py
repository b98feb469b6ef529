"""NumPyro model functions and hand-written guides registered by name, so a YAML file can name them
(`register_numpyro_model`, `register_numpyro_guide`).

A model is a plain NumPyro model function. Its parameters are filled from the stage's data (a dataset key of the
same name) and from the model operator's ``kwargs``; ``observed`` names the parameters that carry observations (an
observed parameter with no data is an error before sampling, never a silently latent likelihood).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipekit import ConfigError, suggestion

__all__ = [
    "NumpyroModelSpec",
    "get_numpyro_model",
    "guide_factory",
    "register_numpyro_guide",
    "register_numpyro_model",
    "registered_guides",
    "registered_numpyro_models",
]


@dataclass(frozen=True)
class NumpyroModelSpec:
    """A registered model: the function, the parameters that carry observations, and its signature."""

    name: str
    fn: Callable[..., Any]
    observed: tuple[str, ...]

    @property
    def parameters(self) -> list[str]:
        return [
            p.name
            for p in inspect.signature(self.fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]

    @property
    def required(self) -> list[str]:
        return [
            p.name
            for p in inspect.signature(self.fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        ]


_MODELS: dict[str, NumpyroModelSpec] = {}


def _builtins() -> dict[str, NumpyroModelSpec]:
    from . import _builtin_models  # noqa: F401  (registers eight_schools, conjugate_normal, linear/logistic regression)

    return _MODELS


def register_numpyro_model(
    name: str, *, observed: tuple[str, ...] | list[str] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a NumPyro model function under `name` (``NumpyroModel(model=name)`` in YAML).

    Args:
        name: The name YAML files use.
        observed: The model's parameters that carry observations (``obs=``). Each must get data from the stage's
            dataset; a missing one is an error before sampling.

    Example:
        >>> @register_numpyro_model("doc_coin", observed=("flips",))
        ... def coin(flips=None):
        ...     import numpyro, numpyro.distributions as dist
        ...     p = numpyro.sample("p", dist.Beta(1.0, 1.0))
        ...     numpyro.sample("flips", dist.Bernoulli(p), obs=flips)
        >>> "doc_coin" in registered_numpyro_models()
        True
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_numpyro_model: name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = NumpyroModelSpec(name, fn, tuple(observed))
        unknown = [o for o in spec.observed if o not in spec.parameters]
        if unknown:
            raise ConfigError(
                f"register_numpyro_model({name!r}): observed {unknown} are not parameters of {fn.__qualname__}"
                f"{suggestion(unknown[0], spec.parameters)}; it has: {', '.join(spec.parameters)}"
            )
        old = _MODELS.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ConfigError(
                f"NumPyro model {name!r} is already registered by {old.fn.__module__}.{old.fn.__qualname__}; "
                "choose another name"
            )
        _MODELS[name] = spec
        return fn

    return decorator


def registered_numpyro_models() -> list[str]:
    """The names `NumpyroModel.model` accepts, sorted."""
    return sorted(_builtins())


def get_numpyro_model(name: str, where: str = "NumpyroModel.model") -> NumpyroModelSpec:
    """The registered model `name`, or a one-line `ConfigError` with the closest names."""
    spec = _builtins().get(name)
    if spec is None:
        names = registered_numpyro_models()
        raise ConfigError(
            f"{where} {name!r} is not a registered NumPyro model{suggestion(name, names)}; registered: "
            f"{', '.join(names)} (register one with @register_numpyro_model(NAME) in a module loaded with --import)"
        )
    return spec


# Guides ---------------------------------------------------------------------------------------------------
_AUTO_GUIDES = ("AutoNormal", "AutoDiagonalNormal", "AutoMultivariateNormal", "AutoLaplaceApproximation", "AutoDelta")
_GUIDES: dict[str, Callable[..., Any]] = {}


def register_numpyro_guide(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a hand-written guide: a function ``make(model_fn) -> guide_fn`` (``NumpyroGuide(guide=name)``)."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _AUTO_GUIDES:
            raise ConfigError(f"register_numpyro_guide: {name!r} is a built-in autoguide name")
        _GUIDES[name] = fn
        return fn

    return decorator


def registered_guides() -> list[str]:
    """The names `NumpyroGuide.guide` accepts."""
    return [*_AUTO_GUIDES, *sorted(_GUIDES)]


def guide_factory(name: str) -> Callable[..., Any] | None:
    """The factory registered as `name` with `register_numpyro_guide`, or ``None`` (an autoguide, or no guide)."""
    return _GUIDES.get(name)
