"""The editor-help commands: ``pipekit-train describe TYPE`` and ``pipekit-train schema [-o FILE]``.

``describe TYPE`` prints an operator type's summary and its fields (type, default, meaning); ``TYPE`` is a
registered name (``TrainingLoop``, ``MSE``) or a kind of operator (``Loss``, ``Callback``: the types a field of
that kind takes). ``schema`` prints a JSON Schema (draft 2020-12) of pipeline files covering every registered
operator, for YAML editors to complete and check ``pipeline.yaml`` files; ``-o FILE`` writes it to a file instead.

Both read the operator registry: the built-in types and those of installed plugins, plus the modules named by
``--import`` / ``$PIPEKIT_IMPORT``. Exit codes: 0 done; 2 a mistake (one line on standard error, with the closest
names for an unknown type) or bad usage; 1 a failure such as a full disk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._common import EXIT_OK, CommandError, guarded, run_commands
from ._imports import add_import_flag, import_modules, requested_imports

__all__ = ["add_schema_commands", "main"]


def _print(text: str) -> None:
    """Print to standard output; a reader that went away (``pipekit-train schema | head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        try:  # Python would report the pipe again when it flushes standard output at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass


def cmd_describe(args: argparse.Namespace) -> int:
    """``describe TYPE``: an operator type's summary and fields (type, default, meaning)."""
    import pipekit

    import_modules(requested_imports(args.imports))
    if args.markdown:
        _print(markdown_table(args.type))
        return EXIT_OK
    _print(pipekit.describe(args.type))
    return EXIT_OK


def markdown_table(name: str) -> str:
    """The Markdown field table of the operator type `name` (``| field | type | default | meaning |``), as
    docs/yaml.md holds it for `TrainingLoop`: types and defaults from the code, meanings from the docstring."""
    import pipekit
    from pipekit import ConfigError
    from pipekit._registry import registered
    from pipekit._schema import _resolve, field_table

    _, cls = _resolve(name, registered())
    if cls._pipekit_name is None or not issubclass(cls, pipekit.Operator):
        raise ConfigError(f"--markdown needs a registered operator type, got the kind {name!r}")
    return field_table(cls)


def cmd_schema(args: argparse.Namespace) -> int:
    """``schema [-o FILE]``: the JSON Schema of pipeline files, on standard output or into FILE."""
    import pipekit

    import_modules(requested_imports(args.imports))
    doc = pipekit.schema()
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    if args.output is None:
        _print(text)
        return EXIT_OK
    path = Path(args.output)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CommandError(f"-o {path}: cannot write the schema: {e.strerror or e}") from None
    count = sum(1 for key in doc["$defs"] if key.startswith("document."))
    _print(f"wrote the JSON Schema of {count} operator types to {path}")
    return EXIT_OK


def add_schema_commands(subparsers: Any) -> None:
    """Add ``describe TYPE`` and ``schema [-o FILE]`` to a CLI's subparsers; each sets ``func`` (the exit code)."""
    p = subparsers.add_parser(
        "describe",
        help="an operator type's fields: type, default, meaning",
        description=(
            "Describe an operator type: its summary and fields (type, default, meaning). TYPE is a registered name "
            "(TrainingLoop, MSE, Checkpoint) or a kind (Loss, Callback: the types a field of that kind takes)."
        ),
    )
    p.add_argument("type", metavar="TYPE", help="a registered operator type, e.g. TrainingLoop")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the fields as a Markdown table (field, type, default, meaning), as in docs/yaml.md",
    )
    add_import_flag(p)
    p.set_defaults(func=guarded("describe", cmd_describe))

    p = subparsers.add_parser(
        "schema",
        help="a JSON Schema of pipeline files, for YAML editors",
        description=(
            "Print a JSON Schema (draft 2020-12) of pipeline files: every registered operator type, its fields, "
            "their types and defaults. Point your editor's YAML support at it to complete and check pipeline files "
            "(for example '# yaml-language-server: $schema=pipekit.schema.json' on a file's first line)."
        ),
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the schema to FILE instead of standard output")
    add_import_flag(p)
    p.set_defaults(func=guarded("schema", cmd_schema))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pipekit-train describe …`` or ``pipekit-train schema …`` in-process; returns the exit code."""
    return run_commands(add_schema_commands, argv)
