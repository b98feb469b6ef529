"""The artifact store's SQLite schema: the migrations from each schema version to the next, and the index columns.

`MIGRATIONS[v]` takes a database from schema version ``v`` to ``v + 1``; `ArtifactStore` applies the missing ones
in one transaction when it opens a file.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from typing import Any

from ._errors import ArtifactStoreError

#: `MIGRATIONS[v]` takes a database from schema version ``v`` to ``v + 1`` (version 0 is an empty file).
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE artifacts (
            artifact_id TEXT PRIMARY KEY,
            run_id TEXT NOT NULL,
            stage TEXT NOT NULL,
            pipeline_hash TEXT,
            dataset_hash TEXT,
            backend TEXT,
            trained_model_hash TEXT,
            model_registry_uri TEXT,
            tracker_run_id TEXT,
            status TEXT NOT NULL,
            started_at TEXT NOT NULL,
            ended_at TEXT,
            seed INTEGER,
            record TEXT NOT NULL
        )""",
        "CREATE INDEX artifacts_started ON artifacts(started_at)",
        "CREATE INDEX artifacts_dataset ON artifacts(dataset_hash)",
        "CREATE INDEX artifacts_pipeline ON artifacts(pipeline_hash)",
        "CREATE INDEX artifacts_model ON artifacts(trained_model_hash)",
        "CREATE INDEX artifacts_run ON artifacts(run_id)",
        """CREATE TABLE parents (
            child_id TEXT NOT NULL REFERENCES artifacts(artifact_id),
            parent_id TEXT NOT NULL,
            position INTEGER NOT NULL,
            PRIMARY KEY (child_id, parent_id)
        )""",
        "CREATE INDEX parents_by_parent ON parents(parent_id)",
        """CREATE TABLE metrics (
            artifact_id TEXT NOT NULL REFERENCES artifacts(artifact_id),
            name TEXT NOT NULL,
            value REAL,
            PRIMARY KEY (artifact_id, name)
        )""",
        "CREATE INDEX metrics_by_name ON metrics(name, value)",
    ),
    # 2: artifacts record the user modules imported before the pipeline was read (`TrainingArtifact.imports`);
    # older artifacts imported none, so there is nothing to fill in.
    (
        """CREATE TABLE imports (
            artifact_id TEXT NOT NULL REFERENCES artifacts(artifact_id),
            position INTEGER NOT NULL,
            module TEXT NOT NULL,
            file TEXT,
            sha256 TEXT,
            PRIMARY KEY (artifact_id, position)
        )""",
        "CREATE INDEX imports_by_module ON imports(module, sha256)",
    ),
    # 3: each record carries the digest of its JSON text, checked on every read. The records already in the file
    # were trusted until now: their digest is computed from them (`_DIGEST_SQL_FUNCTION`, registered on every
    # connection).
    (
        "ALTER TABLE artifacts ADD COLUMN digest TEXT",
        "UPDATE artifacts SET digest = pipekit_record_digest(record)",
    ),
    # 4: evaluations of a trained model on a dataset (`pipekit-train evaluate`), linked to the artifact that trained
    # it, each a JSON record with its digest like the artifacts; older stores hold none.
    (
        """CREATE TABLE evaluations (
            evaluation_id TEXT PRIMARY KEY,
            artifact_id TEXT,
            model_hash TEXT NOT NULL,
            dataset_hash TEXT NOT NULL,
            created_at TEXT NOT NULL,
            record TEXT NOT NULL,
            digest TEXT NOT NULL
        )""",
        "CREATE INDEX evaluations_by_dataset ON evaluations(dataset_hash)",
        "CREATE INDEX evaluations_by_artifact ON evaluations(artifact_id)",
        """CREATE TABLE evaluation_metrics (
            evaluation_id TEXT NOT NULL REFERENCES evaluations(evaluation_id),
            name TEXT NOT NULL,
            value REAL,
            PRIMARY KEY (evaluation_id, name)
        )""",
        "CREATE INDEX evaluation_metrics_by_name ON evaluation_metrics(name, value)",
    ),
    # 5: the code a run trained with (`TrainingArtifact.code`: the uncommitted patch, the imported modules, the
    # pipeline file), content-addressed: one row per distinct content, however many artifacts name it. Older
    # artifacts stored no code, so there is nothing to fill in.
    (
        """CREATE TABLE blobs (
            digest TEXT PRIMARY KEY,
            size INTEGER NOT NULL,
            content BLOB NOT NULL
        )""",
    ),
    # 6: each distinct dependency lock (`TrainingArtifact.deps_lock`) once, keyed by the digest of its JSON text; a
    # record names it (``lock_digest``) in place of holding it (``_locks.py``). The records already in the file are
    # split the same way (the SQL functions of `_locks.register_lock_functions`); one that would not join back to
    # its exact text is kept whole (``lock_digest`` NULL). The digests are unchanged: each still covers the whole
    # artifact, lock included.
    (
        "CREATE TABLE locks (digest TEXT PRIMARY KEY, content TEXT NOT NULL)",
        "ALTER TABLE artifacts ADD COLUMN lock_digest TEXT",
        "INSERT OR IGNORE INTO locks (digest, content) SELECT pipekit_lock_digest(record), pipekit_lock_text(record) "
        "FROM artifacts WHERE pipekit_lock_digest(record) IS NOT NULL",
        "UPDATE artifacts SET lock_digest = pipekit_lock_digest(record), record = pipekit_record_without_lock(record) "
        "WHERE pipekit_lock_digest(record) IS NOT NULL",
    ),
]
SCHEMA_VERSION = len(MIGRATIONS)

_DIGEST_SQL_FUNCTION = "pipekit_record_digest"
#: The columns of ``artifacts`` that index a field of the record, as (column, field).
_INDEX_COLUMNS = (
    ("run_id", "run_id"),
    ("stage", "stage"),
    ("pipeline_hash", "pipeline_hash"),
    ("dataset_hash", "dataset_hash"),
    ("backend", "backend"),
    ("trained_model_hash", "trained_model_hash"),
    ("model_registry_uri", "model_registry_uri"),
    ("tracker_run_id", "tracker_run_id"),
    ("status", "status"),
    ("seed", "seed"),
)


def record_digest(text: str) -> str:
    """The digest a store keeps beside a record: ``"sha256:<hex>"`` of its JSON text (`TrainingArtifact.to_json`)."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sql_record_digest(text: Any) -> str | None:
    return record_digest(text) if isinstance(text, str) else None


def time_key(value: str | _dt.datetime) -> str:
    """A time as a fixed-width UTC ISO string, so that times compare as strings (naive times are taken as UTC)."""
    if isinstance(value, str):
        try:
            value = _dt.datetime.fromisoformat(value)
        except ValueError:
            raise ArtifactStoreError(
                f"not an ISO-8601 time: {value!r} (expected e.g. 2026-05-01 or 2026-05-01T12:00:00Z)"
            ) from None
    if not isinstance(value, _dt.datetime):
        raise ArtifactStoreError(f"a time must be an ISO-8601 string or a datetime, got {value!r}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=_dt.UTC)
    return value.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


def _float_or_none(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if out != out else out
