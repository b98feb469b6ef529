"""Lazy re-exports: a package's public names are imported on first use, so ``import pipekit_train`` stays cheap.

A facade lists its exports once, as ordinary imports inside ``if TYPE_CHECKING:`` (which type checkers and editors
read), and calls `attach` with its own ``__name__`` and ``__file__``. `attach` reads that block with `ast` (no
import happens) and returns the module-level ``__getattr__`` and ``__dir__`` that import a name's module the first
time the name is used (PEP 562), the same idea as scientific Python's ``lazy_loader``.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from typing import Any


def _exports(path: str) -> dict[str, tuple[str, str]]:
    """``{public name: (relative module, attribute)}`` from the ``if TYPE_CHECKING:`` imports of the file at `path`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom):
                module = "." * stmt.level + (stmt.module or "")
                for alias in stmt.names:
                    out[alias.asname or alias.name] = (module, alias.name)
    return out


def attach(
    package: str, path: str, eager: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the facade `package` (a package's ``__init__.py``, or a module)
    whose file is at `path`.

    `eager` is the package's ``globals()``: an imported name is stored there, so later lookups are plain attribute
    reads.
    """
    exports = _exports(path)
    # Relative imports are relative to the package: the facade's own for an ``__init__.py``, else its parent's.
    anchor = package if path.endswith("__init__.py") else package.rpartition(".")[0]

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(target[0], anchor)
        value = getattr(module, target[1])
        eager[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(eager) | set(exports))

    return __getattr__, __dir__, sorted(exports)
