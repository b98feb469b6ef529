"""Errors of the artifact store."""

from __future__ import annotations

import os

from pipekit import PipekitError


class ArtifactStoreError(PipekitError):
    """The artifact store cannot do what was asked (a newer schema, a conflicting record, a locked file)."""


class UnknownArtifactError(ArtifactStoreError):
    """No artifact (or more than one) has the id or id prefix given."""


class ArtifactIntegrityError(ArtifactStoreError):
    """A record does not match its digest, or the store file is damaged. The message names the store, the artifact
    (when one is to blame) and the recovery: restore the file from its backup, or re-record the run from its own
    ``artifact.json`` with ``pipekit-train artifacts import RUN_DIR``."""

    def __init__(self, message: str, *, path: str | os.PathLike[str], artifact_id: str | None = None) -> None:
        super().__init__(message)
        self.path = str(path)
        self.artifact_id = artifact_id
