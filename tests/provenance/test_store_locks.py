"""Dependency locks kept once in the artifact store (schema 6, ``_locks.py``), and the migration of a schema-5 store.

The schema-5 store is ``data/store_v5.sql``: the SQL dump of a store written by the previous code (commit 1fc76cf,
``data/store_v5_make.py``), with what that code answered in ``data/store_v5_answers.json``. It is replayed into a
fresh file here, so nothing depends on another process's files.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipekit_train.provenance import _locks
from pipekit_train.provenance._artifact import TrainingArtifact
from pipekit_train.provenance._errors import ArtifactIntegrityError
from pipekit_train.provenance._schema import record_digest
from pipekit_train.provenance._store import SCHEMA_VERSION, ArtifactStore

DATA = Path(__file__).parent / "data"
LOCK = {
    "lock_file": "jax==0.10.2\noptax==0.2.8\n" * 20,
    "lock_path": "/proj/requirements.lock",
    "distributions": {"jax": "0.10.2", "optax": "0.2.8"},
    "python": "3.11.9",
    "jax": "0.10.2",
    "devices": ["cpu:0 cpu"],
}


def _v5_store(path: Path) -> ArtifactStore:
    """The schema-5 store of ``data/store_v5.sql``, replayed into `path` (not yet opened by today's code)."""
    with sqlite3.connect(path) as conn:
        conn.executescript((DATA / "store_v5.sql").read_text(encoding="utf-8"))
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(5,)]
    conn.close()
    return ArtifactStore(path)


@pytest.fixture(scope="module")
def answers() -> dict[str, Any]:
    return json.loads((DATA / "store_v5_answers.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    store = _v5_store(tmp_path_factory.mktemp("v5") / "artifacts.sqlite")
    assert store.schema_version() == SCHEMA_VERSION == 6  # opening it migrated it
    return store


def _cli(store: ArtifactStore, argv: list[str]) -> dict[str, Any]:
    from pipekit_train.cli._artifacts import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["artifacts", *argv, "--store", str(store.path)])
    return {"argv": argv, "code": code, "out": out.getvalue().replace(str(store.path), "STORE")}


def _answers(store: ArtifactStore, old: dict[str, Any]) -> dict[str, Any]:
    """What `store` answers to the questions ``data/store_v5_make.py`` asked the schema-5 code."""
    ids = list(old["records"])
    return {
        "records": {i: store.get(i).to_json() for i in ids},
        "queries": {
            "all": [a.artifact_id for a in store.query()],
            "sweep": [a.artifact_id for a in store.query(sweep="lr")],
            "imported": [a.artifact_id for a in store.query(imported="my_losses")],
            "metric": [a.artifact_id for a in store.query(metrics=[("train/loss", "<", 0.4)])],
            "stopped": [a.artifact_id for a in store.query(status="stopped")],
        },
        "lineage": {
            i: {k: [getattr(a, "artifact_id", a) for a in v] for k, v in store.lineage(i).items()} for i in ids
        },
        "diff": {key: store.diff(*key.split()) for key in old["diff"]},
        "verify": {k: v for k, v in store.verify(models=False).items() if k != "store"},
        "cli": [_cli(store, c["argv"]) for c in old["cli"]],
    }


def test_a_schema_5_store_migrates_and_answers_every_question_as_before(migrated, answers):
    got = json.loads(json.dumps(_answers(migrated, answers)))  # tuples as the JSON file holds them
    for section in answers:
        assert got[section] == answers[section], section
    with sqlite3.connect(migrated.path) as conn:
        rows = conn.execute("SELECT artifact_id, lock_digest, record FROM artifacts ORDER BY artifact_id").fetchall()
        locks = dict(conn.execute("SELECT digest, content FROM locks").fetchall())
    # three distinct locks among six artifacts that have one; the empty lock stays in its record
    assert len(locks) == 3 and all(_locks.lock_digest(text) == key for key, text in locks.items())
    assert [r[0] for r in rows if r[1] is None] == ["c0000001"]
    for aid, key, stored in rows:
        if key is not None:
            assert json.loads(stored)["deps_lock"] == key  # still JSON: SQL reads its other fields
            assert _locks.join_lock(stored, key, locks[key]) == answers["records"][aid]


def test_new_records_share_a_lock_with_the_migrated_ones(migrated, answers):
    old = TrainingArtifact.from_json(answers["records"]["a0000001"])
    new = old.replace(artifact_id="n0000001", run_id="after", parent_ids=("a0000001",))
    migrated.record(new)
    migrated.record(new)  # the same artifact again: a no-op
    with sqlite3.connect(migrated.path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM locks").fetchone()[0] == 3
        digest, stored = conn.execute("SELECT digest, record FROM artifacts WHERE artifact_id = 'n0000001'").fetchone()
    assert digest == record_digest(new.to_json()) and len(stored) < len(new.to_json()) - 1000
    assert ArtifactStore(migrated.path).get("n0000001") == new
    assert "n0000001" in [a.artifact_id for a in migrated.lineage("a0000001")["descendants"]]


def test_a_migration_that_fails_midway_leaves_the_schema_5_store(tmp_path: Path, monkeypatch, answers):
    path = tmp_path / "v5.sqlite"
    _v5_store(path)
    before = sqlite3.connect(path).execute("SELECT artifact_id, record FROM artifacts").fetchall()
    calls = {"n": 0}
    split = _locks.split_record_text.__wrapped__

    def failing(doc: str) -> Any:
        calls["n"] += 1
        if calls["n"] > 4:  # after some rows were split and written
            raise RuntimeError("killed midway")
        return split(doc)

    monkeypatch.setattr(_locks, "split_record_text", failing)
    with pytest.raises(Exception, match="killed midway|user-defined function raised"):
        len(ArtifactStore(path))
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(5,)]
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'locks'").fetchall() == []
        assert conn.execute("SELECT artifact_id, record FROM artifacts").fetchall() == before
    monkeypatch.undo()
    store = ArtifactStore(path)
    assert store.schema_version() == 6 and store.get("a0000002").to_json() == answers["records"]["a0000002"]
    assert ArtifactStore(path).schema_version() == 6  # opened again: nothing to do


def test_a_killed_migration_leaves_the_schema_5_store(tmp_path: Path, answers):
    """SIGKILL inside the migration's transaction (a real process, killed midway): the file is the old store."""
    path = tmp_path / "v5.sqlite"
    _v5_store(path)
    script = textwrap.dedent(
        f"""
        import os, signal
        from pipekit_train.provenance import _locks
        from pipekit_train.provenance._store import ArtifactStore
        split, calls = _locks.split_record_text.__wrapped__, []
        def dying(doc):
            calls.append(1)
            if len(calls) > 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return split(doc)
        _locks.split_record_text = dying
        len(ArtifactStore({str(path)!r}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120, check=False)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    copy = tmp_path / "copy.sqlite"  # what is on disk, WAL included, read without migrating
    for suffix in ("", "-wal"):
        if Path(f"{path}{suffix}").exists():
            shutil.copy(f"{path}{suffix}", f"{copy}{suffix}")
    with sqlite3.connect(copy) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(5,)]
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'locks'").fetchall() == []
    store = ArtifactStore(path)
    assert store.schema_version() == 6
    assert store.verify(models=False)["problems"] == [("a0000003", "lineage: parent gone0001 is not in this store")]
    assert store.get("a0000003").to_json() == answers["records"]["a0000003"]


def test_a_changed_or_lost_lock_is_damage_on_every_read_and_in_verify(tmp_path: Path):
    store = ArtifactStore(tmp_path / "a.sqlite")
    a = TrainingArtifact(artifact_id="l0000001", run_id="r", deps_lock=LOCK, started_at="2026-05-01T00:00:00Z")
    b = a.replace(artifact_id="l0000002", parent_ids=("l0000001",))
    store.record(a)
    store.record(b)
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM locks").fetchone()[0] == 1
        conn.execute("UPDATE locks SET content = replace(content, '0.10.2', '0.10.3')")
    for read in (lambda: store.get("l0000001"), store.query, lambda: store.lineage("l0000002")):
        with pytest.raises(ArtifactIntegrityError, match="l000000[12] is damaged .*hashes to"):
            read()
    report = store.verify(models=False)
    assert {aid for aid, _ in report["problems"]} == {None, "l0000001", "l0000002"}
    assert any("stored dependency lock sha256:" in text for _, text in report["problems"])
    store.record(a.replace(artifact_id="l0000003"))  # recording the true lock again puts its text back
    assert store.get("l0000001") == a and store.verify(models=False)["problems"] == []
    with sqlite3.connect(store.path) as conn:
        conn.execute("DELETE FROM locks")
    with pytest.raises(ArtifactIntegrityError, match=r"l0000002 is damaged \(its dependency lock sha256:.* is not in"):
        store.get("l0000002")
    store.record(b, repair=True)  # `artifacts import` repairs it
    assert store.get("l0000002") == b


def test_split_keeps_whole_what_would_not_join_back_exactly():
    data = TrainingArtifact(artifact_id="x1", deps_lock=LOCK).to_dict()
    doc = json.dumps(data, sort_keys=True)
    stored, key, text = _locks.split_lock(data, doc)
    assert key == _locks.lock_digest(text) and _locks.join_lock(stored, key, text) == doc
    assert _locks.split_lock({**data, "deps_lock": {}}, doc)[1] is None  # nothing to share
    assert _locks.split_record_text(json.dumps(data))[1] is None  # keys not sorted: not to_json's text
    decoy = {**data, "backend_info": {"x": '"deps_lock": "' + key + '"', "deps_lock": key}}
    decoy_doc = json.dumps(decoy, sort_keys=True)
    assert _locks.split_lock(decoy, decoy_doc) == (decoy_doc, None, None)  # the placeholder would be found first
    assert _locks.split_record_text("not json")[1] is None and _locks.split_record_text("[1]")[1] is None
