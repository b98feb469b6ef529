"""Checking and converting field values against their type hints.

The same rules serve Python construction (`TrainingLoop(batch_size=32)`) and YAML loading, so a value is
accepted or refused the same way whichever road it took. Conversions are the lossless ones a YAML file needs:
a list becomes a tuple where the hint says tuple, an int becomes a float where the hint says float.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Literal, Union

from ._errors import ConfigError, suggestion


class Mismatch(Exception):
    """Internal: a value does not fit a hint. Carries the human description of what was expected."""

    def __init__(self, expected: str, value: Any, path: str = "") -> None:
        self.expected = expected
        self.value = value
        self.path = path
        super().__init__(expected)


#: The range of an int field: what a 64-bit integer holds.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def describe(hint: Any) -> str:
    """A short human name for a type hint: ``int``, ``tuple of Callback``, ``'mean', 'sum' or 'none'``."""
    if hint is Any:
        return "any value"
    if hint is type(None) or hint is None:
        return "null"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in (tuple, collections.abc.Sequence, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {describe(args[0])}"
        if args:
            return "a list of [" + ", ".join(describe(a) for a in args) + "]"
        return "a list"
    if origin in (dict, collections.abc.Mapping):
        return "a mapping" + (f" of {describe(args[0])} to {describe(args[1])}" if args else "")
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return "a callable"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__array__")


def coerce(value: Any, hint: Any) -> Any:
    """Return `value` converted to fit `hint`, or raise `Mismatch`."""
    if hint is Any or isinstance(hint, typing.TypeVar) or isinstance(hint, str):
        return value
    if hint is None or hint is type(None):
        if value is None:
            return None
        raise Mismatch("null", value)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return coerce(value, args[0])
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        hint_text = ""
        if isinstance(value, str):
            hint_text = suggestion(value, [a for a in args if isinstance(a, str)])
        raise Mismatch(describe(hint) + hint_text, value)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return coerce(value, arm)
            except Mismatch:
                continue
        raise Mismatch(describe(hint), value)
    if origin in (tuple, list, collections.abc.Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise Mismatch(describe(hint), value)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce_item(v, args[0], f"[{i}]") for i, v in enumerate(value)]
        elif args and origin is tuple:
            if len(value) != len(args):
                raise Mismatch(describe(hint), value)
            items = [_coerce_item(v, a, f"[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        elif args:
            items = [_coerce_item(v, args[0], f"[{i}]") for i, v in enumerate(value)]
        else:
            items = list(value)
        return list(items) if origin is list else tuple(items)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, collections.abc.Mapping):
            raise Mismatch(describe(hint), value)
        if not args:
            return dict(value)
        return {_coerce_item(k, args[0], f"[{k!r}]"): _coerce_item(v, args[1], f"[{k!r}]") for k, v in value.items()}
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        if callable(value):
            return value
        raise Mismatch("a callable", value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Mismatch("float", value)
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Mismatch("int", value)
        if not INT64_MIN <= value <= INT64_MAX:  # nothing past a 64-bit int reaches NumPy, JAX or a JSON reader
            raise Mismatch(f"an int that fits in 64 bits ({INT64_MIN} to {INT64_MAX})", value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise Mismatch("bool (true or false)", value)
        return value
    if isinstance(hint, type):
        if getattr(hint, "_is_protocol", False) and not getattr(hint, "_is_runtime_protocol", False):
            return value
        if isinstance(value, hint):
            return value
        raise Mismatch(describe(hint), value)
    return value


def _coerce_item(value: Any, hint: Any, step: str) -> Any:
    try:
        return coerce(value, hint)
    except Mismatch as e:
        raise Mismatch(e.expected, e.value, step + e.path) from None


def check_field(owner: str, field: str, value: Any, hint: Any, where: str | None = None) -> Any:
    """Coerce one field's value, or raise a `ConfigError` naming the field, the rule and the value."""
    try:
        return coerce(value, hint)
    except Mismatch as e:
        shown = e.value
        text = repr(shown)
        if len(text) > 80:
            text = text[:77] + "..."
        inner = f"{field}{e.path}" if e.path else field
        rule = e.expected if not e.path else f"{e.expected} (the whole field is {describe(hint)})"
        raise ConfigError(f"{owner}.{inner} must be {rule}, got {text}", where) from None
