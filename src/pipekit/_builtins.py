"""Small built-in operators: `Tap` (look at the carrier) and `AssertShape` (check array leaves)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import ConfigError, ShapeError, suggestion
from ._operator import Operator

_SINKS: dict[str, Callable[[Any], None]] = {}


def register_sink(name: str, fn: Callable[[Any], None]) -> None:
    """Register `fn` as a sink that `Tap(sink=name)` hands the carrier to."""
    _SINKS[name] = fn


def _print_sink(carrier: Any) -> None:
    print(carrier, file=sys.stdout)


register_sink("print", _print_sink)


class Tap(Operator):
    """Hand the carrier to a registered sink and return it unchanged.

    Sinks are registered by name with `pipekit.register_sink`, so a YAML file can only reach functions the
    program registered. ``"print"`` is built in.

    Args:
        sink: A registered sink (`pipekit.register_sink`); ``"print"`` prints the carrier.

    Example:
        >>> import pipekit
        >>> seen = []
        >>> pipekit.register_sink("collect", seen.append)
        >>> pipekit.Tap(sink="collect")(41)
        41
        >>> seen
        [41]
    """

    sink: str = "print"

    def __call__(self, carrier: Any) -> Any:
        fn = _SINKS.get(self.sink)
        if fn is None:
            raise ConfigError(
                f"Tap.sink {self.sink!r} is not a registered sink{suggestion(self.sink, _SINKS)}; "
                f"registered sinks: {', '.join(sorted(_SINKS))}"
            )
        fn(carrier)
        return carrier


def array_leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) for every array-like leaf (has `shape` and `dtype`) of a nested container.

    Paths read like ``x``, ``layers[0].weight``, ``batch['image']`` . Dicts, lists, tuples, named tuples,
    dataclasses and plain objects with ``__dict__`` (Equinox modules among them) are walked.
    """
    out: list[tuple[str, Any]] = []
    _walk(tree, prefix, out, depth=0)
    return out


def _walk(node: Any, path: str, out: list[tuple[str, Any]], depth: int) -> None:
    if depth > 100:
        return
    if hasattr(node, "shape") and hasattr(node, "dtype"):
        out.append((path or "<root>", node))
        return
    if isinstance(node, Mapping):
        for k, v in node.items():
            _walk(v, f"{path}.{k}" if path else str(k), out, depth + 1)
    elif isinstance(node, tuple) and hasattr(node, "_fields"):
        for k in node._fields:
            _walk(getattr(node, k), f"{path}.{k}" if path else k, out, depth + 1)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _walk(v, f"{path}[{i}]", out, depth + 1)
    elif hasattr(node, "__dataclass_fields__"):
        for k in node.__dataclass_fields__:
            _walk(getattr(node, k, None), f"{path}.{k}" if path else k, out, depth + 1)
    elif hasattr(node, "__dict__") and not isinstance(node, type) and not callable(node):
        for k, v in vars(node).items():
            _walk(v, f"{path}.{k}" if path else k, out, depth + 1)


class AssertShape(Operator):
    """Check the shapes (and optionally dtypes) of a carrier's array leaves; return the carrier unchanged.

    `shapes` maps a leaf path (as `array_leaves` spells it) to the expected shape; ``None`` in a shape matches
    any size. `dtypes` maps a leaf path to a dtype name. A missing leaf, a wrong shape or a wrong dtype raises
    `ShapeError` naming the leaf, what was expected and what was found.

    Args:
        shapes: ``{leaf path: shape}``; ``None`` in a shape matches any size. Omitted: no shape is checked.
        dtypes: ``{leaf path: dtype name}`` (``float32``). Omitted: no dtype is checked.

    Example:
        >>> import numpy as np, pipekit
        >>> check = pipekit.AssertShape(shapes={"x": (None, 3)}, dtypes={"x": "float32"})
        >>> _ = check({"x": np.zeros((5, 3), np.float32)})
        >>> check({"x": np.zeros((5, 4), np.float32)})
        Traceback (most recent call last):
        ...
        pipekit._errors.ShapeError: AssertShape: leaf 'x' should have shape (None, 3), got (5, 4)
    """

    shapes: dict[str, tuple[int | None, ...]] | None = None
    dtypes: dict[str, str] | None = None

    def __call__(self, carrier: Any) -> Any:
        leaves = dict(array_leaves(carrier))
        for path, expected in (self.shapes or {}).items():
            leaf = leaves.get(path)
            if leaf is None:
                raise ShapeError(
                    f"AssertShape: no array leaf {path!r}{suggestion(path, leaves)}; leaves: {sorted(leaves)}"
                )
            actual = tuple(int(d) for d in leaf.shape)
            ok = len(actual) == len(expected) and all(e is None or e == a for e, a in zip(expected, actual))
            if not ok:
                raise ShapeError(f"AssertShape: leaf {path!r} should have shape {tuple(expected)}, got {actual}")
        for path, dtype in (self.dtypes or {}).items():
            leaf = leaves.get(path)
            if leaf is None:
                raise ShapeError(
                    f"AssertShape: no array leaf {path!r}{suggestion(path, leaves)}; leaves: {sorted(leaves)}"
                )
            if str(leaf.dtype) != dtype:
                raise ShapeError(f"AssertShape: leaf {path!r} should have dtype {dtype}, got {leaf.dtype}")
        return carrier

    @classmethod
    def example(cls) -> AssertShape:
        return cls(shapes={"x": (None, 3), "y": (2,)}, dtypes={"x": "float32"})
