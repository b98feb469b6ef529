"""Editor help from the code: a JSON Schema of the registered operators (`schema`) and field documentation
(`describe`, `field_table`).

Everything here is derived from what pipekit already knows: the registered names, each operator's dataclass
fields, their type hints (the same hints values are checked against), their defaults, and the class docstring
(its first paragraph, and per-field text under Google-style ``Args:`` / ``Attributes:`` sections, read from the
class and then its bases). Nothing is imported here but the registry's own entry points.

One idea in one module, although it passes 500 lines: the JSON Schema and the field tables are two renderings of
one reading of an operator's fields (type hints to schema fragments and to readable type names, defaults, the
docstring's per-field text); split, each half would re-implement that reading.

Example:
    >>> import pipekit
    >>> from pipekit._schema import field_table
    >>> print(field_table(pipekit.Tap))
    | field | type | default | meaning |
    | --- | --- | --- | --- |
    | `sink` | `str` | `print` | A registered sink (`pipekit.register_sink`); `"print"` prints the carrier. |
    >>> doc = pipekit.schema({"Tap": pipekit.Tap})
    >>> doc["$defs"]["Tap"]["properties"]["sink"]["default"]
    'print'

Why one file of about 500 lines: the JSON Schema, `describe` and the field table are three renderings of one
reading of the operators' type hints and docstrings; keeping them together keeps the three in agreement.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import json
import math
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml

from . import _registry
from ._errors import ConfigError, suggestion
from ._operator import Operator, field_hints
from ._yaml import FORMAT_VERSION, to_plain

__all__ = [
    "DIALECT",
    "FieldInfo",
    "default_text",
    "describe",
    "field_docs",
    "field_table",
    "fields_of",
    "schema",
    "summary",
    "type_text",
]

DIALECT = "https://json-schema.org/draft/2020-12/schema"
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Fields|Parameters):\s*$")
_ENTRY = re.compile(r"^\**(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_DOUBLE_TICKS = re.compile(r"``(.+?)``")


# Reading the code ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One field of an operator, as a file writes it: name, type hint, default (if any) and documented meaning."""

    name: str
    hint: Any
    required: bool
    default: Any
    meaning: str


def _own_doc(cls: type) -> str:
    """`cls`'s own docstring (not one `dataclasses` made up from the signature), cleaned; ``""`` if none."""
    doc = cls.__dict__.get("__doc__")
    if not isinstance(doc, str) or doc.startswith(f"{cls.__name__}("):
        return ""
    return inspect.cleandoc(doc)


def _one_line(text: str) -> str:
    return _DOUBLE_TICKS.sub(r"`\1`", " ".join(text.split()))


def summary(cls: type) -> str:
    """The first paragraph of `cls`'s docstring, on one line (``""`` when it has none)."""
    doc = _own_doc(cls)
    return _one_line(doc.split("\n\n", 1)[0]) if doc else ""


def _documented_fields(doc: str) -> dict[str, str]:
    """``{name: text}`` from the ``Args:`` / ``Attributes:`` sections of a cleaned Google-style docstring."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        match = _SECTION.match(lines[i])
        i += 1
        if match is None:
            continue
        indent = len(match.group(1))
        entry_indent: int | None = None
        current: str | None = None
        while i < len(lines):
            line = lines[i]
            if line.strip():
                here = len(line) - len(line.lstrip())
                if here <= indent:
                    break  # the next section (``Example:``) or the prose after this one
                if entry_indent is None:
                    entry_indent = here
                entry = _ENTRY.match(line.strip()) if here == entry_indent else None
                if entry is not None:
                    current = entry.group(1)
                    out[current] = entry.group(2)
                elif current is not None:
                    out[current] += " " + line.strip()
            i += 1
    return {name: _one_line(text) for name, text in out.items()}


def field_docs(cls: type) -> dict[str, str]:
    """Each documented field's text, from `cls`'s docstring and then its bases' (the nearest one wins)."""
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        for name, text in _documented_fields(_own_doc(klass)).items():
            if text:
                out.setdefault(name, text)
    return out


def fields_of(cls: type[Operator]) -> list[FieldInfo]:
    """The fields a file can set on `cls`, in declaration order."""
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise ConfigError(f"expected an Operator subclass, got {cls!r}")
    hints = field_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            required, default = False, f.default
        elif f.default_factory is not dataclasses.MISSING:
            required, default = False, f.default_factory()
        else:
            required, default = True, None
        out.append(FieldInfo(f.name, hints.get(f.name, Any), required, default, docs.get(f.name, "")))
    return out


def _type_name(cls: type) -> str:
    if issubclass(cls, Operator):
        return cls.__dict__.get("_pipekit_name") or cls.__name__
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str"}.get(cls, cls.__name__)


def type_text(hint: Any) -> str:
    """A short name for a type hint as a file sees it: ``int or null``, ``list of Callback``, ``"min" or "max"``."""
    if hint is Any or isinstance(hint, typing.TypeVar):
        return "any"
    if hint is None or hint is type(None):
        return "null"
    if isinstance(hint, str):
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin in (tuple, list, collections.abc.Sequence):
        if not args:
            return "list"
        if (len(args) == 2 and args[1] is Ellipsis) or origin is not tuple:
            item = type_text(args[0])
            return f"list of ({item})" if " or " in item else f"list of {item}"
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin in (dict, collections.abc.Mapping):
        if not args or args[1] is Any:
            return "mapping"
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return "callable"
    if isinstance(hint, type):
        return _type_name(hint)
    return str(hint)


def _yaml_scalar(text: str) -> str:
    """`text` as YAML flow text: bare when YAML reads it back as the same string, else double-quoted."""
    plain = (
        text
        and text == text.strip()
        and not any(c in text for c in ",[]{}#&*!|>'\"%@`\n")
        and ": " not in text
        and not text.endswith(":")
    )
    if plain:
        try:
            plain = yaml.safe_load(text) == text
        except yaml.YAMLError:
            plain = False
    return text if plain else json.dumps(text)


def default_text(value: Any) -> str:
    """A default value as a YAML file writes it, on one line: ``10000``, ``null``, ``{name: adamw, lr: 0.0003}``."""
    return _flow(to_plain(value, strict=False))


def _flow(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _yaml_scalar(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_flow(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _yaml_scalar(str(value))


# Field tables ----------------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def field_table(cls: type[Operator], meanings: Mapping[str, str] | None = None) -> str:
    """A Markdown table of `cls`'s fields: ``| field | type | default | meaning |``, one row per field, in order.

    Type and default come from the code; the meaning from `meanings` where it names the field, else from the
    docstring. A required field's default reads ``required``.
    """
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for info in fields_of(cls):
        meaning = (meanings or {}).get(info.name, info.meaning)
        default = "required" if info.required else f"`{_cell(default_text(info.default))}`"
        rows.append(f"| `{info.name}` | `{_cell(type_text(info.hint))}` | {default} | {_cell(meaning)} |")
    return "\n".join(rows)


# Describe ----------------------------------------------------------------------------------------------------------
def _kinds(registry: Mapping[str, type[Operator]]) -> dict[str, type[Operator]]:
    """The unregistered operator base classes of the registered types, by class name (``Loss``, ``Callback``)."""
    registered = set(registry.values())
    out: dict[str, type[Operator]] = {"Operator": Operator}
    for cls in registry.values():
        for base in cls.__mro__[1:]:
            if isinstance(base, type) and issubclass(base, Operator) and base not in registered:
                out.setdefault(base.__name__, base)
    return out


def _members(cls: type, registry: Mapping[str, type[Operator]]) -> list[str]:
    """The registered names whose class is `cls` or a subclass of it."""
    return sorted(name for name, c in registry.items() if issubclass(c, cls))


def _operator_classes(hint: Any) -> list[type[Operator]]:
    """The operator classes a hint names, at any depth (``tuple[Callback, ...] | None`` → ``[Callback]``)."""
    if isinstance(hint, type):
        return [hint] if issubclass(hint, Operator) else []
    out: list[type[Operator]] = []
    for arg in typing.get_args(hint):
        for cls in _operator_classes(arg):
            if cls not in out:
                out.append(cls)
    return out


def _resolve(name_or_class: str | type, registry: Mapping[str, type[Operator]]) -> tuple[str, type[Operator]]:
    if isinstance(name_or_class, type):
        if not issubclass(name_or_class, Operator):
            raise ConfigError(f"describe expects an operator type or its registered name, got {name_or_class!r}")
        return _type_name(name_or_class), name_or_class
    if not isinstance(name_or_class, str):
        raise ConfigError(f"describe expects an operator type or its registered name, got {name_or_class!r}")
    cls = registry.get(name_or_class)
    if cls is not None:
        return name_or_class, cls
    kinds = _kinds(registry)
    if name_or_class in kinds:
        return name_or_class, kinds[name_or_class]
    names = sorted(registry)
    raise ConfigError(
        f"unknown operator type {name_or_class!r}{suggestion(name_or_class, [*names, *kinds])}; "
        f"registered types: {', '.join(names)}"
    )


def describe(name_or_class: str | type[Operator], *, width: int = 118) -> str:
    """A readable description of an operator type: what it is, and its fields with type, default and meaning.

    `name_or_class` is a registered name (``"TrainingLoop"``), a base class's name (``"Loss"``: which types a field
    of that kind takes) or the class itself. An unknown name is a `ConfigError` with the closest names.
    """
    registry = _registry.registered()
    name, cls = _resolve(name_or_class, registry)
    lines = [f"{name}  ({cls.__module__}.{cls.__qualname__})"]
    text = summary(cls)
    if text:
        lines += ["", *textwrap.wrap(text, width)]
    if registry.get(name) is not cls:
        members = _members(cls, registry)
        lines += [
            "",
            *textwrap.wrap(
                f"Not registered as a type of its own: where a field takes a {name}, write one of: "
                + (", ".join(members) or "(none is registered)"),
                width,
            ),
        ]
    infos = fields_of(cls)
    if not infos:
        lines += ["", "No fields."]
        return "\n".join(lines)
    rows = [
        (i.name, type_text(i.hint), "required" if i.required else default_text(i.default), i.meaning) for i in infos
    ]
    header = ("field", "type", "default", "meaning")
    widths = [min(max(len(r[k]) for r in [header, *rows]), 36) for k in range(3)]
    starts = [sum(widths[:k]) + 2 * k for k in range(4)]
    lines.append("")
    for row in [header, *rows]:
        line = ""
        for cell, start in zip(row[:3], starts):
            if len(line) > start - 2 and line.strip():  # the cell before ran past its column: go on below
                lines.append(line.rstrip())
                line = ""
            line = line.ljust(start) + cell
        if len(line) > starts[3] - 2:
            lines.append(line.rstrip())
            line = ""
        wrapped = textwrap.wrap(row[3], max(width - starts[3], 30)) or [""]
        lines.append((line.ljust(starts[3]) + wrapped[0]).rstrip())
        lines += [" " * starts[3] + more for more in wrapped[1:]]
    kinds = []
    for info in infos:
        for base in _operator_classes(info.hint):
            members = _members(base, registry)
            entry = f"{_type_name(base)}: {', '.join(members) or '(none is registered)'}"
            if members != [_type_name(base)] and entry not in kinds:
                kinds.append(entry)
    if kinds:
        lines += ["", "Operator fields take one of these registered types:"]
        for entry in kinds:
            lines += textwrap.wrap(entry, width, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


# JSON Schema ----------------------------------------------------------------------------------------------------
def _json_default(value: Any) -> tuple[bool, Any]:
    """``(True, plain)`` when the default can be written as JSON, else ``(False, None)``."""
    try:
        plain = to_plain(value, strict=False)
        json.dumps(plain, allow_nan=False)
    except (ConfigError, TypeError, ValueError):
        return False, None
    return True, plain


class _SchemaBuilder:
    def __init__(self, registry: Mapping[str, type[Operator]]) -> None:
        self.registry = dict(sorted(registry.items()))
        self.defs: dict[str, Any] = {}
        self.kind_keys: dict[type, str] = {}

    def operator_ref(self, cls: type[Operator]) -> dict[str, Any]:
        members = _members(cls, self.registry)
        if not members:
            return {
                "type": "object",
                "required": ["type"],
                "description": f"a {cls.__name__} operator (no type of this kind is registered)",
            }
        if len(members) == 1 and self.registry[members[0]] is cls:
            return {"$ref": f"#/$defs/{members[0]}"}
        key = self.kind_keys.get(cls)
        if key is None:
            key = f"any.{cls.__name__}"
            if key in self.defs:
                key = f"any.{cls.__module__}.{cls.__qualname__}"
            self.kind_keys[cls] = key
            self.defs[key] = {
                "title": f"any {cls.__name__}",
                "description": f"a {cls.__name__}: one of {', '.join(members)}",
                "oneOf": [{"$ref": f"#/$defs/{m}"} for m in members],
            }
        return {"$ref": f"#/$defs/{key}"}

    def hint(self, hint: Any) -> dict[str, Any]:
        if hint is Any or isinstance(hint, (typing.TypeVar, str)):
            return {}
        if hint is None or hint is type(None):
            return {"type": "null"}
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Annotated:
            return self.hint(args[0])
        if origin is Literal:
            return {"enum": list(args)} if all(_json_default(a)[0] for a in args) else {}
        if origin in (Union, types.UnionType):
            arms = [self.hint(a) for a in args]
            if any(arm == {} for arm in arms):
                return {}
            if all(set(arm) == {"type"} and isinstance(arm["type"], str) for arm in arms):
                return {"type": list(dict.fromkeys(arm["type"] for arm in arms))}
            return {"anyOf": arms}
        if origin in (tuple, list, collections.abc.Sequence):
            out: dict[str, Any] = {"type": "array"}
            if not args:
                return out
            if (len(args) == 2 and args[1] is Ellipsis) or origin is not tuple:
                item = self.hint(args[0])
                if item:
                    out["items"] = item
                return out
            out["prefixItems"] = [self.hint(a) for a in args]
            out["minItems"] = len(args)
            out["items"] = False
            return out
        if origin in (dict, collections.abc.Mapping):
            out = {"type": "object"}
            if args and self.hint(args[1]):
                out["additionalProperties"] = self.hint(args[1])
            return out
        if hint is bool:
            return {"type": "boolean"}
        if hint is int:
            return {"type": "integer"}
        if hint is float:
            return {"type": "number"}
        if hint is str:
            return {"type": "string"}
        if isinstance(hint, type) and issubclass(hint, Operator):
            return self.operator_ref(hint)
        return {}  # a Python-only value (a callable, a class instance): no JSON form to check

    def operator(self, name: str, cls: type[Operator]) -> dict[str, Any]:
        text = summary(cls)
        properties: dict[str, Any] = {"type": {"const": name}}
        required = ["type"]
        for info in fields_of(cls):
            prop = dict(self.hint(info.hint))
            if info.meaning:
                prop["description"] = info.meaning
            if info.required:
                required.append(info.name)
            else:
                ok, plain = _json_default(info.default)
                if ok:
                    prop["default"] = plain
            properties[info.name] = prop
        out: dict[str, Any] = {"title": name}
        if text:
            out["description"] = text
        out.update(type="object", properties=properties, required=required, additionalProperties=False)
        return out

    def build(self) -> dict[str, Any]:
        for name, cls in self.registry.items():
            self.defs[name] = self.operator(name, cls)
        version = {
            "const": FORMAT_VERSION,
            "description": f"the pipekit file format version ({FORMAT_VERSION}); pipekit.dumps writes it",
        }
        documents = {}
        for name in self.registry:
            op = self.defs[name]
            documents[f"document.{name}"] = {**op, "properties": {"pipekit": version, **op["properties"]}}
        self.defs.update(documents)
        names = list(self.registry)
        return {
            "$schema": DIALECT,
            "title": "pipekit pipeline",
            "description": (
                "A pipekit pipeline file: one operator as a mapping. `type` names a registered operator, the other "
                "keys are its fields; only fields that differ from their defaults need to be written."
            ),
            "type": "object",
            "required": ["type"],
            "properties": {
                "pipekit": version,
                "type": {"enum": names, "description": "the registered operator type"},
            },
            "oneOf": [{"$ref": f"#/$defs/document.{n}"} for n in names],
            "$defs": self.defs,
        }


def schema(registry: Mapping[str, type[Operator]] | None = None) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of pipeline files, for editors to complete and check them.

    A document is one operator mapping (plus the optional ``pipekit: 1`` version key): ``type`` is one of the
    registered names, and each type's fields are typed from their hints (``int``, ``float | None``, ``Literal``
    as an enum, tuples as arrays, an operator-typed field as any registered operator of that class), with
    defaults, the required fields and no other keys. `registry` (``{name: class}``) defaults to every registered
    operator, after loading installed plugins.
    """
    return _SchemaBuilder(_registry.registered() if registry is None else registry).build()
