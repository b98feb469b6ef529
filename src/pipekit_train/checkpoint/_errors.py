"""Errors of checkpoint reading and writing."""

from __future__ import annotations

from pipekit import PipekitError


# Errors ------------------------------------------------------------------------------------------------------
class CheckpointError(PipekitError):
    """A checkpoint cannot be written or read as asked."""


class CheckpointNotFoundError(CheckpointError):
    """The requested checkpoint does not exist, or exists but never committed."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (in the background when saving asynchronously); earlier ones are intact."""


class CheckpointMismatchError(CheckpointError):
    """The ``abstract_state`` given to a restore does not match the tree the checkpoint holds."""


class CheckpointCorruptedError(CheckpointError):
    """A committed checkpoint's files are damaged (truncated, changed, missing).

    Attributes:
        step: The step of the damaged checkpoint.
        files: The damaged files (absolute paths), or the item directory when they cannot be pinpointed.
    """

    def __init__(self, message: str, *, step: int, files: list[str]) -> None:
        super().__init__(message)
        self.step = step
        self.files = files
