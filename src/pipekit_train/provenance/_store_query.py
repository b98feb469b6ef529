"""Reading the artifact store: one artifact by id or prefix, queries by hash, metric and time, lineage, the diff of
two artifacts, stored code, evaluation records; every record read has its digest checked.

Part of `ArtifactStore` (``_store.py``).
"""

from __future__ import annotations

import datetime as _dt
import difflib
import sqlite3
from collections.abc import Sequence
from typing import Any

from ._artifact import TrainingArtifact
from ._code import blob_digest
from ._errors import ArtifactIntegrityError, ArtifactStoreError, UnknownArtifactError
from ._schema import record_digest, time_key
from ._store_db import _StoreDatabase

_OPS = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "=", "=": "=", "!=": "!="}
_MAX_DEPTH = 1000


class _StoreQueries(_StoreDatabase):
    """Finding artifacts and following their lineage."""

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
            rows = conn.execute(
                "SELECT artifact_id, digest, record, lock_digest FROM artifacts WHERE artifact_id = ?", (full,)
            ).fetchall()
            (row,) = self._with_locks(conn, rows, 2)
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
        sql = "SELECT a.artifact_id, a.digest, a.record, a.lock_digest FROM artifacts a"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at DESC, artifact_id"
        if limit is not None:
            if limit < 0:
                raise ArtifactStoreError(f"query limit must be a non-negative int, got {limit}")
            sql += " LIMIT ?"
            args.append(int(limit))
        with self._connect() as conn:
            rows = self._with_locks(conn, conn.execute(sql, args), 2)
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
            SELECT up.id, MIN(up.depth) AS d, a.digest, a.record, a.lock_digest
            FROM up LEFT JOIN artifacts a ON a.artifact_id = up.id
            WHERE up.id != ? GROUP BY up.id ORDER BY d, up.id"""
        descendants_sql = f"""
            WITH RECURSIVE down(id, depth) AS (
                SELECT child_id, 1 FROM parents WHERE parent_id = ?
                UNION
                SELECT p.child_id, down.depth + 1 FROM parents p JOIN down ON p.parent_id = down.id
                WHERE down.depth < {_MAX_DEPTH}
            )
            SELECT down.id, MIN(down.depth) AS d, a.digest, a.record, a.lock_digest
            FROM down JOIN artifacts a ON a.artifact_id = down.id
            WHERE down.id != ? GROUP BY down.id ORDER BY d, a.started_at, down.id"""
        with self._connect() as conn:
            up = self._with_locks(conn, conn.execute(ancestors_sql, (root, root)), 3)
            down = self._with_locks(conn, conn.execute(descendants_sql, (root, root)), 3)
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
