"""``--import MODULE`` and ``$PIPEKIT_IMPORT``: the user's modules, imported before a pipeline file is read.

A pipeline file can only name registered types (``type: Huber``) and backends; the modules that define them
(``@register_model``, ``@register_dataset``, `Loss` and `Callback` subclasses, `register_backend` calls) must be
imported first. ``$PIPEKIT_IMPORT`` (comma-separated) comes first, then each ``--import`` in order; a name given
twice is imported once. A module is found like ``import MODULE`` finds it (``PYTHONPATH``, the installed packages)
and then in the working directory.

Each imported module is recorded, ``{"module": name, "file": path or None, "sha256": hex digest of the file or
None}``, in `RunSettings.imports` and from there in every artifact of the run.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from ._common import CommandError

__all__ = ["ENV_VAR", "add_import_flag", "import_modules", "reimport_recorded", "requested_imports"]

ENV_VAR = "PIPEKIT_IMPORT"


def requested_imports(flags: Sequence[str] | None) -> list[tuple[str, str]]:
    """``[(module, where it was asked for)]``: ``$PIPEKIT_IMPORT``'s names, then the ``--import`` flags."""
    out = [(name.strip(), f"${ENV_VAR}") for name in os.environ.get(ENV_VAR, "").split(",") if name.strip()]
    out += [(name.strip(), "--import") for name in flags or ()]
    return out


def _check_name(name: str, where: str) -> None:
    if name.endswith(".py") or "/" in name or "\\" in name:
        raise CommandError(
            f"{where} expects a module name such as my_models (found on PYTHONPATH or in the working directory), "
            f"not a file path; got {name!r}"
        )
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise CommandError(f"{where} expects a dotted module name (letters, digits, '_' and '.'), got {name!r}")


def _where_raised(exc: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost frame that raised `exc` outside the import machinery, or ``""``."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    machinery = {os.path.abspath(__file__), os.path.abspath(importlib.__file__ or "")}
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith("<frozen") and os.path.abspath(f.filename) not in machinery
    ]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def module_record(name: str, module: Any) -> dict[str, Any]:
    """``{"module", "file", "sha256"}`` of an imported module: its file (absolute) and the file's sha256 digest."""
    import hashlib

    file = getattr(module, "__file__", None)
    digest = None
    if file:
        file = os.path.abspath(file)
        try:
            with open(file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            digest = None
    return {"module": name, "file": file or None, "sha256": digest}


def import_modules(requests: Iterable[tuple[str, str]]) -> tuple[dict[str, Any], ...]:
    """Import each ``(module, where)`` of `requests` once, in order; return their records.

    A module that cannot be found or fails while importing is a `CommandError` naming `where`, the module and the
    reason (with the file and line that raised).
    """
    cwd = os.getcwd()
    records: dict[str, dict[str, Any]] = {}
    for name, where in requests:
        _check_name(name, where)
        if name in records:
            continue
        if "" not in sys.path and cwd not in sys.path:
            sys.path.append(cwd)  # after everything else: a module in the working directory never shadows one
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                raise CommandError(
                    f"{where} {name}: cannot import module {name!r}: no module named {e.name!r} on PYTHONPATH, "
                    f"among the installed packages or in the working directory {cwd}"
                ) from None
            raise CommandError(
                f"{where} {name}: importing module {name!r} failed: {type(e).__name__}: {_one_line(str(e))}"
                f"{_where_raised(e)}"
            ) from None
        except Exception as e:
            reason = e.msg if isinstance(e, SyntaxError) else str(e)  # str() of a SyntaxError repeats the place
            raise CommandError(
                f"{where} {name}: importing module {name!r} failed: {type(e).__name__}: {_one_line(reason)}"
                f"{_where_raised(e)}"
            ) from None
        records[name] = module_record(name, module)
    return tuple(records.values())


def reimport_recorded(
    store: Any, artifact_id: str, flags: Sequence[str] | None, *, say: TextIO | None = None
) -> tuple[dict[str, Any], ...]:
    """Import the modules recorded by the stages leading to `artifact_id` (then $PIPEKIT_IMPORT and --import).

    Says on `say` (default: standard output) which modules it imported, and warns on standard error when a
    module's file is not the one that was recorded.
    """
    chain = [store.get(artifact_id)]
    while chain[0].parent_ids:  # the stages `pipeline_of` rebuilds: first parents, oldest first
        chain.insert(0, store.get(chain[0].parent_ids[0]))
    recorded: dict[str, tuple[dict[str, Any], Any]] = {}
    for art in chain:
        for rec in art.imports:
            recorded.setdefault(rec["module"], (rec, art))
    requests = [(name, f"artifact {art.artifact_id[:12]} recorded import") for name, (_, art) in recorded.items()]
    imports = import_modules([*requests, *requested_imports(flags)])
    if recorded:
        print(
            f"re-imported the recorded module(s) {', '.join(recorded)} before rebuilding the pipeline",
            file=say or sys.stdout,
        )
    for now in imports:
        then = recorded.get(now["module"], (None, None))[0]
        if then is not None and then.get("sha256") != now["sha256"]:
            print(
                f"pipekit-train: warning: module {now['module']!r} is not the recorded one: {now['file']} has "
                f"sha256 {now['sha256']}, the artifact recorded {then.get('file')} with sha256 {then.get('sha256')}",
                file=sys.stderr,
            )
    return imports


def add_import_flag(parser: Any) -> None:
    """Add ``--import MODULE`` (repeatable, into ``args.imports``) to the argparse `parser`."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help=(
            "import MODULE before reading the pipeline, for the models, datasets, losses, callbacks and backends "
            f"it registers (repeatable; ${ENV_VAR}=mod1,mod2 imports more, first)"
        ),
    )
