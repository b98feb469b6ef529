"""How ``store_v5.sql`` and ``store_v5_answers.json`` were made: run with pipekit-train at commit 1fc76cf (artifact
store schema 5, every artifact's dependency lock inline in its record), from the repository root:

    PYTHONPATH=src python tests/provenance/data/store_v5_make.py

It records a few artifacts (a chain, a fork, a missing parent, three distinct locks and an empty one, imports, stored
code, a sweep, an evaluation) with that code, dumps the SQLite file as SQL (``Connection.iterdump``) and writes what
that code answered: every record's JSON, queries, lineage, diffs, verify, and the CLI's text and ``--json`` output.
``tests/provenance/test_store_locks.py`` replays the SQL, opens the store with today's code (which migrates it) and
checks that every answer is the same. Not a test; kept so the fixture can be understood and rebuilt.
"""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import sys
import tempfile
from pathlib import Path

from pipekit_train.cli._artifacts import main as artifacts_main
from pipekit_train.provenance._artifact import TrainingArtifact
from pipekit_train.provenance._code import blob_digest
from pipekit_train.provenance._store import ArtifactStore

HERE = Path(__file__).parent
LOCK_TEXT = "".join(f"package-{i:03d}==1.{i}.0 \\\n    --hash=sha256:{i:064x}\n" for i in range(40))
LOCK = {
    "lock_file": LOCK_TEXT,
    "lock_path": "/home/me/proj/requirements.lock",
    "distributions": {f"package-{i:03d}": f"1.{i}.0" for i in range(40)},
    "python": "3.11.9",
    "jax": "0.10.2",
    "devices": ["cpu:0 cpu"],
}
LOCK_NEWER_JAX = {**LOCK, "jax": "0.10.3", "distributions": {**LOCK["distributions"], "jax": "0.10.3"}}
LOCK_NO_FILE = {
    "lock_file": None,
    "lock_path": None,
    "distributions": {"jax": "0.10.2"},
    "python": "3.11.9",
    "jax": "0.10.2",
    "devices": ["cpu:0 cpu"],
}
YAML = "pipekit: 1\ntype: TrainingLoop\nmax_steps: 10\nbatch_size: 32\n"
CODE = b"def loss(x):\n    return x * x\n"


def artifacts() -> list[TrainingArtifact]:
    common = dict(
        run_id="run-1",
        backend="equinox",
        training_pipeline_yaml=YAML,
        dataset_hash="sha256:" + "d1" * 32,
        seed=0,
        deps_lock=LOCK,
    )
    code = {
        "stored": True,
        "reason": None,
        "repo_root": "/home/me/proj",
        "commit": "c" * 40,
        "cwd": "",
        "patch": None,
        "files": [
            {
                "role": "import",
                "module": "my_losses",
                "path": "/home/me/proj/my_losses.py",
                "repo_path": "my_losses.py",
                "import_root": "",
                "sha256": blob_digest(CODE),
            }
        ],
        "bytes": len(CODE),
        "cap_bytes": 10485760,
    }
    out = [
        TrainingArtifact(
            artifact_id="a0000001",
            started_at="2026-05-01T12:00:00+00:00",
            final_metrics={"train/loss": 0.5, "validate/accuracy": 0.8},
            **common,
        ),
        TrainingArtifact(
            artifact_id="a0000002",
            stage="finetune",
            parent_ids=("a0000001",),
            started_at="2026-05-02T12:00:00+00:00",
            ended_at="2026-05-02T13:00:00+00:00",
            final_metrics={"train/loss": 0.25, "validate/accuracy": 0.9},
            imports=[{"module": "my_losses", "file": "/home/me/proj/my_losses.py", "sha256": blob_digest(CODE)[7:]}],
            code=code,
            **common,
        ),
        TrainingArtifact(
            artifact_id="a0000003",
            stage="finetune2",
            parent_ids=("a0000002", "gone0001"),
            started_at="2026-05-03T12:00:00+00:00",
            status="stopped: signal SIGTERM",
            final_metrics={"train/loss": 0.2},
            **{**common, "deps_lock": LOCK_NEWER_JAX, "seed": 1},
        ),
        TrainingArtifact(
            artifact_id="b0000001",
            stage="stage0",
            started_at="2026-05-04T12:00:00+00:00",
            sweep={"name": "lr", "trial": 0},
            final_metrics={"validate/loss": 0.3},
            **{**common, "run_id": "sweep-lr-0"},
        ),
        TrainingArtifact(
            artifact_id="b0000002",
            stage="stage0",
            started_at="2026-05-04T12:05:00+00:00",
            sweep={"name": "lr", "trial": 1},
            final_metrics={"validate/loss": 0.4},
            **{**common, "run_id": "sweep-lr-1"},
        ),
        TrainingArtifact(
            artifact_id="c0000001",
            run_id="bare",
            stage="stage0",
            started_at="2026-05-05T12:00:00+00:00",
            backend="numpyro",
            status="failed",
            deps_lock={},
        ),
        TrainingArtifact(
            artifact_id="c0000002",
            run_id="nolock",
            stage="stage0",
            started_at="2026-05-06T12:00:00+00:00",
            backend="equinox",
            deps_lock=LOCK_NO_FILE,
            parent_ids=("a0000001",),
        ),
    ]
    return out


def cli(store: Path, *argv: str) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = artifacts_main(["artifacts", *argv, "--store", str(store)])
    return {"argv": list(argv), "code": code, "out": out.getvalue().replace(str(store), "STORE")}


CLI_CALLS = [
    ("list",),
    ("show", "a0000002"),
    ("show", "a0000002", "--json"),
    ("show", "c0000001"),
    ("lineage", "a0000002"),
    ("lineage", "a0000003", "--json"),
    ("query", "--metric", "validate/accuracy>=0.85"),
    ("query", "--sweep", "lr", "--json"),
    ("query", "--backend", "equinox", "--since", "2026-05-02"),
    ("diff", "a0000001", "a0000003"),
    ("diff", "a0000001", "c0000001", "--json"),
    ("diff", "a0000001", "c0000002"),
    ("verify", "--all", "--no-models"),
    ("verify", "a0000002", "--no-models", "--json"),
]


def answers(store: ArtifactStore) -> dict[str, object]:
    ids = [a.artifact_id for a in artifacts()]
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
        "diff": {
            f"{a} {b}": store.diff(a, b)
            for a, b in [
                ("a0000001", "a0000003"),
                ("a0000001", "c0000001"),
                ("a0000001", "c0000002"),
                ("b0000001", "b0000002"),
            ]
        },
        "verify": {k: v for k, v in store.verify(models=False).items() if k != "store"},
        "cli": [cli(store.path, *argv) for argv in CLI_CALLS],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = ArtifactStore(Path(tmp) / "v5.sqlite")
        assert store.schema_version() == 5, "run this with the schema-5 code (commit 1fc76cf)"
        for artifact in artifacts():
            store.record(artifact, blobs={blob_digest(CODE): CODE} if artifact.code else None)
        store.record_evaluation(
            {
                "evaluation_id": "eval0001",
                "artifact_id": "a0000002",
                "model_hash": "sha256:" + "m1" * 32,
                "dataset_hash": "sha256:" + "d2" * 32,
                "created_at": "2026-05-07T12:00:00+00:00",
                "metrics": {"accuracy": 0.75},
            }
        )
        got = answers(store)
        with sqlite3.connect(store.path) as conn:
            dump = "\n".join(conn.iterdump())
    header = "-- An artifact store written by pipekit-train at commit 1fc76cf (schema 5); see store_v5_make.py.\n"
    (HERE / "store_v5.sql").write_text(header + dump + "\n", encoding="utf-8")
    (HERE / "store_v5_answers.json").write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {HERE / 'store_v5.sql'} and {HERE / 'store_v5_answers.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
