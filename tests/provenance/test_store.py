"""ArtifactStore: every query filter, lineage, diff, schema versions, id lookup, and 8 concurrent writer processes."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipekit_train.provenance._artifact import TrainingArtifact
from pipekit_train.provenance._store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ArtifactStore,
    ArtifactStoreError,
    UnknownArtifactError,
)

YAML_A = "pipekit: 1\ntype: TrainingLoop\nmax_steps: 10\nbatch_size: 32\n"
YAML_B = "pipekit: 1\ntype: TrainingLoop\nmax_steps: 20\nbatch_size: 32\n"
DEPS_A = {"lock_file": None, "distributions": {"jax": "0.10.2", "optax": "0.2.8", "grain": "0.2.18"}, "python": "3.11"}
DEPS_B = {"lock_file": None, "distributions": {"jax": "0.10.3", "optax": "0.2.8", "numpy": "2.0"}, "python": "3.11"}


def _art(artifact_id: str, **changes) -> TrainingArtifact:
    base = dict(
        artifact_id=artifact_id,
        run_id="run-1",
        stage="stage0",
        training_pipeline_yaml=YAML_A,
        dataset_hash="sha256:" + "d1" * 32,
        backend="equinox",
        deps_lock=DEPS_A,
        trained_model_hash="sha256:" + "m1" * 32,
        started_at="2026-05-01T12:00:00+00:00",
        ended_at="2026-05-01T12:01:00+00:00",
        final_metrics={"train/loss": 0.5, "validate/accuracy": 0.8},
        seed=0,
        git={"commit": "c" * 40, "dirty": False, "diff_hash": None},
    )
    base.update(changes)
    return TrainingArtifact(**base)


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    s = ArtifactStore(tmp_path / "artifacts.sqlite")
    s.record(_art("aaaa0001"))
    s.record(
        _art(
            "aaaa0002",
            stage="finetune",
            parent_ids=("aaaa0001",),
            training_pipeline_yaml=YAML_B,
            dataset_hash="sha256:" + "d2" * 32,
            trained_model_hash="sha256:" + "m2" * 32,
            started_at="2026-05-02T12:00:00+02:00",  # 10:00 UTC
            final_metrics={"train/loss": 0.2, "validate/accuracy": 0.95},
        )
    )
    s.record(
        _art(
            "bbbb0003",
            run_id="run-2",
            backend="keras",
            started_at="2026-05-03T00:00:00Z",
            final_metrics={"train/loss": 0.9},
            status="failed",
        )
    )
    s.record(_art("cccc0004", run_id="run-3", started_at="2026-05-04T00:00:00", status="stopped: patience"))
    return s


def _ids(artifacts) -> list[str]:
    return [a.artifact_id for a in artifacts]


def test_record_and_get_round_trip_with_prefixes(store: ArtifactStore):
    assert len(store) == 4
    assert store.get("aaaa0002") == _ids_get(store, "aaaa0002")
    assert store.get("bbbb").artifact_id == "bbbb0003"  # a unique prefix, as in git
    art = store.get("aaaa0002")
    assert art.parent_ids == ("aaaa0001",) and art.final_metrics["validate/accuracy"] == 0.95
    store.record(art)  # recording the same artifact again changes nothing
    assert len(store) == 4


def _ids_get(store: ArtifactStore, artifact_id: str) -> TrainingArtifact:
    (match,) = [a for a in store.query() if a.artifact_id == artifact_id]
    return match


def test_bad_ids_name_the_id_and_the_close_ones(store: ArtifactStore):
    with pytest.raises(UnknownArtifactError, match=r"no artifact with id 'aaaa0009' .*closest ids: aaaa0001, aaaa0002"):
        store.get("aaaa0009")
    with pytest.raises(UnknownArtifactError, match=r"prefix 'aaaa' is ambiguous .*aaaa0001, aaaa0002; give more"):
        store.get("aaaa")
    with pytest.raises(UnknownArtifactError, match=r"no artifact with id 'zzzz' .*\(4 artifacts recorded\)"):
        store.get("zzzz")
    with pytest.raises(UnknownArtifactError, match=r"non-empty string, got ''"):
        store.get("")


def test_a_different_artifact_under_a_recorded_id_is_refused(store: ArtifactStore):
    with pytest.raises(ArtifactStoreError, match=r"already holds a different artifact with id 'aaaa0001'"):
        store.record(_art("aaaa0001", seed=5))


def test_query_every_filter(store: ArtifactStore):
    assert _ids(store.query()) == ["cccc0004", "bbbb0003", "aaaa0002", "aaaa0001"]  # newest first
    assert _ids(store.query(dataset_hash="sha256:" + "d2" * 32)) == ["aaaa0002"]
    assert _ids(store.query(dataset_hash="sha256:d2d2")) == ["aaaa0002"]  # a prefix of a hash
    assert _ids(store.query(pipeline_hash=store.get("aaaa0002").pipeline_hash)) == ["aaaa0002"]
    assert _ids(store.query(model_hash="sha256:m2")) == ["aaaa0002"]
    assert _ids(store.query(backend="keras")) == ["bbbb0003"]
    assert _ids(store.query(stage="finetune")) == ["aaaa0002"]
    assert _ids(store.query(run_id="run-1")) == ["aaaa0002", "aaaa0001"]
    assert _ids(store.query(status="failed")) == ["bbbb0003"]
    assert _ids(store.query(status="stopped")) == ["cccc0004"]
    # Times compare in UTC whatever offset they were written with; naive times are UTC.
    assert _ids(store.query(since="2026-05-02T10:00:00Z")) == ["cccc0004", "bbbb0003", "aaaa0002"]
    assert _ids(store.query(since="2026-05-02T10:00:01Z")) == ["cccc0004", "bbbb0003"]
    assert _ids(store.query(until="2026-05-02")) == ["aaaa0001"]
    assert _ids(store.query(since="2026-05-02", until="2026-05-03T00:00:00+00:00")) == ["bbbb0003", "aaaa0002"]
    assert _ids(store.query(metrics=[("validate/accuracy", ">=", 0.9)])) == ["aaaa0002"]
    assert _ids(store.query(metrics=[("validate/accuracy", "<", 0.9)])) == ["cccc0004", "aaaa0001"]
    assert _ids(store.query(metrics=[("train/loss", "==", 0.9)])) == ["bbbb0003"]
    assert _ids(store.query(metrics=[("train/loss", "!=", 0.5)])) == ["bbbb0003", "aaaa0002"]
    assert _ids(store.query(metrics=[("train/loss", "<=", 0.5), ("validate/accuracy", ">", 0.9)])) == ["aaaa0002"]
    assert _ids(store.query(run_id="run-1", stage="stage0", backend="equinox")) == ["aaaa0001"]
    assert _ids(store.query(limit=2)) == ["cccc0004", "bbbb0003"]
    assert store.query(backend="lightning") == []


def test_query_errors_name_the_rule(store: ArtifactStore):
    with pytest.raises(ArtifactStoreError, match=r"operator must be one of .*got '=>'"):
        store.query(metrics=[("validate/accuracy", "=>", 0.9)])
    with pytest.raises(ArtifactStoreError, match=r"a metric filter is \(name, op, number\)"):
        store.query(metrics=[("validate/accuracy>=0.9",)])
    with pytest.raises(ArtifactStoreError, match=r"metric filter is .*got \('loss', '<', 'low'\)"):
        store.query(metrics=[("loss", "<", "low")])
    with pytest.raises(ArtifactStoreError, match=r"not an ISO-8601 time: 'last tuesday'"):
        store.query(since="last tuesday")
    with pytest.raises(ArtifactStoreError, match=r"limit must be a non-negative int, got -1"):
        store.query(limit=-1)


def test_lineage_across_a_chain_of_three(tmp_path: Path):
    store = ArtifactStore(tmp_path / "a.sqlite")
    store.record(_art("pre", stage="pretrain", parent_ids=("elsewhere",)))
    store.record(_art("mid", stage="finetune", parent_ids=("pre",), started_at="2026-05-02T00:00:00Z"))
    store.record(_art("end", stage="distill", parent_ids=("mid",), started_at="2026-05-03T00:00:00Z"))
    store.record(_art("side", stage="probe", parent_ids=("pre",), started_at="2026-05-04T00:00:00Z"))
    store.record(_art("lone", stage="other"))
    up = store.lineage("end")
    assert _ids(up["ancestors"]) == ["mid", "pre"]  # nearest first
    assert up["descendants"] == [] and up["missing"] == ["elsewhere"]
    down = store.lineage("pre")
    assert _ids(down["descendants"]) == ["mid", "side", "end"]
    assert down["ancestors"] == []
    middle = store.lineage("mid")
    assert _ids(middle["ancestors"]) == ["pre"] and _ids(middle["descendants"]) == ["end"]
    assert store.lineage("lone") == {"ancestors": [], "descendants": [], "missing": []}
    with pytest.raises(UnknownArtifactError, match=r"no artifact with id 'nope'"):
        store.lineage("nope")


def test_diff_reports_pipeline_dataset_deps_code_seed_and_metrics(tmp_path: Path):
    store = ArtifactStore(tmp_path / "a.sqlite")
    store.record(_art("one"))
    store.record(
        _art(
            "two",
            training_pipeline_yaml=YAML_B,
            dataset_hash="sha256:" + "d2" * 32,
            deps_lock={**DEPS_B, "jax": "0.10.3"},
            git={"commit": "c" * 40, "dirty": True, "diff_hash": "sha256:" + "9" * 64},
            seed=1,
            final_metrics={"train/loss": 0.5, "validate/accuracy": 0.9, "validate/loss": 0.3},
        )
    )
    d = store.diff("one", "two")
    assert d["a"] == "one" and d["b"] == "two"
    assert "-max_steps: 10\n+max_steps: 20\n" in d["pipeline"] and d["pipeline"].startswith("--- a/one/")
    assert d["dataset_hash"] == {"a": "sha256:" + "d1" * 32, "b": "sha256:" + "d2" * 32}
    assert d["deps"] == {
        "added": {"numpy": "2.0"},
        "removed": {"grain": "0.2.18"},
        "changed": {"jax": ["0.10.2", "0.10.3"]},
        "jax": [None, "0.10.3"],
    }
    assert d["code"]["a"]["dirty"] is False and d["code"]["b"]["diff_hash"] == "sha256:" + "9" * 64
    assert d["seed"] == {"a": 0, "b": 1}
    assert d["metrics"] == {"validate/accuracy": [0.8, 0.9], "validate/loss": [None, 0.3]}
    assert d["backend"] is None and d["trained_model_hash"] is None
    same = store.diff("one", "one")
    assert all(v is None for k, v in same.items() if k not in ("a", "b"))
    json.dumps(d)


def test_schema_version_is_recorded(store: ArtifactStore):
    assert store.schema_version() == SCHEMA_VERSION >= 1
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrates_an_empty_v0_database(tmp_path: Path):
    path = tmp_path / "old.sqlite"
    sqlite3.connect(path).close()  # an empty file: schema version 0
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []
    store = ArtifactStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    store.record(_art("x1"))
    assert _ids(ArtifactStore(path).query()) == ["x1"]


IMPORT_A = {"module": "my_losses", "file": "/src/my_losses.py", "sha256": "a" * 64}
IMPORT_B = {"module": "my_callbacks", "file": "/src/my_callbacks.py", "sha256": "b" * 64}


def test_imports_are_kept_returned_and_queryable(store: ArtifactStore):
    store.record(_art("dddd0005", imports=[IMPORT_A, IMPORT_B]))
    store.record(_art("dddd0006", imports=[IMPORT_B], started_at="2026-05-05T00:00:00Z"))
    got = ArtifactStore(store.path).get("dddd0005")
    assert got.imports == (IMPORT_A, IMPORT_B) and got == _art("dddd0005", imports=[IMPORT_A, IMPORT_B])
    assert _ids(store.query(imported="my_losses")) == ["dddd0005"]
    assert _ids(store.query(imported="my_callbacks")) == ["dddd0006", "dddd0005"]
    assert _ids(store.query(imported="my_callbacks", run_id="run-1", limit=1)) == ["dddd0006"]
    assert store.query(imported="my") == []  # a module name, not a prefix
    assert store.get("aaaa0001").imports == ()
    with sqlite3.connect(store.path) as conn:
        rows = conn.execute("SELECT position, module, sha256 FROM imports WHERE artifact_id = 'dddd0005'").fetchall()
    assert sorted(rows) == [(0, "my_losses", "a" * 64), (1, "my_callbacks", "b" * 64)]


def test_diff_reports_imports_by_module_and_digest(tmp_path: Path):
    store = ArtifactStore(tmp_path / "a.sqlite")
    moved = {**IMPORT_A, "file": "/elsewhere/my_losses.py"}  # same file content at another path: the same import
    changed = {**IMPORT_B, "sha256": "c" * 64}
    store.record(_art("one", imports=[IMPORT_A, IMPORT_B]))
    store.record(_art("two", imports=[moved, changed]))
    store.record(_art("three", imports=[IMPORT_B, {"module": "extra", "file": None, "sha256": None}]))
    assert store.diff("one", "one")["imports"] is None
    expected = {"added": {}, "removed": {}, "changed": {"my_callbacks": ["b" * 64, "c" * 64]}}
    assert store.diff("one", "two")["imports"] == expected
    d = store.diff("one", "three")["imports"]
    assert list(d["added"]) == ["extra"] and list(d["removed"]) == ["my_losses"] and d["changed"] == {}


def test_migrates_a_v1_database_and_keeps_its_artifacts(tmp_path: Path):
    """A store written before artifacts recorded their imports (schema 1) is brought up to date in place."""
    path = tmp_path / "v1.sqlite"
    old = _art("0ld00001").to_dict()
    del old["imports"]  # what a v1 pipekit-train wrote
    with sqlite3.connect(path) as conn:
        for statement in MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (1)")
        conn.execute(
            "INSERT INTO artifacts VALUES (?, 'run-1', 'stage0', NULL, NULL, 'equinox', NULL, NULL, NULL, "
            "'completed', '2026-05-01T12:00:00.000000+00:00', NULL, 0, ?)",
            ("0ld00001", json.dumps(old)),
        )
        conn.execute("INSERT INTO metrics VALUES ('0ld00001', 'train/loss', 0.5)")
    store = ArtifactStore(path)
    assert store.get("0ld0").imports == () and store.get("0ld0").final_metrics["train/loss"] == 0.5
    assert store.schema_version() == SCHEMA_VERSION == 6
    store.record(_art("new00002", imports=[IMPORT_A], started_at="2026-06-01T00:00:00Z"))
    assert _ids(store.query()) == ["new00002", "0ld00001"]
    assert _ids(store.query(imported="my_losses")) == ["new00002"]
    assert _ids(store.query(metrics=[("train/loss", "<", 1)])) == ["new00002", "0ld00001"]


def test_refuses_a_newer_schema_and_a_foreign_database(tmp_path: Path):
    newer = tmp_path / "newer.sqlite"
    with sqlite3.connect(newer) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION + 1,))
    with pytest.raises(ArtifactStoreError, match=rf"schema version {SCHEMA_VERSION + 1}, newer than .*upgrade"):
        len(ArtifactStore(newer))
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    with pytest.raises(ArtifactStoreError, match=r"foreign.sqlite is an SQLite database without a schema_version"):
        len(ArtifactStore(foreign))


def test_default_path_honours_the_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PIPEKIT_ARTIFACT_STORE", str(tmp_path / "env.sqlite"))
    assert ArtifactStore().path == tmp_path / "env.sqlite"
    monkeypatch.delenv("PIPEKIT_ARTIFACT_STORE")
    monkeypatch.chdir(tmp_path)
    assert ArtifactStore().path == tmp_path / "runs" / "artifacts.sqlite"


_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pipekit_train.provenance._artifact import TrainingArtifact
    from pipekit_train.provenance._store import ArtifactStore
    path, worker, count, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    open(go + f".ready{worker}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit("no go signal")
        time.sleep(0.001)
    store = ArtifactStore(path)  # a fresh store object: every process also races the schema migration
    parent = ()
    for i in range(count):
        art = TrainingArtifact(
            artifact_id=f"w{worker}n{i:04d}",
            run_id=f"worker-{worker}",
            stage=f"stage{i}",
            parent_ids=parent,
            training_pipeline_yaml=f"n: {i}\\n",
            final_metrics={"validate/accuracy": i / count, "train/loss": float(worker)},
        )
        store.record(art)
        parent = (art.artifact_id,)
    print(time.time())
    """
)


@pytest.mark.slow
def test_eight_processes_writing_at_once_lose_nothing(tmp_path: Path):
    workers, count = 8, 50
    path = tmp_path / "shared.sqlite"  # does not exist yet: the processes create and migrate it together
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    go = str(tmp_path / "go")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(path), str(w), str(count), go],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in range(workers)
    ]
    try:
        deadline = time.monotonic() + 300  # each worker imports JAX; slow on a loaded 2-CPU machine
        while not all(os.path.exists(f"{go}.ready{w}") for w in range(workers)):
            assert time.monotonic() < deadline, "workers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.01)
        start = time.time()
        Path(go).touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * workers, [err for _, err in results]
    elapsed = max(float(out.strip().splitlines()[-1]) for out, _ in results) - start
    store = ArtifactStore(path)
    assert len(store) == workers * count
    assert store.schema_version() == SCHEMA_VERSION
    for w in range(workers):
        chain = store.lineage(f"w{w}n{count - 1:04d}")["ancestors"]
        assert len(chain) == count - 1
        assert len(store.query(run_id=f"worker-{w}", metrics=[("train/loss", "==", float(w))])) == count
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 2 * workers * count
        assert conn.execute("SELECT COUNT(*) FROM parents").fetchone()[0] == workers * (count - 1)
    print(
        f"\n{workers * count} artifacts from {workers} processes in {elapsed:.2f}s: {workers * count / elapsed:.0f}/s"
    )


# The `pipekit-train artifacts` commands (cli_artifacts), run in-process through argparse -----------------------
def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from pipekit_train.cli._artifacts import main

    code = main(["artifacts", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_list_and_query_tables_and_json(store: ArtifactStore, capsys):
    s = str(store.path)
    code, out, err = _cli(capsys, "list", "--store", s)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "STARTED", "(UTC)", "RUN", "STAGE", "BACKEND", "STATUS", "METRICS"]
    assert [line.split()[0] for line in lines[1:]] == ["cccc0004", "bbbb0003", "aaaa0002", "aaaa0001"]
    assert "2026-05-02 10:00:00" in lines[3] and "validate/accuracy=0.95" in lines[3]
    code, out, _ = _cli(capsys, "list", "--store", s, "--limit", "1", "--json")
    assert code == 0 and [a["artifact_id"] for a in json.loads(out)] == ["cccc0004"]
    code, out, _ = _cli(
        capsys, "query", "--store", s, "--metric", "validate/accuracy>=0.9", "--dataset-hash", "sha256:d2", "--json"
    )
    assert code == 0 and [a["artifact_id"] for a in json.loads(out)] == ["aaaa0002"]
    for argv, expected in [
        (["--backend", "keras"], ["bbbb0003"]),
        (["--stage", "finetune"], ["aaaa0002"]),
        (["--run-id", "run-1", "--metric", "train/loss < 0.3"], ["aaaa0002"]),
        (["--since", "2026-05-03", "--until", "2026-05-03T23:59:59Z"], ["bbbb0003"]),
        (["--status", "stopped"], ["cccc0004"]),
        (
            ["--model-hash", "sha256:m1", "--pipeline-hash", store.get("aaaa0001").pipeline_hash],
            ["cccc0004", "bbbb0003", "aaaa0001"],
        ),
        (["--since", "1d"], []),
    ]:
        code, out, _ = _cli(capsys, "query", "--store", s, "--json", *argv)
        assert code == 0 and [a["artifact_id"] for a in json.loads(out)] == expected, argv
    code, out, _ = _cli(capsys, "query", "--store", s, "--backend", "jax")
    assert code == 0 and out == "no artifacts match\n"


def test_cli_show_lineage_and_diff(store: ArtifactStore, capsys):
    s = str(store.path)
    code, out, _ = _cli(capsys, "show", "aaaa0002", "--store", s)
    assert code == 0
    assert "artifact   aaaa0002" in out and "parents    aaaa0001" in out
    assert "code       cccccccccccc (clean)" in out and "  validate/accuracy  0.95" in out
    assert "pipeline YAML\n  pipekit: 1\n" in out
    code, out, _ = _cli(capsys, "show", "aaaa0002", "--store", s, "--json")
    assert TrainingArtifact.from_dict(json.loads(out)) == store.get("aaaa0002")
    code, out, _ = _cli(capsys, "lineage", "aaaa0001", "--store", s)
    assert code == 0
    lines = out.splitlines()
    assert lines[:2] == ["ancestors (oldest first):", "  (none)"]
    assert lines[2].startswith("* aaaa0001  stage0") and lines[2].endswith("<- this artifact")
    assert lines[3] == "descendants (nearest first):" and lines[4].startswith("  aaaa0002  finetune")
    code, out, _ = _cli(capsys, "lineage", "aaaa0002", "--store", s, "--json")
    assert [a["artifact_id"] for a in json.loads(out)["ancestors"]] == ["aaaa0001"]
    code, out, _ = _cli(capsys, "diff", "aaaa0001", "aaaa0002", "--store", s)
    assert code == 0
    assert "-max_steps: 10" in out and "+max_steps: 20" in out
    assert f"dataset_hash: sha256:{'d1' * 32} -> sha256:{'d2' * 32}" in out
    assert "validate/accuracy  0.8 -> 0.95" in out and "same: backend, deps, code, seed" in out
    code, out, _ = _cli(capsys, "diff", "aaaa0001", "aaaa0002", "--store", s, "--json")
    assert json.loads(out)["seed"] is None


def test_cli_errors_are_one_line_with_exit_codes(store: ArtifactStore, capsys, tmp_path: Path):
    s = str(store.path)
    code, out, err = _cli(capsys, "show", "aaaa0009", "--store", s)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("pipekit-train artifacts: error: no artifact with id 'aaaa0009'")
    assert "closest ids: aaaa0001" in err
    code, _, err = _cli(capsys, "query", "--store", s, "--metric", "accuracy~0.9")
    assert code == 2 and "--metric must look like NAME OP NUMBER" in err
    code, _, err = _cli(capsys, "query", "--store", s, "--since", "someday")
    assert code == 2 and "--since must be an ISO-8601 time" in err
    missing = tmp_path / "nowhere.sqlite"
    code, _, err = _cli(capsys, "list", "--store", str(missing))
    assert code == 2 and f"no artifact store at {missing}" in err and not missing.exists()
    code, _, err = _cli(capsys, "show")
    assert code == 2 and "the following arguments are required: ID" in err


def test_cli_commands_plug_into_another_parser(store: ArtifactStore, capsys):
    import argparse

    from pipekit_train.cli._artifacts import add_artifact_commands

    parser = argparse.ArgumentParser(prog="pipekit-train")
    add_artifact_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["artifacts", "show", "bbbb", "--store", str(store.path), "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["artifact_id"] == "bbbb0003"


def test_cli_show_query_and_diff_print_imports(store: ArtifactStore, capsys):
    s = str(store.path)
    store.record(_art("eeee0007", imports=[IMPORT_A, {"module": "pkg.ns", "file": None, "sha256": None}]))
    store.record(_art("eeee0008", imports=[{**IMPORT_A, "sha256": "f" * 64}], started_at="2026-05-06T00:00:00Z"))
    code, out, _ = _cli(capsys, "show", "eeee0007", "--store", s)
    assert code == 0
    assert f"imports    my_losses  /src/my_losses.py  sha256 {'a' * 64}\n" in out
    assert "\n           pkg.ns  (no file)  no file digest\n" in out
    code, out, _ = _cli(capsys, "show", "aaaa0001", "--store", s)
    assert "imports    -\n" in out
    code, out, _ = _cli(capsys, "show", "eeee0007", "--store", s, "--json")
    assert json.loads(out)["imports"][0] == IMPORT_A
    code, out, _ = _cli(capsys, "query", "--store", s, "--imported", "my_losses", "--json")
    assert code == 0 and [a["artifact_id"] for a in json.loads(out)] == ["eeee0008", "eeee0007"]
    code, out, _ = _cli(capsys, "diff", "eeee0007", "eeee0008", "--store", s)
    assert code == 0
    assert f"imports:\n  - pkg.ns  (no file)  no file digest\n  ~ my_losses sha256 {'a' * 64} -> {'f' * 64}" in out
    code, out, _ = _cli(capsys, "diff", "aaaa0001", "cccc0004", "--store", s)
    assert out.rstrip().endswith("imports")  # "same: ..., imports"


def test_cli_short_views_show_the_objective_first_and_no_timing(tmp_path: Path, capsys):
    """A stage without validation once showed time/checkpoint_s, time/compile_s, time/data_wait_frac and no loss."""
    timing = {"time/checkpoint_s": 0.1, "time/compile_s": 2.0, "time/data_wait_frac": 0.01, "time/step_s": 0.001}
    s = ArtifactStore(tmp_path / "a.sqlite")
    final = {**timing, "train/loss": 0.25, "train/lr": 0.01, "test/mae": 0.4}
    s.record(_art("dddd0001", final_metrics=final, user={"dataset_version": "v3"}))
    s.record(
        _art(
            "dddd0002",
            parent_ids=("dddd0001",),
            final_metrics={
                **timing,
                "train/loss": 0.3,
                "validate/loss": 0.35,
                "validate/loss/MSE_0": 0.2,
                "validate/accuracy": 0.9,
            },
        )
    )
    code, out, _ = _cli(capsys, "list", "--store", str(s.path))
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows["dddd0001"].endswith("train/loss=0.25 test/mae=0.4 train/lr=0.01")
    assert rows["dddd0002"].endswith("validate/loss=0.35 validate/accuracy=0.9 validate/loss/MSE_0=0.2")
    code, out, _ = _cli(capsys, "lineage", "dddd0002", "--store", str(s.path))
    assert code == 0 and "time/" not in out
    assert "* dddd0002" in out and "validate/loss=0.35 validate/accuracy=0.9" in out
    code, out, _ = _cli(capsys, "query", "--store", str(s.path), "--stage", "stage0")
    assert code == 0 and "time/" not in out and out.count("train/loss=0.25") == 1
    code, out, _ = _cli(capsys, "show", "dddd0001", "--store", str(s.path))
    assert code == 0
    shown = [line.split()[0] for line in out.split("\nmetrics\n")[1].splitlines() if line.startswith("  ")]
    assert shown[:3] == ["train/loss", "test/mae", "train/lr"] and shown[3:7] == sorted(timing)
    assert '\nuser\n  dataset_version  "v3"\n' in out


def test_each_contexts_loss_comes_before_its_other_metrics():
    from pipekit_train.cli._artifacts_text import metric_order

    final = {"test/accuracy": 0.25, "test/loss": 2.3, "validate/accuracy": 0.24, "validate/loss": 2.2, "train/loss": 2}
    assert metric_order(final) == ["validate/loss", "validate/accuracy", "test/loss", "test/accuracy", "train/loss"]
