"""The artifact store's database: its connections (WAL, the lock wait, no network file system), errors naming
the file, the digest check of a row (its record joined again with its dependency lock, ``_locks.py``), and the
schema migrations run on first use.

Part of `ArtifactStore` (``_store.py``), which holds its path; see that module for the store as a whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._artifact import TrainingArtifact
from ._errors import ArtifactIntegrityError, ArtifactStoreError
from ._locks import JoinedRecord, MissingLock, register_lock_functions
from ._netfs import ALLOW_ENV_VAR, network_filesystem
from ._schema import _DIGEST_SQL_FUNCTION, MIGRATIONS, SCHEMA_VERSION, _sql_record_digest
from ._verify import _check_record, _run_dir_hint

ENV_VAR = "PIPEKIT_ARTIFACT_STORE"
DEFAULT_PATH = os.path.join("runs", "artifacts.sqlite")
#: How long a writer waits for the lock before giving up, in milliseconds.
BUSY_TIMEOUT_MS = 60_000
#: The schema version from which each distinct dependency lock is kept once (``_locks.py``).
_LOCKS_SHARED = 6


class _StoreDatabase:
    """Connections and the schema of the SQLite file at `path`: what every other part of `ArtifactStore` uses."""

    path: Path
    _ready: bool  # whether the first connection set WAL mode and migrated the schema

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A fresh connection (safe across processes and threads), schema brought up to date on first use.

        SQLite errors become one-line errors naming the file (`ArtifactIntegrityError` when the
        file is damaged).
        """
        if not self._ready:
            self._refuse_network_filesystem()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as e:
            raise self._database_error(e) from None
        try:
            conn.create_function(_DIGEST_SQL_FUNCTION, 1, _sql_record_digest, deterministic=True)
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if not self._ready:
                register_lock_functions(conn)
                self._set_wal(conn)
                self._migrate(conn)
                self._ready = True
            conn.execute("PRAGMA foreign_keys = ON")
            yield conn
        except sqlite3.Error as e:
            raise self._database_error(e) from None
        finally:
            conn.close()

    def _refuse_network_filesystem(self) -> None:
        """A store on NFS, SMB, sshfs, ... is refused: WAL's locks do not reach across machines (``_netfs.py``)."""
        found = network_filesystem(self.path)
        if found is None or os.environ.get(ALLOW_ENV_VAR) == "1":
            return
        raise ArtifactStoreError(
            f"{self.path}: the artifact store is on a network file system, {found}; SQLite's WAL mode needs every "
            "process that opens the store on one machine, and two machines would corrupt it. Keep the store on a "
            f"local disk (--store PATH or PIPEKIT_ARTIFACT_STORE), or set {ALLOW_ENV_VAR}=1 if only one machine "
            "will ever open it"
        )

    def _recovery(self, run_dir: str | None = None) -> str:
        run = run_dir or "RUN_DIR"
        return (
            f"restore {self.path} from its backup, or record the run again from its own artifact.json with "
            f"'pipekit-train artifacts import {run} --store {self.path}'"
        )

    def _database_error(self, e: sqlite3.Error) -> ArtifactStoreError:
        text = " ".join(str(e).split()) or type(e).__name__
        low = text.lower()
        if any(word in low for word in ("not a database", "malformed", "corrupt")):
            return ArtifactIntegrityError(
                f"{self.path}: the artifact store is damaged (SQLite: {text}); {self._recovery()}", path=self.path
            )
        if "locked" in low or "busy" in low:
            return ArtifactStoreError(
                f"{self.path}: the artifact store stayed locked by another process for {BUSY_TIMEOUT_MS // 1000} s "
                f"(SQLite: {text}); try again when the other writer is done"
            )
        return ArtifactStoreError(f"{self.path}: the artifact store cannot be used (SQLite: {text})")

    def _checked(self, artifact_id: str, digest: Any, record: Any) -> TrainingArtifact:
        """The artifact a row holds, after checking its digest; an `ArtifactIntegrityError` when it does not match."""
        artifact, problem = _check_record(artifact_id, digest, record)
        if artifact is None:
            raise ArtifactIntegrityError(
                f"{self.path}: artifact {artifact_id} is damaged ({problem}); do not trust it: "
                f"{self._recovery(_run_dir_hint(record))} ('pipekit-train artifacts verify --all' lists every "
                "damaged record)",
                path=self.path,
                artifact_id=artifact_id,
            )
        return artifact

    @staticmethod
    def _with_locks(conn: sqlite3.Connection, rows: Iterable[Sequence[Any]], at: int) -> list[tuple[Any, ...]]:
        """`rows` with their stored record (column `at`) joined with its lock (column ``at + 1``, the record's
        ``lock_digest``) into a `JoinedRecord` (a record kept whole stays its text); the lock column is dropped. A
        lock the ``locks`` table lacks becomes a `MissingLock`, which `_checked` reports as damage. Each distinct
        lock is read and parsed once."""
        rows = list(rows)
        wanted = sorted({r[at + 1] for r in rows if r[at + 1] is not None})
        locks: dict[str, tuple[str, Any]] = {}
        for start in range(0, len(wanted), 500):  # SQLite's bound on parameters is 999 or more
            chunk = wanted[start : start + 500]
            sql = f"SELECT digest, content FROM locks WHERE digest IN ({', '.join('?' * len(chunk))})"
            for key, text in conn.execute(sql, chunk):
                try:
                    locks[key] = (text, json.loads(text))
                except (TypeError, ValueError):  # damaged: the joined text will not match the record's digest
                    locks[key] = (text if isinstance(text, str) else "", None)
        out = []
        for r in rows:
            record, key = r[at], r[at + 1]
            if key is not None and isinstance(record, str):
                found = locks.get(key)
                record = MissingLock(key) if found is None else JoinedRecord(record, key, *found)
            out.append((*r[:at], record, *r[at + 2 :]))
        return out

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        # Switching to WAL needs a moment of exclusive access; when another process holds the file, wait a little.
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise ArtifactStoreError(f"{self.path}: cannot switch the database to WAL mode: {e}") from None
                time.sleep(0.01)
        if str(mode).lower() != "wal":
            raise ArtifactStoreError(
                f"{self.path}: SQLite refused WAL mode (got {mode!r}); the store needs a local file system"
            )

    @staticmethod
    def _version(conn: sqlite3.Connection) -> int:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" not in tables:
            return -1 if tables else 0
        row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def schema_version(self) -> int:
        """The schema version of the file (after opening, always `SCHEMA_VERSION`)."""
        with self._connect() as conn:
            return self._version(conn)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        if self._version(conn) == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = self._version(conn)  # again, under the write lock: another process may have migrated
            if version < 0:
                raise ArtifactStoreError(
                    f"{self.path} is an SQLite database without a schema_version table, so it is not a pipekit "
                    "artifact store; point --store / $PIPEKIT_ARTIFACT_STORE at another file"
                )
            if version > SCHEMA_VERSION:
                raise ArtifactStoreError(
                    f"{self.path} has artifact-store schema version {version}, newer than this pipekit-train "
                    f"reads ({SCHEMA_VERSION}); upgrade pipekit-train"
                )
            if version == 0:
                conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step]:
                    conn.execute(statement)
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if 0 < version < _LOCKS_SHARED:
            self._give_space_back(conn)

    def _give_space_back(self, conn: sqlite3.Connection) -> None:
        """After the migration that keeps each lock once: rewrite the file (``VACUUM``, itself one transaction) so
        that it shrinks, rather than keeping the freed pages for later records. Skipped, and the space kept for
        later records, when another process holds the store."""
        conn.execute("PRAGMA busy_timeout = 2000")
        try:
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.OperationalError:
            pass
        finally:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
