"""The ``pipekit-train lr-find`` command: an exponential learning-rate sweep over a copy of one training stage.

``lr-find PIPELINE.yaml [--stage N|NAME] [--min-lr 1e-6] [--max-lr 1] [--steps 100] [--plot FILE] [--from-run DIR]``
prints a table of the sweep and the suggested learning rate (`pipekit_train.sweep._lr_find`), and with ``--plot`` draws
the curve (needs the ``plot`` extra). It records nothing: no run directory, no checkpoint, no artifact. Exit codes:
0 done, 2 a mistake in what was asked (one line on standard error), 1 a failure.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ._common import EXIT_OK, guarded, run_commands

__all__ = ["add_lr_find_commands", "main"]


def cmd_lr_find(args: argparse.Namespace) -> int:
    """Sweep the learning rate of one stage and print the table and the suggestion."""
    from ..sweep._lr_find import lr_find
    from ._imports import import_modules, requested_imports
    from ._main import _load_pipeline, _preflight

    import_modules(requested_imports(args.imports))
    op = _load_pipeline(args.pipeline, args.set or [])
    from ..stage.preflight import check_pipeline

    _preflight(check_pipeline, op, args.pipeline)
    result = lr_find(op, args.stage, min_lr=args.min_lr, max_lr=args.max_lr, steps=args.steps, from_run=args.from_run)
    print(f"lr-find: stage {result.stage!r}, {len(result.lrs)} steps from {result.lrs[0]:.3g} to {result.lrs[-1]:.3g}")
    for note in result.notes:
        print(f"  note: {note}")
    print(result.table())
    print(f"stopped: {result.stop_reason}")
    how = (
        "where the smoothed loss falls fastest"
        if result.method == "steepest"
        else "a tenth of the rate at the lowest smoothed loss (no clear descent)"
    )
    print(f"suggested learning rate: {result.suggestion:.3g} ({result.method}: {how})")
    if args.plot:
        print(f"wrote {result.plot(args.plot)}")
    return EXIT_OK


def add_lr_find_commands(sub: Any) -> None:
    """Add ``lr-find`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "lr-find",
        help="sweep the learning rate of one stage and suggest one (records nothing)",
        description=(
            "Run an exponential learning-rate sweep on a copy of one training stage (its compiled step, model, "
            "loss and data), print the loss per rate and the suggested learning rate. Nothing is recorded."
        ),
    )
    p.add_argument("pipeline", metavar="PIPELINE.yaml")
    p.add_argument("--stage", metavar="N|NAME", help="the training stage: its position (0 first) or name; default 0")
    p.add_argument("--min-lr", type=float, default=1e-6, help="the first learning rate (default 1e-6)")
    p.add_argument("--max-lr", type=float, default=1.0, help="the last learning rate (default 1)")
    p.add_argument("--steps", type=int, default=100, help="steps of the sweep (default 100)")
    p.add_argument("--plot", metavar="FILE", help="also draw the curve into FILE, a PNG (needs pipekit-train[plot])")
    p.add_argument(
        "--from-run",
        metavar="DIR",
        help="a later stage starts from the earlier stages finished in this run directory (read only); "
        "without it they are trained first in a temporary directory",
    )
    p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override a field, as for run")
    from ._imports import add_import_flag

    add_import_flag(p)
    p.set_defaults(func=guarded("lr-find", cmd_lr_find))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lr-find`` with `argv` (the `pipekit-train` command line holds it too)."""
    return run_commands(add_lr_find_commands, argv, description="A learning-rate sweep.")
