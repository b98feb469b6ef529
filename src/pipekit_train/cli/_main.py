"""The `pipekit-train` command line: run and validate pipelines, inspect runs, artifacts and checkpoints."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from pipekit_train._signals import command_finished, phase
from pipekit_train.cli import _common
from pipekit_train.cli._common import EXIT_OK, EXIT_USAGE, OneLineParser, UsageError, report_error
from pipekit_train.cli._imports import ENV_VAR as IMPORT_ENV_VAR
from pipekit_train.cli._imports import add_import_flag, import_modules, reimport_recorded, requested_imports

# Exit codes (`_common`): 0 done; 2 a mistake in what was asked (one line on stderr); 1 the command ran and failed
# (one line), or an internal error; 128 + signal number when SIGINT (130) or SIGTERM (143) stopped training
# gracefully after a committed checkpoint, or stopped the command before training (`_signals`); 141 when the reader
# of standard output went away. `--debug` (anywhere on the command line) or $PIPEKIT_DEBUG=1 prints the traceback.

_DESCRIPTION = """\
Train JAX models from YAML pipelines.

  pipekit-train run PIPELINE.yaml              train (a TrainingLoop or a Sequential of them)
  pipekit-train validate PIPELINE.yaml         check a pipeline file without training
  pipekit-train lr-find PIPELINE.yaml --stage 1   sweep one stage's learning rate and suggest one
  pipekit-train launch --num-processes 2 P.yaml   train with 2 processes on this host (jax.distributed)
  pipekit-train check-resume PIPELINE.yaml     kill and resume it N times: does it resume bitwise?
  pipekit-train sweep SWEEP.yaml [--status]    train over a grid or a search, resumably; the table of trials
  pipekit-train artifacts list                 what was trained, from which data and code
  pipekit-train artifacts lineage ID           where a model came from, and what came from it
  pipekit-train artifacts compare A B --loo    posteriors compared by PSIS-LOO (ArviZ), recorded as evaluations
  pipekit-train reproduce ID                   train the recorded pipeline again
  pipekit-train reproduce ID --restore-code    ... with the recorded code (commit + uncommitted patch)
  pipekit-train run P.yaml --fork RUN@STEP     a new run from another run's checkpoint (--set what changes)
  pipekit-train extend RUN_DIR --stage S --steps N   continue a finished stage N more steps (or draws)
  pipekit-train runs RUN_DIR                   runs and their checkpoints
  pipekit-train average RUN_DIR --last 5 -o D  average checkpoints into a new one
  pipekit-train history RUN_DIR --png F.png    train/validate curves and a table of the logged metrics
  pipekit-train export ID -o model.jaxexport   the trained model as a jax.export program, with its provenance
  pipekit-train evaluate ID --data test.yaml   a trained model's metrics on a dataset, recorded in the store
  pipekit-train predict ID --data x.npz -o P   a trained model's outputs for every record, into P (.npz)
  pipekit-train generate ID --prompt TEXT      text sampled from a trained language model (records nothing)
  pipekit-train describe TYPE                  an operator's fields, types, defaults and meaning
  pipekit-train schema -o pipekit.schema.json  a JSON Schema of pipeline files, for YAML editors

Your own models, datasets, losses, callbacks and backends: name the modules that define them with
--import MODULE (run, validate, reproduce; repeatable) or $PIPEKIT_IMPORT=mod1,mod2.
"""


def _load_pipeline(path: str, overrides: Sequence[str]) -> Any:
    import pipekit
    from pipekit import ConfigError

    try:
        op = pipekit.load(path)
    except ConfigError as e:
        if "unknown operator type" not in str(e):
            raise
        raise ConfigError(
            f"{e}; if a module of yours defines it, import it first with --import MODULE or ${IMPORT_ENV_VAR}"
        ) from None
    # Each value's type is checked as it is set; the fields together once, after every --set (so that
    # `--set model_op={type: KerasModel, ...} --set backend=keras` works in either order).
    return pipekit.apply_overrides(op, [pipekit.parse_override(text) for text in overrides])


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse a --store that is a folder and a --run-dir that is a file, before anything is loaded."""
    store = getattr(args, "store", None)
    if store and os.path.isdir(store):
        raise UsageError(
            f"--store {store}: is a directory; --store names the SQLite file, "
            f"e.g. --store {os.path.join(store, 'artifacts.sqlite')}"
        )
    run_dir = getattr(args, "run_dir", None)
    if run_dir and os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UsageError(f"--run-dir {run_dir}: is a file, not a directory")


def _preflight(check: Any, op: Any, path: str) -> Any:
    """`check(op)`; a `ConfigError` that names no place is prefixed with the pipeline file, which it is about."""
    from pipekit import ConfigError, ShapeError

    try:
        return check(op)
    except ConfigError as e:
        if e.where:
            raise
        raise ConfigError(e.bare_message, path) from e
    except ShapeError as e:
        raise ShapeError(f"{path}: {e}") from e


def _cmd_validate(args: argparse.Namespace) -> int:
    import_modules(requested_imports(args.imports))
    op = _load_pipeline(args.pipeline, args.set or [])
    from pipekit_train.stage.preflight import check_pipeline

    report = _preflight(check_pipeline, op, args.pipeline)
    print(f"{args.pipeline}: ok ({report})")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    import pipekit
    from pipekit_train.stage.driver import run_pipeline
    from pipekit_train.stage.record import TrainingInterrupted
    from pipekit_train.stage.settings import RunSettings

    if args.force_resume and args.resume != "auto":
        raise UsageError("--force-resume continues a run: use it with --resume auto")
    if args.resume == "auto" and not args.run_dir:
        raise UsageError(
            "--resume auto continues the run in --run-dir DIR: name that directory (without --run-dir every run "
            "starts in a new runs/<run id>)"
        )
    if args.fork and args.resume == "auto":
        raise UsageError("--fork starts a new run from another run's checkpoint; --resume auto continues one: use one")
    _check_paths(args)
    from pipekit_train.scale._distributed import initialize_distributed, is_primary

    # One of several processes ($PIPEKIT_NUM_PROCESSES, `launch`): connect before JAX computes anything.
    initialize_distributed()
    imports = import_modules(requested_imports(args.imports))
    op = _load_pipeline(args.pipeline, args.set or [])
    phase("loaded")
    if args.print_config:
        print(pipekit.dumps(op), end="")
        return EXIT_OK
    from pipekit_train.stage.preflight import existing_run, plan_pipeline

    if is_primary():  # a reused run directory is refused before pre-flight (which imports JAX)
        existing_run(args.run_dir, "auto" if args.resume == "auto" or _resumes(op) else "never")
    if args.resume == "auto" or _resumes(op):  # a device count that cannot continue a checkpoint, in its words
        from pipekit_train.stage.preflight import check_pipeline_topologies

        check_pipeline_topologies(op, args.run_dir)
    fork = None
    if args.fork:  # the checkpoint a fork starts from is found (or refused) before anything is compiled
        from pipekit_train.engine._fork import resolve_fork
        from pipekit_train.stage.preflight import training_stages

        first = training_stages(op)[:1]
        own = first[0].checkpoint_dir if first else None
        fork = resolve_fork(args.fork, (first[0].name or "stage0") if first else None, own)
    # Every stage is checked (and its fresh model built) before any trains; each stage's run takes its plan.
    plans = _preflight(plan_pipeline, op, args.pipeline)
    store: Any = False if args.no_store else args.store
    code = None
    if store is not False and is_primary():  # the code as it is now, before training (`provenance._code`)
        from pipekit_train.provenance._code import capture_code

        code = capture_code(args.pipeline, imports)
    run_dir = args.run_dir
    from pipekit_train._lock import run_dir_lock

    # One writer per run directory for the whole pipeline, not only while each stage trains.
    # Several processes: process 0 holds it (`run_stage` makes the others wait for process 0).
    held = run_dir and os.path.exists(run_dir) and is_primary()
    lock = run_dir_lock(run_dir) if held else contextlib.nullcontext()
    try:
        settings = RunSettings(
            run_dir=run_dir,
            store=store,
            resume=args.resume,
            force_resume=args.force_resume,
            pipeline=op,
            imports=imports,
            code=code,
            fork=fork,
        )
        with lock:
            result = run_pipeline(op, settings, plans)
    except TrainingInterrupted as stop:
        _print_summary(stop.artifact, store)
        where = os.path.dirname(stop.artifact.run_dir) if stop.artifact.run_dir else run_dir
        if is_primary():
            from pipekit_train.cli._launch import relaunch_command

            print(
                f"pipekit-train: stopped by {stop.reason} after a committed checkpoint; continue exactly with:\n"
                f"  pipekit-train {relaunch_command()}{args.pipeline} --run-dir {where} --resume auto",
                file=sys.stderr,
            )
        return 128 + stop.signum
    artifact = result[1] if isinstance(result, tuple) and len(result) == 2 else None
    _print_summary(artifact, store)
    return EXIT_OK


_PERCENT = ("accuracy", "top5_accuracy", "f1_macro", "precision_macro", "recall_macro")
_SHORT = {"validate": "val", "test": "test", "train": "train"}


def summary_columns(finals: Sequence[dict[str, Any]], per_context: int = 2) -> list[tuple[str, str, int]]:
    """``(label, metric, width)`` of the run summary's columns: the train loss, then the validation and test loss
    and up to `per_context` other metrics of each, those that some stage logged (a regression shows ``test mae``,
    a classifier ``val acc``; nothing shows a column no stage has).

    Example:
        >>> [label for label, _, _ in summary_columns([{"train/loss": 1.0, "test/loss": 2.0, "test/mae": 0.5}])]
        ['train loss', 'test loss', 'test mae']
        >>> [label for label, _, _ in summary_columns([{"train/loss": 46.1, "posterior/r_hat_max": 1.0}])]
        ['r_hat max']
    """
    present = [name for final in finals for name in final]
    # A sampler's stage reports its posterior (`posterior/*`), not a loss: its "train loss" is a potential energy.
    trained = [final for final in finals if not any(name.startswith("posterior/") for name in final)]
    out = [("train loss", "train/loss")] if trained or not finals else []
    for label, name in _POSTERIOR:
        if name in present:
            out.append((label, name))
    for context in ("validate", "test"):
        names = list(dict.fromkeys(n for n in present if n.startswith(f"{context}/") and n.count("/") == 1))
        if f"{context}/loss" in names:
            out.append((f"{_SHORT[context]} loss", f"{context}/loss"))
        others = [n for n in names if n != f"{context}/loss"][:per_context]
        for name in others:
            key = name.split("/", 1)[1]
            out.append((f"{_SHORT[context]} {'acc' if key == 'accuracy' else key}", name))
    return [(label, name, max(len(label), 8)) for label, name in out]


#: The run summary's columns of a sampler's stage.
_POSTERIOR = (
    ("r_hat max", "posterior/r_hat_max"),
    ("ess min", "posterior/ess_bulk_min"),
    ("divergent", "posterior/divergences"),
)


def _summary_value(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name.startswith("posterior/"):
        return f"{value:.3f}" if name.endswith("r_hat_max") else f"{value:.0f}"
    return f"{100 * value:.1f}%" if name.split("/", 1)[1] in _PERCENT else f"{value:.4f}"


def _resumes(op: Any) -> bool:
    """Whether the first training stage of `op` says ``resume: auto`` itself (it then continues its run)."""
    from pipekit_train.stage.preflight import training_stages

    stages = training_stages(op)
    return bool(stages) and stages[0].resume == "auto"


def _print_summary(artifact: Any, store: Any) -> None:
    from pipekit_train.scale._distributed import is_primary

    if artifact is None or not is_primary():  # several processes: process 0 speaks for the run
        return
    stage_dir = getattr(artifact, "run_dir", None)
    run_dir = os.path.dirname(stage_dir) if stage_dir else None
    artifacts = []
    if run_dir:
        from pipekit_train._jsonio import read_json

        for path in sorted(glob.glob(os.path.join(run_dir, "*", "artifact.json")), key=os.path.getmtime):
            artifacts.append(read_json(path, what="a stage's artifact"))
    if not artifacts:
        artifacts = [artifact.to_dict()]
    columns = summary_columns([a.get("final_metrics", {}) for a in artifacts])
    print("\nSummary")
    header = f"{'stage':<14} {'steps':>6}  " + "  ".join(f"{label:>{width}}" for label, _, width in columns)
    header += "  artifact"
    print(header)
    print("-" * len(header))
    for a in artifacts:
        m = a.get("final_metrics", {})
        steps = a.get("backend_info", {}).get("steps", "")
        cells = "  ".join(f"{_summary_value(name, m.get(name)):>{width}}" for _, name, width in columns)
        print(f"{a['stage']:<14} {steps!s:>6}  {cells}  {a['artifact_id'][:12]}")
    print(f"\nrun directory: {run_dir}")
    if store is not False:
        where = f" --store {shlex.quote(str(store))}" if store else ""  # the hint runs as printed, from here
        print(f"lineage:       pipekit-train artifacts lineage {artifacts[-1]['artifact_id'][:12]}{where}")


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from pipekit_train.provenance._store import ArtifactStore

    _check_paths(args)
    if args.restore_code:  # in a temporary worktree of the recorded code (`_restore.py`)
        from pipekit_train.cli._restore import reproduce_restored

        return reproduce_restored(args)
    with ArtifactStore(args.store) as store:
        imports = reimport_recorded(store, args.artifact, args.imports)
    from pipekit_train.cli._fork import reproduce_recorded
    from pipekit_train.provenance._code import capture_code

    # The stages again (a fork's parent first, `_fork.py`), recording the code they train with as `run` does.
    return reproduce_recorded(args, imports, capture_code(None, imports))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pipekit-train", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from pipekit_train import __version__

    parser.add_argument("--version", action="version", version=f"pipekit-train {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error as well as its one line (also $PIPEKIT_DEBUG=1; accepted anywhere)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="train a pipeline", description="Train the pipeline in a YAML file.")
    run.add_argument("pipeline", metavar="PIPELINE.yaml")
    run.add_argument(
        "--set", action="append", metavar="PATH=VALUE", help="override a field, e.g. stages.0.max_steps=50"
    )
    run.add_argument("--run-dir", metavar="DIR", help="where the run writes (default runs/<run id>)")
    run.add_argument("--resume", choices=["never", "auto"], default="never", help="continue the run in --run-dir")
    run.add_argument(
        "--force-resume",
        action="store_true",
        help="with --resume auto, continue a checkpoint written under another configuration (recorded)",
    )
    run.add_argument(
        "--fork",
        metavar="RUN_DIR@STEP",
        help="start a new run from that committed checkpoint of another run (weights, optimizer state, data "
        "position), under this configuration; RUN_DIR/STAGE@STEP when the run has several stages",
    )
    run.add_argument("--print-config", action="store_true", help="print the pipeline after --set and exit")
    run.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    run.add_argument("--no-store", action="store_true", help="do not record artifacts")
    add_import_flag(run)
    run.set_defaults(func=_cmd_run)

    val = sub.add_parser("validate", help="check a pipeline file without training")
    val.add_argument("pipeline", metavar="PIPELINE.yaml")
    val.add_argument("--set", action="append", metavar="PATH=VALUE")
    add_import_flag(val)
    val.set_defaults(func=_cmd_validate)

    rep = sub.add_parser("reproduce", help="rerun the pipeline that made an artifact (refused if its data changed)")
    rep.add_argument("artifact", metavar="ARTIFACT_ID", help="an artifact id or a unique prefix of one")
    rep.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    rep.add_argument("--run-dir", metavar="DIR", help="where the new run writes")
    rep.add_argument(
        "--restore-code",
        action="store_true",
        help="rebuild the recorded code (commit, uncommitted patch, imported modules) in a temporary git worktree "
        "and retrain there; exit 0 only when the weights are bitwise equal",
    )
    add_import_flag(rep)
    rep.set_defaults(func=_cmd_reproduce)

    from pipekit_train.cli._artifacts import add_artifact_commands
    from pipekit_train.cli._check_resume import add_check_resume_commands
    from pipekit_train.cli._checkpoints import add_checkpoint_commands
    from pipekit_train.cli._evaluate import add_evaluate_commands
    from pipekit_train.cli._export import add_export_commands
    from pipekit_train.cli._extend import add_extend_commands
    from pipekit_train.cli._generate import add_generate_commands
    from pipekit_train.cli._history import add_history_commands
    from pipekit_train.cli._launch import add_launch_commands
    from pipekit_train.cli._lr_find import add_lr_find_commands
    from pipekit_train.cli._schema import add_schema_commands
    from pipekit_train.cli._sweep import add_sweep_commands

    add_artifact_commands(sub)
    add_checkpoint_commands(sub)
    add_history_commands(sub)
    add_export_commands(sub)
    add_extend_commands(sub)
    add_evaluate_commands(sub)
    add_generate_commands(sub)
    add_schema_commands(sub)
    add_launch_commands(sub)
    add_lr_find_commands(sub)
    add_check_resume_commands(sub)
    add_sweep_commands(sub)
    return parser


def _drop_orbax_teardown_noise(unraisable: Any) -> None:
    """`sys.unraisablehook` that drops one known, harmless message and passes everything else on.

    When Orbax fails to restore a damaged checkpoint it closes its asyncio loop while sibling tensorstore reads
    are still in flight; their completion callbacks then raise ``RuntimeError('Event loop is closed')``, which
    Python would print as tracebacks around the CLI's one-line error.
    """
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return
    sys.__unraisablehook__(unraisable)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `pipekit-train`; returns the exit code.

    Every error is one line on standard error (``--debug`` shows its traceback too); see `_common.report_error`
    for the exit codes.
    """
    sys.unraisablehook = _drop_orbax_teardown_noise
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--debug` anywhere before a `--`: `pipekit-train run pipe.yaml --debug` is what people type.
    end = argv.index("--") if "--" in argv else len(argv)
    debug_before, _common.DEBUG = _common.DEBUG, "--debug" in argv[:end]
    try:  # for this call only: a caller's later commands in this process print one line again
        with _common.one_line_warnings():  # warnings are one line too, like errors
            code = _parse_and_run([a for i, a in enumerate(argv) if not (i < end and a == "--debug")])
    finally:
        _common.DEBUG = debug_before
    command_finished(code)  # the command's handlers stay until the process exits: a signal now says it had finished
    return code


def _parse_and_run(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (one line, already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    from pipekit_train._signals import stop_on_signals

    # SIGINT / SIGTERM outside training (loading, pre-flight, compiling): one line, 130 / 143, nothing half-begun.
    with stop_on_signals():
        try:
            return int(args.func(args))
        except Exception as e:
            return report_error("pipekit-train", e, collapse=False)  # a refused resume prints its diff below


if __name__ == "__main__":
    sys.exit(main())
