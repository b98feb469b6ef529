"""TrainingArtifact: JSON round trip, checks, dependency capture and git state."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipekit import ConfigError
from pipekit_train.provenance._artifact import (
    TrainingArtifact,
    collect_deps_lock,
    git_state,
    new_run_id,
    pipeline_hash,
)

YAML = "pipekit: 1\ntype: TrainingLoop\nmax_steps: 10\n"


def _artifact(**changes) -> TrainingArtifact:
    base = dict(
        run_id=new_run_id(),
        stage="finetune",
        parent_ids=("a" * 32,),
        training_pipeline_yaml=YAML,
        dataset_hash="sha256:" + "d" * 64,
        backend="equinox",
        backend_info={"compiles": 1, "optax": "0.2.8"},
        deps_lock={"lock_file": None, "distributions": {"jax": "0.10.2"}, "python": "3.11", "jax": "0.10.2"},
        tracker_run_id="abc",
        model_registry_uri="pipekit-model:sha256:" + "e" * 64,
        trained_model_hash="sha256:" + "e" * 64,
        started_at="2026-05-01T12:00:00+00:00",
        ended_at="2026-05-01T12:05:00+00:00",
        final_metrics={"train/loss": 0.25, "validate/accuracy": 1},
        seed=7,
        git={"commit": "f" * 40, "dirty": False, "diff_hash": None},
        status="stopped: early stopping on validate/loss",
        imports=[
            {"module": "my_losses", "file": "/src/my_losses.py", "sha256": "1" * 64},
            {"module": "pkg.callbacks", "file": None, "sha256": None},
        ],
    )
    base.update(changes)
    return TrainingArtifact(**base)


def test_json_round_trip_keeps_every_field():
    art = _artifact()
    text = json.dumps(art.to_dict())
    back = TrainingArtifact.from_dict(json.loads(text))
    assert back == art
    assert back.parent_ids == ("a" * 32,) and isinstance(back.parent_ids, tuple)
    assert TrainingArtifact.from_json(art.to_json()) == art
    assert back.final_metrics["validate/accuracy"] == 1.0 and isinstance(back.final_metrics["validate/accuracy"], float)
    assert isinstance(back.imports, tuple) and [m["module"] for m in back.imports] == ["my_losses", "pkg.callbacks"]
    assert art.to_dict()["imports"][0] == {"module": "my_losses", "file": "/src/my_losses.py", "sha256": "1" * 64}


def test_artifacts_recorded_before_imports_existed_still_load():
    old = _artifact().to_dict()
    del old["imports"]
    assert TrainingArtifact.from_dict(old).imports == ()


@pytest.mark.parametrize(
    "imports",
    [
        "my_losses",
        [{"module": "my_losses"}],
        [{"module": "my-losses", "file": None, "sha256": None}],
        [{"module": "my_losses", "file": None, "sha256": "sha256:" + "1" * 64}],
        [{"module": "my_losses", "file": "", "sha256": None}],
        [{"module": "my_losses", "file": None, "sha256": None, "extra": 1}],
    ],
    ids=["a-string", "missing-keys", "bad-name", "prefixed-digest", "empty-file", "extra-key"],
)
def test_bad_imports_name_the_field_the_rule_and_the_value(imports):
    with pytest.raises(ConfigError, match=r"TrainingArtifact\.imports(\[0\])? must be .*\"module\": dotted name.*got "):
        _artifact(imports=imports)


def test_defaults_fill_id_times_and_pipeline_hash():
    art = TrainingArtifact(run_id="r", training_pipeline_yaml=YAML)
    assert len(art.artifact_id) == 32 and int(art.artifact_id, 16) >= 0
    assert art.pipeline_hash == "sha256:" + hashlib.sha256(YAML.encode()).hexdigest() == pipeline_hash(YAML)
    assert art.started_at.endswith("+00:00")
    assert art.replace(training_pipeline_yaml="x: 1\n").pipeline_hash == pipeline_hash("x: 1\n")
    assert TrainingArtifact().artifact_id != TrainingArtifact().artifact_id


def test_bad_values_name_the_field_and_value():
    with pytest.raises(ConfigError, match=r"TrainingArtifact.status must be .*got 'done'"):
        _artifact(status="done")
    with pytest.raises(ConfigError, match=r"TrainingArtifact.started_at must be an ISO-8601 time, got 'yesterday'"):
        _artifact(started_at="yesterday")
    with pytest.raises(ConfigError, match=r"TrainingArtifact.artifact_id must be .*got 'a b'"):
        _artifact(artifact_id="a b")
    with pytest.raises(ConfigError, match=r"from_dict got unknown key\(s\) \['colour'\]"):
        TrainingArtifact.from_dict({**_artifact().to_dict(), "colour": "red"})


def test_new_run_ids_are_unique_and_sort_by_time():
    ids = [new_run_id() for _ in range(50)]
    assert len(set(ids)) == 50
    assert all(len(i) == 25 and i[8] == "T" and i[15] == "Z" for i in ids)


def test_deps_lock_reads_the_lock_file_walking_up(tmp_path: Path):
    (tmp_path / "requirements.lock").write_text(
        "# pinned\njax==0.10.2\nEquinox==0.13.8  # comment\nmsgpack[x]==1.1.0\n"
    )
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    deps = collect_deps_lock(nested)
    assert deps["lock_file"].startswith("# pinned")
    assert deps["lock_path"] == str((tmp_path / "requirements.lock").resolve())
    assert deps["distributions"] == {"jax": "0.10.2", "equinox": "0.13.8", "msgpack": "1.1.0"}
    assert deps["python"].count(".") == 2
    assert deps["jax"] == __import__("jax").__version__
    assert deps["devices"] and deps["devices"][0].startswith("cpu:0")
    json.dumps(deps)


def test_deps_lock_reads_uv_lock(tmp_path: Path):
    (tmp_path / "uv.lock").write_text('version = 1\n[[package]]\nname = "Optax"\nversion = "0.2.8"\n')
    assert collect_deps_lock(tmp_path)["distributions"] == {"optax": "0.2.8"}


def test_deps_lock_without_a_lock_file_lists_installed_distributions(tmp_path: Path):
    if any((p / "requirements.lock").exists() or (p / "uv.lock").exists() for p in (tmp_path, *tmp_path.parents)):
        pytest.skip("a lock file above the temporary directory")
    deps = collect_deps_lock(tmp_path)
    assert deps["lock_file"] is None and deps["lock_path"] is None
    assert deps["distributions"]["jax"] == __import__("jax").__version__
    assert "equinox" in deps["distributions"] and "pipekit-train" in deps["distributions"]


def test_the_installed_distributions_are_read_once_until_an_install_changes_them(tmp_path, monkeypatch):
    """Reading every distribution's metadata is the artifact's slowest fixed work without a lock file: a process
    reads it once, and again when a ``*.dist-info`` folder appears on `sys.path` (an install)."""
    import importlib.metadata

    from pipekit_train.provenance import _artifact

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    scans = []
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: scans.append(1) or real())
    first = _artifact._installed()
    assert _artifact._installed() == first and len(scans) == 1
    info = site / "pipekit_probe_dist-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pipekit_probe_dist\nVersion: 1.2\n")
    assert _artifact._installed() == {**first, "pipekit-probe-dist": "1.2"} and len(scans) == 2


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_state_commit_dirty_and_diff_hash(tmp_path: Path):
    assert git_state(tmp_path) is None  # not a repository

    def git(*args: str) -> str:
        env_args = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
        return subprocess.run(
            ["git", *env_args, *args], cwd=tmp_path, check=True, capture_output=True, text=True, timeout=30
        ).stdout

    git("init", "-q")
    assert git_state(tmp_path) == {"commit": None, "dirty": True, "diff_hash": None}
    (tmp_path / "train.py").write_text("lr = 0.1\n")
    git("add", "train.py")
    git("commit", "-q", "-m", "first")
    commit = git("rev-parse", "HEAD").strip()
    assert git_state(tmp_path) == {"commit": commit, "dirty": False, "diff_hash": None}
    (tmp_path / "train.py").write_text("lr = 0.2\n")
    dirty = git_state(tmp_path)
    assert dirty["commit"] == commit and dirty["dirty"] is True
    diff = subprocess.run(
        ["git", "diff", "HEAD", "--no-color", "--no-ext-diff", "--binary"], cwd=tmp_path, capture_output=True
    ).stdout
    assert dirty["diff_hash"] == "sha256:" + hashlib.sha256(diff).hexdigest()
    (tmp_path / "train.py").write_text("lr = 0.3\n")
    assert git_state(tmp_path)["diff_hash"] != dirty["diff_hash"]


def test_user_fields_round_trip_and_must_be_json():
    art = _artifact(user={"dataset_version": "v3", "scaler": {"mean": [1.5]}})
    assert TrainingArtifact.from_json(art.to_json()) == art
    assert "user" not in _artifact().to_dict()  # a record without user fields is the JSON it always was
    with pytest.raises(ConfigError, match=r"TrainingArtifact.user must be JSON data: .*set"):
        _artifact(user={"tags": {1, 2}})


def test_repr_is_one_short_line():
    """print(artifact) once dumped about 12 KB (the whole lock file and pipeline)."""
    lock = {"lock_file": "x==1\n" * 2000, "distributions": {f"p{i}": "1" for i in range(300)}}
    text = repr(_artifact(deps_lock=lock, artifact_id="a87ac53b"))
    assert "\n" not in text and len(text) < 200
    assert text.startswith("TrainingArtifact(artifact_id='a87ac53b', run_id=") and text.endswith("train/loss=0.25)")
