"""What the `pipekit-train` subcommand modules share: exit codes, one-line errors, the handler wrapper.

Exit codes: 0 done; 2 a mistake in what was asked (a bad argument, pipeline file, field, path or id: one line on
standard error); 1 the command ran and failed (training diverged, a damaged checkpoint or store, a full disk; one
line) or an internal error (a bug: one line that says how to see the traceback); 128 + signal number for a graceful
stop on SIGINT (130) or SIGTERM (143); 141 when the reader of standard output went away (``... | head``).
``--debug`` (anywhere on the command line, or ``$PIPEKIT_DEBUG=1``) prints the traceback before the line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
#: The exit code when standard output is a pipe whose reader went away (128 + SIGPIPE, as a shell reports it).
EXIT_BROKEN_PIPE = 141

#: Set by ``--debug`` for one call of `pipekit-train`'s `main` (restored when it returns): errors print their
#: traceback before the one line. ``$PIPEKIT_DEBUG=1`` does the same for the whole process.
DEBUG = False


class CommandError(Exception):
    """A command cannot do what was asked; the message is printed as one line and the exit code is 2."""


class UsageError(CommandError):
    """The arguments do not make sense together; printed as one line, exit code 2."""


class CommandFailed(CommandError):
    """The command ran and failed (something it needs is damaged); printed as one line, exit code 1."""


def debug_enabled() -> bool:
    """Whether errors should show their traceback: ``--debug`` or ``$PIPEKIT_DEBUG`` set to a true value."""
    return DEBUG or os.environ.get("PIPEKIT_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


#: Errors that mean the command ran and failed (exit code 1), not that what was asked is wrong (2); by class name,
#: so that reporting an error imports nothing (the inspection commands never import JAX).
_FAILURES = frozenset(
    {
        "FloatingPointError",
        "CheckpointCorruptedError",
        "CheckpointSaveError",
        "ArtifactIntegrityError",
        "ModelIntegrityError",
        "DamagedFileError",
    }
)
_PATH_MISTAKES = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


def one_line(text: object) -> str:
    """`text` with its whitespace (newlines included) collapsed to single spaces."""
    return " ".join(str(text).split())


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror.lower() if e.strerror[:1].isupper() else e.strerror}"
    return str(e)


def report_error(prog: str, e: BaseException, *, collapse: bool = True) -> int:
    """Print `e` as ``PROG: error: ...`` (one line; the traceback first under ``--debug``); return the exit code.

    A `BrokenPipeError` (the reader of standard output went away) prints nothing and returns 141. An exception that
    is not a known kind of error is a bug: one line with its type and message, and how to see the traceback.
    With `collapse` false a message that holds lines of its own (a refused resume's configuration diff) keeps
    them after its first line.
    """
    if isinstance(e, BrokenPipeError):
        silence_stdout()
        return EXIT_BROKEN_PIPE
    debug = debug_enabled()
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    from pipekit import PipekitError

    failed = isinstance(e, CommandFailed) or any(t.__name__ in _FAILURES for t in type(e).__mro__)
    if isinstance(e, (*_PATH_MISTAKES, ImportError)) or (isinstance(e, (CommandError, PipekitError)) and not failed):
        code = EXIT_USAGE  # a mistake in what was asked: an argument, a file, a field, an id
    elif failed or isinstance(e, OSError):  # training diverged, something is damaged, a full disk
        code = EXIT_ERROR
    else:
        hint = "" if debug else "; rerun with --debug for the traceback"
        print(
            f"{prog}: internal error: {type(e).__name__}: {one_line(e)} (a bug in pipekit-train: please report it"
            f"{hint})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    message = _os_message(e) if isinstance(e, OSError) else str(e)
    print(f"{prog}: error: {one_line(message) if collapse else message.strip()}", file=sys.stderr)
    return code


@contextlib.contextmanager
def one_line_warnings(prog: str = "pipekit-train") -> Iterator[None]:
    """Within: print each `PipekitTrainWarning` as ``PROG: warning: MESSAGE``, the way `report_error` prints errors
    (no Python ``file:line: Category:`` header, no source line; a message that holds lines of its own, a forced
    resume's configuration diff, keeps them below its first). Under ``--debug``, and for other packages' warnings,
    Python's own format (it says where the warning was raised).

    Only the format changes (`warnings.formatwarning`), not where warnings go: a caller recording them
    (``warnings.catch_warnings(record=True)``, ``pytest.warns``) around an in-process `main` still gets them."""
    import warnings

    previous = warnings.formatwarning

    def format_warning(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        from pipekit_train._warnings import PipekitTrainWarning

        if not issubclass(category, PipekitTrainWarning) or debug_enabled():
            return previous(message, category, filename, lineno, line)
        return f"{prog}: warning: {str(message).strip()}\n"

    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


def silence_stdout() -> None:
    """Point standard output at /dev/null, so that Python's flush at exit does not report a broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def guarded(name: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`fn` as a command handler: errors become ``pipekit-train NAME: error: ...`` and an exit code."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except Exception as e:
            return report_error(f"pipekit-train {name}", e)

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose usage errors are one line: ``PROG: error: MESSAGE (see PROG --help)``, exit 2.

    An unknown subcommand or choice names the closest valid ones.
    """

    def error(self, message: str) -> NoReturn:
        import re

        from pipekit._errors import suggestion

        m = re.match(r"argument (\S+): invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if m:
            what, value, choices = m.groups()
            names = [c.strip().strip("'") for c in choices.split(",")]
            kind = "command" if what in {"COMMAND", "command"} else f"value for {what}"
            message = f"unknown {kind} {value!r}{suggestion(value, names)}; choose from {', '.join(names)}"
        print(f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def run_commands(add_commands: Callable[[Any], object], argv: Sequence[str] | None, description: str = "") -> int:
    """Parse `argv` for the subcommands `add_commands` registers and run one in-process; return the exit code."""
    parser = OneLineParser(prog="pipekit-train", description=description or None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_commands(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error (or --help)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    with one_line_warnings():
        return int(args.func(args))
