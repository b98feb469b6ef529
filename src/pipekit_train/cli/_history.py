"""The ``pipekit-train history`` command: what runs logged, as a table, as JSON, or as curves in an image.

``history RUN_DIR... [--metric NAME]... [--png FILE] [--json]`` reads each run's ``<stage>/metrics.jsonl`` and
prints, per run, stage and metric, the last value and the best one (with their steps). ``--png FILE`` also draws
the train and validate curves of every run on one figure (needs the ``plot`` extra: matplotlib). Nothing here
imports JAX. Exit codes: 0 done, 2 a mistake in what was asked (one line on standard error), 1 a failure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ._common import EXIT_OK, guarded, run_commands

__all__ = ["add_history_commands", "main"]


def _metric_names(flags: Sequence[str] | None) -> list[str] | None:
    """``--metric a --metric b,c`` → ``["a", "b", "c"]``; ``None`` when no ``--metric`` was given."""
    if not flags:
        return None
    return [name.strip() for flag in flags for name in flag.split(",") if name.strip()]


def cmd_history(args: argparse.Namespace) -> int:
    """Print the runs' metrics as a table (or JSON), and draw their curves with --png."""
    from ..tracking._history import format_table, history, plot_history

    metrics = _metric_names(args.metric)
    hist = history(args.run_dirs, metrics)
    if args.json:
        print(json.dumps(hist, indent=2))
    else:
        print(format_table(hist))
    if args.png:
        written = plot_history(hist, args.png, metrics)
        print(f"wrote {written}")
    return EXIT_OK


def add_history_commands(sub: Any) -> None:
    """Add ``history`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "history",
        help="a table (and a plot) of the metrics runs logged",
        description=(
            "Print, per run, stage and metric, the last and the best value the runs' metrics.jsonl hold; with "
            "--png, draw the train (solid) and validate (dashed) curves of all the runs on one figure."
        ),
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory (or one stage's folder)")
    p.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help="only this metric: 'loss' (every context) or 'validate/accuracy' (repeatable, or comma-separated)",
    )
    p.add_argument("--png", metavar="FILE", help="also draw the curves into FILE (needs pipekit-train[plot])")
    p.add_argument("--json", action="store_true", help="print the history as JSON instead of the table")
    p.set_defaults(func=guarded("history", cmd_history))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``history`` with `argv` (the `pipekit-train` command line holds it too)."""
    return run_commands(add_history_commands, argv, description="The metrics runs logged.")
