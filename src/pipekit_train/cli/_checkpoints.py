"""The ``pipekit-train average`` and ``pipekit-train runs`` commands: average checkpoints, list checkpointed runs.

``average RUN_OR_CKPT_DIR (--last K | --best K | --steps 1,2,3) -o OUT`` writes the uniform mean of the chosen
checkpoints as an ordinary checkpoint in ``OUT`` (its meta records what was averaged); start a new stage from it
with ``init_from: OUT``. ``runs ROOT [--json]`` lists the checkpointed runs under ``ROOT`` from their manifests.

Each command returns an exit code: 0 on success, 1 on an error and 2 on bad arguments, each printed as one line on
standard error.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._common import EXIT_OK, CommandError, UsageError, guarded, run_commands

__all__ = ["add_checkpoint_commands", "main"]

_MANIFEST = "manifest.json"


# Argument helpers ------------------------------------------------------------------------------------------
def _positive(flag: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(f"{flag} must be a positive int, got {value!r}")
    return number


def parse_steps(text: str) -> list[int]:
    """``"100,200, 300"`` → ``[100, 200, 300]``: the steps named by ``--steps``."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p.isdigit() for p in parts):
        raise UsageError(f"--steps must be a comma-separated list of steps, e.g. --steps 100,200,300; got {text!r}")
    return [int(p) for p in parts]


def _is_checkpoint_dir(directory: Path, names: Sequence[str] | None = None) -> bool:
    """Whether `directory` holds checkpoints: a ``manifest.json``, or a committed step whose manifest was lost
    (a resume or restore rebuilds it, and so does `cmd_average`)."""
    from ..checkpoint._layout import _uncommitted_reason

    if names is None:
        names = os.listdir(directory) if directory.is_dir() else []
    return _MANIFEST in names or any(n.isdigit() and _uncommitted_reason(directory / n) is None for n in names)


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under `root` (`_is_checkpoint_dir`), never looking inside checkpoint steps."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if _is_checkpoint_dir(Path(dirpath), [*filenames, *dirnames]):
            found.append(Path(dirpath))
            dirnames[:] = [d for d in dirnames if not d.split(".", 1)[0].isdigit()]
    return found


def resolve_checkpoint_dir(path: str) -> Path:
    """The checkpoint directory `path` names: itself, ``<stage>/checkpoints``, or the only one under a run."""
    where = Path(path)
    if not where.is_dir():
        raise CommandError(f"{path}: no such directory")
    if _is_checkpoint_dir(where):
        return where
    if _is_checkpoint_dir(where / "checkpoints"):
        return where / "checkpoints"
    found = _checkpoint_dirs(where)
    if not found:
        raise CommandError(f"{path} holds no checkpoints (no committed step or {_MANIFEST} in it or below it)")
    if len(found) > 1:
        names = ", ".join(str(d) for d in found)
        raise CommandError(f"{path} holds {len(found)} checkpoint directories ({names}); name one of them")
    return found[0]


# Commands --------------------------------------------------------------------------------------------------
def cmd_average(args: argparse.Namespace) -> int:
    """Average the chosen checkpoints of a run into a new checkpoint directory."""
    from ..checkpoint._average import _pick, write_average
    from ..checkpoint._selectors import Average, Best, Last

    chosen = [flag for flag in ("last", "best", "steps") if getattr(args, flag) is not None]
    if len(chosen) != 1:
        raise UsageError("say what to average with exactly one of --last K, --best K or --steps S1,S2,...")
    if not args.out:
        raise UsageError("say where to write the average with -o OUT (a new or empty directory)")
    steps: Any
    if args.last is not None:
        steps = Average(selector=Last(n=_positive("--last", args.last)))
    elif args.best is not None:
        steps = Average(selector=Best(k=_positive("--best", args.best)))
    else:
        steps = parse_steps(args.steps)
    source = resolve_checkpoint_dir(args.source)
    if not (source / _MANIFEST).is_file():  # rebuilt from the committed steps and written, as a resume does
        from ..checkpoint._average import _selection
        from ..checkpoint._checkpointer import Checkpointer

        _, monitor, mode = _selection(source.absolute())  # the metric the steps were scored under
        Checkpointer(source, monitor=monitor, mode=mode, async_save=False).close()
    out = Path(args.out).absolute()
    picked, _ = _pick(source.absolute(), steps)  # resolved once, so what is printed is what is averaged
    from .._lock import enclosing_run_dir, run_dir_lock

    # Into a run directory: hold its lock (a run writing there, or another `average`, is refused, naming it).
    run_dir = enclosing_run_dir(out)
    with run_dir_lock(run_dir) if run_dir is not None else contextlib.nullcontext():
        step = write_average(source, out, picked)
    print(f"averaged {len(picked)} checkpoint(s) of {source} (steps {', '.join(map(str, picked))})")
    gaps = [b - a for a, b in itertools.pairwise(picked)]
    if gaps and max(gaps) > 4 * min(gaps):  # Last(n) over kept checkpoints can reach back past sparse Every/Best ones
        print(
            f"pipekit-train average: warning: the averaged checkpoints are unevenly spaced ({min(gaps)} to "
            f"{max(gaps)} steps apart): the average mixes weights from far-apart points of training; choose the "
            "steps with --steps to average only nearby ones",
            file=sys.stderr,
        )
    print(f"wrote {out} (step {step}); start a stage from it with  init_from: {out}")
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    """List the checkpointed runs under a directory, newest first."""
    from ..checkpoint._runs import format_runs_table, list_runs

    rows = list_runs(args.root)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_runs_table(rows))
    return EXIT_OK


def add_checkpoint_commands(subparsers: Any) -> None:
    """Add ``average`` and ``runs`` to a CLI's subparsers (``parser.add_subparsers()``).

    Each parser sets ``func``: call ``args.func(args)`` for the exit code.
    """
    p = subparsers.add_parser(
        "average",
        help="average checkpoints into a new one",
        description=(
            "Write the uniform mean of a run's checkpoints as an ordinary checkpoint in OUT (its meta records "
            "the averaged steps and their directory). Floating-point arrays are averaged; integer ones (step "
            "counters) come from the newest checkpoint. Start a new stage from it with `init_from: OUT`."
        ),
    )
    p.add_argument(
        "source",
        metavar="RUN_OR_CKPT_DIR",
        help="a checkpoint directory, a stage directory, or a run directory with one checkpointed stage",
    )
    p.add_argument("--last", metavar="K", help="the K latest checkpoints")
    p.add_argument("--best", metavar="K", help="the K best checkpoints by the monitored metric")
    p.add_argument("--steps", metavar="S1,S2,...", help="these steps, e.g. 100,200,300")
    p.add_argument("-o", "--out", metavar="OUT", help="where to write the average (a new or empty directory)")
    p.set_defaults(func=guarded("average", cmd_average))

    r = subparsers.add_parser(
        "runs",
        help="runs and their checkpoints",
        description=(
            "List the checkpointed runs under ROOT, newest first, read from the checkpoint manifests: run id, "
            "stage, number of checkpoints, latest step, best score, monitored metric, time of the last write."
        ),
    )
    r.add_argument("root", metavar="ROOT", help="a directory holding run directories (or one run directory)")
    r.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    r.set_defaults(func=guarded("runs", cmd_runs))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``average …`` or ``runs …`` (``python -m pipekit_train.cli._checkpoints``); returns the exit code."""
    return run_commands(add_checkpoint_commands, argv, "Average checkpoints and list runs.")


if __name__ == "__main__":
    sys.exit(main())
