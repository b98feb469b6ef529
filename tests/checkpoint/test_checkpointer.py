"""Checkpoints: real writes on tmp_path, in both layouts (flat, the one-process default, and orbax); retention,
manifest, crash safety, corruption, averaging, runs."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train._warnings import PipekitTrainWarning
from pipekit_train.checkpoint import (
    Average,
    Best,
    Checkpoint,
    CheckpointCorruptedError,
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    Every,
    Last,
    ManifestEntry,
    average_checkpoints,
    format_runs_table,
    list_runs,
    write_average,
)
from pipekit_train.checkpoint._layout import _with_io_retry
from pipekit_train.checkpoint._manifest import MANIFEST


def make_state(seed: int = 0, n: int = 1000) -> dict:
    key = jax.random.key(seed)
    return {
        "params": {"w": jax.random.normal(key, (n, 4)), "b": jnp.arange(4, dtype=jnp.bfloat16) + seed},
        "opt": [jnp.int32(seed), jnp.zeros((2, 3), jnp.float32) + seed],
        "rng": jax.random.key(seed + 100),
    }


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def assert_bitwise_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def save_scores(ckpt: Checkpointer, scores: dict[int, float | None], **meta) -> None:
    for step, score in scores.items():
        ckpt.save(step, state=make_state(step, n=8), data_iter={"next_index": step}, meta={"score": score, **meta})


def step_dirs(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def state_data_files(step_dir: Path) -> list[Path]:
    """The array data files of a checkpoint's state item, largest first (``state.bin`` in the flat layout)."""
    if (step_dir / "state.bin").is_file():
        return [step_dir / "state.bin"]
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


LAYOUTS = pytest.mark.parametrize("layout", ["flat", "orbax"])
ITEM_FILE = {  # where each item's JSON lives, by layout
    "flat": {"meta": "meta.json", "data_iter": "data_iter.json", "state": "state.bin"},
    "orbax": {"meta": "meta/metadata", "data_iter": "data_iter/metadata", "state": "state"},
}


# Operators ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "op",
    [Checkpoint(), Checkpoint.example(), Best(k=2, among=Last(n=5)), Every.example(), Average.example()],
    ids=repr,
)
def test_operators_round_trip_through_yaml(op):
    assert pipekit.loads(pipekit.dumps(op)) == op


def test_checkpoint_operator_defaults_and_cadence():
    cb = Checkpoint()
    assert cb.keep == (Best(k=3), Last(n=1)) and cb.monitor == "validate/loss" and cb.mode == "min"
    assert [s for s in range(0, 1501) if cb.should_save(s)] == [500, 1000, 1500]
    loaded = pipekit.loads("type: Checkpoint\nkeep: [{type: Last, n: 2}, {type: Every, n: 10}]\nmode: max\n")
    assert loaded.keep == (Last(n=2), Every(n=10)) and loaded.mode == "max"


def test_operator_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"Checkpoint.every_n_steps must be a positive int, got 0"):
        Checkpoint(every_n_steps=0)
    with pytest.raises(ConfigError, match=r"Checkpoint.keep must be a non-empty list"):
        Checkpoint(keep=())
    with pytest.raises(ConfigError, match=r"Checkpoint.keep\[0\] = Best\(k=2, among=Last\(n=5\)\): `among` is for"):
        Checkpoint(keep=(Best(k=2, among=Last(n=5)),))
    with pytest.raises(ConfigError, match=r"Checkpoint.mode must be one of 'min', 'max', got 'low'"):
        Checkpoint(mode="low")
    with pytest.raises(ConfigError, match=r"Best.k must be a positive int, got 0"):
        Best(k=0)
    with pytest.raises(ConfigError, match=r"Last.n must be a positive int, got -1"):
        Last(n=-1)
    with pytest.raises(ConfigError, match=r"Every.n must be a positive int, got 0"):
        Every(n=0)
    with pytest.raises(ConfigError, match=r"Average is missing required field\(s\): selector"):
        pipekit.loads("type: Average\n")
    with pytest.raises(ConfigError, match=r"Checkpointer.mode must be 'min' or 'max', got 'up'"):
        Checkpointer("x", mode="up")  # type: ignore[arg-type]


def test_selectors_pick_from_entries():
    entries = [ManifestEntry(step=s, score=v) for s, v in [(1, 0.9), (2, 0.1), (3, None), (4, 0.1), (5, 0.5)]]
    assert Best(k=2).select(entries, "min") == {2, 4}
    assert Best(k=1).select(entries, "min") == {2}  # ties go to the earlier step
    assert Best(k=2).select(entries, "max") == {1, 5}
    assert Best(k=1, among=Last(n=2)).select(entries, "min") == {4}
    assert Last(n=2).select(entries, "min") == {4, 5}
    assert Every(n=2).select(entries, "min") == {2, 4}
    assert Average(selector=Last(n=3)).steps(entries, "min") == [3, 4, 5]


# Save / restore -------------------------------------------------------------------------------------------
@LAYOUTS
@pytest.mark.parametrize("async_save", [True, False])
def test_save_restore_is_a_bitwise_round_trip(tmp_path, async_save, layout):
    state = make_state(7)
    data_iter = {"next_index": 12, "epoch": 3, "nested": {"order": [3, 1, 2], "seed": None}}
    meta = {
        "epoch": 3,
        "stage": "pretrain",
        "run_id": "r1",
        "score": 0.25,
        "stop_reason": None,
        "callbacks": [{"best": float("inf"), "bad_epochs": 2}],
        "config_sha256": "ab" * 32,
    }
    with Checkpointer(tmp_path / "ck", keep=(Last(n=1),), async_save=async_save, layout=layout) as ckpt:
        assert ckpt.save(40, state=state, data_iter=data_iter, meta=meta) is True
        got_state, got_iter, got_meta = ckpt.restore("latest", abstract_of(state))
    assert_bitwise_equal(got_state, state)
    assert got_iter == data_iter
    assert got_meta == meta
    assert jax.dtypes.issubdtype(got_state["rng"].dtype, jax.dtypes.prng_key)
    assert (jax.random.normal(got_state["rng"], (3,)) == jax.random.normal(state["rng"], (3,))).all()
    # the three items are one checkpoint: no side-car beside the step directory
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["40", MANIFEST]
    names = {p.name for p in (tmp_path / "ck" / "40").iterdir()}
    if layout == "flat":
        assert names == {"state.bin", "data_iter.json", "meta.json", "commit_success.txt"}
    else:
        assert {"state", "data_iter", "meta", "_CHECKPOINT_METADATA", "commit_success.txt"} <= names


@LAYOUTS
def test_restore_in_a_new_process_object_with_concrete_template_and_as_saved(tmp_path, layout):
    state = make_state(1)
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout=layout) as ckpt:
        ckpt.save(5, state=state, data_iter={}, meta={})
    reader = Checkpointer(tmp_path)  # a reader changes nothing on disk
    got, _, _ = reader.restore(5, state)
    assert_bitwise_equal(got, state)
    as_saved, _, _ = reader.restore("latest")
    assert set(as_saved) == {"params", "opt", "rng"}
    assert_bitwise_equal(as_saved, {**state, "params": dict(state["params"]), "opt": list(state["opt"])})
    assert jax.dtypes.issubdtype(as_saved["rng"].dtype, jax.dtypes.prng_key)
    f32 = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)]
    cast, _, _ = reader.restore(5, {**abstract_of(state), "opt": f32})
    assert cast["opt"][0].dtype == jnp.float32 and float(cast["opt"][0]) == 1.0


@LAYOUTS
def test_loading_never_unpickles(tmp_path, monkeypatch, layout):
    import pickle

    state = make_state(3)
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout=layout) as ckpt:
        ckpt.save(1, state=state, data_iter={"i": 1}, meta={"epoch": 0})

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load called pickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    reader = Checkpointer(tmp_path)
    assert_bitwise_equal(reader.restore(1, abstract_of(state))[0], state)
    assert reader.restore(1)[2] == {"epoch": 0}
    assert average_checkpoints(tmp_path, [1])["opt"][0] == 3
    assert list_runs(tmp_path)[0]["latest_step"] == 1


def test_restore_refuses_a_mismatched_abstract_state(tmp_path):
    state = make_state(0)
    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        ckpt.save(1, state=state, data_iter={}, meta={})
        wrong = abstract_of(state)
        wrong["params"]["w"] = jax.ShapeDtypeStruct((3, 3), jnp.float32)
        with pytest.raises(
            CheckpointMismatchError, match=r"shape of 'params/w': checkpoint \(1000, 4\), abstract_state"
        ):
            ckpt.restore(1, wrong)
        extra = {**abstract_of(state), "ema": jax.ShapeDtypeStruct((2,), jnp.float32)}
        with pytest.raises(CheckpointMismatchError, match=r"not in the checkpoint: \['ema'\]"):
            ckpt.restore(1, extra)


def test_save_argument_errors(tmp_path):
    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        with pytest.raises(
            CheckpointError, match=r"state leaf 'lr' is a float; checkpoint state leaves must be arrays"
        ):
            ckpt.save(1, state={"lr": 0.1}, data_iter={}, meta={})
        with pytest.raises(CheckpointError, match=r"meta\['cb'\]\[0\] is a ndarray; meta must be JSON data"):
            ckpt.save(1, state={"w": jnp.ones(2)}, data_iter={}, meta={"cb": [np.zeros(2)]})
        with pytest.raises(CheckpointError, match=r"data_iter has a non-string key 3"):
            ckpt.save(1, state={"w": jnp.ones(2)}, data_iter={3: 1}, meta={})
        with pytest.raises(CheckpointError, match=r"step must be a non-negative int, got -1"):
            ckpt.save(-1, state={"w": jnp.ones(2)}, data_iter={}, meta={})
        with pytest.raises(CheckpointError, match=r"meta\['epoch'\] must be int or None, got '3'"):
            ckpt.save(1, state={"w": jnp.ones(2)}, data_iter={}, meta={"epoch": "3"})
        with pytest.raises(ConfigError, match=r"meta\['score'\] must be a real number or None, got 'low'"):
            ckpt.save(1, state={"w": jnp.ones(2)}, data_iter={}, meta={"score": "low"})
        ckpt.save(10, state={"w": jnp.ones(2)}, data_iter={}, meta={})
        with pytest.raises(
            CheckpointError, match=r"step 10 is not after the latest checkpoint 10 .* steps must increase"
        ):
            ckpt.save(10, state={"w": jnp.ones(2)}, data_iter={}, meta={})
        with pytest.raises(CheckpointError, match=r"which must be a step, 'latest' or 'best', got 'newest'"):
            ckpt.restore("newest")
    assert Checkpointer(tmp_path).steps() == [10]
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint in .*empty"):
        Checkpointer(tmp_path / "empty").restore("latest")


# Retention and the manifest -------------------------------------------------------------------------------
def manifest_steps(directory: Path) -> list[int]:
    return [e["step"] for e in json.loads((directory / MANIFEST).read_text())["entries"]]


SCORES = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: None, 6: 0.6, 7: 0.3, 8: 0.8, 9: 0.1, 10: 0.95}


@pytest.mark.parametrize(
    "keep,mode",
    [
        ((Best(k=2), Last(n=1)), "min"),
        ((Best(k=2), Last(n=1)), "max"),
        ((Every(n=3), Last(n=2)), "min"),
        ((Best(k=1), Every(n=4), Last(n=3)), "min"),
    ],
    ids=["best2-last1-min", "best2-last1-max", "every3-last2", "best1-every4-last3"],
)
def test_retention_keeps_exactly_the_union_after_every_save(tmp_path, keep, mode):
    ckpt = Checkpointer(tmp_path, keep=keep, mode=mode, async_save=True)
    seen: list[ManifestEntry] = []
    for step, score in SCORES.items():
        ckpt.save(step, state=make_state(step, n=8), data_iter={"next_index": step}, meta={"score": score})
        ckpt.wait()
        seen.append(ManifestEntry(step=step, score=score))
        # the expected set, computed over the whole history (retention never loses something a selector wants)
        expected = set().union(*(sel.select(seen, mode) for sel in keep))
        assert set(ckpt.steps()) == expected, step
        assert set(step_dirs(tmp_path)) == expected
        assert set(manifest_steps(tmp_path)) == expected
    ckpt.close()


def test_best_only_keep_declines_what_it_would_not_retain(tmp_path):
    with Checkpointer(tmp_path, keep=(Best(k=1),)) as ckpt:
        assert ckpt.save(1, state={"w": jnp.ones(2)}, data_iter={}, meta={"score": None}) is False
        assert ckpt.save(2, state={"w": jnp.ones(2)}, data_iter={}, meta={"score": 0.5}) is True
        assert ckpt.save(3, state={"w": jnp.ones(2)}, data_iter={}, meta={"score": 0.7}) is False
        assert ckpt.save(4, state={"w": jnp.ones(2)}, data_iter={}, meta={"score": float("nan")}) is False
        assert ckpt.save(5, state={"w": jnp.ones(2)}, data_iter={}, meta={"score": 0.1}) is True
    assert step_dirs(tmp_path) == [5]


def test_manifest_records_each_checkpoint_and_lookups_use_it(tmp_path, monkeypatch):
    from pipekit_train.checkpoint import _writer

    # The writer of step 500 waits until the lookup below has run: a fast one committed it first, by chance.
    writing, looked = threading.Event(), threading.Event()
    write_flat = _writer.write_flat

    def held_back(directory: Path, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == 500:
            writing.set()
            assert looked.wait(60)
        return write_flat(directory, step, *args, **kwargs)

    monkeypatch.setattr(_writer, "write_flat", held_back)
    with Checkpointer(tmp_path, keep=(Best(k=2), Last(n=1)), monitor="validate/acc", mode="max") as ckpt:
        for step, score in [(100, 0.5), (200, 0.8), (300, 0.6), (400, None)]:
            meta = {"score": score, "epoch": step // 100, "stage": "s0", "run_id": "run-a"}
            ckpt.save(step, state=make_state(step, n=8), data_iter={"i": step}, meta=meta)
        ckpt.save(500, state=make_state(5, n=8), data_iter={}, meta={"score": 0.1, "stop_reason": "max_steps"})
        assert writing.wait(60)
        try:
            assert ckpt.latest_step() == 400  # 500 is still being written: only committed checkpoints count
        finally:
            looked.set()
        ckpt.wait()
        assert ckpt.latest_step() == 500
        assert ckpt.best_step() == 200
        assert ckpt.steps() == [200, 300, 500]
    doc = json.loads((tmp_path / MANIFEST).read_text())
    assert doc["monitor"] == "validate/acc" and doc["mode"] == "max"
    entries = {e["step"]: e for e in doc["entries"]}
    assert sorted(entries) == step_dirs(tmp_path) == [200, 300, 500]
    assert entries[200]["score"] == 0.8 and entries[200]["epoch"] == 2 and entries[200]["run_id"] == "run-a"
    assert entries[200]["metric"] == "validate/acc" and entries[200]["stage"] == "s0" and entries[200]["time"] > 0
    assert entries[500]["stop_reason"] == "max_steps"
    files = entries[300]["files"]  # the default (flat) layout: state.bin's bytes are pinned by the leaf digests
    assert set(files) == {"state.bin", "meta.json", "data_iter.json", "commit_success.txt"}
    assert files["state.bin"][1] is None and all(len(files[f][1]) == 64 for f in ("meta.json", "data_iter.json"))
    assert files["state.bin"][0] == (tmp_path / "300" / "state.bin").stat().st_size
    # a new object answers from the manifest, following its monitor and mode
    reader = Checkpointer(tmp_path)
    assert (reader.monitor, reader.mode, reader.best_step(), reader.latest_step()) == ("validate/acc", "max", 200, 500)
    assert reader.restore("best")[1] == {"i": 200}
    assert not list(tmp_path.glob(".manifest.json.*"))  # no temporary manifest left behind


def test_checkpoints_written_under_another_metric_are_kept_and_not_ranked(tmp_path):
    with Checkpointer(tmp_path, keep=(Last(n=1),), monitor="validate/loss") as ckpt:
        save_scores(ckpt, {1: 0.1, 2: 0.2})
    with pytest.warns(PipekitTrainWarning, match=r"1 checkpoint\(s\) .* \(steps \[2\]\) were scored under another"):
        ckpt = Checkpointer(tmp_path, keep=(Last(n=1),), monitor="validate/acc", mode="max")
    save_scores(ckpt, {3: 0.5, 4: 0.6})
    ckpt.close()
    assert ckpt.steps() == [2, 4] and ckpt.best_step() == 4


def test_a_manifest_lost_after_commit_is_rebuilt_from_the_checkpoints(tmp_path):
    with Checkpointer(tmp_path, keep=(Best(k=1), Last(n=1))) as ckpt:
        save_scores(ckpt, {1: 0.3, 2: 0.1, 3: 0.4}, run_id="r")
    (tmp_path / MANIFEST).unlink()  # as if the process died between the commit and the manifest write
    with pytest.warns(PipekitTrainWarning, match=r"step\(s\) \[2, 3\] were committed but missing from manifest"):
        reader = Checkpointer(tmp_path)
    assert reader.steps() == [2, 3] and reader.best_step() == 2
    assert reader.manifest()[0].run_id == "r" and reader.manifest()[0].files is None
    assert (tmp_path / MANIFEST).exists()  # written again, so later readers need no rebuild
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.warns(PipekitTrainWarning) as seen:
        assert Checkpointer(tmp_path).steps() == [2, 3]
    assert any("manifest.json is unreadable" in str(w.message) for w in seen)


# Crashes mid-save ------------------------------------------------------------------------------------------
def test_missing_commit_marker_or_tmp_dir_is_ignored_and_the_previous_one_used(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=(Last(n=5),), layout="orbax")
    save_scores(ckpt, {1: 0.5, 2: 0.4, 3: 0.3, 4: 0.2})
    ckpt.close()
    (tmp_path / "4" / "commit_success.txt").unlink()  # the step marker of the newest
    (tmp_path / "3" / "state" / "commit_success.txt").rename(tmp_path / "3" / "state" / "x")  # an item marker
    (tmp_path / "2").rename(tmp_path / "2.orbax-checkpoint-tmp")  # never renamed into place
    for reader in (ckpt, Checkpointer(tmp_path)):
        assert reader.latest_step() == 1 and reader.steps() == [1] and reader.best_step() == 1
        with pytest.warns(PipekitTrainWarning) as said:  # the newer steps are named, never skipped quietly
            assert reader.restore("latest")[1] == {"next_index": 1}
        assert [str(w.message).split(" never committed ")[1] for w in said] == [
            "(missing state/commit_success.txt); restoring step 1",
            "(missing commit_success.txt); restoring step 1",
        ]
        with pytest.raises(
            CheckpointNotFoundError, match=r"step 4 in .* is not a committed checkpoint \(missing commit_"
        ):
            reader.restore(4)
        with pytest.raises(CheckpointNotFoundError, match=r"step 3 .* \(missing state/commit_success.txt\)"):
            reader.restore(3)


def test_flat_missing_commit_marker_or_tmp_dir_is_ignored_and_the_previous_one_used(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=(Last(n=5),))
    save_scores(ckpt, {1: 0.5, 2: 0.4, 3: 0.3})
    ckpt.close()
    (tmp_path / "3" / "commit_success.txt").unlink()  # the marker of the newest (a deletion cut short)
    (tmp_path / "2").rename(tmp_path / ".pipekit-tmp-2-123-abcdef")  # never renamed into place
    for reader in (ckpt, Checkpointer(tmp_path)):
        assert reader.latest_step() == 1 and reader.steps() == [1] and reader.best_step() == 1
        with pytest.warns(PipekitTrainWarning, match=r"step 3 .* never committed \(missing commit_success.txt\)"):
            assert reader.restore("latest")[1] == {"next_index": 1}
        with pytest.raises(CheckpointNotFoundError, match=r"step 3 in .* \(missing commit_success.txt\)"):
            reader.restore(3)
    with Checkpointer(tmp_path, keep=(Last(n=5),)) as writer:  # the first save clears what a killed writer left
        writer.save(4, state={"w": jnp.ones(2)}, data_iter={}, meta={})
    assert not list(tmp_path.glob(".pipekit-tmp-*")) and Checkpointer(tmp_path).latest_step() == 4


def test_flat_killed_before_the_rename_leaves_the_previous_checkpoint(tmp_path):
    """The flat writer dies after writing state.bin, before the rename (its first sync exits the process)."""
    script = textwrap.dedent(
        f"""
        import os, jax.numpy as jnp
        from pipekit_train.checkpoint import Checkpointer, Last, _flat
        ck = Checkpointer({str(tmp_path)!r}, keep=(Last(n=1),))
        ck.save(1, state={{"w": jnp.ones((4, 4))}}, data_iter={{"i": 1}}, meta={{}})
        ck.wait()
        _flat._datasync = _flat.os.fsync = lambda fd: os._exit(0)  # SIGKILL-like: no wait, no close, no cleanup
        ck.save(2, state={{"w": jnp.zeros((400, 100))}}, data_iter={{"i": 2}}, meta={{}})
        ck.wait()
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env, capture_output=True)
    (tmp,) = tmp_path.glob(".pipekit-tmp-2-*")  # state.bin written, never renamed into place
    assert (tmp / "state.bin").stat().st_size == 400 * 100 * 4 and not (tmp / "commit_success.txt").exists()
    reader = Checkpointer(tmp_path)
    assert reader.latest_step() == 1 and step_dirs(tmp_path) == [1] and manifest_steps(tmp_path) == [1]
    assert reader.restore("latest", {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})[1] == {"i": 1}


def test_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, jax, jax.numpy as jnp
        from pipekit_train.checkpoint import Checkpointer, Last
        ck = Checkpointer({str(tmp_path)!r}, keep=(Last(n=1),), layout="orbax")
        ck.save(1, state={{"w": jnp.ones((4, 4))}}, data_iter={{"i": 1}}, meta={{}})
        ck.wait()
        ck.save(2, state={{"w": jax.random.normal(jax.random.key(0), (4000, 1000))}}, data_iter={{"i": 2}}, meta={{}})
        import time
        deadline = time.time() + 30
        while not os.path.isdir({str(tmp_path / "2.orbax-checkpoint-tmp")!r}) and time.time() < deadline:
            time.sleep(0.001)  # the background thread checksums, then Orbax starts writing
        os._exit(0)  # dies with the background write in flight: no wait, no close
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env, capture_output=True)
    assert (tmp_path / "2.orbax-checkpoint-tmp").is_dir()  # the 16 MB write was cut off before its commit
    reader = Checkpointer(tmp_path)
    assert reader.latest_step() == 1
    assert reader.restore("latest", {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})[1] == {"i": 1}
    assert manifest_steps(tmp_path) == [1]
    # a new writer cleans up the interrupted write and carries on
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout="orbax") as ckpt:
        ckpt.save(2, state={"w": jnp.zeros((4, 4))}, data_iter={"i": 2}, meta={})
    assert step_dirs(tmp_path) == [2] and not list(tmp_path.glob("*orbax-checkpoint-tmp*"))


def test_a_normal_exit_without_close_still_commits_the_last_async_save(tmp_path):
    script = textwrap.dedent(
        f"""
        import jax.numpy as jnp
        from pipekit_train.checkpoint import Checkpointer, Last
        ck = Checkpointer({str(tmp_path)!r}, keep=(Last(n=1),))
        ck.save(7, state={{"w": jnp.ones((2000, 1000))}}, data_iter={{"i": 7}}, meta={{}})
        """  # no wait(), no close(): the exit hook finishes the write before Orbax's thread pools stop
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env, capture_output=True)
    assert manifest_steps(tmp_path) == [7] and Checkpointer(tmp_path).latest_step() == 7


def test_a_failed_background_write_surfaces_at_the_next_wait_and_keeps_the_old_ones(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=(Last(n=1),))
    ckpt.save(1, state={"w": jnp.ones(4)}, data_iter={}, meta={})
    ckpt.wait()
    big = {"w": jax.random.normal(jax.random.key(0), (300, 1000))}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))  # the disk "fills up": writes past 200 kB fail
    try:
        assert ckpt.save(2, state=big, data_iter={}, meta={}) is True  # returns; the write fails in the background
        with pytest.raises(CheckpointSaveError, match=r"saving step 2 .* failed in the background: .*File too large"):
            ckpt.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert ckpt.steps() == [1] and manifest_steps(tmp_path) == [1]  # step 1 was not rotated away
    ckpt.wait()  # the error is raised once
    ckpt.save(3, state=big, data_iter={}, meta={})
    ckpt.close()
    assert ckpt.steps() == [3] and step_dirs(tmp_path) == [3]
    assert not list(tmp_path.glob("*orbax-checkpoint-tmp*")) and not list(tmp_path.glob(".pipekit-tmp-*"))


def test_async_save_then_immediate_second_save(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=(Last(n=2),), async_save=True)
    states = {s: make_state(s, n=20_000) for s in (1, 2, 3)}
    for s, st in states.items():
        ckpt.save(s, state=st, data_iter={"i": s}, meta={})
    ckpt.close()
    assert ckpt.steps() == [2, 3]
    for s in (2, 3):
        got, it, _ = ckpt.restore(s, abstract_of(states[s]))
        assert_bitwise_equal(got, states[s])
        assert it == {"i": s}


# Corruption ------------------------------------------------------------------------------------------------
@LAYOUTS
def test_flipped_bytes_raise_corrupted_naming_the_file(tmp_path, layout):
    state = make_state(0)
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout=layout) as ckpt:
        ckpt.save(1, state=state, data_iter={}, meta={})
    victim = state_data_files(tmp_path / "1")[0]
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match=rf"checkpoint step 1 is corrupted: .*{victim.name}") as info:
        Checkpointer(tmp_path).restore("latest", abstract_of(state))
    assert info.value.files == [str(victim)] and info.value.step == 1


@LAYOUTS
def test_truncated_file_raises_corrupted_naming_the_file(tmp_path, layout):
    state = make_state(0)
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout=layout) as ckpt:
        ckpt.save(1, state=state, data_iter={}, meta={})
    victim = state_data_files(tmp_path / "1")[0]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointCorruptedError, match=rf"{victim.name} \(size {size // 2}, {size} when committed\)"):
        Checkpointer(tmp_path).restore(1, abstract_of(state))


@LAYOUTS
def test_corruption_is_caught_without_recorded_file_digests(tmp_path, layout):
    """A checkpoint re-listed after a lost manifest has no file digests: the leaf checksums still catch it."""
    state = make_state(0)
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout=layout) as ckpt:
        ckpt.save(1, state=state, data_iter={"i": 1}, meta={})
    (tmp_path / MANIFEST).unlink()
    victim = state_data_files(tmp_path / "1")[0]
    original = victim.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01  # one bit
    victim.write_bytes(bytes(data))
    with pytest.warns(PipekitTrainWarning, match=r"missing from manifest.json"):
        reader = Checkpointer(tmp_path)
    state_file = ITEM_FILE[layout]["state"]
    with pytest.raises(
        CheckpointCorruptedError, match=rf"leaf checksum mismatch at \['params/w'\]; in .*1/{state_file}"
    ):
        reader.restore(1, abstract_of(state))
    victim.write_bytes(original)
    iter_file = tmp_path / "1" / ITEM_FILE[layout]["data_iter"]
    iter_file.write_text(iter_file.read_text().replace("1", "2"))  # still valid JSON, another position
    with pytest.raises(
        CheckpointCorruptedError,
        match=rf"data_iter checksum mismatch; in .*1/{ITEM_FILE[layout]['data_iter'].split('/')[0]}",
    ):
        Checkpointer(tmp_path).restore(1, abstract_of(state))


@LAYOUTS
def test_corrupted_meta_item_is_named(tmp_path, layout):
    with Checkpointer(tmp_path, keep=(Last(n=1),), layout=layout) as ckpt:
        ckpt.save(1, state={"w": jnp.ones(3)}, data_iter={}, meta={"epoch": 1})
    meta_file = tmp_path / "1" / ITEM_FILE[layout]["meta"]
    meta_file.write_text(meta_file.read_text().replace('"epoch": 1', '"epoch": 7'))
    with pytest.raises(
        CheckpointCorruptedError, match=rf"meta checksum mismatch; damaged file\(s\): .*{meta_file.name}"
    ):
        Checkpointer(tmp_path).restore(1)


# Averaging -------------------------------------------------------------------------------------------------
def test_average_checkpoints_is_the_mean_of_float_leaves(tmp_path):
    with Checkpointer(tmp_path, keep=(Last(n=5),)) as ckpt:
        save_scores(ckpt, {1: 0.5, 2: 0.4, 3: 0.3, 4: 0.2})
    states = {s: make_state(s, n=8) for s in (2, 3, 4)}
    avg = average_checkpoints(tmp_path, [2, 3, 4], abstract_of(states[4]))
    expected_w = sum(np.asarray(states[s]["params"]["w"], np.float64) for s in (2, 3, 4)) / 3
    np.testing.assert_allclose(avg["params"]["w"], expected_w.astype(np.float32), rtol=0)
    assert avg["params"]["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(avg["params"]["b"], np.float32), np.arange(4) + 3)
    assert int(avg["opt"][0]) == 4  # integer leaf from the newest
    assert (jax.random.key_data(avg["rng"]) == jax.random.key_data(states[4]["rng"])).all()
    by_selector = average_checkpoints(tmp_path, Average(selector=Last(n=3)))
    assert_bitwise_equal(by_selector, avg)
    best2 = average_checkpoints(tmp_path, Average(selector=Best(k=2)))
    np.testing.assert_allclose(best2["opt"][1], np.full((2, 3), 3.5))
    with pytest.raises(CheckpointNotFoundError, match=r"step\(s\) \[9\] are not committed checkpoints"):
        average_checkpoints(tmp_path, [3, 9])
    with pytest.raises(CheckpointError, match=r"steps is empty"):
        average_checkpoints(tmp_path, [])


def test_write_average_writes_an_ordinary_checkpoint_recording_its_sources(tmp_path):
    src, out = tmp_path / "run", tmp_path / "avg"
    with Checkpointer(src, keep=(Last(n=3),)) as ckpt:
        save_scores(ckpt, {10: 0.5, 20: 0.4, 30: 0.3}, run_id="r9", stage="s1")
    assert write_average(src, out, Average(selector=Last(n=2))) == 30
    reader = Checkpointer(out)
    state, data_iter, meta = reader.restore("latest")
    assert meta["averaged_from"] == [20, 30] and meta["source"] == str(src.absolute())
    assert meta["run_id"] == "r9" and data_iter == {}
    expected = sum(np.asarray(make_state(s, n=8)["params"]["w"], np.float64) for s in (20, 30)) / 2
    np.testing.assert_allclose(state["params"]["w"], expected.astype(np.float32), rtol=0)
    with pytest.raises(CheckpointError, match=r"avg already holds checkpoints \[30\]"):
        write_average(src, out, [10, 20])
    with pytest.raises(CheckpointError, match=r"out_dir must differ from src_dir"):
        write_average(src, src, [10])


# Runs ------------------------------------------------------------------------------------------------------
def test_list_runs_reads_manifests_and_formats_a_table(tmp_path):
    with Checkpointer(tmp_path / "exp" / "a" / "stage0", keep=(Best(k=1), Last(n=1))) as ckpt:
        save_scores(ckpt, {1: 0.5, 2: 0.2, 3: 0.9}, run_id="run-a", stage="stage0")
    with Checkpointer(tmp_path / "exp" / "b", keep=(Last(n=2),), monitor="validate/acc", mode="max") as ckpt:
        save_scores(ckpt, {5: 0.5, 6: 0.7}, run_id="run-b", stage="finetune")
    (tmp_path / "exp" / "unrelated").mkdir()
    rows = list_runs(tmp_path / "exp")
    assert [r["run_id"] for r in rows] == ["run-b", "run-a"]  # newest first
    b, a = rows
    assert (a["stage"], a["checkpoints"], a["latest_step"], a["best_step"], a["best_score"]) == ("stage0", 2, 3, 2, 0.2)
    assert (b["metric"], b["mode"], b["best_step"], b["steps"]) == ("validate/acc", "max", 6, [5, 6])
    assert a["directory"] == str(tmp_path / "exp" / "a" / "stage0")
    table = format_runs_table(rows).splitlines()
    assert table[0].split() == ["RUN", "STAGE", "CKPTS", "LATEST", "BEST", "METRIC", "LAST", "WRITE", "DIRECTORY"]
    assert table[2].split()[:7] == ["run-a", "stage0", "2", "3", "0.2", "@", "2"]
    assert format_runs_table([]) == "no checkpointed runs found"
    with pytest.raises(CheckpointNotFoundError, match=r"run directory not found: .*missing"):
        list_runs(tmp_path / "missing")


def test_io_retry_retries_transient_errors_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return "ok"

    assert _with_io_retry(flaky, backoff=0) == "ok" and len(calls) == 3

    def denied():
        calls.append(1)
        raise PermissionError(13, "Permission denied")

    calls.clear()
    with pytest.raises(PermissionError, match="Permission denied"):
        _with_io_retry(denied, backoff=0)
    assert len(calls) == 1


# Layouts -----------------------------------------------------------------------------------------------------
def test_one_directory_may_hold_both_layouts_and_every_reader_takes_either(tmp_path):
    states = {s: make_state(s, n=8) for s in (1, 2, 3, 4)}
    with Checkpointer(tmp_path, keep=(Last(n=3),), layout="orbax") as ckpt:
        for s in (1, 2):
            ckpt.save(s, state=states[s], data_iter={"i": s}, meta={"score": 1.0 / s})
    with Checkpointer(tmp_path, keep=(Last(n=3),)) as ckpt:  # a resumed run, now writing the default layout
        assert ckpt.layout == "flat" and ckpt.steps() == [1, 2]
        for s in (3, 4):
            ckpt.save(s, state=states[s], data_iter={"i": s}, meta={"score": 1.0 / s})
    assert step_dirs(tmp_path) == [2, 3, 4]  # retention spans both layouts
    assert (tmp_path / "2" / "state").is_dir() and (tmp_path / "3" / "state.bin").is_file()
    reader = Checkpointer(tmp_path)
    for s in (2, 3, 4):
        got, data_iter, _ = reader.restore(s, abstract_of(states[s]))
        assert_bitwise_equal(got, states[s])
        assert data_iter == {"i": s}
    averaged = average_checkpoints(tmp_path, [2, 3])  # one Orbax and one flat checkpoint
    np.testing.assert_array_equal(
        np.asarray(averaged["params"]["w"]),
        (np.asarray(states[2]["params"]["w"]) + np.asarray(states[3]["params"]["w"])) / 2,
    )
    assert list_runs(tmp_path)[0]["steps"] == [2, 3, 4]


def test_a_misspelled_layout_is_refused_naming_the_field_and_the_nearest():
    with pytest.raises(
        ConfigError,
        match=r"Checkpoint.layout must be one of 'auto', 'flat', 'orbax' \(did you mean 'flat'\?\), got 'flta'",
    ):
        Checkpoint(layout="flta").validate()
    with pytest.raises(
        ConfigError, match=r"Checkpointer.layout must be one of .* \(did you mean 'orbax'\?\), got 'obrax'"
    ):
        Checkpointer("/nonexistent", layout="obrax")
    with pytest.raises(ConfigError, match=r"layout"):
        pipekit.loads("pipekit: 1\ntype: Checkpoint\nlayout: zarr\n").validate()
