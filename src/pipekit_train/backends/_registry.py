"""Backends by name: the ``pipekit_train.backends`` entry-point group and in-process registrations.

A backend is an *adapter module* that implements the contract in ``adapters/README.md`` (`preflight`, `run`,
`backend_info`, and the model operators it registers). `TrainingLoop.backend` names one. Installed packages declare
their adapters in the entry-point group ``pipekit_train.backends`` (``name = "package.module"``); code that is not
packaged registers one with `register_backend`. A YAML file can only choose among these names: nothing it says is
imported.

Adapter modules must be cheap to import: they import their framework inside the functions that need it, so listing
or checking backends never loads Keras, torch or JAX.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import threading
from types import ModuleType
from typing import Any

from pipekit import ConfigError, suggestion

__all__ = ["BackendError", "available_backends", "get_backend", "register_backend"]

ENTRY_POINT_GROUP = "pipekit_train.backends"

#: The backends this project knows by name, whether or not their adapter or framework is installed here.
_BACKEND_MODULES = {
    "equinox": "pipekit_train.adapters.equinox",
    "lightning": "pipekit_train.adapters.lightning",
    "keras": "pipekit_train.adapters.keras",
    "numpyro-svi": "pipekit_train.adapters.numpyro_svi",
    "numpyro-mcmc": "pipekit_train.adapters.numpyro_mcmc",
    "blackjax": "pipekit_train.adapters.blackjax",
}
#: The extra that installs each known backend's framework: ``pip install 'pipekit-train[EXTRA]'``.
_EXTRAS = {
    "equinox": None,
    "lightning": "lightning",
    "keras": "keras",
    "numpyro-svi": "numpyro",
    "numpyro-mcmc": "numpyro",
    "blackjax": "blackjax",
}

_REGISTERED: dict[str, str | ModuleType] = {}
_LOADED: dict[str, ModuleType] = {}
_lock = threading.Lock()
_entry_points_read = False


class BackendError(ConfigError):
    """A backend name that is unknown, not installed, or whose adapter breaks the contract."""


def register_backend(name: str, adapter: str | ModuleType) -> None:
    """Make `name` a valid `TrainingLoop.backend` in this process.

    Args:
        name: The name YAML files use (letters, digits, ``-`` and ``_``).
        adapter: The adapter module, or its dotted name (imported when a stage first uses it).

    The packaged equivalent is an entry point: ``[project.entry-points."pipekit_train.backends"]
    my-backend = "my_package.adapter"``.
    """
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise BackendError(f"register_backend: the name must be letters, digits, '-' or '_', got {name!r}")
    if not isinstance(adapter, (str, ModuleType)):
        raise BackendError(
            f"register_backend({name!r}, ...): the adapter must be a module or a dotted module name, "
            f"got {type(adapter).__name__}"
        )
    with _lock:
        _REGISTERED[name] = adapter
        _LOADED.pop(name, None)


def _read_entry_points() -> None:
    global _entry_points_read
    if _entry_points_read:
        return
    with _lock:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _REGISTERED.setdefault(ep.name, ep.value.split(":", 1)[0])
        _entry_points_read = True


def available_backends() -> list[str]:
    """The backend names registered here (installed entry points and `register_backend`), sorted."""
    _read_entry_points()
    return sorted(_REGISTERED)


def check_backend_name(name: str, where: str = "TrainingLoop.backend") -> None:
    """Refuse a backend name that is not registered, with the nearest names and what to install."""
    _read_entry_points()
    if name in _REGISTERED:
        return
    if name in _BACKEND_MODULES:
        extra = _EXTRAS.get(name)
        hint = f"install it with: pip install 'pipekit-train[{extra}]'" if extra else "reinstall pipekit-train"
        raise BackendError(
            f"{where} {name!r} is a backend pipekit-train knows, but its adapter is not installed here; {hint} "
            f"(installed backends: {', '.join(available_backends())})"
        )
    known = sorted(set(_REGISTERED) | set(_BACKEND_MODULES))
    raise BackendError(
        f"{where} {name!r} is not a registered backend{suggestion(name, known)}; installed backends: "
        f"{', '.join(available_backends())} (a plugin registers more through the {ENTRY_POINT_GROUP!r} entry-point "
        "group, or pipekit_train.register_backend in a module loaded with --import)"
    )


_REQUIRED = ("preflight", "run", "backend_info")


def get_backend(name: str) -> ModuleType:
    """The adapter module registered as `name`, imported, with its framework checked to be installed."""
    check_backend_name(name)
    loaded = _LOADED.get(name)
    if loaded is not None:
        return loaded
    target = _REGISTERED[name]
    module = importlib.import_module(target) if isinstance(target, str) else target
    missing = [attr for attr in _REQUIRED if not callable(getattr(module, attr, None))]
    if missing:
        raise BackendError(
            f"backend {name!r}: adapter {module.__name__} does not implement {', '.join(missing)} "
            "(see adapters/README.md for the contract)"
        )
    for framework in getattr(module, "REQUIRES", ()):
        if importlib.util.find_spec(framework) is None:
            extra = getattr(module, "EXTRA", None) or _EXTRAS.get(name)
            how = f"pip install 'pipekit-train[{extra}]'" if extra else f"pip install {framework}"
            raise BackendError(f"backend {name!r} needs the {framework!r} package, which is not installed: {how}")
    _LOADED[name] = module
    return module


def adapter_of(loop: Any) -> ModuleType:
    """The adapter module for `loop.backend`."""
    return get_backend(loop.backend)
