"""YAML: `dumps` / `loads` / `dump` / `load` of operators, with a safe loader and located errors.

A document is one operator mapping plus a ``pipekit:`` format-version key::

    pipekit: 1
    type: Sequential
    stages:
      - type: Tap
        sink: print

The text is parsed with PyYAML's *safe* composer into nodes (never constructed by PyYAML), and this module
builds values from the nodes itself: only the plain YAML scalar tags are accepted, so ``!!python/...`` and every
other custom tag is refused before anything happens; ``type:`` must be a registered name; aliases are allowed
but the expanded document is bounded in size and depth, which defeats "billion laughs" documents.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import yaml

from . import _registry
from ._errors import ConfigError, suggestion
from ._operator import Operator, field_hints
from ._types import check_field

FORMAT_VERSION = 1
MAX_NODES = 100_000
MAX_DEPTH = 64
MAX_BYTES = 10 * 1024 * 1024

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_PLAIN_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
_scalar_constructor = yaml.SafeLoader("")
# YAML 1.1 (PyYAML) reads `1e-3` as a string because it wants a dot; people write learning rates that way.
_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$")


# Dumping ---------------------------------------------------------------------------------------------------
IN_MEMORY_KEY = "in_memory_data"


def to_plain(value: Any, path: str = "", strict: bool = True) -> Any:
    """Turn an operator (and everything inside it) into plain YAML-able data.

    With ``strict=False`` an operator holding in-memory data is described (type and array shapes under
    ``in_memory_data:``) instead of refused, and one standing for a Python object (`Operator.python_only`) is
    named: readable in a record, but not loadable.
    """
    if isinstance(value, Operator):
        cls = type(value)
        python = value.python_only()
        if python is not None:  # a Python object wrapped as an operator (a loss given as a function)
            name, instead = python
            if strict:
                raise ConfigError(
                    f"{path or cls.__name__}: {cls.__name__}({name}) wraps a Python object, which cannot be written "
                    f"to YAML; {instead}"
                )
            return {"type": f"{name} (Python object, not written to YAML)"}
        if not strict and cls._pipekit_name is None:
            return {"type": f"{cls.__module__}.{cls.__qualname__} (not registered)"}
        if not cls._yaml_serializable:
            if not strict:
                return {"type": _registry.name_of(cls), IN_MEMORY_KEY: _describe_in_memory(value)}
            raise ConfigError(
                f"{path or cls.__name__}: {cls.__name__} holds in-memory data and cannot be written to YAML; "
                "save the arrays to a file (for example .npz) and use a file source instead"
            )
        out: dict[str, Any] = {"type": _registry.name_of(cls)}
        for k, v in value.non_default_fields().items():
            out[k] = to_plain(v, f"{path}.{k}" if path else k, strict)
        return out
    if isinstance(value, (list, tuple)):
        return [to_plain(v, f"{path}[{i}]", strict) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): to_plain(v, f"{path}.{k}", strict) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return value.item()
    if not strict:  # a Python-only value (a training task): described by its type, the same text in every run
        cls = type(value)
        return {"type": f"{cls.__module__}.{cls.__qualname__} (Python object, not written to YAML)"}
    raise ConfigError(f"{path or 'value'}: {type(value).__name__} values cannot be written to YAML: {value!r}")


def _describe_in_memory(op: Operator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in op.non_default_fields().items():
        items = value.items() if isinstance(value, dict) else [(name, value)]
        for key, leaf in items:
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                out[str(key)] = f"{leaf.dtype}{list(leaf.shape)}"
    return out


def dumps(op: Operator, *, strict: bool = True) -> str:
    """The YAML text of `op`: its type and every field that differs from its default.

    With ``strict=False``, operators holding in-memory data are described rather than refused (the text then
    documents the pipeline but cannot be loaded back).
    """
    if not isinstance(op, Operator):
        raise ConfigError(f"pipekit.dumps expects an Operator, got {type(op).__name__}")
    doc = {"pipekit": FORMAT_VERSION, **to_plain(op, strict=strict)}
    return str(yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True))


def dump(op: Operator, path: str | os.PathLike[str]) -> None:
    """Write `dumps(op)` to `path` (atomically: a temporary file, then a rename)."""
    text = dumps(op)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# Loading ---------------------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, source: str) -> None:
        self.source = source
        self.count = 0

    def where(self, node: yaml.Node) -> str:
        mark = node.start_mark
        return f"{self.source}:{mark.line + 1}:{mark.column + 1}"

    def _tick(self, node: yaml.Node, depth: int) -> None:
        self.count += 1
        if self.count > MAX_NODES:
            raise ConfigError(
                f"document expands to more than {MAX_NODES} nodes (alias bomb?); refusing to load it",
                self.where(node),
            )
        if depth > MAX_DEPTH:
            raise ConfigError(f"document nests deeper than {MAX_DEPTH} levels; refusing to load it", self.where(node))

    def plain(self, node: yaml.Node, depth: int = 0) -> Any:
        """Build plain data (no operators) from a node."""
        self._tick(node, depth)
        if isinstance(node, yaml.ScalarNode):
            if node.tag not in _PLAIN_TAGS:
                raise ConfigError(
                    f"YAML tag {node.tag!r} is not allowed; only plain strings, numbers, booleans and null are",
                    self.where(node),
                )
            if node.tag == "tag:yaml.org,2002:str" and not node.style and _FLOAT_WITHOUT_DOT.match(node.value):
                return float(node.value)
            return _scalar_constructor.construct_object(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != "tag:yaml.org,2002:seq":
                raise ConfigError(f"YAML tag {node.tag!r} is not allowed on a list", self.where(node))
            return [self.value(child, depth + 1) for child in node.value]
        if isinstance(node, yaml.MappingNode):
            if node.tag != "tag:yaml.org,2002:map":
                raise ConfigError(f"YAML tag {node.tag!r} is not allowed on a mapping", self.where(node))
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise ConfigError("YAML merge keys (<<) are not supported", self.where(key_node))
                key = self.plain(key_node, depth + 1)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    raise ConfigError(f"mapping keys must be plain scalars, got {key!r}", self.where(key_node))
                if key in out:
                    raise ConfigError(f"duplicate key {key!r}", self.where(key_node))
                out[key] = self.value(value_node, depth + 1)
            return out
        raise ConfigError(f"unsupported YAML node {node!r}", self.where(node))

    def value(self, node: yaml.Node, depth: int) -> Any:
        """A mapping with a ``type:`` key is an operator; anything else is plain data."""
        if isinstance(node, yaml.MappingNode) and any(
            isinstance(k, yaml.ScalarNode) and k.value == "type" for k, _ in node.value
        ):
            return self.operator(node, depth)
        return self.plain(node, depth)

    def operator(self, node: yaml.MappingNode, depth: int, allow_version: bool = False) -> Operator:
        self._tick(node, depth)
        if node.tag != "tag:yaml.org,2002:map":
            raise ConfigError(f"YAML tag {node.tag!r} is not allowed on an operator", self.where(node))
        entries: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = self.plain(key_node, depth + 1)
            if not isinstance(key, str):
                raise ConfigError(f"operator field names must be strings, got {key!r}", self.where(key_node))
            if key in entries:
                raise ConfigError(f"duplicate key {key!r}", self.where(key_node))
            entries[key] = (key_node, value_node)
        if allow_version and "pipekit" in entries:
            version_node = entries.pop("pipekit")[1]
            version = self.plain(version_node, depth + 1)
            if version != FORMAT_VERSION:
                raise ConfigError(
                    f"unsupported pipekit format version {version!r}; this pipekit reads version {FORMAT_VERSION}",
                    self.where(version_node),
                )
        if "type" not in entries:
            raise ConfigError("an operator mapping needs a 'type:' key naming a registered operator", self.where(node))
        type_node = entries.pop("type")[1]
        type_name = self.plain(type_node, depth + 1)
        try:
            cls = _registry.lookup(type_name)
        except ConfigError as e:
            raise ConfigError(e.bare_message, self.where(type_node)) from None
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        hints = field_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, (key_node, value_node) in entries.items():
            if key not in fields:
                raise ConfigError(
                    f"{type_name} has no field {key!r}{suggestion(key, fields)}; allowed fields: {', '.join(fields)}",
                    self.where(key_node),
                )
            raw = self.value(value_node, depth + 1)
            kwargs[key] = check_field(type_name, key, raw, hints.get(key, Any), self.where(value_node))
        missing = [
            n
            for n, f in fields.items()
            if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{type_name} is missing required field(s): {', '.join(missing)}", self.where(node))
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if e.where:
                raise
            at = _named_field(e.bare_message, type_name, entries)
            raise ConfigError(e.bare_message, self.where(node if at is None else at)) from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{type_name}: {e}", self.where(node)) from None


def _named_field(message: str, type_name: str, entries: dict[str, tuple[yaml.Node, yaml.Node]]) -> yaml.Node | None:
    """The value node of the field an operator's check names first (``TrainingLoop.batch_size must ...``,
    ``unknown optimizer_config key ...``), so its error points at that line; ``None`` when it names none."""
    first: tuple[int, yaml.Node] | None = None
    for key, (_, value_node) in entries.items():
        m = re.search(rf"(?<![\w]){re.escape(key)}(?!\w)", message)
        if m and (first is None or m.start() < first[0]):
            first = (m.start(), value_node)
    return None if first is None else first[1]


def _compose(text: str, source: str) -> yaml.Node | None:
    """The node tree of `text` (nothing constructed), or a `ConfigError` naming `source`; refuses oversized text."""
    if len(text) > MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ConfigError(f"document is larger than {MAX_BYTES} bytes; refusing to load it", source)
    try:
        node: yaml.Node | None = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError(f"YAML syntax error: {e.problem or e}", where) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"YAML error: {' '.join(str(e).split())}", source) from None
    return node


def loads(text: str, source: str = "<string>") -> Operator:
    """Build the operator a YAML document describes. `source` names the text in error messages."""
    node = _compose(text, source)
    if node is None:
        raise ConfigError("the document is empty; expected an operator mapping with a 'type:' key", source)
    builder = _Builder(source)
    if not isinstance(node, yaml.MappingNode):
        builder.plain(node)  # refuses a custom tag first, so the error says what was wrong
        raise ConfigError("the document must be a mapping with a 'type:' key", builder.where(node))
    return builder.operator(node, 0, allow_version=True)


def load_value(text: str, source: str = "<value>") -> Any:
    """Build one field's value from YAML text, exactly as the same text inside a pipeline file would be built.

    The command line's ``--set PATH=VALUE`` reads `VALUE` with it: the same safe composer, tag rules (no
    ``!!set``, ``!!binary``, merge keys or custom tags) and limits (size, node count after aliases, depth) as
    `loads`, and a mapping with a ``type:`` key is an operator (``{type: MSE}``). An empty text is ``None``.
    """
    node = _compose(text, source)
    if node is None:
        return None
    return _Builder(source).value(node, 0)


def load(path: str | os.PathLike[str]) -> Operator:
    """Read and build the operator in the YAML file at `path`; errors name the file, line and column.

    The size limit is checked before the file is read whole: from its size, then by reading at most one byte
    more than the limit (for files that report no size, such as those under ``/proc``).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                raise ConfigError(f"file is {size} bytes, larger than {MAX_BYTES}; refusing to load it", str(path))
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"pipeline file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a pipeline file") from None
    except OSError as e:
        raise ConfigError(f"cannot read the pipeline file {path}: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"file is larger than {MAX_BYTES} bytes; refusing to load it", str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start} is {data[e.start : e.start + 1]!r})", str(path)) from None
    return loads(text, source=str(path))
