"""Recording in the artifact store: a `TrainingArtifact` with its index rows, its dependency lock (kept once,
``_locks.py``) and stored code, and an evaluation.

Part of `ArtifactStore` (``_store.py``).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from typing import Any

from ._artifact import TrainingArtifact
from ._code import blob_digest
from ._errors import ArtifactStoreError
from ._locks import split_lock, whole_text
from ._schema import _float_or_none, record_digest, time_key
from ._store_db import _StoreDatabase
from ._verify import _check_record


class _StoreRecording(_StoreDatabase):
    """Writing: each record is one ``BEGIN IMMEDIATE`` transaction with its digest and index rows."""

    def record(
        self, artifact: TrainingArtifact, *, repair: bool = False, blobs: Mapping[str, bytes] | None = None
    ) -> None:
        """Add `artifact`. Recording the same artifact again is a no-op; a different one under its id is an error.

        A damaged record under the same id (one that does not match its digest) is an `ArtifactIntegrityError`,
        or, with ``repair=True`` (``pipekit-train artifacts import``), replaced by `artifact`.

        `blobs` (digest to bytes: the code `TrainingArtifact.code` names, `capture_code`) are added in the same
        transaction, each once: a digest already stored adds no row. So is the artifact's dependency lock: the row
        holds its digest, the ``locks`` table the lock, once however many artifacts share it.
        """
        if not isinstance(artifact, TrainingArtifact):
            raise TypeError(f"ArtifactStore.record expects a TrainingArtifact, got {type(artifact).__name__}")
        for key, data in (blobs or {}).items():
            if blob_digest(data) != key:
                raise ArtifactStoreError(f"blob {key[:19]}... does not hash to its key; refusing to store it")
        fields = artifact.to_dict()
        doc = json.dumps(fields, sort_keys=True)  # `TrainingArtifact.to_json`: the text the digest is of
        digest = record_digest(doc)
        stored, lock_key, lock_text = split_lock(fields, doc)
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
            "record": stored,
            "digest": digest,
            "lock_digest": lock_key,
        }
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                found = conn.execute(
                    "SELECT digest, record, lock_digest FROM artifacts WHERE artifact_id = ?", (artifact.artifact_id,)
                ).fetchall()
                old = self._with_locks(conn, found, 1)[0] if found else None
                if old is not None:
                    if whole_text(old[1]) == doc and old[0] == digest:
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
                if lock_key is not None:  # a damaged row under this digest gets the true text back
                    conn.execute(
                        "INSERT INTO locks (digest, content) VALUES (?, ?) ON CONFLICT (digest) DO UPDATE "
                        "SET content = excluded.content WHERE content IS NOT excluded.content",
                        (lock_key, lock_text),
                    )
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
