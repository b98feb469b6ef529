"""``pipekit-train sweep FILE.yaml``: run a `Sweep` (resumably), print its table of trials, plot it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from ._common import EXIT_OK, UsageError
from ._imports import add_import_flag, import_modules, requested_imports


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..sweep import load_sweep, run_sweep, sweep_status
    from ..sweep._journal import default_run_dir
    from ..sweep._report import format_table

    if args.json and not args.status:
        raise UsageError("--json prints the table of --status: use it with --status")
    if args.run_dir and os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise UsageError(f"--run-dir {args.run_dir}: is a file, not a directory")
    import_modules(requested_imports(args.imports))
    sweep = load_sweep(args.sweep)
    run_dir = args.run_dir or default_run_dir(sweep)
    if args.status or args.plot:
        if not os.path.isdir(run_dir):
            raise UsageError(
                f"--run-dir {run_dir}: no sweep has run there yet; run it with pipekit-train sweep {args.sweep}"
            )
        result = sweep_status(sweep, run_dir)
        if args.plot:
            from ..sweep._plot import plot_sweep

            plot_sweep(result, sweep.metric, args.plot)
            print(f"wrote {args.plot}")
        if args.status:
            print(json.dumps(result.to_json(), indent=2) if args.json else format_table(result, sweep.metric))
        return EXIT_OK
    store: Any = False if args.no_store else args.store

    def said(entry: dict[str, Any]) -> None:
        objective = "-" if entry["objective"] is None else f"{entry['objective']:.6g}"
        print(f"trial {entry['number']}: {entry['state']} ({sweep.metric} = {objective})", flush=True)

    from .._signals import note_continuation
    from ..stage.record import TrainingInterrupted

    again = continue_command(args, run_dir)
    # A signal outside a trial's training (between two trials, a trial's start-up) names the sweep and this command,
    # not the run directory of a trial (`_signals`): the journal and the trials' directories continue from there.
    note_continuation(f"sweep {sweep.name}", again)
    try:
        result = run_sweep(sweep, run_dir, store=store, on_trial=said)
    except TrainingInterrupted as stop:  # after the trial's committed checkpoint: it resumes from there
        print(
            f"pipekit-train: sweep {sweep.name} stopped by {stop.reason} after a committed checkpoint; continue it "
            f"with:\n  {again}",
            file=sys.stderr,
        )
        return 128 + stop.signum
    print(format_table(result, sweep.metric))
    print(f"\nsweep directory: {run_dir}")
    return EXIT_OK


def continue_command(args: argparse.Namespace, run_dir: str) -> str:
    """The command that continues this sweep: ``pipekit-train sweep FILE --run-dir DIR`` and the flags that change
    what it records (``--store``, ``--no-store``, ``--import``), quoted for a shell."""
    words = ["pipekit-train", "sweep", args.sweep, "--run-dir", run_dir]
    if args.no_store:
        words.append("--no-store")
    elif args.store:
        words += ["--store", args.store]
    for name in args.imports or ():
        words += ["--import", name]
    return shlex.join(words)


def add_sweep_commands(sub: Any) -> None:
    """Add ``sweep`` to a CLI's subparsers."""
    p = sub.add_parser(
        "sweep",
        help="train a pipeline over a grid or a search (resumable); --status prints its trials",
        description="Run a Sweep file: every trial an ordinary run in RUN_DIR/trials/<key>. Running it again with "
        "the same command continues it: finished trials are skipped, a half-trained one resumes.",
    )
    p.add_argument("sweep", metavar="SWEEP.yaml")
    p.add_argument("--run-dir", metavar="DIR", help="the sweep's directory (default runs/sweeps/<name>)")
    p.add_argument("--status", action="store_true", help="print the table of trials and the best, run nothing")
    p.add_argument("--json", action="store_true", help="with --status: the table as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot the objective against each parameter and validation curves")
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.add_argument("--no-store", action="store_true", help="do not record artifacts")
    add_import_flag(p)
    p.set_defaults(func=cmd_sweep)
