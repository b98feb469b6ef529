"""The ``pipekit-train extend`` command: continue a finished stage for N more steps (`pipekit_train.stage.extend`).

``extend RUN_DIR --stage NAME --steps N [--new-segment] [--store PATH | --no-store] [--import MODULE]`` runs the
stage planned N steps longer as a new stage ``NAME-extend<k>`` of the run, from the stage's final checkpoint:
bitwise the longer stage (N more training or SVI steps, N more MCMC iterations), or refused in one line when the
learning-rate schedule would differ (``--new-segment`` continues it anyway as a new schedule segment, recorded).
Exit codes: 0 done, 2 a mistake in what was asked (one line on standard error), 1 a failure, 128 + signal after
a stop (continue it by running the same command again).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._common import EXIT_OK
from ._imports import add_import_flag, import_modules, requested_imports

__all__ = ["add_extend_commands"]


def cmd_extend(args: argparse.Namespace) -> int:
    """Extend the stage and print the run's summary."""
    from ..stage.extension import extend
    from ..stage.record import TrainingInterrupted
    from ._main import _print_summary

    imports = import_modules(requested_imports(args.imports))
    store: Any = False if args.no_store else args.store
    try:
        _, artifact = extend(
            args.run_dir, args.stage, args.steps, new_segment=args.new_segment, store=store, imports=imports
        )
    except TrainingInterrupted as stop:
        _print_summary(stop.artifact, store)
        print(
            f"pipekit-train: stopped by {stop.reason} after a committed checkpoint; continue exactly with:\n"
            f"  pipekit-train extend {args.run_dir} --stage {args.stage} --steps {args.steps}",
            file=sys.stderr,
        )
        return 128 + stop.signum
    _print_summary(artifact, store)
    return EXIT_OK


def add_extend_commands(sub: Any) -> None:
    """Add ``extend`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "extend",
        help="continue a finished stage for N more steps (or MCMC draws) as a new stage of the run",
        description=(
            "Continue the finished stage NAME of the run in RUN_DIR for N more steps from its final checkpoint, as "
            "the new stage NAME-extend<k>: bitwise the stage planned N steps longer (training and SVI steps, MCMC "
            "iterations), or refused when its learning-rate schedule would differ."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--stage", required=True, metavar="NAME", help="the finished stage to extend")
    p.add_argument("--steps", required=True, type=int, metavar="N", help="how many steps (or draws) to add")
    p.add_argument(
        "--new-segment",
        action="store_true",
        help="restart a schedule whose horizon is max_steps over the new steps (not exact; recorded)",
    )
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.add_argument("--no-store", action="store_true", help="do not record the artifact")
    add_import_flag(p)
    p.set_defaults(func=cmd_extend)
