"""Backends by name: the ``pipekit_train.backends`` entry-point group and in-process registrations.

A backend is one object implementing the contract of `pipekit_train.backends.Backend` (``adapters/README.md``):
``name``, ``requires``, ``extra``, ``capabilities``, ``check``, ``build``, ``start``, ``info``. `TrainingLoop.backend`
names one. Installed packages declare theirs in the entry-point group ``pipekit_train.backends``
(``name = "package.module:backend"``); code that is not packaged registers one with `register_backend`. A YAML file
can only choose among these names: nothing it says is imported.

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

from ._contract import CAPABILITIES, Backend

__all__ = ["BackendError", "able_to", "available_backends", "backends_with", "get_backend", "register_backend"]

ENTRY_POINT_GROUP = "pipekit_train.backends"

_REGISTERED: dict[str, Any] = {}
_LOADED: dict[str, Backend] = {}
_lock = threading.Lock()
_entry_points_read = False


class BackendError(ConfigError):
    """A backend name that is unknown, not installed, or whose adapter breaks the contract."""


def register_backend(name: str, backend: Any) -> None:
    """Make `name` a valid `TrainingLoop.backend` in this process.

    Args:
        name: The name YAML files use (letters, digits, ``-`` and ``_``).
        backend: The backend object (``adapters/README.md``), a module whose ``backend`` attribute is one, or the
            dotted name of either (``"my_package.adapter:backend"``; imported when a stage first uses it).

    The packaged equivalent is an entry point: ``[project.entry-points."pipekit_train.backends"]
    my-backend = "my_package.adapter:backend"``.
    """
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise BackendError(f"register_backend: the name must be letters, digits, '-' or '_', got {name!r}")
    if not isinstance(backend, (str, ModuleType)):
        _check_is_backend(f"register_backend({name!r}, ...)", backend)
    with _lock:
        _REGISTERED[name] = backend
        _LOADED.pop(name, None)


def _read_entry_points() -> None:
    global _entry_points_read
    if _entry_points_read:
        return
    with _lock:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _REGISTERED.setdefault(ep.name, ep.value)
        _entry_points_read = True


def available_backends() -> list[str]:
    """The backend names registered here (installed entry points and `register_backend`), sorted."""
    _read_entry_points()
    return sorted(_REGISTERED)


def check_backend_name(name: str, where: str = "TrainingLoop.backend") -> None:
    """Refuse a backend name that is not registered, with the nearest names. (The backends that ship with
    pipekit-train are always registered, by their entry points: one whose framework is missing is refused by
    `get_backend`, naming the extra that installs it.)"""
    _read_entry_points()
    if name in _REGISTERED:
        return
    raise BackendError(
        f"{where} {name!r} is not a registered backend{suggestion(name, sorted(_REGISTERED))}; installed backends: "
        f"{', '.join(available_backends())} (a plugin registers more through the {ENTRY_POINT_GROUP!r} entry-point "
        "group, or pipekit_train.register_backend in a module loaded with --import)"
    )


def _resolve(name: str, target: Any) -> Any:
    """The backend object `target` stands for: itself, a module's ``backend``, or a dotted ``module[:attr]``."""
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        target = importlib.import_module(module_name)
        if attr:
            target = getattr(target, attr, None)
            if target is None:
                raise BackendError(
                    f"backend {name!r}: module {module_name} has no {attr!r} (the contract is in adapters/README.md)"
                )
    if isinstance(target, ModuleType):
        module = target
        target = getattr(module, "backend", None)
        if target is None:
            raise BackendError(
                f"backend {name!r}: module {module.__name__} has no `backend` object (the contract is in "
                "adapters/README.md)"
            )
    return target


def _check_is_backend(where: str, backend: Any) -> None:
    """Refuse an object that is not a `Backend` (the contract is a type: its methods are what the core calls)."""
    if not isinstance(backend, Backend):
        raise BackendError(
            f"{where}: {type(backend).__name__} is not a pipekit_train.backends.Backend; subclass it (its abstract "
            "methods check, build and start are the contract: adapters/README.md)"
        )


def get_backend(name: str) -> Backend:
    """The backend registered as `name`, with its framework checked to be installed."""
    check_backend_name(name)
    loaded = _LOADED.get(name)
    if loaded is not None:
        return loaded
    backend = _resolve(name, _REGISTERED[name])
    _check_is_backend(f"backend {name!r}", backend)
    assert isinstance(backend, Backend)
    unknown = sorted(set(backend.capabilities) - set(CAPABILITIES))
    if unknown:
        raise BackendError(
            f"backend {name!r} lists unknown capabilities {unknown}; known: {', '.join(sorted(CAPABILITIES))}"
        )
    for framework in backend.requires:
        if importlib.util.find_spec(framework) is None:
            how = f"pip install 'pipekit-train[{backend.extra}]'" if backend.extra else f"pip install {framework}"
            raise BackendError(f"backend {name!r} needs the {framework!r} package, which is not installed: {how}")
    _LOADED[name] = backend
    return backend


def backends_with(capability: str) -> list[str]:
    """The installed backends that list `capability`, sorted (for the remedies of pre-flight refusals); a backend
    whose framework is missing here is left out."""
    out = []
    for name in available_backends():
        try:
            if capability in get_backend(name).capabilities:
                out.append(name)
        except (BackendError, ImportError):
            continue
    return out


def adapter_of(loop: Any) -> Backend:
    """The backend object for `loop.backend`."""
    return get_backend(loop.backend)


def able_to(capability: str, besides: str | None = None) -> str:
    """`backends_with(capability)` as a refusal's remedy says it: ``"equinox, keras"``, or ``"none installed"``;
    `besides` (the stage's own backend) left out."""
    return ", ".join(b for b in backends_with(capability) if b != besides) or "none installed"
