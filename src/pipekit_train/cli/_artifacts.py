"""The ``pipekit-train artifacts`` commands: list, show, lineage, query, diff, import and verify the recorded
training artifacts.

Every command takes ``--store PATH`` (default ``$PIPEKIT_ARTIFACT_STORE``, else ``./runs/artifacts.sqlite``) and
``--json`` (machine-readable output instead of tables). Each returns an exit code: 0 on success, 1 on an error
(printed as one line on standard error), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._artifacts_text import _diff, _lineage, _listing, _show
from ._common import EXIT_ERROR, EXIT_OK, CommandError, CommandFailed, UsageError, guarded, run_commands

if TYPE_CHECKING:  # imported when a command runs, so that `pipekit-train --help` stays cheap
    from ..provenance._artifact import TrainingArtifact
    from ..provenance._store import ArtifactStore

__all__ = ["add_artifact_commands", "main"]

_METRIC = re.compile(r"^\s*([^<>=!]+?)\s*(>=|<=|==|!=|>|<|=)\s*(\S+)\s*$")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


# Parsing helpers -------------------------------------------------------------------------------------------
def parse_metric_filter(text: str) -> tuple[str, str, float]:
    """``"validate/accuracy>=0.9"`` → ``("validate/accuracy", ">=", 0.9)``."""
    match = _METRIC.match(text)
    if match is not None:
        try:
            return match.group(1), match.group(2), float(match.group(3))
        except ValueError:
            pass
    raise CommandError(
        f"--metric must look like NAME OP NUMBER with OP one of < <= > >= == !=, e.g. 'validate/accuracy>=0.9'; "
        f"got {text!r}"
    )


def parse_time(text: str, flag: str) -> str:
    """An ISO-8601 time (``2026-05-01``, ``2026-05-01T12:00Z``) or an age (``30m``, ``12h``, ``7d``, ``2w``)."""
    match = _RELATIVE.match(text.strip())
    if match is not None:
        delta = _dt.timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
        return (_dt.datetime.now(_dt.UTC) - delta).isoformat()
    try:
        _dt.datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(
            f"{flag} must be an ISO-8601 time (2026-05-01, 2026-05-01T12:00:00Z) or an age (30m, 12h, 7d, 2w); "
            f"got {text!r}"
        ) from None
    return text


# Commands --------------------------------------------------------------------------------------------------
def _store(args: argparse.Namespace) -> ArtifactStore:
    from ..provenance._store import ArtifactStore

    store = ArtifactStore(args.store)
    if not store.path.exists():
        raise CommandError(
            f"no artifact store at {store.path}; pass --store PATH or set $PIPEKIT_ARTIFACT_STORE "
            "(runs record to ./runs/artifacts.sqlite by default)"
        )
    if store.path.is_file() and store.path.stat().st_size == 0:  # SQLite would take it for a new, empty store
        raise CommandFailed(
            f"{store.path}: the artifact store is empty (0 bytes: truncated?); restore it from its backup, or record "
            f"the runs again with 'pipekit-train artifacts import RUN_DIR --store {store.path}'"
        )
    return store


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def _matches(args: argparse.Namespace, artifacts: list[TrainingArtifact]) -> None:
    if args.json:
        _emit(args, [a.to_dict() for a in artifacts], "")
    elif artifacts:
        print(_listing(artifacts))
    else:
        print("no artifacts match")


def cmd_list(args: argparse.Namespace) -> int:
    """``artifacts list``: the newest artifacts."""
    _matches(args, _store(args).query(limit=args.limit))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    """``artifacts show ID``: one artifact in full."""
    artifact = _store(args).get(args.id)
    _emit(args, artifact.to_dict(), _show(artifact))
    return EXIT_OK


def cmd_lineage(args: argparse.Namespace) -> int:
    """``artifacts lineage ID``: what an artifact descends from and what descends from it."""
    store = _store(args)
    root = store.get(args.id)
    lineage = store.lineage(root.artifact_id)
    if not args.json:  # the text names each artifact in a line: no need for every record as data
        print(_lineage(root, lineage))
        return EXIT_OK
    data = {
        "artifact": root.artifact_id,
        "ancestors": [a.to_dict() for a in lineage["ancestors"]],
        "descendants": [a.to_dict() for a in lineage["descendants"]],
        "missing": lineage["missing"],
    }
    _emit(args, data, "")
    return EXIT_OK


def cmd_query(args: argparse.Namespace) -> int:
    """``artifacts query``: the artifacts matching every filter given."""
    metrics = [parse_metric_filter(m) for m in args.metric or []]
    found = _store(args).query(
        dataset_hash=args.dataset_hash,
        pipeline_hash=args.pipeline_hash,
        model_hash=args.model_hash,
        backend=args.backend,
        stage=args.stage,
        run_id=args.run_id,
        status=args.status,
        since=parse_time(args.since, "--since") if args.since else None,
        until=parse_time(args.until, "--until") if args.until else None,
        metrics=metrics,
        imported=args.imported,
        sweep=args.sweep,
        limit=args.limit,
    )
    _matches(args, found)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    """``artifacts diff A B``: what differs between two artifacts."""
    d = _store(args).diff(args.a, args.b)
    _emit(args, d, "" if args.json else _diff(d))
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    """``artifacts import RUN_DIR...``: record the artifacts a run wrote (``<stage>/artifact.json``) in the store.

    For a run whose store could not be written: the stage folders keep their own record, and this adds it.
    Recording an artifact the store already holds changes nothing.
    """
    from .._jsonio import DamagedFileError, read_json
    from ..provenance._artifact import TrainingArtifact
    from ..provenance._store import ArtifactIntegrityError, ArtifactStore, UnknownArtifactError

    store = ArtifactStore(args.store)
    found = 0
    for run_dir in args.run_dirs:
        root = Path(run_dir)
        if not root.is_dir():
            raise CommandError(f"artifacts import: {run_dir} is not a directory (give a run directory)")
        paths = sorted(root.glob("*/artifact.json"))
        if not paths:
            raise CommandError(f"artifacts import: {run_dir} holds no <stage>/artifact.json (is it a run directory?)")
        for path in paths:
            data = read_json(path, what="a stage's artifact", required=("artifact_id",))
            try:
                artifact = TrainingArtifact.from_dict(data)
            except (TypeError, ValueError) as e:
                raise DamagedFileError(f"{path}: the stage's artifact is damaged ({e})", path=path) from None
            action = "recorded"
            try:
                store.get(artifact.artifact_id)
            except UnknownArtifactError:
                pass
            except ArtifactIntegrityError:
                action = "repaired"  # the stored record was damaged: the run's own record replaces it
            store.record(artifact, repair=True)
            found += 1
            print(f"{action} {artifact.artifact_id}  {artifact.stage}  ({path})")
    print(f"{found} artifact(s) in {store.path}")
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    """``artifacts compare A B [C...] --loo``: the models compared by PSIS-LOO (their backend computes it: a sampler
    posterior's pointwise log-likelihood), printed and recorded in the store as one evaluation per model."""
    from ..inference._compare import compare
    from ._imports import import_modules, requested_imports

    if not args.loo:
        raise UsageError("artifacts compare: name the criterion: --loo (leave-one-out cross-validation)")
    import_modules(requested_imports(args.imports))
    result = compare(args.ids, "loo", store=_store(args), record=not args.no_record)
    if args.json:
        _emit(args, {k: result[k] for k in ("rows", "warnings", "evaluations")}, "")
        return EXIT_OK
    print(result["text"])
    for line in result["warnings"]:
        print(f"warning: {line}")
    if result["evaluations"]:
        print(f"recorded {len(result['evaluations'])} evaluation(s) of kind 'comparison' in {_store(args).path}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """``artifacts verify ID | --all``: check records, lineage links, model-registry entries and the SQLite file.

    Prints one line per problem (``ID  what is wrong``) and a summary; exit code 1 when anything is wrong.
    """
    if (args.id is None) == (not args.all):
        raise UsageError("artifacts verify: give an artifact ID or --all (not both)")
    if not args.no_models:  # the model types of your own modules ($PIPEKIT_IMPORT, --import), as `run` does
        from ._imports import import_modules, requested_imports

        import_modules(requested_imports(args.imports))
    report = _store(args).verify(None if args.all else args.id, models=not args.no_models)
    problems, warnings = report["problems"], report["warnings"]
    if args.json:
        _emit(
            args,
            {
                "store": report["store"],
                "checked": report["checked"],
                "evaluations": report.get("evaluations", 0),
                "ok": not problems,
                "problems": [{"artifact_id": a, "problem": t} for a, t in problems],
                "warnings": [{"artifact_id": a, "warning": t} for a, t in warnings],
            },
            "",
        )
    else:
        for aid, text in problems:
            print(f"{aid or 'store'}  {text}")
        for aid, text in warnings:
            print(f"{aid or 'store'}  warning: {text}")
        verdict = f"{len(problems)} problem(s)" if problems else "ok"
        extra = f", {len(warnings)} warning(s)" if warnings else ""
        evaluations = f" and {report['evaluations']} evaluation(s)" if report.get("evaluations") else ""
        print(f"verified {report['checked']} artifact(s){evaluations} in {report['store']}: {verdict}{extra}")
        if problems:
            print(
                "to recover: restore the store from its backup, or record a damaged run again from its own "
                "artifact.json with 'pipekit-train artifacts import RUN_DIR'"
            )
    return EXIT_ERROR if problems else EXIT_OK


def add_artifact_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``artifacts`` commands (list, show, lineage, query, diff, import, verify) to a CLI's subparsers.

    Each leaf parser sets ``func``: call ``args.func(args)`` for the exit code.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE, else runs/artifacts.sqlite)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "artifacts",
        help="list, show, trace and compare recorded training artifacts",
        description="Inspect the training artifacts recorded in the artifact store.",
    )
    sub = parser.add_subparsers(dest="artifacts_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("list", parents=[common], help="the newest artifacts")
    p.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    p.set_defaults(func=guarded("artifacts", cmd_list))

    p = sub.add_parser("show", parents=[common], help="one artifact in full")
    p.add_argument("id", metavar="ID", help="artifact id or a unique prefix of it")
    p.set_defaults(func=guarded("artifacts", cmd_show))

    p = sub.add_parser("lineage", parents=[common], help="ancestors and descendants of an artifact")
    p.add_argument("id", metavar="ID", help="artifact id or a unique prefix of it")
    p.set_defaults(func=guarded("artifacts", cmd_lineage))

    p = sub.add_parser("query", parents=[common], help="artifacts matching filters (all must hold)")
    p.add_argument("--dataset-hash", metavar="H", help="dataset hash or a prefix of it")
    p.add_argument("--pipeline-hash", metavar="H", help="pipeline YAML hash or a prefix of it")
    p.add_argument("--model-hash", metavar="H", help="trained weights hash (sha256:<hex>) or a prefix of it")
    p.add_argument("--backend", metavar="B")
    p.add_argument("--stage", metavar="S")
    p.add_argument("--run-id", metavar="R")
    p.add_argument("--status", metavar="S", help="completed, failed or stopped")
    p.add_argument("--since", metavar="T", help="started at or after T (ISO-8601, or an age: 30m, 12h, 7d)")
    p.add_argument("--until", metavar="T", help="started at or before T")
    p.add_argument(
        "--metric", action="append", metavar="EXPR", help="final-metric filter, e.g. 'validate/accuracy>=0.9'"
    )
    p.add_argument("--imported", metavar="MODULE", help="runs that imported MODULE (--import, $PIPEKIT_IMPORT)")
    p.add_argument("--sweep", metavar="NAME", help="the trials of sweep NAME (pipekit-train sweep)")
    p.add_argument("--limit", type=int, default=None, help="at most this many (newest first)")
    p.set_defaults(func=guarded("artifacts", cmd_query))

    p = sub.add_parser("diff", parents=[common], help="what differs between two artifacts")
    p.add_argument("a", metavar="A", help="artifact id or prefix")
    p.add_argument("b", metavar="B", help="artifact id or prefix")
    p.set_defaults(func=guarded("artifacts", cmd_diff))

    p = sub.add_parser("import", parents=[common], help="record the artifacts a run directory holds")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (their <stage>/artifact.json)")
    p.set_defaults(func=guarded("artifacts", cmd_import))

    p = sub.add_parser("compare", parents=[common], help="models compared by PSIS-LOO (--loo), recorded")
    p.add_argument("ids", nargs="+", metavar="ID", help="two or more artifact ids or unique prefixes")
    p.add_argument("--loo", action="store_true", help="by leave-one-out cross-validation (ArviZ's az.compare)")
    p.add_argument("--no-record", action="store_true", help="print only; record no evaluation in the store")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first, for the model types it registers (repeatable)",
    )
    p.set_defaults(func=guarded("artifacts", cmd_compare))

    p = sub.add_parser(
        "verify", parents=[common], help="check records, lineage links, model-registry entries and the SQLite file"
    )
    p.add_argument("id", nargs="?", metavar="ID", help="artifact id or a unique prefix of it")
    p.add_argument("--all", action="store_true", help="every artifact, and the whole SQLite file")
    p.add_argument("--no-models", action="store_true", help="do not load the model-registry entries")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first, for the model types it registers (repeatable)",
    )
    p.set_defaults(func=guarded("artifacts", cmd_verify))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pipekit-train artifacts …`` in-process: `argv` starts with ``"artifacts"``. Returns the exit code."""
    return run_commands(add_artifact_commands, argv)
