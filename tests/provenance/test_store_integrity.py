"""Integrity of the artifact store: record digests checked on every read, `artifacts verify`, damaged files."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from pipekit_train.provenance import ArtifactIntegrityError
from pipekit_train.provenance._artifact import TrainingArtifact
from pipekit_train.provenance._store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ArtifactStore,
    ArtifactStoreError,
    record_digest,
)

DATASET = "sha256:" + "d1" * 32


def _art(artifact_id: str, **changes) -> TrainingArtifact:
    base = dict(
        artifact_id=artifact_id,
        run_id="run-1",
        training_pipeline_yaml="pipekit: 1\ntype: TrainingLoop\nmax_steps: 10\n",
        dataset_hash=DATASET,
        backend="equinox",
        started_at="2026-05-01T12:00:00+00:00",
        final_metrics={"train/loss": 0.5},
        seed=0,
    )
    base.update(changes)
    return TrainingArtifact(**base)


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    s = ArtifactStore(tmp_path / "artifacts.sqlite")
    s.record(_art("aaaa0001", run_dir=str(tmp_path / "runs" / "r1" / "stage0")))
    s.record(_art("aaaa0002", stage="stage1", parent_ids=("aaaa0001",), started_at="2026-05-02T00:00:00Z"))
    return s


def _flip_bit_in_dataset_hash(path: Path, artifact_id: str) -> str:
    """Flip one bit of one character of the record's dataset_hash, in place, keeping the digest as it was."""
    with sqlite3.connect(path) as conn:
        (record,) = conn.execute("SELECT record FROM artifacts WHERE artifact_id = ?", (artifact_id,)).fetchone()
        at = record.index(DATASET) + len("sha256:") + 5
        flipped = record[:at] + chr(ord(record[at]) ^ 1) + record[at + 1 :]
        assert flipped != record and len(flipped) == len(record)
        conn.execute("UPDATE artifacts SET record = ? WHERE artifact_id = ?", (flipped, artifact_id))
    return flipped


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from pipekit_train.cli._artifacts import main

    code = main(["artifacts", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_record_carries_the_digest_of_its_json(store: ArtifactStore):
    with sqlite3.connect(store.path) as conn:
        rows = conn.execute("SELECT record, digest FROM artifacts").fetchall()
    assert len(rows) == 2
    for record, digest in rows:
        assert digest == record_digest(record) and digest.startswith("sha256:")
    assert store.get("aaaa0001").to_json() == rows[0][0] or store.get("aaaa0001").to_json() == rows[1][0]


def test_a_flipped_bit_is_refused_on_every_read_path(store: ArtifactStore):
    _flip_bit_in_dataset_hash(store.path, "aaaa0001")
    pattern = r"artifacts.sqlite: artifact aaaa0001 is damaged .*restore .* from its backup.*artifacts import"
    with pytest.raises(ArtifactIntegrityError, match=pattern) as info:
        store.get("aaaa0001")
    assert info.value.artifact_id == "aaaa0001" and isinstance(info.value, ArtifactStoreError)
    assert str(Path(str(store.path)).parent / "runs" / "r1") in str(info.value)  # the run named in the record
    for read in (
        lambda: store.query(),
        lambda: store.query(dataset_hash="sha256:d1"),
        lambda: store.lineage("aaaa0002"),
        lambda: store.diff("aaaa0001", "aaaa0002"),
    ):
        with pytest.raises(ArtifactIntegrityError, match="aaaa0001"):
            read()
    assert store.get("aaaa0002").parent_ids == ("aaaa0001",)  # the intact record is still readable


def test_show_fails_and_verify_reports_the_damaged_record(store: ArtifactStore, capsys):
    s = str(store.path)
    code, out, err = _cli(capsys, "verify", "--all", "--store", s)
    assert code == 0, out + err
    assert out.strip().splitlines()[-1] == f"verified 2 artifact(s) in {s}: ok"
    _flip_bit_in_dataset_hash(store.path, "aaaa0001")
    code, out, err = _cli(capsys, "show", "aaaa0001", "--store", s)
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "artifact aaaa0001 is damaged" in err and s in err
    code, out, err = _cli(capsys, "verify", "--all", "--store", s)
    assert code == 1
    lines = out.strip().splitlines()
    assert lines[0].startswith("aaaa0001  record does not match its digest")
    assert f"verified 2 artifact(s) in {s}: 1 problem(s)" in lines
    code, out, _ = _cli(capsys, "verify", "aaaa0002", "--store", s)
    assert code == 0, out
    code, out, _ = _cli(capsys, "verify", "aaaa0001", "--store", s, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["problems"][0]["artifact_id"] == "aaaa0001"
    code, _, err = _cli(capsys, "verify", "--store", s)
    assert code == 2 and "an artifact ID or --all" in err


def test_import_from_the_runs_own_record_repairs_it(store: ArtifactStore, capsys, tmp_path: Path):
    good = store.get("aaaa0001")
    _flip_bit_in_dataset_hash(store.path, "aaaa0001")
    stage = tmp_path / "runs" / "r1" / "stage0"
    stage.mkdir(parents=True)
    (stage / "artifact.json").write_text(json.dumps(good.to_dict()))
    with pytest.raises(ArtifactIntegrityError):  # a plain record() never overwrites, even a damaged record
        store.record(good)
    code, out, err = _cli(capsys, "import", str(tmp_path / "runs" / "r1"), "--store", str(store.path))
    assert code == 0, err
    assert out.startswith("repaired aaaa0001")
    assert store.get("aaaa0001") == good
    assert store.verify()["problems"] == []
    store.record(good)  # the same artifact again: a no-op


def test_verify_finds_index_lineage_and_sqlite_problems(store: ArtifactStore):
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE artifacts SET dataset_hash = 'sha256:ff' WHERE artifact_id = 'aaaa0002'")
        conn.execute("UPDATE metrics SET value = 0.1 WHERE artifact_id = 'aaaa0002'")
    store.record(_art("cccc0003", parent_ids=("gone0000",)))
    problems = store.verify(models=False)["problems"]
    texts = sorted(f"{a} {t}" for a, t in problems)
    assert any(t.startswith("aaaa0002 index column dataset_hash is 'sha256:ff'") for t in texts), texts
    assert any(t.startswith("aaaa0002 metrics table disagrees") for t in texts), texts
    assert any(t == "cccc0003 lineage: parent gone0000 is not in this store" for t in texts), texts
    assert len(problems) == 3


def test_verify_checks_the_model_registry_entry(tmp_path: Path):
    store = ArtifactStore(tmp_path / "a.sqlite")
    gone = "pipekit-model:sha256:" + "ab" * 32 + "?root=" + str(tmp_path / "no-such-registry")
    missing = "pipekit-model:sha256:" + "cd" * 32 + "?root=" + str(tmp_path)
    store.record(_art("m0000001", model_registry_uri=gone))
    store.record(_art("m0000002", model_registry_uri=missing))
    report = store.verify()
    assert [a for a, _ in report["warnings"]] == ["m0000001"] and "is gone" in report["warnings"][0][1]
    assert [a for a, _ in report["problems"]] == ["m0000002"] and "no model" in report["problems"][0][1]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_store_file_is_one_line(store: ArtifactStore, capsys, damage: str):
    with sqlite3.connect(store.path) as conn:  # everything into the main file, so that truncating it hurts
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = store.path.read_bytes()
    for suffix in ("-wal", "-shm"):
        Path(str(store.path) + suffix).unlink(missing_ok=True)
    store.path.write_bytes(
        {"garbage": b"this is not a database\n" * 400, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    s = str(store.path)
    for argv in (("show", "aaaa0001"), ("lineage", "aaaa0001"), ("list",), ("verify", "--all")):
        code, out, err = _cli(capsys, *argv, "--store", s)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, (argv, out, err)
        assert s in lines[0] and "backup" in lines[0] and "artifacts import" in lines[0], lines[0]
    if damage == "garbage":
        with pytest.raises(ArtifactIntegrityError, match=r"the artifact store is damaged \(SQLite: file is not a"):
            ArtifactStore(s).get("aaaa0001")


def test_migration_to_v3_adds_the_digest_of_the_records_it_trusted(tmp_path: Path):
    path = tmp_path / "v2.sqlite"
    old = _art("0ld00001")
    with sqlite3.connect(path) as conn:
        for step in MIGRATIONS[:2]:
            for statement in step:
                conn.execute(statement)
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (2)")
        conn.execute(
            "INSERT INTO artifacts VALUES (?, 'run-1', 'stage0', ?, ?, 'equinox', NULL, NULL, NULL, "
            "'completed', '2026-05-01T12:00:00.000000+00:00', NULL, 0, ?)",
            ("0ld00001", old.pipeline_hash, DATASET, old.to_json()),
        )
        conn.execute("INSERT INTO metrics VALUES ('0ld00001', 'train/loss', 0.5)")
    store = ArtifactStore(path)
    assert store.get("0ld0") == old
    assert store.schema_version() == SCHEMA_VERSION == 6
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT digest FROM artifacts").fetchone()[0] == record_digest(old.to_json())
    assert store.verify()["problems"] == []
    _flip_bit_in_dataset_hash(path, "0ld00001")
    with pytest.raises(ArtifactIntegrityError, match="0ld00001"):
        store.get("0ld00001")


def _evaluation(evaluation_id: str, artifact_id: str | None, accuracy: float) -> dict:
    return {
        "evaluation_id": evaluation_id,
        "artifact_id": artifact_id,
        "model_hash": "sha256:" + "ab" * 32,
        "dataset_hash": DATASET,
        "created_at": "2026-05-03T00:00:00Z",
        "metrics": {"accuracy": accuracy, "loss": float("nan")},
    }


def test_verify_checks_evaluation_records(store: ArtifactStore, capsys):
    store.record_evaluation(_evaluation("eval0001", "aaaa0001", 0.9))
    store.record_evaluation(_evaluation("eval0002", "aaaa0002", 0.8))
    store.record_evaluation(_evaluation("eval0003", None, 0.7))
    report = store.verify(models=False)
    assert (report["evaluations"], report["problems"]) == (3, [])  # a NaN metric (NULL in SQLite) is not damage
    assert store.verify("aaaa0002", models=False)["evaluations"] == 1
    with sqlite3.connect(store.path) as conn:
        conn.execute(
            "UPDATE evaluation_metrics SET value = 0.99 WHERE evaluation_id = 'eval0001' AND name = 'accuracy'"
        )
        (doc,) = conn.execute("SELECT record FROM evaluations WHERE evaluation_id = 'eval0003'").fetchone()
        conn.execute("UPDATE evaluations SET record = ? WHERE evaluation_id = 'eval0003'", (doc.replace("0.7", "0.8"),))
    problems = sorted(f"{a} {t}" for a, t in store.verify(models=False)["problems"])
    assert len(problems) == 2, problems
    assert problems[0].startswith("None evaluation eval0003: record does not match its digest"), problems
    assert problems[1].startswith("aaaa0001 evaluation eval0001: its evaluation_metrics rows"), problems
    code, out, _ = _cli(capsys, "verify", "--all", "--store", str(store.path), "--no-models")
    assert code == 1
    assert "verified 2 artifact(s) and 3 evaluation(s)" in out
    assert "store  evaluation eval0003: record does not match its digest" in out
