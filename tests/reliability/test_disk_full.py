"""A disk that fills up in the middle of a checkpoint save (and a file-size limit reached in the middle of one).

The run directory lies on a small tmpfs (mounted here when the machine allows it; otherwise the save's write call
gets an ``ENOSPC`` injected). Training fills the disk, all but a few kilobytes, just before the step-10 save, so
the writer (pipekit's flat layout, or Orbax) has written part of that checkpoint when it runs out of space.
Asserted: the run stops with one line naming the save, the step-5 checkpoint stays committed and intact, and once
space is freed ``resume="auto"`` ends with the weights of an uninterrupted run, bit for bit.

The portable twin, which needs no mount and injects nothing: a real process lowers its own ``RLIMIT_FSIZE`` just
before the step-10 save (``SIGXFSZ`` ignored, so writes past the limit fail with ``EFBIG`` as on a full disk) and
must stop with one line naming the checkpoint directory and the free space.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    Checkpointer,
    CheckpointSaveError,
    EquinoxModel,
    Last,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)

X = np.random.default_rng(3).normal(size=(64, 3)).astype(np.float32)
# What the filler leaves, by layout: part of the step-10 checkpoint fits, the rest does not (the flat layout's
# state.bin takes one 4 KiB page of the tmpfs, its meta.json would need the next).
FREE_AFTER_FILL = {"flat": 4 * 1024, "orbax": 16 * 1024}

#: One xdist worker for the module (--dist loadgroup): the uninterrupted reference run (`reference_hash`) trains
#: and compiles once, not once per worker.
pytestmark = pytest.mark.xdist_group("disk-full")


class FillDisk(Callback, register=False):
    """At `step`, fills the file system holding `path`, leaving `FREE_AFTER_FILL` bytes (a test-only callback).

    Only ever pointed at the test's own small tmpfs; with no `path` it does nothing.
    """

    step: int = 10
    path: str = ""
    free: int = 0
    order: int = -100  # before the checkpoint of the same step

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        if ctx.step != self.step or not self.path:
            return
        fs = os.statvfs(os.path.dirname(self.path))
        assert fs.f_blocks * fs.f_frsize <= 64 << 20, "FillDisk only fills a small test file system"
        block = b"\0" * (64 * 1024)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            written = 0
            while True:
                try:
                    written += os.write(fd, block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
            os.ftruncate(fd, max(0, written - self.free))
        finally:
            os.close(fd)

    def fingerprint(self) -> None:
        return None


class LimitFileSize(Callback, register=False):
    """At `step`, lowers this process's file-size limit to `limit` bytes (a test-only callback, run in a child)."""

    step: int = 10
    limit: int = 0
    order: int = -100  # before the checkpoint of the same step

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        if ctx.step == self.step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def fingerprint(self) -> None:
        return None


def _loop(*callbacks: Callback, layout: str = "auto") -> TrainingLoop:
    return TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1] * 2})),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=20,
        batch_size=8,
        log_every_n_steps=5,
        progress=False,
        name="fit",
        callbacks=(Checkpoint(every_n_steps=5, keep=(Last(n=2),), async_save=False, layout=layout), *callbacks),
    )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, bool]]:
    """A 4 MiB tmpfs at tmp_path/disk, and whether it is one (False: a plain folder; ENOSPC is injected)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = (
        shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "pipekit-test", str(disk)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield disk, mounted
    finally:
        if mounted and subprocess.run(["umount", str(disk)]).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=True)  # busy: detach it now, free it when unused


def _inject_enospc(monkeypatch: pytest.MonkeyPatch, at_step: int, layout: str) -> None:
    """No tmpfs: make the write of `at_step` fail as a full disk does (the fallback of `small_disk`)."""
    if layout == "flat":
        from pipekit_train.checkpoint import _writer

        write = _writer.write_flat

        def flat_full(directory: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            if step == at_step:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
            return write(directory, step, *args, **kwargs)

        monkeypatch.setattr(_writer, "write_flat", flat_full)
        return
    import orbax.checkpoint as ocp

    save = ocp.CheckpointManager.save

    def full(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == at_step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory))
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full)


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The trained weights' hash of the uninterrupted run (the default layout: the layout does not change them)."""
    with run_settings(run_dir=str(tmp_path_factory.mktemp("reference")), store=False):
        _, reference = _loop().run()
    return str(reference.trained_model_hash)


@pytest.mark.parametrize("layout", ["flat", "orbax"])
def test_a_disk_full_mid_save_keeps_the_last_checkpoint_and_resumes_bitwise(
    tmp_path: Path, small_disk: tuple[Path, bool], layout: str, reference_hash: str
):
    disk, mounted = small_disk
    run_dir, filler = disk / "run", disk / "filler"
    ckpt_dir = run_dir / "fit" / "checkpoints"
    with (
        pytest.MonkeyPatch.context() as patch,
        run_settings(run_dir=str(run_dir), store=False),
        pytest.raises(CheckpointSaveError) as failed,
    ):
        if not mounted:
            _inject_enospc(patch, at_step=10, layout=layout)
        _loop(FillDisk(path=str(filler) if mounted else "", free=FREE_AFTER_FILL[layout]), layout=layout).run()
    message = str(failed.value)
    print(message)
    assert "\n" not in message and len(message) < 600 and "step 10" in message and str(ckpt_dir) in message, message
    assert "No space left on device" in message or "ENOSPC" in message or "RESOURCE_EXHAUSTED" in message, message

    # The step-5 checkpoint is committed, listed, and reads back against its checksums; step 10 never committed.
    assert Checkpointer(ckpt_dir).steps() == [5]
    assert not list(ckpt_dir.glob(".pipekit-tmp-*"))  # the flat writer removed its half-written step
    state, _, meta = Checkpointer(ckpt_dir).restore(5)
    assert meta["step"] == 5 and state

    # Space is freed; the run continues from step 5 and ends where the uninterrupted one did.
    filler.unlink(missing_ok=True)
    with run_settings(run_dir=str(run_dir), store=False, resume="auto"):
        _, resumed = _loop(layout=layout).run()
    assert resumed.trained_model_hash == reference_hash
    assert resumed.backend_info["steps"] == 20


# The child: trains with the file-size limit lowered before the step-10 save, prints the one line it stops with.
_CHILD = """
import sys
sys.path.insert(0, {here!r})
from test_disk_full import LimitFileSize, _loop
from pipekit_train import CheckpointSaveError, run_settings
with run_settings(run_dir={run_dir!r}, store=False):
    try:
        _loop(LimitFileSize(limit={limit}), layout={layout!r}).run()
    except CheckpointSaveError as e:
        print(e, file=sys.stderr)
        sys.exit(3)
"""


@pytest.mark.parametrize("layout", ["flat", "orbax"])
def test_a_file_size_limit_mid_save_stops_with_the_free_space_and_resumes_bitwise(
    tmp_path: Path, reference_hash: str, layout: str, xla_cache_env: dict[str, str]
):
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "fit" / "checkpoints"
    # 5000 bytes: above the metrics.jsonl (about 2 KB at step 10) and the manifest, below the checkpoint's own JSON
    # (flat meta.json about 8 KB; orbax _METADATA about 10 KB), so the save is what hits the limit.
    code = _CHILD.format(here=str(Path(__file__).parent), run_dir=str(run_dir), limit=5000, layout=layout)
    env = {**os.environ, **xla_cache_env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = child.stderr.strip().splitlines()
    assert child.returncode == 3, child.stderr[-3000:]
    message = lines[-1]
    print(message)
    assert message.startswith(f"saving step 10 to {ckpt_dir} failed"), message
    assert "File too large" in message or "os_error_code='27'" in message, message
    assert " free on the file system of " in message and "file-size limit" in message, message
    assert len(message) < 700, message
    # Orbax's writer threads ended before the exit (none fails at interpreter shutdown after the line). Orbax's own
    # absl log of its failed thread comes before the line; that is Orbax's logging, left as it is.
    assert "interpreter shutdown" not in child.stderr, child.stderr[-3000:]

    # Step 5 is committed, listed and intact; nothing of step 10 is left to be taken for a checkpoint.
    assert Checkpointer(ckpt_dir).steps() == [5]
    assert not list(ckpt_dir.glob(".pipekit-tmp-*")) and not (ckpt_dir / "10").exists()
    _, _, meta = Checkpointer(ckpt_dir).restore(5)
    assert meta["step"] == 5

    with run_settings(run_dir=str(run_dir), store=False, resume="auto"):  # this process has no limit: room again
        _, resumed = _loop(layout=layout).run()
    assert resumed.trained_model_hash == reference_hash
    assert resumed.backend_info["steps"] == 20
