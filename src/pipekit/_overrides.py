"""Field overrides: ``PATH=VALUE`` strings and the edits they make to an operator tree (``pipekit-train run
--set``, a sweep's trials). A value is read as the same YAML in a pipeline file would be, and each edited field is
type-checked as the loader checks a file; the operators on edited paths are validated once, after every edit.

Example:
    >>> import pipekit
    >>> pipe = pipekit.Sequential([pipekit.Tap()])
    >>> pipekit.apply_overrides(pipe, [pipekit.parse_override("stages.0.sink=print")]) == pipe
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["apply_overrides", "check_edited", "parse_override", "set_field"]


def apply_overrides(op: Any, overrides: Sequence[tuple[list[str], Any]]) -> Any:
    """`op` with every ``(path, value)`` of `overrides` set (`set_field`), then every operator on an edited path
    validated once (`check_edited`): fields that only fit together (a model and its backend) may be set in any
    order."""
    if not overrides:
        return op
    from ._operator import deferred_validation

    with deferred_validation():
        for parts, value in overrides:
            op = set_field(op, parts, value)
    return check_edited(op, [parts for parts, _ in overrides])


def parse_override(text: str) -> tuple[list[str], Any]:
    """``PATH=VALUE`` → (path parts, value). `VALUE` is built as the same YAML in a pipeline file would be.

    It goes through the file loader's composer, tag rules and limits (`pipekit._yaml.load_value`): no alias bombs,
    no ``!!set`` / ``!!binary`` / merge keys / custom tags, and a mapping with ``type:`` is an operator. An empty
    `VALUE` is the empty string.
    """
    from ._errors import ConfigError
    from ._yaml import load_value

    if "=" not in text:
        raise ConfigError(f"--set expects PATH=VALUE (for example stages.0.max_steps=100), got {text!r}")
    path, raw = text.split("=", 1)
    parts = [p for p in path.replace("[", ".").replace("]", "").split(".") if p]
    if not parts:
        raise ConfigError(f"--set {text!r}: the path before '=' is empty")
    shown = ".".join(parts)
    try:
        value = load_value(raw, source=f"--set {shown}") if raw.strip() else ""
    except RecursionError:  # a last resort: the loader's depth limit stops recursive aliases long before this
        raise ConfigError(f"--set {shown}: the value nests too deeply; refusing to load it") from None
    return parts, value


def set_field(node: Any, path: list[str], value: Any, shown: str = "") -> Any:
    """A copy of `node` with the field at `path` set to `value`, type-checked as the YAML loader checks the file.

    `path` walks operator fields, mapping keys and list indices (an index equal to the list's length appends).
    """
    from ._errors import ConfigError, suggestion
    from ._operator import Operator, field_hints
    from ._types import check_field

    head, rest = path[0], path[1:]
    where = f"{shown}.{head}" if shown else head
    if isinstance(node, Operator):
        fields = {f.name: f for f in dataclasses.fields(node) if f.init}  # type: ignore[arg-type]
        if head not in fields:
            hint = _inner_paths(node, fields, head, shown) or suggestion(head, fields)
            raise ConfigError(
                f"--set {where}: {type(node).__name__} has no field {head!r}{hint}; allowed fields: {', '.join(fields)}"
            )
        new = value if not rest else set_field(getattr(node, head), rest, value, where)
        owner = type(node)._pipekit_name or type(node).__name__
        new = check_field(owner, head, new, field_hints(type(node)).get(head, Any), f"--set {where}")
        try:
            return node.replace(**{head: new})
        except ConfigError as e:
            if e.where:
                raise
            raise ConfigError(e.bare_message, f"--set {where}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{owner}: {e}", f"--set {where}") from None
    if isinstance(node, (list, tuple)):
        try:
            index = int(head)
        except ValueError:
            index = None
        if index is None or not -len(node) <= index <= len(node):
            raise ConfigError(
                f"--set {where}: expected a list index from 0 to {len(node)} ({len(node)} appends), got {head!r}"
            ) from None
        items = list(node)
        if index == len(node):
            if rest:
                raise ConfigError(f"--set {where}: there is no item {index} yet; set the whole item first")
            items.append(value)
        else:
            items[index] = value if not rest else set_field(items[index], rest, value, where)
        return type(node)(items)
    if isinstance(node, dict):
        out = dict(node)
        out[head] = value if not rest else set_field(node.get(head, {}), rest, value, where)
        return out
    raise ConfigError(f"--set {where}: {shown or 'the value'} is a {type(node).__name__}, not something with fields")


def _inner_paths(node: Any, fields: Any, name: str, shown: str) -> str:
    """`` (did you mean 'stages.0.max_steps' or 'stages.1.max_steps'?)`` when operators in a list field of `node`
    (a `Sequential`'s stages) have the field `name` that `node` lacks; else an empty string."""
    from ._operator import Operator

    paths = []
    for f in fields:
        items = getattr(node, f, None)
        if isinstance(items, (list, tuple)):
            for i, item in enumerate(items):
                if isinstance(item, Operator) and name in {x.name for x in dataclasses.fields(item)}:  # type: ignore[arg-type]
                    paths.append(".".join(p for p in (shown, f, str(i), name) if p))
    if not paths:
        return ""
    return " (did you mean " + " or ".join(repr(p) for p in paths[:4]) + "?)"


def check_edited(node: Any, paths: list[list[str]], shown: str = "") -> Any:
    """`node` with every operator on an edited `path` rebuilt (innermost first), which runs its `validate`.

    An operator whose fields do not fit together is refused naming the ``--set`` paths that edited it.
    """
    from ._errors import ConfigError
    from ._operator import Operator

    def inner(head: str) -> list[list[str]]:
        return [p[1:] for p in paths if p[0] == head and len(p) > 1]

    heads = list(dict.fromkeys(p[0] for p in paths if len(p) > 1))
    join = (lambda h: f"{shown}.{h}") if shown else (lambda h: h)
    if isinstance(node, Operator):
        changes = {h: check_edited(getattr(node, h), inner(h), join(h)) for h in heads}
        try:
            return dataclasses.replace(node, **changes)  # type: ignore[type-var]
        except ConfigError as e:
            if e.where:
                raise
            where = ", ".join(f"--set {join('.'.join(p))}" for p in paths)
            raise ConfigError(e.bare_message, where) from None
    if isinstance(node, (list, tuple)):
        items = list(node)
        for h in heads:
            i = int(h)
            items[i] = check_edited(items[i], inner(h), join(h))
        return type(node)(items)
    if isinstance(node, dict):
        return {k: check_edited(v, inner(k), join(k)) if k in heads else v for k, v in node.items()}
    return node
