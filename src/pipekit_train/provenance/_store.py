"""`ArtifactStore`: the training artifacts of every run, in one SQLite file, queryable.

The file is an SQLite database in WAL mode, so readers never block the writer and many processes on one machine
(the runs of a sweep) can record at once: each write is one short ``BEGIN IMMEDIATE`` transaction and a writer that
finds the database locked waits (``busy_timeout``) rather than failing. WAL needs every process on the same host
(it shares memory through a ``-shm`` file), so keep the file on a local disk: a store on a network file system
(NFS, SMB, sshfs, Ceph, Lustre, ...; `_netfs.network_filesystem`) is refused unless ``PIPEKIT_ALLOW_NETWORK_STORE=1``.

The whole artifact is kept as JSON; the columns and the ``parents``, ``metrics`` and ``imports`` tables beside it
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
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import difflib
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._artifact import TrainingArtifact
from ._code import blob_digest
from ._errors import ArtifactIntegrityError, ArtifactStoreError, UnknownArtifactError
from ._netfs import ALLOW_ENV_VAR, network_filesystem
from ._schema import (
    _DIGEST_SQL_FUNCTION,
    _INDEX_COLUMNS,
    MIGRATIONS,
    SCHEMA_VERSION,
    _float_or_none,
    _sql_record_digest,
    record_digest,
    time_key,
)
from ._verify import _blob_problems, _check_model, _check_record, _code_problems, _index_problems, _run_dir_hint

__all__ = [
    "ArtifactIntegrityError",
    "ArtifactStore",
    "ArtifactStoreError",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "UnknownArtifactError",
    "record_digest",
]

ENV_VAR = "PIPEKIT_ARTIFACT_STORE"
DEFAULT_PATH = os.path.join("runs", "artifacts.sqlite")
#: How long a writer waits for the lock before giving up, in milliseconds.
BUSY_TIMEOUT_MS = 60_000


_OPS = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "=", "=": "=", "!=": "!="}
_MAX_DEPTH = 1000


class ArtifactStore:
    """Training artifacts in one SQLite file: record them, find them, trace their lineage, compare two.

    Args:
        path: The database file. Default: ``$PIPEKIT_ARTIFACT_STORE``, else ``./runs/artifacts.sqlite``. The
            folder is created if needed.

    Example:
        >>> import tempfile, os
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

    # Connections and schema ------------------------------------------------------------------------------
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

    # Writing ---------------------------------------------------------------------------------------------
    def record(
        self, artifact: TrainingArtifact, *, repair: bool = False, blobs: Mapping[str, bytes] | None = None
    ) -> None:
        """Add `artifact`. Recording the same artifact again is a no-op; a different one under its id is an error.

        A damaged record under the same id (one that does not match its digest) is an `ArtifactIntegrityError`,
        or, with ``repair=True`` (``pipekit-train artifacts import``), replaced by `artifact`.

        `blobs` (digest to bytes: the code `TrainingArtifact.code` names, `capture_code`) are added in the same
        transaction, each once: a digest already stored adds no row.
        """
        if not isinstance(artifact, TrainingArtifact):
            raise TypeError(f"ArtifactStore.record expects a TrainingArtifact, got {type(artifact).__name__}")
        for key, data in (blobs or {}).items():
            if blob_digest(data) != key:
                raise ArtifactStoreError(f"blob {key[:19]}... does not hash to its key; refusing to store it")
        doc = artifact.to_json()
        digest = record_digest(doc)
        row = {
            "artifact_id": artifact.artifact_id,
            "run_id": artifact.run_id,
            "stage": artifact.stage,
            "pipeline_hash": artifact.pipeline_hash,
            "dataset_hash": artifact.dataset_hash,
            "backend": artifact.backend,
            "trained_model_hash": artifact.trained_model_hash,
            "model_registry_uri": artifact.model_registry_uri,
            "tracker_run_id": artifact.tracker_run_id,
            "status": artifact.status,
            "started_at": time_key(artifact.started_at),
            "ended_at": time_key(artifact.ended_at) if artifact.ended_at else None,
            "seed": artifact.seed,
            "record": doc,
            "digest": digest,
        }
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                old = conn.execute(
                    "SELECT digest, record FROM artifacts WHERE artifact_id = ?", (artifact.artifact_id,)
                ).fetchone()
                if old is not None:
                    if old[1] == doc and old[0] == digest:
                        conn.execute("ROLLBACK")
                        return
                    if _check_record(artifact.artifact_id, old[0], old[1])[0] is not None:
                        conn.execute("ROLLBACK")
                        raise ArtifactStoreError(
                            f"{self.path} already holds a different artifact with id {artifact.artifact_id!r}; "
                            "artifacts are immutable, record a new one instead"
                        )
                    if not repair:
                        conn.execute("ROLLBACK")
                        self._checked(artifact.artifact_id, old[0], old[1])  # raises, naming the damage
                    for table, column in (
                        ("imports", "artifact_id"),
                        ("metrics", "artifact_id"),
                        ("parents", "child_id"),
                        ("artifacts", "artifact_id"),
                    ):
                        conn.execute(f"DELETE FROM {table} WHERE {column} = ?", (artifact.artifact_id,))
                conn.execute(
                    f"INSERT INTO artifacts ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                    tuple(row.values()),
                )
                conn.executemany(
                    "INSERT OR IGNORE INTO parents (child_id, parent_id, position) VALUES (?, ?, ?)",
                    [(artifact.artifact_id, p, i) for i, p in enumerate(artifact.parent_ids)],
                )
                conn.executemany(
                    "INSERT INTO metrics (artifact_id, name, value) VALUES (?, ?, ?)",
                    [(artifact.artifact_id, k, _float_or_none(v)) for k, v in artifact.final_metrics.items()],
                )
                conn.executemany(
                    "INSERT INTO imports (artifact_id, position, module, file, sha256) VALUES (?, ?, ?, ?, ?)",
                    [
                        (artifact.artifact_id, i, m["module"], m["file"], m["sha256"])
                        for i, m in enumerate(artifact.imports)
                    ],
                )
                conn.executemany(
                    "INSERT OR IGNORE INTO blobs (digest, size, content) VALUES (?, ?, ?)",
                    [(key, len(data), sqlite3.Binary(data)) for key, data in (blobs or {}).items()],
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def blob(self, digest: str) -> bytes:
        """The stored bytes whose digest is `digest` (``"sha256:<hex>"``), checked against it.

        Raises:
            UnknownArtifactError: no such blob.
            ArtifactIntegrityError: the bytes no longer hash to `digest`.
        """
        with self._connect() as conn:
            row = conn.execute("SELECT content FROM blobs WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            raise UnknownArtifactError(f"{self.path} holds no stored code with digest {digest}")
        data = bytes(row[0])
        if blob_digest(data) != digest:
            raise ArtifactIntegrityError(
                f"{self.path}: the stored code {digest[:19]}... is damaged (its bytes hash to "
                f"{blob_digest(data)[:19]}...); restore the store from its backup",
                path=self.path,
            )
        return data

    # Reading ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._connect() as conn:
            return int(conn.execute("SELECT COUNT(*) FROM artifacts").fetchone()[0])

    def get(self, artifact_id: str) -> TrainingArtifact:
        """The artifact with id `artifact_id`, or with an id starting with it (a unique prefix, as in git).

        Raises:
            UnknownArtifactError: no artifact, or several, match.
            ArtifactIntegrityError: the record does not match its digest.
        """
        with self._connect() as conn:
            full = self._resolve_id(conn, artifact_id)
            row = conn.execute(
                "SELECT artifact_id, digest, record FROM artifacts WHERE artifact_id = ?", (full,)
            ).fetchone()
        return self._checked(*row)

    def _resolve_id(self, conn: sqlite3.Connection, artifact_id: str) -> str:
        """The one recorded id equal to `artifact_id` or starting with it."""
        if not isinstance(artifact_id, str) or not artifact_id:
            raise UnknownArtifactError(f"an artifact id must be a non-empty string, got {artifact_id!r}")
        row = conn.execute("SELECT artifact_id FROM artifacts WHERE artifact_id = ?", (artifact_id,)).fetchone()
        if row is not None:
            return str(row[0])
        rows = conn.execute(
            "SELECT artifact_id FROM artifacts WHERE artifact_id >= ? AND artifact_id < ? ORDER BY artifact_id LIMIT 6",
            (artifact_id, artifact_id + "\U0010ffff"),
        ).fetchall()
        if len(rows) == 1:
            return str(rows[0][0])
        if rows:
            shown = ", ".join(r[0] for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
            raise UnknownArtifactError(
                f"artifact id prefix {artifact_id!r} is ambiguous in {self.path}: it matches {shown}; "
                "give more characters"
            )
        ids = [r[0] for r in conn.execute("SELECT artifact_id FROM artifacts")]
        near = self._close_ids(artifact_id, ids)
        hint = f"; closest ids: {', '.join(near)}" if near else f" ({len(ids)} artifacts recorded)"
        raise UnknownArtifactError(f"no artifact with id {artifact_id!r} in {self.path}{hint}")

    @staticmethod
    def _close_ids(wanted: str, ids: Sequence[str], n: int = 3) -> list[str]:
        """Ids sharing the longest prefix with `wanted`, then difflib's closest; at most `n`."""
        out: list[str] = []
        for k in range(len(wanted) - 1, 0, -1):
            out = sorted(i for i in ids if i.startswith(wanted[:k]))[:n]
            if out:
                break
        for near in difflib.get_close_matches(wanted, list(ids), n=n, cutoff=0.6):
            if near not in out and len(out) < n:
                out.append(near)
        return out

    def query(
        self,
        *,
        dataset_hash: str | None = None,
        pipeline_hash: str | None = None,
        model_hash: str | None = None,
        backend: str | None = None,
        stage: str | None = None,
        run_id: str | None = None,
        status: str | None = None,
        since: str | _dt.datetime | None = None,
        until: str | _dt.datetime | None = None,
        metrics: Sequence[tuple[str, str, float]] = (),
        imported: str | None = None,
        sweep: str | None = None,
        limit: int | None = None,
    ) -> list[TrainingArtifact]:
        """The artifacts matching every filter given, newest first.

        Args:
            dataset_hash, pipeline_hash, model_hash: A hash, or a prefix of one (``"sha256:1f2e"``).
            backend, stage, run_id: Exact values.
            status: ``"completed"``, ``"failed"``, or ``"stopped"`` (any stop reason).
            since, until: Start-time bounds (inclusive), ISO-8601 strings or datetimes; naive means UTC.
            metrics: ``(name, op, value)`` filters on final metrics, ``op`` one of ``< <= > >= == !=``:
                ``[("validate/accuracy", ">=", 0.9)]``. An artifact without the metric does not match.
            imported: A module name: the artifacts whose run imported it (``--import``, ``$PIPEKIT_IMPORT``).
            sweep: A sweep's name: the artifacts of its trials (`TrainingArtifact.sweep`).
            limit: At most this many (the newest).
        """
        where: list[str] = []
        args: list[Any] = []
        for column, value in (
            ("dataset_hash", dataset_hash),
            ("pipeline_hash", pipeline_hash),
            ("trained_model_hash", model_hash),
        ):
            if value is not None:
                where.append(f"substr({column}, 1, length(?)) = ?")
                args += [value, value]
        for column, value in (("backend", backend), ("stage", stage), ("run_id", run_id)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if status is not None:
            if status == "stopped":
                where.append("status LIKE 'stopped:%'")
            else:
                where.append("status = ?")
                args.append(status)
        if since is not None:
            where.append("started_at >= ?")
            args.append(time_key(since))
        if until is not None:
            where.append("started_at <= ?")
            args.append(time_key(until))
        for item in metrics:
            try:
                name, op, bound = item
                bound = float(bound)
            except (TypeError, ValueError):
                raise ArtifactStoreError(
                    f"a metric filter is (name, op, number), like ('validate/accuracy', '>=', 0.9); got {item!r}"
                ) from None
            if op not in _OPS:
                raise ArtifactStoreError(
                    f"metric filter operator must be one of {', '.join(sorted(set(_OPS)))}, got {op!r}"
                )
            where.append(
                "EXISTS (SELECT 1 FROM metrics m WHERE m.artifact_id = a.artifact_id "
                f"AND m.name = ? AND m.value {_OPS[op]} ?)"
            )
            args += [str(name), bound]
        if imported is not None:
            where.append("EXISTS (SELECT 1 FROM imports i WHERE i.artifact_id = a.artifact_id AND i.module = ?)")
            args.append(str(imported))
        if sweep is not None:
            where.append("json_extract(a.record, '$.sweep.name') = ?")
            args.append(str(sweep))
        sql = "SELECT a.artifact_id, a.digest, a.record FROM artifacts a"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at DESC, artifact_id"
        if limit is not None:
            if limit < 0:
                raise ArtifactStoreError(f"query limit must be a non-negative int, got {limit}")
            sql += " LIMIT ?"
            args.append(int(limit))
        with self._connect() as conn:
            rows = conn.execute(sql, args).fetchall()
        return [self._checked(*r) for r in rows]

    def lineage(self, artifact_id: str) -> dict[str, list[Any]]:
        """The artifacts `artifact_id` descends from and those descending from it, nearest first.

        Returns:
            ``{"ancestors": [TrainingArtifact, …], "descendants": [TrainingArtifact, …], "missing": [id, …]}``;
            ``missing`` lists ancestor ids that are named as parents but not recorded in this store.
        """
        root = self.get(artifact_id).artifact_id
        ancestors_sql = f"""
            WITH RECURSIVE up(id, depth) AS (
                SELECT parent_id, 1 FROM parents WHERE child_id = ?
                UNION
                SELECT p.parent_id, up.depth + 1 FROM parents p JOIN up ON p.child_id = up.id
                WHERE up.depth < {_MAX_DEPTH}
            )
            SELECT up.id, MIN(up.depth) AS d, a.digest, a.record
            FROM up LEFT JOIN artifacts a ON a.artifact_id = up.id
            WHERE up.id != ? GROUP BY up.id ORDER BY d, up.id"""
        descendants_sql = f"""
            WITH RECURSIVE down(id, depth) AS (
                SELECT child_id, 1 FROM parents WHERE parent_id = ?
                UNION
                SELECT p.child_id, down.depth + 1 FROM parents p JOIN down ON p.parent_id = down.id
                WHERE down.depth < {_MAX_DEPTH}
            )
            SELECT down.id, MIN(down.depth) AS d, a.digest, a.record
            FROM down JOIN artifacts a ON a.artifact_id = down.id
            WHERE down.id != ? GROUP BY down.id ORDER BY d, a.started_at, down.id"""
        with self._connect() as conn:
            up = conn.execute(ancestors_sql, (root, root)).fetchall()
            down = conn.execute(descendants_sql, (root, root)).fetchall()
        return {
            "ancestors": [self._checked(r[0], r[2], r[3]) for r in up if r[3] is not None],
            "descendants": [self._checked(r[0], r[2], r[3]) for r in down],
            "missing": [r[0] for r in up if r[3] is None],
        }

    def diff(self, a: str, b: str) -> dict[str, Any]:
        """What differs between artifacts `a` and `b` (ids or unique prefixes).

        Returns:
            ``{"a": id, "b": id, "pipeline": unified diff or None, "dataset_hash": {"a", "b"} or None,
            "backend": …, "deps": {"added", "removed", "changed", "python", "jax", "devices"} or None,
            "code": {"a": git, "b": git} or None, "seed": {"a", "b"} or None,
            "metrics": {name: [value_a, value_b]} or None,
            "imports": {"added": {module: record}, "removed": {module: record}, "changed": {module: [sha256_a,
            sha256_b]}} or None}``; a section is ``None`` when the two agree. Imports are compared by module
            name and file digest (the same file at another path is the same import).
        """
        x, y = self.get(a), self.get(b)
        out: dict[str, Any] = {"a": x.artifact_id, "b": y.artifact_id}
        pipeline = "".join(
            difflib.unified_diff(
                x.training_pipeline_yaml.splitlines(keepends=True),
                y.training_pipeline_yaml.splitlines(keepends=True),
                fromfile=f"a/{x.artifact_id[:12]}/pipeline.yaml",
                tofile=f"b/{y.artifact_id[:12]}/pipeline.yaml",
            )
        )
        out["pipeline"] = pipeline or None
        for name in ("dataset_hash", "backend", "seed", "trained_model_hash"):
            va, vb = getattr(x, name), getattr(y, name)
            out[name] = None if va == vb else {"a": va, "b": vb}
        out["deps"] = _deps_diff(x.deps_lock, y.deps_lock)
        out["code"] = None if (x.git or None) == (y.git or None) else {"a": x.git, "b": y.git}
        metrics: dict[str, list[float | None]] = {}
        for name in sorted(set(x.final_metrics) | set(y.final_metrics)):
            va, vb = x.final_metrics.get(name), y.final_metrics.get(name)
            if va != vb:
                metrics[name] = [va, vb]
        out["metrics"] = metrics or None
        out["imports"] = _imports_diff(x.imports, y.imports)
        return out

    # Checking ---------------------------------------------------------------------------------------------
    def verify(self, artifact_id: str | None = None, *, models: bool = True) -> dict[str, Any]:
        """Check the store: every record (or the one `artifact_id` names) and what it points to.

        For each record: its digest, that its id, index columns, ``parents``, ``metrics`` and ``imports`` rows
        agree with it, that its parents are recorded, and (with `models`) that the model-registry entry it names
        loads with verified hashes and has its ``trained_model_hash``. For the whole store (no `artifact_id`):
        SQLite's ``PRAGMA integrity_check`` and ``foreign_key_check`` too. The evaluation records (all, or those
        of `artifact_id`): their digests, the artifact each names, their ``evaluation_metrics`` rows.

        Returns:
            ``{"store": path, "checked": number of records, "evaluations": number of evaluation records,
            "problems": [(artifact id or None, text), …], "warnings": [(artifact id, text), …]}``. A warning is
            something that could not be checked (a model registry folder that is gone), not damage.
        """
        problems: list[tuple[str | None, str]] = []
        warnings: list[tuple[str | None, str]] = []
        with self._connect() as conn:
            if artifact_id is None:
                for (line,) in conn.execute("PRAGMA integrity_check").fetchall():
                    if line != "ok":
                        problems.append((None, f"SQLite integrity_check: {line}"))
                for table, rowid, parent, _ in conn.execute("PRAGMA foreign_key_check").fetchall():
                    problems.append((None, f"{table} row {rowid} refers to an artifact not in the store ({parent})"))
                ids = [r[0] for r in conn.execute("SELECT artifact_id FROM artifacts ORDER BY artifact_id")]
            else:
                ids = [self._resolve_id(conn, artifact_id)]
            known = {r[0] for r in conn.execute("SELECT artifact_id FROM artifacts")}
            columns = ", ".join(c for c, _ in _INDEX_COLUMNS)
            rows = []
            for aid in ids:
                row = conn.execute(
                    f"SELECT artifact_id, digest, record, started_at, ended_at, {columns} FROM artifacts "
                    "WHERE artifact_id = ?",
                    (aid,),
                ).fetchone()
                parents = [
                    r[0]
                    for r in conn.execute("SELECT parent_id FROM parents WHERE child_id = ? ORDER BY position", (aid,))
                ]
                metrics = dict(conn.execute("SELECT name, value FROM metrics WHERE artifact_id = ?", (aid,)).fetchall())
                imports = conn.execute(
                    "SELECT module, file, sha256 FROM imports WHERE artifact_id = ? ORDER BY position", (aid,)
                ).fetchall()
                rows.append((row, parents, metrics, imports))
            if artifact_id is None:
                evaluations = conn.execute(
                    "SELECT evaluation_id, artifact_id, digest, record FROM evaluations"
                ).fetchall()
            else:
                evaluations = conn.execute(
                    "SELECT evaluation_id, artifact_id, digest, record FROM evaluations WHERE artifact_id = ?",
                    (ids[0],),
                ).fetchall()
            blob_rows = conn.execute("SELECT digest, size, content FROM blobs").fetchall()
            evaluation_metrics = {
                e[0]: dict(conn.execute("SELECT name, value FROM evaluation_metrics WHERE evaluation_id = ?", (e[0],)))
                for e in evaluations
            }
        for evaluation_id, linked, digest, doc in evaluations:
            for text in _evaluation_problems(doc, digest, linked, known, evaluation_metrics[evaluation_id]):
                problems.append((linked, f"evaluation {evaluation_id}: {text}"))
        stored_blobs = {r[0] for r in blob_rows}
        if artifact_id is None:
            problems += [(None, text) for text in _blob_problems(blob_rows)]
        model_cache: dict[str, tuple[str, str] | None] = {}
        for row, parents, metrics, imports in rows:
            aid = row[0]
            artifact, problem = _check_record(aid, row[1], row[2])
            if artifact is None:
                problems.append((aid, f"record does not match its digest: {problem}"))
                continue
            for text in _index_problems(artifact, row, parents, metrics, imports):
                problems.append((aid, text))
            for text in _code_problems(artifact, stored_blobs):  # e.g. imported from an artifact.json: a warning
                warnings.append((aid, text))
            for parent in artifact.parent_ids:
                if parent not in known:
                    problems.append((aid, f"lineage: parent {parent} is not in this store"))
            if models and artifact.model_registry_uri:
                uri = artifact.model_registry_uri
                if uri not in model_cache:
                    model_cache[uri] = _check_model(uri, artifact.trained_model_hash)
                found = model_cache[uri]
                if found is not None:
                    (problems if found[0] == "problem" else warnings).append((aid, found[1]))
        return {
            "store": str(self.path),
            "checked": len(rows),
            "evaluations": len(evaluations),
            "problems": problems,
            "warnings": warnings,
        }

    # Evaluations ---------------------------------------------------------------------------------------------
    def record_evaluation(self, record: dict[str, Any]) -> None:
        """Add an evaluation record (`pipekit_train.evaluate`'s ``Evaluation.to_dict()``), with its digest.

        It needs ``evaluation_id``, ``model_hash``, ``dataset_hash``, ``created_at`` and ``metrics`` (name to
        number); ``artifact_id`` links it to the artifact that trained the model (``None`` for a bare model URI).
        """
        import json

        missing = [
            k for k in ("evaluation_id", "model_hash", "dataset_hash", "created_at", "metrics") if k not in record
        ]
        if missing:
            raise ArtifactStoreError(f"an evaluation record needs {missing}; got keys {sorted(record)}")
        doc = json.dumps(record, sort_keys=True)
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    "INSERT INTO evaluations (evaluation_id, artifact_id, model_hash, dataset_hash, created_at, "
                    "record, digest) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        record["evaluation_id"],
                        record.get("artifact_id"),
                        record["model_hash"],
                        record["dataset_hash"],
                        time_key(record["created_at"]),
                        doc,
                        record_digest(doc),
                    ),
                )
                conn.executemany(
                    "INSERT INTO evaluation_metrics (evaluation_id, name, value) VALUES (?, ?, ?)",
                    [(record["evaluation_id"], str(k), float(v)) for k, v in record["metrics"].items()],
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def evaluations(
        self, *, dataset_hash: str | None = None, artifact_id: str | None = None, metric: str | None = None
    ) -> list[dict[str, Any]]:
        """Evaluation records, oldest first: of models evaluated on `dataset_hash`, of the artifact `artifact_id`
        (a unique prefix is enough), and/or holding `metric`. Each record's digest is checked."""
        import json

        where, args = [], []
        with self._connect() as conn:
            if dataset_hash is not None:
                where.append("e.dataset_hash = ?")
                args.append(dataset_hash)
            if artifact_id is not None:
                where.append("e.artifact_id = ?")
                args.append(self._resolve_id(conn, artifact_id))
            if metric is not None:
                where.append(
                    "EXISTS (SELECT 1 FROM evaluation_metrics m WHERE m.evaluation_id = e.evaluation_id AND m.name = ?)"
                )
                args.append(metric)
            sql = "SELECT e.evaluation_id, e.digest, e.record FROM evaluations e"
            if where:
                sql += " WHERE " + " AND ".join(where)
            rows = conn.execute(sql + " ORDER BY e.created_at, e.evaluation_id", args).fetchall()
        out = []
        for evaluation_id, digest, doc in rows:
            if record_digest(doc) != digest:
                raise ArtifactIntegrityError(
                    f"{self.path}: evaluation {evaluation_id} does not match its digest (the record was changed or "
                    "damaged); restore the store from its backup",
                    path=self.path,
                )
            out.append(json.loads(doc))
        return out


def _evaluation_problems(
    doc: str, digest: str, linked: str | None, known: set[str], metrics: dict[str, float]
) -> list[str]:
    """What is wrong with one evaluation row: its digest, its link to an artifact, its ``evaluation_metrics`` rows."""
    import json

    if record_digest(doc) != digest:
        return ["record does not match its digest (the record was changed or damaged)"]
    record = json.loads(doc)
    out = []
    if linked is not None and linked not in known:
        out.append(f"names artifact {linked}, which is not in this store")
    if record.get("artifact_id") != linked:
        out.append(f"its artifact_id column ({linked}) differs from its record ({record.get('artifact_id')})")
    recorded = {str(k): float(v) for k, v in record.get("metrics", {}).items()}

    def same(a: float, b: float | None) -> bool:  # SQLite keeps NaN as NULL
        return a == b or (b is None and a != a) or (b is not None and a != a and b != b)

    if set(recorded) != set(metrics) or not all(same(v, metrics[k]) for k, v in recorded.items()):
        out.append(f"its evaluation_metrics rows {metrics} differ from its record {recorded}")
    return out


def _deps_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    da, db = a.get("distributions") or {}, b.get("distributions") or {}
    out: dict[str, Any] = {
        "added": {k: db[k] for k in sorted(set(db) - set(da))},
        "removed": {k: da[k] for k in sorted(set(da) - set(db))},
        "changed": {k: [da[k], db[k]] for k in sorted(set(da) & set(db)) if da[k] != db[k]},
    }
    for key in ("python", "jax", "devices"):
        if a.get(key) != b.get(key):
            out[key] = [a.get(key), b.get(key)]
    if not any(out.values()):
        return None
    return out


def _imports_diff(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    ia, ib = {m["module"]: m for m in a}, {m["module"]: m for m in b}
    out: dict[str, Any] = {
        "added": {k: ib[k] for k in ib if k not in ia},
        "removed": {k: ia[k] for k in ia if k not in ib},
        "changed": {k: [ia[k]["sha256"], ib[k]["sha256"]] for k in ia if ib.get(k, ia[k])["sha256"] != ia[k]["sha256"]},
    }
    return out if any(out.values()) else None
