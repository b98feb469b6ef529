"""Verifying the artifact store: every record's digest and index rows, lineage links, evaluation records, stored
code and dependency locks, the models the records name, and SQLite's own integrity checks (`ArtifactStore.verify`).

Part of `ArtifactStore` (``_store.py``); the checks of one record or row are in ``_verify.py``.
"""

from __future__ import annotations

from typing import Any

from ._locks import lock_digest
from ._schema import _INDEX_COLUMNS, record_digest
from ._store_query import _StoreQueries
from ._verify import _blob_problems, _check_model, _check_record, _code_problems, _index_problems


class _StoreVerification(_StoreQueries):
    """`verify`: the whole store, or one artifact and what it points to."""

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
                selected = conn.execute(
                    f"SELECT artifact_id, digest, record, lock_digest, started_at, ended_at, {columns} FROM artifacts "
                    "WHERE artifact_id = ?",
                    (aid,),
                ).fetchall()
                (row,) = self._with_locks(conn, selected, 2)
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
            lock_rows = conn.execute("SELECT digest, content FROM locks").fetchall()
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
            problems += [(None, text) for text in _lock_problems(lock_rows)]
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


def _lock_problems(rows: list[tuple[str, str]]) -> list[str]:
    """Stored dependency locks (``locks`` rows: digest, JSON text) whose text no longer hashes to their digest."""
    return [
        f"stored dependency lock {digest}: its text hashes to {lock_digest(text)[:19]}...; it was changed"
        if isinstance(text, str)
        else f"stored dependency lock {digest}: its content is not text but {type(text).__name__}"
        for digest, text in rows
        if not isinstance(text, str) or lock_digest(text) != digest
    ]


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
