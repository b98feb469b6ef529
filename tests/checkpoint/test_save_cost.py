"""What a save costs the training thread, and that the cheaper save keeps the atomic commit.

Counted, never timed: the files one checkpoint writes (in each layout), which thread does the writing, and what
is on disk while an asynchronous save is still waiting to be written or was killed in the middle of its commit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests import _forked

from pipekit_train import Checkpointer, Last, PipekitTrainWarning
from pipekit_train.checkpoint import _retention, _writer

HERE = Path(__file__).resolve().parent


def small_state() -> dict[str, jax.Array]:
    return {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4), "count": jnp.asarray(7, jnp.int32)}


def files_of(step_dir: Path) -> list[str]:
    """The step's files, with the content-hashed names of data files shown as ``<hash>``."""
    names = [p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()]
    return sorted(re.sub(r"/d/[0-9a-f]{32}$", "/d/<hash>", n) for n in names)


def test_a_flat_checkpoint_is_four_files_whatever_the_number_of_leaves(tmp_path):
    for n_leaves in (3, 12):
        state = {f"w{i}": jnp.full((i + 1, 5), float(i)) for i in range(n_leaves)}
        with Checkpointer(tmp_path / str(n_leaves), keep=(Last(n=1),)) as ckpt:
            ckpt.save(1, state=state, data_iter={"i": 1}, meta={})
        assert files_of(tmp_path / str(n_leaves) / "1") == [
            "commit_success.txt",
            "data_iter.json",
            "meta.json",
            "state.bin",
        ]
        size = (tmp_path / str(n_leaves) / "1" / "state.bin").stat().st_size
        nbytes = [(i + 1) * 5 * 4 for i in range(n_leaves)]
        assert sum(nbytes) <= size < sum(nbytes) + 64 * n_leaves  # the leaves' bytes, 64-byte aligned


def test_an_orbax_checkpoint_is_ten_fixed_files_and_its_data_files_whatever_the_number_of_leaves(tmp_path):
    for n_leaves in (3, 12):
        state = {f"w{i}": jnp.full((i + 1, 5), float(i)) for i in range(n_leaves)}
        with Checkpointer(tmp_path / str(n_leaves), keep=(Last(n=1),), layout="orbax") as ckpt:
            ckpt.save(1, state=state, data_iter={"i": 1}, meta={})
        files = files_of(tmp_path / str(n_leaves) / "1")
        fixed = [f for f in files if not f.endswith("/d/<hash>")]
        assert fixed == [
            "_CHECKPOINT_METADATA",
            "commit_success.txt",
            "data_iter/commit_success.txt",
            "data_iter/metadata",
            "meta/commit_success.txt",
            "meta/metadata",
            "state/_METADATA",
            "state/commit_success.txt",
            "state/manifest.ocdbt",
            "state/ocdbt.process_0/manifest.ocdbt",
        ]
        # Host (NumPy) leaves: no `_sharding` file and no per-process array metadata, which JAX-array leaves add.
        # Beside them, only OCDBT data files. How many: TensorStore writes one per batch of the writes that reach
        # it together, plus its tree's nodes, and the batches depend on timing (for 12 leaves: 5 files on a quiet
        # machine, 6 under load, 9 once in CI; for 3 leaves: 5), so their number is not asserted.
        data = [f for f in files if f.endswith("/d/<hash>")]
        assert data and all(f.startswith("state/") for f in data), files


@pytest.mark.parametrize("layout", ["flat", "orbax"])
def test_an_async_save_returns_before_anything_is_written_and_commits_whole(tmp_path, monkeypatch, layout):
    gate, started = threading.Event(), threading.Event()
    threads: dict[str, str] = {}
    host_leaves = _writer._host_leaves

    def gated(leaves):
        threads["host copy and write"] = threading.current_thread().name
        started.set()
        assert gate.wait(60)
        return host_leaves(leaves)

    monkeypatch.setattr(_writer, "_host_leaves", gated)
    ckpt = Checkpointer(tmp_path, keep=(Last(n=1),), async_save=True, layout=layout)
    try:
        first = small_state()
        ckpt.save(1, state=first, data_iter={"i": 1}, meta={})
        assert started.wait(60)
        # save() has returned; its write waits at the gate: nothing of step 1 is on disk, nothing is listed.
        assert not (tmp_path / "1").exists() and ckpt.steps() == []
        assert not (tmp_path / "manifest.json").exists()
        expected = {k: np.asarray(v) for k, v in first.items()}
        for leaf in first.values():
            leaf.delete()  # the caller may donate its buffers as soon as save() returns
        gate.set()
        ckpt.wait()
        assert ckpt.steps() == [1]
        assert json.loads((tmp_path / "manifest.json").read_text())["entries"][0]["step"] == 1
        restored, data_iter, _ = ckpt.restore("latest", {k: jnp.zeros_like(v) for k, v in expected.items()})
        assert data_iter == {"i": 1}
        for k, v in expected.items():
            np.testing.assert_array_equal(np.asarray(restored[k]), v)
            assert np.asarray(restored[k]).dtype == v.dtype
    finally:
        gate.set()
        ckpt.close()
    assert threads["host copy and write"] == "pipekit-checkpoint-writer"  # not the training thread


def test_orbax_works_in_the_background_thread_only(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    callers: list[str] = []
    save = ocp.CheckpointManager.save

    def recording(self, *args, **kwargs):
        callers.append(threading.current_thread().name)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", recording)
    with Checkpointer(tmp_path / "async", keep=(Last(n=1),), async_save=True, layout="orbax") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state=small_state(), data_iter={}, meta={})
    with Checkpointer(tmp_path / "sync", keep=(Last(n=1),), async_save=False, layout="orbax") as ckpt:
        ckpt.save(1, state=small_state(), data_iter={}, meta={})
    with Checkpointer(tmp_path / "flat", keep=(Last(n=1),)) as ckpt:  # the default layout never calls Orbax
        ckpt.save(1, state=small_state(), data_iter={}, meta={})
    main = threading.current_thread().name
    assert callers == ["pipekit-checkpoint-writer"] * 3 + [main]  # one long-lived writer thread, not one per save


CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import jax, jax.numpy as jnp
    from pipekit_train import Checkpointer, Last
    from pipekit_train.checkpoint import _retention, _writer

    directory, window, layout = sys.argv[1], sys.argv[2], sys.argv[3]
    ckpt = Checkpointer(directory, keep=(Last(n=1),), async_save=True, layout=layout)
    ckpt.save(1, state={"w": jnp.full((1000, 1000), 1.0)}, data_iter={"i": 1}, meta={})
    ckpt.wait()

    def kill(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    if window == "after-commit":  # step 2 was renamed into place; the manifest does not list it yet
        _retention._write_manifest = kill
    elif layout == "flat":  # state.bin of step 2 is written into the temporary directory, not yet renamed
        _writer.write_flat.__globals__["_datasync"] = kill
    else:  # Orbax is writing step 2 into its temporary directory
        def watch():
            while not any(".orbax-checkpoint-tmp" in name for name in os.listdir(directory)):
                time.sleep(0.0005)
            kill()
        threading.Thread(target=watch, daemon=True).start()
    ckpt.save(2, state={"w": jax.random.normal(jax.random.key(0), (4000, 1000))}, data_iter={"i": 2}, meta={})
    ckpt.wait()
    print("NOT KILLED", flush=True)
    """
)


@pytest.mark.parametrize("layout", ["flat", "orbax"])
@pytest.mark.parametrize("window", ["during-write", "after-commit"])
def test_a_sigkill_during_an_async_commit_leaves_the_previous_checkpoint_usable(tmp_path, window, layout):
    directory = tmp_path / "ck"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = _forked.run(
        [sys.executable, "-c", CHILD, str(directory), window, layout],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    listed = [e["step"] for e in json.loads((directory / "manifest.json").read_text())["entries"]]
    assert listed == [1]  # the manifest was never rewritten, so step 1 was never rotated away
    template = {"w": jnp.zeros((1000, 1000))}
    if window == "after-commit":
        with pytest.warns(PipekitTrainWarning, match=r"step\(s\) \[2\] were committed but missing"):
            ckpt = Checkpointer(directory, keep=(Last(n=1),))
        expected_latest = 2
    else:
        tmp = ".orbax-checkpoint-tmp" if layout == "orbax" else ".pipekit-tmp-2-"
        assert any(tmp in p.name for p in directory.iterdir())  # the write was cut short
        ckpt = Checkpointer(directory, keep=(Last(n=1),))
        expected_latest = 1
    with ckpt:
        assert ckpt.latest_step() == expected_latest
        state, data_iter, _ = ckpt.restore(1, template)
        np.testing.assert_array_equal(np.asarray(state["w"]), np.ones((1000, 1000), np.float32))
        assert data_iter == {"i": 1}
        ckpt.save(3, state=template, data_iter={"i": 3}, meta={})
    assert sorted(p.name for p in directory.iterdir()) == ["3", "manifest.json"]  # leftovers cleaned, rotated


FIRST_STEP = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, run_settings
    from pipekit_train.checkpoint import Checkpoint

    heavy = ("orbax", "tensorstore", "grain")
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((64, 4)).astype(np.float32), "y": rng.standard_normal((64, 1)).astype(np.float32)}
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays=data)),
        loss=MSE(),
        max_steps=3,
        batch_size=8,
        progress=False,
    )
    with run_settings(store=False, run_dir=sys.argv[1] + "/plain"):
        loop.run()
    print("PLAIN", sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy)}))
    with run_settings(store=False, run_dir=sys.argv[1] + "/saving"):
        loop.replace(callbacks=(Checkpoint(every_n_steps=2),)).run()
    print("SAVING", sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy)}))
    with run_settings(store=False, run_dir=sys.argv[1] + "/orbax"):
        loop.replace(callbacks=(Checkpoint(every_n_steps=2, layout="orbax"),)).run()
    print("ORBAX", sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy)}))
    """
)


def test_only_the_orbax_layout_imports_orbax_or_grain(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_STEP, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(
        line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("PLAIN", "SAVING", "ORBAX"))
    )
    assert lines["PLAIN"] == "[]"  # Grain imports Orbax and TensorStore: about 60 MB before the first step
    assert lines["SAVING"] == "[]"  # the default (flat) layout is written by pipekit alone
    assert "orbax" in lines["ORBAX"] and "tensorstore" in lines["ORBAX"]  # the first orbax save brings them in


def test_leaves_written_from_the_host_restore_as_jax_arrays_whatever_the_template(tmp_path):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(3), "h": jnp.ones(2, jnp.bfloat16)}
    templates = [
        None,
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),  # no sharding
        {"w": np.zeros((2, 3), np.float32), "key": jax.random.key(0), "h": np.zeros(2, np.float32)},
    ]
    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        ckpt.save(1, state=state, data_iter={}, meta={})
        for template in templates:
            restored, _, _ = ckpt.restore(1, template)
            assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored)), template
            np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
            assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])


def test_the_save_plan_is_made_once_per_structure_and_the_snapshot_is_copy_free(tmp_path, monkeypatch):
    """A save holds the CPU buffers as views (no copy on the training thread): the next step cannot donate those
    buffers (XLA gives its outputs fresh ones, and the saved bytes stay as they were until written); the step
    after it donates as before. The checkpoint holds the saved step's values."""
    from pipekit_train.checkpoint import _layout

    plans = []
    plan_state = _layout._plan_state
    monkeypatch.setattr(_layout, "_plan_state", lambda state: plans.append(1) or plan_state(state))
    monkeypatch.setattr(_layout, "_PLANS", {})
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    state = small_state()
    with Checkpointer(tmp_path, keep=(Last(n=2),)) as ckpt:
        for i in range(1, 4):
            ckpt.save(i, state=state, data_iter={"i": i}, meta={})
            snapshot = _layout._prepare_state(state)
            assert all(np.shares_memory(a, np.asarray(b)) for a, b in zip(snapshot.leaves, jax.tree.leaves(state)))
            saved = state
            state = step(state)  # the training step asks to donate the buffers save() holds: they are kept
            assert not any(x.is_deleted() for x in jax.tree.leaves(saved))
            del snapshot, saved
            ckpt.wait()
            older = state
            state = step(state)  # buffers no save holds are donated as before
            assert all(x.is_deleted() for x in jax.tree.leaves(older))
        ckpt.save(4, state={**state, "extra": jnp.zeros(2)}, data_iter={}, meta={})  # another structure
        ckpt.wait()
        restored, _, _ = ckpt.restore(3, small_state())
    assert len(plans) == 2  # one plan per tree structure, not one per save
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(12.0).reshape(3, 4) + 4)


class _Flattened:
    """A pytree node that records the thread of every flatten of it (an Equinox module flattens through Python)."""

    threads: list[str] = []

    def __init__(self, w: jax.Array, empty: tuple[()] = ()) -> None:
        self.w, self.empty = w, empty

    def flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], None]:
        _Flattened.threads.append(threading.current_thread().name)
        return ((jax.tree_util.GetAttrKey("w"), self.w), (jax.tree_util.GetAttrKey("empty"), self.empty)), None

    def flatten(self) -> tuple[tuple[Any, Any], None]:
        _Flattened.threads.append(threading.current_thread().name)
        return (self.w, self.empty), None

    @classmethod
    def unflatten(cls, _: None, children: Any) -> _Flattened:
        return cls(*children)


jax.tree_util.register_pytree_with_keys(
    _Flattened, _Flattened.flatten_with_keys, _Flattened.unflatten, _Flattened.flatten
)


def test_the_writer_thread_never_walks_the_state_tree(tmp_path, monkeypatch):
    """Whatever the background writer does holding the GIL, the training thread waits for: the state is flattened
    once, on the calling thread, and the writer works on that flat list (sizes and empty containers come from the
    cached plan). The checkpoint still restores the tree as saved, empty container included."""
    monkeypatch.setattr(_Flattened, "threads", [])
    state = {"m": _Flattened(jnp.arange(6.0)), "step": jnp.asarray(3, jnp.int32)}
    with Checkpointer(tmp_path, keep=(Last(n=2),), async_save=True, layout="flat") as ckpt:
        for step in (1, 2, 3):
            # The JSON items are copied on the calling thread; any Mapping is JSON data (a dict, as written).
            ckpt.save(
                step, state=state, data_iter=MappingProxyType({"i": step}), meta={"m": MappingProxyType({"t": (1,)})}
            )
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        saved, data_iter, meta = ckpt.restore(3)
    assert meta["m"] == {"t": [1]}
    assert _Flattened.threads and "pipekit-checkpoint-writer" not in _Flattened.threads, _Flattened.threads
    assert saved == {"m": {"w": saved["m"]["w"], "empty": []}, "step": saved["step"]} and data_iter == {"i": 3}
    np.testing.assert_array_equal(saved["m"]["w"], np.arange(6.0))
    lines = (tmp_path / "manifest.json").read_text().splitlines()
    assert [json.loads(line.rstrip(","))["step"] for line in lines[1:-1]] == [2, 3]  # one entry per line


def test_a_dropped_flat_step_is_set_aside_and_its_files_rewritten_by_the_next_save(tmp_path):
    """Each save under ``Last(n=1)`` drops the step before it: the dropped directory is renamed aside (a spare) and
    the next save overwrites its files in place instead of creating four and unlinking four. Every committed step
    still holds its own bytes, a shorter data position cuts the longer old file, and `close` removes the spare."""
    ckpt = Checkpointer(tmp_path, keep=(Last(n=1),))
    inodes = []
    for step in range(1, 6):
        state = {"w": jnp.full((64, 8), float(step)), "count": jnp.asarray(step, jnp.int32)}
        position = {"pos": "x" * (40 - 7 * step)}  # shorter at every save
        ckpt.save(step, state=state, data_iter=position, meta={"epoch": step})
        ckpt.wait()
        names = sorted(p.name for p in tmp_path.iterdir())
        spares = [n for n in names if n.startswith(".pipekit-spare-")]
        assert [n for n in names if n not in spares] == [str(step), "manifest.json"]
        assert len(spares) == (step > 1)  # the step dropped by this save, set aside for the next one
        inodes.append((tmp_path / str(step) / "state.bin").stat().st_ino)
        restored, data_iter, meta = ckpt.restore(step, state)
        for saved, back in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            assert np.asarray(back).tobytes() == np.asarray(saved).tobytes()
        assert data_iter == position and meta["epoch"] == step
    assert inodes[2:] == inodes[:3]  # step 3 was written into step 1's files, 4 into 2's, 5 into 3's
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "manifest.json"]
    assert Checkpointer(tmp_path).restore("latest", None)[1] == {"pos": "x" * 5}


def test_a_step_holding_other_files_is_deleted_not_reused(tmp_path):
    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        ckpt.save(1, state=small_state(), data_iter={}, meta={})
        ckpt.wait()
        (tmp_path / "1" / "notes.txt").write_text("mine")  # not a file the flat layout writes
        ckpt.save(2, state=small_state(), data_iter={}, meta={})
        ckpt.wait()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "manifest.json"]


def test_a_step_whose_rename_aside_cannot_be_made_durable_is_removed_not_reused(tmp_path, monkeypatch):
    from pipekit_train.checkpoint import _flat

    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        ckpt.save(1, state=small_state(), data_iter={}, meta={})
        ckpt.wait()

    def failing_fsync(path: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_flat, "fsync_dir", failing_fsync)
    assert _flat.retire(tmp_path / "1") is None  # never handed to a save to overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_steady_save_syncs_the_directory_twice_and_commits_before_it_drops(tmp_path, monkeypatch):
    # Under `Last(n=1)` a save commits its step, lists it, then drops the previous one. The commit's rename is made
    # durable by the manifest's directory fsync (one journal commit for both renames, where there were two), and
    # that fsync comes before the previous step is renamed aside: a power cut can never leave the old step gone
    # while the new one is not durably committed.
    from pipekit_train.checkpoint import _flat

    events: list[str] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def rename(src: Any, dst: Any) -> None:
        events.append(f"rename {Path(src).name[:14]} -> {Path(dst).name[:14]}")
        real_rename(src, dst)

    def replace(src: Any, dst: Any) -> None:
        events.append(f"replace -> {Path(dst).name}")
        real_replace(src, dst)

    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state=small_state(), data_iter={"i": step}, meta={})
            ckpt.wait()
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(_flat, "_datasync", lambda fd: events.append("fdatasync"))
        ckpt.save(3, state=small_state(), data_iter={"i": 3}, meta={})
        ckpt.wait()
    assert events == [
        "rename .pipekit-spare -> .pipekit-tmp-3",  # step 1's files, set aside by the save of step 2
        "fdatasync",  # state.bin, data_iter.json, meta.json, overwritten in place
        "fdatasync",
        "fdatasync",
        "rename .pipekit-tmp-3 -> 3",  # the commit
        "fsync file",  # the manifest's temporary file
        "replace -> manifest.json",
        "fsync dir",  # the commit's rename and the manifest's, durable together
        "rename 2 -> .pipekit-spare",  # only then is step 2 dropped
        "fsync dir",  # durable before the next save overwrites its files
    ]


def test_a_manifest_that_cannot_be_written_still_syncs_the_commit_and_drops_nothing(tmp_path, monkeypatch):
    from pipekit_train import CheckpointSaveError
    from pipekit_train.checkpoint import _flat

    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        ckpt.save(1, state=small_state(), data_iter={"i": 1}, meta={})
        ckpt.wait()

        def full_disk(*args: Any) -> None:
            raise OSError(28, "No space left on device")

        synced: list[Path] = []
        real_fsync_dir = _flat.fsync_dir
        monkeypatch.setattr(_retention, "_write_manifest", full_disk)
        monkeypatch.setattr(_retention, "fsync_dir", lambda path: (synced.append(Path(path)), real_fsync_dir(path)))
        ckpt.save(2, state=small_state(), data_iter={"i": 2}, meta={})
        with pytest.raises(
            CheckpointSaveError, match=r"step 2 committed in .* could not be updated .*nothing was deleted"
        ):
            ckpt.wait()
        assert synced == [tmp_path]  # the commit's rename, whose fsync the manifest's write would have done
        assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "manifest.json"]
        monkeypatch.undo()
        ckpt.save(3, state=small_state(), data_iter={"i": 3}, meta={})  # the next write lists what committed
        ckpt.wait()
        assert ckpt.steps() == [3]
    assert json.loads((tmp_path / "manifest.json").read_text())["entries"][0]["step"] == 3


SPARE_KILLED = textwrap.dedent(
    """
    import os, sys, jax.numpy as jnp
    from pipekit_train.checkpoint import Checkpointer, Last, _flat
    ck = Checkpointer(sys.argv[1], keep=(Last(n=1),))
    for step in (1, 2):
        ck.save(step, state={"w": jnp.full((100, 10), float(step))}, data_iter={"i": step}, meta={})
        ck.wait()
    assert any(p.startswith(".pipekit-spare-") for p in os.listdir(sys.argv[1]))
    _flat._datasync = lambda fd: os._exit(0)  # dies right after state.bin is rewritten in step 1's old files
    ck.save(3, state={"w": jnp.full((100, 10), 3.0)}, data_iter={"i": 3}, meta={})
    ck.wait()
    """
)


def test_a_kill_while_a_spare_is_rewritten_leaves_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = _forked.run(
        [sys.executable, "-c", SPARE_KILLED, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".pipekit-tmp-3-")]  # the spare, half rewritten
    assert (tmp / "commit_success.txt").exists()  # step 1's marker: a temporary directory is never a step
    ckpt = Checkpointer(tmp_path, keep=(Last(n=1),))
    assert ckpt.steps() == [2]
    state, data_iter, _ = ckpt.restore("latest", {"w": jnp.zeros((100, 10))})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((100, 10), 2.0, np.float32))
    assert data_iter == {"i": 2}
    with ckpt:
        ckpt.save(3, state=state, data_iter={"i": 3}, meta={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "manifest.json"]  # the leftovers removed
