"""The one way pipekit-train writes and reads its small JSON files (``run.json``, ``final.json``, manifests, ...).

`write_json` replaces a file atomically (a temporary file in the same folder, fsynced, renamed over the old one,
the folder fsynced), so a crash leaves the old file or the new one, never half of one. `read_json` turns every kind
of damage (missing, unreadable, not UTF-8, not JSON, the wrong shape) into one `DamagedFileError` that names the
file and says what to do.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipekit import PipekitError

__all__ = ["DamagedFileError", "read_json", "write_json", "write_text"]


class DamagedFileError(PipekitError):
    """A file pipekit-train wrote earlier is missing, unreadable or not what it wrote. The message names it."""

    def __init__(self, message: str, *, path: str | os.PathLike[str]) -> None:
        super().__init__(message)
        self.path = str(path)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2, allow_nan: bool = True) -> None:
    """Write `data` to `path` as JSON, atomically (see the module docstring).

    NaN and infinity are written as Python's JSON does (``NaN``) unless `allow_nan` is false (then refused): a
    metric may legitimately be NaN, a manifest's score may not.
    """
    write_text(path, json.dumps(data, indent=indent, allow_nan=allow_nan))


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` (and a final newline) to `path` atomically, as `write_json` does."""
    target = Path(path)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_json(
    path: str | os.PathLike[str], *, what: str, required: Sequence[str] = (), remedy: str = ""
) -> dict[str, Any]:
    """The JSON object in `path`, with at least the keys `required`.

    Args:
        path: The file.
        what: What the file is, for the message ("the run's metadata").
        required: Keys the object must have.
        remedy: What the user can do about a damaged file, appended to the message.

    Raises:
        DamagedFileError: the file is missing, unreadable, not UTF-8 JSON, not an object, or lacks a key.
    """
    hint = f"; {remedy}" if remedy else ""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DamagedFileError(f"{path}: {what} is missing{hint}", path=path) from None
    except OSError as e:
        raise DamagedFileError(f"{path}: {what} cannot be read ({e.strerror or e}){hint}", path=path) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DamagedFileError(f"{path}: {what} is damaged (not valid JSON: {reason}){hint}", path=path) from None
    if not isinstance(data, dict):
        raise DamagedFileError(
            f"{path}: {what} is damaged (a JSON {type(data).__name__}, not an object){hint}", path=path
        )
    missing = [k for k in required if k not in data]
    if missing:
        raise DamagedFileError(f"{path}: {what} is damaged (no {', '.join(repr(k) for k in missing)}){hint}", path=path)
    return data
