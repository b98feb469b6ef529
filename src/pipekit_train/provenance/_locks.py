"""Dependency locks kept once in the artifact store: a record names its lock by digest, the ``locks`` table holds it.

A run's `TrainingArtifact.deps_lock` (the lock file's text, the distributions, Python, JAX, the devices: ~10 KB)
is the same for every trial of a sweep on one machine, so the store keeps each distinct lock once, keyed by
``"sha256:<hex>"`` of its JSON text (`lock_digest`), as the ``blobs`` table keeps code. The record in the
``artifacts`` table is the artifact's JSON with the lock's value replaced by that digest (still JSON, so SQL can
read its other fields), and its ``lock_digest`` column names the lock.

The split is exact: `join_lock` of the parts gives back, character for character, the JSON text the record's
``digest`` was computed from (`TrainingArtifact.to_json`), and `split_lock` keeps a record whole (``lock_digest``
NULL) whenever it would not, so the digest still covers the whole artifact, lock included: a changed lock row is
caught on read like a changed record. `split_record_text` is the same split for a record already in a file (the
migration to schema 6, through the SQL functions `register_lock_functions` adds).
"""

from __future__ import annotations

import functools
import json
import sqlite3
from typing import Any

from ._schema import record_digest

__all__ = [
    "JoinedRecord",
    "MissingLock",
    "join_lock",
    "lock_digest",
    "register_lock_functions",
    "split_lock",
    "split_record_text",
    "whole_text",
]

#: The names of the SQL functions the migration to schema 6 calls (`register_lock_functions`).
LOCK_DIGEST_SQL = "pipekit_lock_digest"
LOCK_TEXT_SQL = "pipekit_lock_text"
RECORD_WITHOUT_LOCK_SQL = "pipekit_record_without_lock"


class MissingLock:
    """Stands for a record whose lock row is gone: `_verify._check_record` names the lock rather than the digest."""

    def __init__(self, key: str) -> None:
        self.key = key


class JoinedRecord:
    """A stored record and its lock, read back: `text` is the artifact's whole JSON text (what its digest is of),
    `data` the parsed artifact. A query's rows share one parsed lock (`lock`: a lock is parsed once per read, not
    once per artifact); `data` gives each artifact its own copy."""

    __slots__ = ("key", "lock", "lock_text", "stored")

    def __init__(self, stored: str, key: str, lock_text: str, lock: Any) -> None:
        self.stored, self.key, self.lock_text, self.lock = stored, key, lock_text, lock

    @property
    def text(self) -> str:
        return join_lock(self.stored, self.key, self.lock_text)

    def data(self) -> Any:
        """``json.loads(self.text)``, without parsing the lock again."""
        out = json.loads(self.stored)
        if isinstance(out, dict):
            out["deps_lock"] = _copy(self.lock)
        return out


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _copy(value: Any) -> Any:
    """A copy of JSON data (dicts and lists new, the rest immutable); a flat dict or list (the distributions, the
    devices) is copied in one call."""
    if isinstance(value, dict):
        if all(type(v) in _SCALARS for v in value.values()):
            return dict(value)
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        if all(type(v) in _SCALARS for v in value):
            return list(value)
        return [_copy(v) for v in value]
    return value


def whole_text(record: Any) -> str | None:
    """The artifact's whole JSON text of a record read back (a `str` or a `JoinedRecord`); ``None`` otherwise."""
    if isinstance(record, JoinedRecord):
        return record.text
    return record if isinstance(record, str) else None


def lock_digest(text: str) -> str:
    """A lock's key in the ``locks`` table: ``"sha256:<hex>"`` of its JSON text (UTF-8)."""
    return record_digest(text)


def _placeholder(key: str) -> str:
    return f'"deps_lock": "{key}"'


def join_lock(stored: str, key: str, lock_text: str) -> str:
    """The artifact's JSON text from its stored record (the lock's value replaced by `key`) and the lock's text."""
    return stored.replace(_placeholder(key), '"deps_lock": ' + lock_text, 1)


def split_lock(data: dict[str, Any], doc: str) -> tuple[str, str | None, str | None]:
    """``(stored record, lock digest, lock text)`` for an artifact's `to_dict` `data` and its JSON text `doc`.

    ``(doc, None, None)`` when there is nothing to share (no lock, an empty one) or when the parts would not join
    back to `doc` exactly (a record not written by `TrainingArtifact.to_json`, a value elsewhere in it that reads
    like the placeholder): such a record is kept whole, as before schema 6.
    """
    lock = data.get("deps_lock")
    if not isinstance(lock, dict) or not lock:
        return doc, None, None
    lock_text = json.dumps(lock, sort_keys=True)
    key = lock_digest(lock_text)
    stored = json.dumps({**data, "deps_lock": key}, sort_keys=True)
    if join_lock(stored, key, lock_text) != doc:
        return doc, None, None
    return stored, key, lock_text


@functools.lru_cache(maxsize=4)  # the migration calls the three SQL functions on one record in turn
def split_record_text(doc: str) -> tuple[str, str | None, str | None]:
    """`split_lock` of a record's JSON text; a record that is not a JSON object is kept whole."""
    try:
        data = json.loads(doc)
    except ValueError:
        return doc, None, None
    if not isinstance(data, dict):
        return doc, None, None
    return split_lock(data, doc)


def register_lock_functions(conn: sqlite3.Connection) -> None:
    """Add the SQL functions the migration to schema 6 splits the records with (``NULL`` for a record kept whole)."""

    def part(index: int) -> Any:
        def function(doc: Any) -> str | None:
            if not isinstance(doc, str):
                return None
            parts = split_record_text(doc)
            return parts[index] if parts[1] is not None else None

        return function

    conn.create_function(LOCK_DIGEST_SQL, 1, part(1), deterministic=True)
    conn.create_function(LOCK_TEXT_SQL, 1, part(2), deterministic=True)
    conn.create_function(RECORD_WITHOUT_LOCK_SQL, 1, part(0), deterministic=True)
