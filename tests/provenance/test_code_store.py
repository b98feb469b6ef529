"""Runs from a dirty tree: the uncommitted patch, the imported modules and the pipeline file are stored in the
artifact store, content-addressed (one row per content), under a size cap; ``reproduce --restore-code`` rebuilds
that code in a temporary git worktree and retrains there, bitwise.

The git repositories are real (``git init`` in the test's folder); ``reproduce --restore-code`` runs as real
processes.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipekit_train.provenance._artifact import TrainingArtifact
from pipekit_train.provenance._code import CAP_ENV_VAR, blob_digest, capture_code
from pipekit_train.provenance._store import ArtifactStore

USER_MODULE = '''\
"""A user's loss, scaled by a constant the test edits without committing."""

import jax.numpy as jnp

import pipekit_train

SCALE = 1.0


class ScaledMSE(pipekit_train.Loss):
    def __call__(self, predicted, target):
        return SCALE * jnp.mean((predicted - target) ** 2)
'''

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
loss: {type: ScaledMSE}
optimizer_config: {name: sgd, lr: 1e-2}
max_steps: 6
batch_size: 8
progress: false
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A committed git repository holding the user module, the data and the pipeline file."""
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    (root / "user_mod.py").write_text(USER_MODULE)
    (root / "pipe.yaml").write_text(PIPELINE)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "init")
    return root


def _blob_rows(store: ArtifactStore) -> int:
    with sqlite3.connect(store.path) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0])


def test_dirty_code_is_stored_once_per_content_and_verified(repo: Path, tmp_path: Path, capsys):
    (repo / "user_mod.py").write_text(USER_MODULE.replace("SCALE = 1.0", "SCALE = 3.0"))
    (repo / "weights.bin").write_bytes(bytes(range(256)))  # a binary file, tracked: the patch is git's binary patch
    _git(repo, "add", "weights.bin")
    imports = [{"module": "user_mod", "file": str(repo / "user_mod.py"), "sha256": None}]
    snap = capture_code(str(repo / "pipe.yaml"), imports, cwd=repo)
    code = snap.record
    assert code["stored"] and code["commit"] == _git(repo, "rev-parse", "HEAD").strip() and code["cwd"] == "."
    patch = snap.blobs[code["patch"]]
    assert b"+SCALE = 3.0" in patch and b"GIT binary patch" in patch
    assert [(f["role"], f["repo_path"]) for f in code["files"]] == [
        ("import", "user_mod.py"),
        ("pipeline", "pipe.yaml"),
    ]
    assert all(blob_digest(data) == key for key, data in snap.blobs.items()) and len(snap.blobs) == 3

    store = ArtifactStore(tmp_path / "s.sqlite")
    first = TrainingArtifact(run_id="r1", backend="equinox", code=code)
    store.record(first, blobs=snap.blobs)
    assert _blob_rows(store) == 3
    # A thousand runs of one edit: the same content adds no row.
    again = capture_code(str(repo / "pipe.yaml"), imports, cwd=repo)
    store.record(TrainingArtifact(run_id="r2", backend="equinox", code=again.record), blobs=again.blobs)
    assert again.blobs == snap.blobs and _blob_rows(store) == 3
    assert store.get(first.artifact_id).code == code and store.blob(code["patch"]) == patch
    assert store.verify(models=False)["problems"] == []

    # A damaged blob and a missing one are named by verify.
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE blobs SET content = ? WHERE digest = ?", (b"x", code["patch"]))
        conn.execute("DELETE FROM blobs WHERE digest = ?", (code["files"][1]["sha256"],))
    report = store.verify(models=False)
    problems = [text for _, text in report["problems"]]
    assert len(problems) == 1 and code["patch"] in problems[0] and "was changed" in problems[0], problems
    warned = [text for _, text in report["warnings"]]
    assert any(code["files"][1]["sha256"] in t and "is not in this store" in t for t in warned), warned

    # Past the cap: one warning line, nothing stored, the record says why.
    capsys.readouterr()
    os.environ[CAP_ENV_VAR] = "100"
    try:
        over = capture_code(str(repo / "pipe.yaml"), imports, cwd=repo)
    finally:
        del os.environ[CAP_ENV_VAR]
    assert over.blobs == {} and over.record["stored"] is False
    assert f"over the 100-byte cap (${CAP_ENV_VAR})" in over.record["reason"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not stored (the run trains" in err[0], err


def test_reproduce_restore_code_retrains_an_uncommitted_edit_bitwise(
    repo: Path, tmp_path: Path, xla_cache_env, monkeypatch, capsys
):
    from pipekit_train.cli._main import main

    # `run` and the reproduce command run in this process (the user module is imported here, then forgotten);
    # the retraining in the restored tree is the real subprocess.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "user_mod", raising=False)  # removed again at the end
    for key, value in xla_cache_env.items():
        monkeypatch.setenv(key, value)
    store = str(tmp_path / "s.sqlite")
    edited = USER_MODULE.replace("SCALE = 1.0", "SCALE = 7.0")  # changes every gradient, so every weight
    (repo / "user_mod.py").write_text(edited)
    monkeypatch.chdir(repo)
    assert main(["run", "pipe.yaml", "--import", "user_mod", "--store", store, "--run-dir", "R"]) == 0
    monkeypatch.delitem(sys.modules, "user_mod")
    [artifact] = ArtifactStore(store).query()
    assert artifact.git["dirty"] and artifact.code["stored"] and artifact.code["patch"]

    _git(repo, "checkout", "user_mod.py")  # the user moves on: the edit is gone from the tree
    (repo / "notes.txt").write_text("untracked, left alone\n")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rc = main(["reproduce", artifact.artifact_id[:12], "--restore-code", "--store", store, "--run-dir", "R2"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "restored code: match: the trained weights are bitwise equal to the recorded ones " in out.out
    assert f"({artifact.trained_model_hash})" in out.out
    [again] = [a for a in ArtifactStore(store).query() if a.artifact_id != artifact.artifact_id]
    assert again.trained_model_hash == artifact.trained_model_hash
    assert again.code["patch"] == artifact.code["patch"]  # the restored tree had the same uncommitted patch
    # The user's tree is as they left it, and the temporary worktree is gone.
    assert (repo / "user_mod.py").read_text() == USER_MODULE and (repo / "notes.txt").exists()
    assert _git(repo, "status", "--porcelain").split() == ["??", "R/", "??", "notes.txt"]
    assert len(_git(repo, "worktree", "list").splitlines()) == 1
    assert not os.path.exists(again.code["repo_root"])
