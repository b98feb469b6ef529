"""Checks behind `ArtifactStore.verify`: a record against its digest, the index tables against the record, and
the model-registry entry a record points to."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from pipekit import PipekitError

from ._artifact import TrainingArtifact
from ._locks import JoinedRecord, MissingLock
from ._schema import _INDEX_COLUMNS, _float_or_none, record_digest, time_key


def _check_record(artifact_id: str, digest: Any, record: Any) -> tuple[TrainingArtifact | None, str]:
    """(the artifact, "") when the row's record matches its digest and id; else (None, what is wrong).

    `record` is the artifact's JSON text, or a `JoinedRecord` (a stored record and its dependency lock,
    `_StoreDatabase._with_locks`), whose whole text is what the digest is of.
    """
    if isinstance(record, MissingLock):
        return None, f"its dependency lock {record.key[:19]}... is not in the store's locks table"
    if isinstance(record, JoinedRecord):
        text, load = record.text, record.data
    elif isinstance(record, str):
        text, load = record, functools.partial(json.loads, record)
    else:
        return None, f"the record is not JSON text but {type(record).__name__}"
    if not isinstance(digest, str):
        return None, "the record has no digest"
    actual = record_digest(text)
    if actual != digest:
        return None, f"its record hashes to {actual[:19]}..., its digest is {digest[:19]}...; it was changed"
    try:
        artifact = TrainingArtifact.from_dict(load())
    except (PipekitError, ValueError, TypeError, KeyError) as e:
        return None, f"the record is not a valid artifact ({' '.join(str(e).split())})"
    if artifact.artifact_id != artifact_id:
        return None, f"the record under this id is artifact {artifact.artifact_id}'s"
    return artifact, ""


def _run_dir_hint(record: Any) -> str | None:
    """The run directory a (possibly damaged) record names, for the recovery command; ``None`` if it names none."""
    if isinstance(record, JoinedRecord):
        record = record.stored
    try:
        stage_dir = json.loads(record).get("run_dir")
    except (TypeError, ValueError, AttributeError):
        return None
    return os.path.dirname(stage_dir) if isinstance(stage_dir, str) and stage_dir else None


def _index_problems(
    artifact: TrainingArtifact, row: Sequence[Any], parents: list[str], metrics: dict[str, Any], imports: list[Any]
) -> list[str]:
    """Where the index columns and tables beside a record disagree with it (queries would find the wrong rows)."""
    out: list[str] = []
    expected = {
        "started_at": time_key(artifact.started_at),
        "ended_at": time_key(artifact.ended_at) if artifact.ended_at else None,
        **{column: getattr(artifact, field) for column, field in _INDEX_COLUMNS},
    }
    for (column, want), value in zip(expected.items(), row[3:], strict=True):
        if value != want:
            out.append(f"index column {column} is {value!r}, the record says {want!r}")
    if parents != list(artifact.parent_ids):
        out.append(f"parents table lists {parents}, the record says {list(artifact.parent_ids)}")
    want_metrics = {k: _float_or_none(v) for k, v in artifact.final_metrics.items()}
    if metrics != want_metrics:
        names = sorted(k for k in set(metrics) | set(want_metrics) if metrics.get(k) != want_metrics.get(k))
        out.append(f"metrics table disagrees with the record on {', '.join(names)}")
    want_imports = [(m["module"], m["file"], m["sha256"]) for m in artifact.imports]
    if [tuple(r) for r in imports] != want_imports:
        out.append("imports table disagrees with the record")
    return out


def _check_model(uri: str, expected_hash: str | None) -> tuple[str, str] | None:
    """``None`` when the registry entry `uri` names loads with verified hashes; else ("problem" | "warning", text)."""
    from ._model_registry import LocalModelRegistry, ModelRegistryError, parse_model_uri

    try:
        _, query = parse_model_uri(uri)
    except ModelRegistryError as e:
        return "problem", f"model: {e}"
    registry = LocalModelRegistry(query.get("root") or None)
    if not registry.root.is_dir():
        return "warning", f"model {uri}: its registry {registry.root} is gone (moved or deleted); not checked"
    try:
        model = registry.load(uri)
    except ModelRegistryError as e:
        return "problem", f"model: {' '.join(str(e).split())}"
    except Exception as e:  # a damaged file can fail in NumPy or the backend: reported, never a traceback
        return "problem", f"model {uri}: cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())})"
    got = model.weights_hash()
    if expected_hash is not None and got != expected_hash:
        return "problem", f"model {uri}: its weights hash to {got}, the record says {expected_hash}"
    return None


def _blob_problems(rows: Sequence[Sequence[Any]]) -> list[str]:
    """Stored code (``blobs`` rows: digest, size, content) whose bytes no longer hash to their digest or size."""
    from ._code import blob_digest

    out = []
    for digest, size, content in rows:
        data = bytes(content) if isinstance(content, (bytes, memoryview)) else None
        if data is None:
            out.append(f"stored code {digest}: its content is not bytes but {type(content).__name__}")
        elif blob_digest(data) != digest or len(data) != size:
            out.append(
                f"stored code {digest}: its {len(data)} bytes hash to {blob_digest(data)[:19]}...; it was changed"
            )
    return out


def _code_problems(artifact: TrainingArtifact, stored: set[str]) -> list[str]:
    """The blobs an artifact's stored code (`TrainingArtifact.code`) names that the store lacks (warnings)."""
    code = artifact.code
    if not code or not code.get("stored"):
        return []
    wanted = [code.get("patch")] + [f.get("sha256") for f in code.get("files", [])]
    return [
        f"code: stored code {d} is not in this store (an artifact imported from its artifact.json comes without "
        "its code); reproduce --restore-code cannot rebuild it"
        for d in wanted
        if d and d not in stored
    ]
