"""Elastic resume: one run continued on 2 processes x 2 devices, then 1 process x 2 devices, then 1 device.

Every multi-device run is a real ``pipekit-train`` subprocess (the device count is fixed per process: virtual CPU
devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``; two processes through ``pipekit-train launch``
and gloo); the chain's last, one-device run is the command in this process (`_run_here`).
A test-only module imported with ``--import`` (`HOOK`) does two things:

- it logs the record ids (the ``rid`` column of the data) of every batch each process draws, keyed by the data
  position ``(epoch, batch)``, so the global batches of the chain can be compared with the uninterrupted run's;
- its `StopAt` callback SIGTERMs the process at the step named by ``$STOP_AT`` (every process of a launch does,
  the stop is agreed anyway): a graceful stop with a committed checkpoint at a known step, not a race with a kill.

What is asserted: the chain (4 devices of 2 processes -> 2 devices -> 1 device) draws exactly the uninterrupted
4-device run's global batches, record id for record id (each process's rows put side by side); its final weights
agree with that run's within 1e-5 relative (the all-reduce adds the partial gradients in another order); the
artifact records both changes and ``artifacts show`` prints them; a device count that does not split the global
batch (3 of 16) is refused in one line naming the batch, both counts and the nearest counts that work, before
anything is trained or written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.xdist_group("scale"), pytest.mark.slow]  # the gloo launches: one module at a time

PIPELINE = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 16, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, device_resident: false}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 12
  batch_size: 16
  log_every_n_steps: 2
  steps_per_call: 2
  progress: false
  callbacks:
  - {type: Checkpoint, every_n_steps: 4, async_save: false, keep: [{type: Last, n: 2}]}
  - {type: StopAt}
"""

HOOK = """\
import json
import os
import signal

from pipekit_train import Callback
from pipekit_train.data._iterator import BatchIterator

_next = BatchIterator.__next__


def _logged(self):
    import jax

    position = self.get_state()
    batch = _next(self)
    with open(f"{os.environ['RECORD_IDS']}.{jax.process_index()}", "a") as f:
        f.write(json.dumps([position["epoch"], position["batch"], batch["rid"].tolist()]) + "\\n")
    return batch


if os.environ.get("RECORD_IDS"):
    BatchIterator.__next__ = _logged


class StopAt(Callback):
    def on_step_end(self, ctx, metrics):
        if ctx.step == int(os.environ.get("STOP_AT", "0")):
            os.kill(os.getpid(), signal.SIGTERM)

    def fingerprint(self):
        return None  # observes and stops only: the run resumed without $STOP_AT is the same training
"""

TIMEOUT = 240
_CACHE: dict[str, str] = {}


def _run(work: Path, run: str, *extra: str, devices: int = 1, env: dict[str, str] | None = None,
         launch: bool = False) -> subprocess.CompletedProcess[str]:  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("PIPEKIT_")}
    base.update(JAX_PLATFORMS="cpu", RECORD_IDS=str(work / run), **_CACHE, **(env or {}))
    if launch:
        command = ["launch", "--num-processes", "2", "--devices-per-process", str(devices)]
    else:
        command = ["run"]
        if devices > 1:
            base["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    args = [sys.executable, "-m", "pipekit_train.cli", *command, "pipe.yaml", "--import", "elastic_hook"]
    args += ["--run-dir", run, "--store", "store.sqlite", *extra]
    return subprocess.run(args, cwd=work, env=base, capture_output=True, text=True, timeout=TIMEOUT)


def _run_here(work: Path, run: str, *extra: str) -> int:
    """`_run` on one device in this process (``cli.main``, the test process's one CPU device): no interpreter start,
    no second import of JAX. The hook is imported here for the run only: `BatchIterator` and `sys.path` are put back
    and the module forgotten afterwards, so no other test draws batches through it."""
    from pipekit_train.cli._main import main
    from pipekit_train.data._iterator import BatchIterator

    saved_next, saved_path, saved_env, here = BatchIterator.__next__, list(sys.path), dict(os.environ), os.getcwd()
    os.environ["RECORD_IDS"] = str(work / run)
    os.chdir(work)
    try:
        with warnings.catch_warnings(record=True):  # as the command line shows them, not raised as pytest's settings
            warnings.simplefilter("default")
            return main(["run", "pipe.yaml", "--import", "elastic_hook", "--run-dir", run, "--store", "store.sqlite",
                         *extra])  # fmt: skip
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        sys.modules.pop("elastic_hook", None)
        BatchIterator.__next__ = saved_next  # type: ignore[method-assign]


def _batches(work: Path, run: str) -> dict[tuple[int, int], list[int]]:
    """Every global batch the run drew, by data position: the processes' rows side by side, in process order.

    A batch drawn twice (after a resume) must hold the same records both times."""
    parts: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in sorted(work.glob(f"{run}.*")):
        process = int(path.suffix[1:])
        for line in path.read_text().splitlines():
            epoch, batch, rows = json.loads(line)
            seen = parts.setdefault(process, {}).setdefault((epoch, batch), rows)
            assert seen == rows, f"process {process} drew batch {(epoch, batch)} twice with other records"
    out: dict[tuple[int, int], list[int]] = {}
    for process in sorted(parts):
        for position, rows in parts[process].items():
            out.setdefault(position, []).extend(rows)
    return out


def _weights(work: Path, run: str) -> dict[str, np.ndarray]:
    import jax

    from pipekit_train.provenance import LocalModelRegistry

    final = json.loads((work / run / "fit" / "final.json").read_text())
    model = LocalModelRegistry(str(work / run / "models")).load(final["model_uri"])
    flat = jax.tree_util.tree_flatten_with_path(model.module)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if hasattr(x, "dtype")}


def _artifact(work: Path, run: str) -> Any:
    from pipekit_train.provenance import ArtifactStore

    final = json.loads((work / run / "fit" / "final.json").read_text())
    with ArtifactStore(str(work / "store.sqlite")) as store:
        return store.get(final["artifact_id"])


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, xla_cache_env: dict[str, str]) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True), rid=np.arange(64, dtype=np.int32))
    (root / "pipe.yaml").write_text(PIPELINE)
    (root / "elastic_hook.py").write_text(HOOK)
    _CACHE.update(xla_cache_env)  # the run's persistent compilation cache (tests/conftest.py)
    out = _run(root, "whole", devices=4)  # the uninterrupted run: one process, 4 devices
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def test_a_run_resumed_on_fewer_processes_and_devices_draws_the_same_batches(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, ckdir = "chain", work / "chain" / "fit" / "checkpoints"
    # 2 processes x 2 devices, stopped (SIGTERM, agreed by both) after the checkpoint of step 4.
    out = _run(work, run, devices=2, launch=True, env={"STOP_AT": "4"})
    assert out.returncode == 143, out.stderr[-3000:]
    assert (ckdir / "4" / "commit_success.txt").is_file() and not (ckdir / "8").exists()

    # 3 devices cannot split the global batch of 16: one line, before anything is trained or written.
    before = sorted(p.name for p in ckdir.iterdir())
    out = _run(work, run, "--resume", "auto", devices=3)
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("pipekit-train: error: cannot resume stage 'fit' from step 4 in "), line
    assert "on 3 devices (1 process): the checkpoint was written on 4 devices (2 processes)" in line, line
    assert "global batch of 16 records" in line and "resume on 2 or 4 devices (any of 1, 2, 4, 8, 16)" in line, line
    assert "Traceback" not in out.stderr and sorted(p.name for p in ckdir.iterdir()) == before

    # One process with 2 devices continues (no --force-resume), stopped after step 8; then one device finishes.
    out = _run(work, run, "--resume", "auto", devices=2, env={"STOP_AT": "8"})
    assert out.returncode == 143, out.stderr[-3000:]
    # Said on one line, though the stage has `progress: false` (the elastic resume is a warning, not a bar's line).
    notice = (
        "pipekit-train: warning: fit: elastic resume at step 4 on 2 devices (1 process), written on 4 devices "
        "(2 processes): the same batches, weights within float rounding (docs/reliability.md)"
    )
    assert out.stderr.splitlines().count(notice) == 1, out.stderr[-3000:]
    assert _run_here(work, run, "--resume", "auto") == 0

    # The same global batches, record id for record id: 12 steps, 4 batches per epoch.
    want, got = _batches(work, "whole"), _batches(work, run)
    assert sorted(want) == [(e, b) for e in range(3) for b in range(4)]
    assert got == want
    # The weights within float rounding of the uninterrupted run (another all-reduce order), and it did train.
    whole, chain = _weights(work, "whole"), _weights(work, run)
    assert whole.keys() == chain.keys() and whole
    for name in whole:
        np.testing.assert_allclose(chain[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)

    # The artifact records both changes, with the steps where they happened; `artifacts show` prints them.
    info = _artifact(work, run).backend_info
    assert (info["num_devices"], info["num_processes"]) == (1, 1)
    assert info["topology_changes"] == [
        {"step": 4, "from": {"num_devices": 4, "num_processes": 2}, "to": {"num_devices": 2, "num_processes": 1}},
        {"step": 8, "from": {"num_devices": 2, "num_processes": 1}, "to": {"num_devices": 1, "num_processes": 1}},
    ]
    assert "topology_changes" not in _artifact(work, "whole").backend_info
    from pipekit_train.cli._main import main

    assert main(["artifacts", "show", _artifact(work, run).artifact_id, "--store", str(work / "store.sqlite")]) == 0
    shown = capsys.readouterr().out
    history = "4 devices (2 processes) -> step 4: 2 devices (1 process) -> step 8: 1 device (1 process)"
    assert f"topology   {history}" in shown, shown


def test_the_devices_that_split_a_global_batch() -> None:
    from pipekit_train.checkpoint._elastic import fitting_counts, history_text, without_topology

    assert fitting_counts(16) == [1, 2, 4, 8, 16]
    assert fitting_counts(16, processes=2) == [2, 4, 8, 16]
    assert fitting_counts(12, short=4) == [1, 2, 4]  # the short last batch of each epoch must split too
    # The fingerprint without the counts: parameter sharding is configuration and stays.
    old = {"seed": 0, "mesh": {"num_devices": 4, "shard_params": False, "num_processes": 2}}
    assert without_topology(old) == {"seed": 0} == without_topology({"seed": 0})
    assert without_topology({"mesh": {"num_devices": 4, "shard_params": True}}) == {"mesh": {"shard_params": True}}
    assert history_text([]) == "-"
