"""What the `pipekit-train` subcommand modules share: exit codes, one-line errors, the handler wrapper."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: 0 done; 1 an error (one line on stderr); 2 bad command-line usage. `_main.py` adds 128 + signal number for a
#: graceful stop on SIGINT (130) or SIGTERM (143).
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A command cannot do what was asked; the message is printed as one line and the exit code is 1."""


class UsageError(CommandError):
    """The arguments do not make sense together; printed as one line, exit code 2."""


def guarded(name: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`fn` as a command handler: known errors become ``pipekit-train NAME: error: ...`` and an exit code."""

    def run(args: argparse.Namespace) -> int:
        from pipekit import PipekitError  # here, not at the top: `--help` and `--version` import nothing heavy

        try:
            return int(fn(args))
        except UsageError as e:
            print(f"pipekit-train {name}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return EXIT_USAGE
        except (CommandError, PipekitError, OSError) as e:
            message = " ".join(str(e).split())  # one line, whatever the message held
            print(f"pipekit-train {name}: error: {message}", file=sys.stderr)
            return EXIT_ERROR

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def run_commands(add_commands: Callable[[Any], object], argv: Sequence[str] | None, description: str = "") -> int:
    """Parse `argv` for the subcommands `add_commands` registers and run one in-process; return the exit code."""
    parser = argparse.ArgumentParser(prog="pipekit-train", description=description or None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_commands(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error (or --help)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    return int(args.func(args))
