"""`ArtifactStore`: the training artifacts of every run, in one SQLite file, queryable.

The file is an SQLite database in WAL mode, so readers never block the writer and many processes on one machine
(the runs of a sweep) can record at once: each write is one short ``BEGIN IMMEDIATE`` transaction and a writer that
finds the database locked waits (``busy_timeout``) rather than failing. WAL needs every process on the same host
(it shares memory through a ``-shm`` file), so keep the file on a local disk: a store on a network file system
(NFS, SMB, sshfs, Ceph, Lustre, ...; `_netfs.network_filesystem`) is refused unless ``PIPEKIT_ALLOW_NETWORK_STORE=1``.

The whole artifact is kept as JSON, but for its dependency lock, which the ``locks`` table keeps once however many
artifacts share it (``_locks.py``); the columns and the ``parents``, ``metrics`` and ``imports`` tables beside it
are indexes for the queries.

Where the file is: the ``path`` argument, else ``$PIPEKIT_ARTIFACT_STORE``, else ``./runs/artifacts.sqlite``.

The schema is versioned: the ``schema_version`` table holds one number, and `MIGRATIONS` lists the steps from
each version to the next. Opening a store brings an older file up to date in one transaction; a file written by a
newer pipekit-train is refused rather than misread.

Integrity: each record carries ``digest``, ``"sha256:<hex>"`` of its JSON text (`record_digest`), and every read
(`get`, `query`, `lineage`, `diff`) checks it: a record changed by a bad disk, a stray write or a hand edit is an
`ArtifactIntegrityError` naming the store and the artifact, never shown as if it were true. A file that is not an
SQLite database any more (truncated, overwritten) is an `ArtifactIntegrityError` too. `ArtifactStore.verify`
checks everything at once: digests, the index columns and tables against the records, lineage links, and SQLite's
own ``PRAGMA integrity_check``. The digest detects damage, not a deliberate forgery by someone who can write the
file (they can recompute it).

The parts, one idea each: the database and its migrations (``_store_db.py``), recording (``_store_record.py``),
queries and lineage (``_store_query.py``), verification (``_store_verify.py``), dependency locks kept once
(``_locks.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ._errors import ArtifactIntegrityError, ArtifactStoreError, UnknownArtifactError
from ._schema import MIGRATIONS, SCHEMA_VERSION, record_digest
from ._store_db import DEFAULT_PATH, ENV_VAR
from ._store_record import _StoreRecording
from ._store_verify import _StoreVerification

__all__ = [
    "ArtifactIntegrityError",
    "ArtifactStore",
    "ArtifactStoreError",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "UnknownArtifactError",
    "record_digest",
]


class ArtifactStore(_StoreRecording, _StoreVerification):
    """Training artifacts in one SQLite file: record them, find them, trace their lineage, compare two.

    Args:
        path: The database file. Default: ``$PIPEKIT_ARTIFACT_STORE``, else ``./runs/artifacts.sqlite``. The
            folder is created if needed.

    Example:
        >>> import tempfile, os
        >>> from pipekit_train.provenance import TrainingArtifact
        >>> store = ArtifactStore(os.path.join(tempfile.mkdtemp(), "a.sqlite"))
        >>> art = TrainingArtifact(run_id="r1", backend="equinox", final_metrics={"validate/accuracy": 0.93})
        >>> store.record(art)
        >>> store.get(art.artifact_id[:8]) == art
        True
        >>> [a.run_id for a in store.query(metrics=[("validate/accuracy", ">=", 0.9)])]
        ['r1']
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path is None:
            path = os.environ.get(ENV_VAR) or DEFAULT_PATH
        self.path = Path(path).expanduser().absolute()
        self._ready = False

    def __repr__(self) -> str:
        return f"ArtifactStore({str(self.path)!r})"

    def __enter__(self) -> ArtifactStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own connection (safe across processes)."""
