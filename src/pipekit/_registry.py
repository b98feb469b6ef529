"""The registry of operator types, by short name.

Operators register themselves when their class is defined (``class MSE(Operator)`` registers ``"MSE"``).
Third-party packages declare an entry point in the ``pipekit.operators`` group that names a *module* (or a
class); the registry imports those modules, which are installed code the user chose, before its first lookup, so
every installed type (and whatever those modules register, such as model factories) is known whatever order a file
names them in. Nothing named inside a YAML file is ever imported.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ._errors import ConfigError, suggestion

if TYPE_CHECKING:
    from ._operator import Operator

ENTRY_POINT_GROUP = "pipekit.operators"

_REGISTRY: dict[str, type[Operator]] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register(name: str, cls: type[Operator]) -> None:
    """Register `cls` under `name`. Re-registering the same class (a module reload) is allowed."""
    if not name.isidentifier():
        raise ConfigError(f"operator name must be an identifier (no dots, no spaces), got {name!r}")
    with _lock:
        old = _REGISTRY.get(name)
        if (
            old is not None
            and old is not cls
            and (old.__module__, old.__qualname__)
            != (
                cls.__module__,
                cls.__qualname__,
            )
        ):
            raise ConfigError(
                f"operator name {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
                f"pass a different name: class {cls.__name__}(Operator, name='...')"
            )
        _REGISTRY[name] = cls


def load_entry_points() -> None:
    """Import the modules that installed packages declare in the ``pipekit.operators`` group (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    import importlib.metadata  # here, not at import: `import pipekit` stays cheaper than `import numpy`

    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except ImportError as e:
            raise ConfigError(
                f"the installed plugin {ep.name!r} ({ep.value}, entry point group {ENTRY_POINT_GROUP!r}) cannot be "
                f"imported: {e}; reinstall or uninstall the package that provides it"
            ) from e
        if isinstance(obj, type) and ep.name not in _REGISTRY:
            register(ep.name, obj)


def lookup(name: str) -> type[Operator]:
    """The operator class registered as `name`, or a `ConfigError` listing the registered names."""
    if not isinstance(name, str) or not name.isidentifier():
        # Dotted paths (`os.system`) are refused here, before anything is imported.
        raise ConfigError(
            f"operator type must be a registered name, got {name!r}; "
            "pipekit never imports a module or attribute named in a file"
        )
    load_entry_points()
    cls = _REGISTRY.get(name)
    if cls is None:
        names = sorted(_REGISTRY)
        raise ConfigError(
            f"unknown operator type {name!r}{suggestion(name, names)}; registered types: {', '.join(names)}"
        )
    return cls


def registered() -> dict[str, type[Operator]]:
    """A copy of the registry, after loading installed entry points."""
    load_entry_points()
    return dict(_REGISTRY)


def name_of(cls: type[Operator]) -> str:
    """The registered name of `cls`."""
    name = cls.__dict__.get("_pipekit_name")
    if name is None or _REGISTRY.get(name) is not cls:
        raise ConfigError(f"{cls.__qualname__} is not a registered operator type, so it cannot be serialized")
    return str(name)
