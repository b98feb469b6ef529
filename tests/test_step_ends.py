"""`on_step_end` under fusion (`engine._step_ends`): a callback that only observes keeps the steps fused, adds no
compile and no host sync, and hears of every step, in order, with the step, epoch and values (bitwise) that one
step per compiled call gives; a run stopped and resumed with it ends where an uninterrupted one ends.

Counted, never timed: compiles through XLA compile events (`CompileCounter`), host syncs as calls of the engine's
one read of step metrics to the host (`engine._window.to_host`: every read of the log window and of a callback's
values goes through it; the callback gets host values, checked by type).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    EquinoxModel,
    TrainingDataset,
    TrainingInterrupted,
    TrainingLoop,
    run_settings,
)
from pipekit_train.adapters.equinox._steps import CompileCounter
from pipekit_train.checkpoint import Checkpointer, Last
from pipekit_train.cli._check_resume_compare import history_difference
from pipekit_train.engine._chunks import step_hook

#: One xdist worker (``--dist loadgroup``): the three counted runs (`runs`) are trained once for the module.
pytestmark = pytest.mark.xdist_group("step-ends")

SEEN: list[tuple[int, int, float, bool]] = []


class Seen(Callback, register=False):
    """Reads every step's loss, keeps a tally in its state and writes a record per step: nothing declared, so the
    loop infers from its source that it only observes."""

    def initial_state(self) -> dict[str, Any]:
        return {"steps": 0, "sum": 0.0}

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        loss = metrics["loss"]
        SEEN.append((ctx.step, ctx.epoch, float(loss), isinstance(loss, (np.generic, np.ndarray))))
        state = ctx.state_of(self)
        state["steps"] += 1
        state["sum"] += float(loss)
        ctx.writer.write({"type": "metrics", "context": "seen", "step": ctx.step, "loss": float(loss)})

    def fingerprint(self) -> None:
        return None


class SeenEveryStep(Seen, register=False):
    """The same hook taken to act between steps: the per-step path, each step reported at once, device values."""

    observes_only = False


def _data(n: int, seed: int) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1))).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(**kw: Any) -> TrainingLoop:
    """40 steps of 16 records out of 256: 16 steps an epoch, so chunks of 10 cross epochs; eval every 20."""
    base: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": 29, "depth": 1}),
        dataset=_data(256, 0),
        val_dataset=_data(32, 1),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=40,
        batch_size=16,
        log_every_n_steps=10,
        eval_every_n_steps=20,
        seed=1,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _weights(model: Any) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model.module, eqx.is_array))]


def _records(run_dir: Path) -> list[tuple[str, int, float | None]]:
    """The stage's records of steps in the order written: (context, step, loss); phases and timings left out."""
    lines = (json.loads(line) for line in (run_dir / "stage0" / "metrics.jsonl").read_text().splitlines())
    return [
        (r["context"], r["step"], r.get("loss"))
        for r in lines
        if r.get("type") == "metrics" and r["context"] in ("seen", "train", "validate")
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same 40 steps three times: fused without a callback, fused with `Seen`, one step per call with
    `SeenEveryStep`.
    Each with its compiles and host reads (`to_host` calls) counted, what `Seen` saw, the weights and the
    records."""
    from pipekit_train.engine import _window

    root = tmp_path_factory.mktemp("step_ends")
    calls = {"n": 0}
    real = _window.to_host

    def counting(x: Any) -> Any:
        calls["n"] += 1
        return real(x)

    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_window, "to_host", counting)
        for name, loop in (
            ("plain", _loop()),
            ("observed", _loop(callbacks=(Seen(),))),
            ("per_step", _loop(callbacks=(SeenEveryStep(),))),
        ):
            SEEN.clear()
            calls["n"] = 0
            with CompileCounter() as compiles, run_settings(store=False, run_dir=str(root / name)):
                model, artifact = loop.run()
            out[name] = dict(
                compiles=compiles.count,
                syncs=calls["n"],
                seen=list(SEEN),
                weights=_weights(model),
                spc=artifact.backend_info["steps_per_call"],
                records=_records(root / name),
            )
    return out


def test_an_observing_callback_keeps_the_steps_fused_and_adds_no_compile_and_no_host_sync(runs):
    assert step_hook(Seen()) == "observes"  # inferred from its source: nothing declared
    plain, observed = runs["plain"], runs["observed"]
    assert plain["spc"] == observed["spc"] == 10  # four calls of ten steps, with or without it
    assert plain["compiles"] > 0 and observed["compiles"] == 0  # the same programs: nothing compiled for it
    # Every step's loss read on the host, and not one device read more than without it: its reads share the one
    # transfer per chunk that the log records make anyway.
    assert plain["syncs"] > 0 and observed["syncs"] == plain["syncs"]
    assert all(on_host for *_, on_host in observed["seen"])
    for a, b in zip(plain["weights"], observed["weights"], strict=True):
        np.testing.assert_array_equal(a, b)  # watching changes nothing trained


def test_it_sees_every_step_in_order_with_the_values_one_step_per_call_gives(runs):
    observed, per_step = runs["observed"], runs["per_step"]
    assert per_step["spc"] == 1 and not any(on_host for *_, on_host in per_step["seen"])  # the classic path
    steps = [(s, e) for s, e, _, _ in observed["seen"]]
    assert steps == [(s, s // 16) for s in range(1, 41)]  # its own step and epoch, also mid-chunk (16, 32)
    fused = [(s, e, loss) for s, e, loss, _ in observed["seen"]]
    assert fused == [(s, e, loss) for s, e, loss, _ in per_step["seen"]]  # bitwise the same losses
    # Its records come where the per-step run writes them: each step's before the train and validate records of
    # that step, though the fused run reports a chunk's steps after the next chunk is dispatched.
    assert observed["records"] == per_step["records"]
    assert [c for c, s, _ in observed["records"] if s == 20] == ["seen", "train", "validate"]


class TermAtLog(Callback, register=False):
    """SIGTERM when the train record of step 10 is written (armed only for the interrupted run). It listens to
    records, not steps, so the `Seen` beside it still only observes and its reports still wait a dispatch."""

    armed = False

    def on_log(self, ctx: Any, record: Mapping[str, Any]) -> None:
        if TermAtLog.armed and record.get("context") == "train" and record["step"] == 10:
            TermAtLog.armed = False
            os.kill(os.getpid(), signal.SIGTERM)

    def fingerprint(self) -> None:
        return None


def test_a_run_with_an_observing_callback_stopped_and_resumed_ends_bitwise_equal(runs, tmp_path: Path):
    """Stopped at step 10, between checkpoints (every 20), and resumed: the weights, every callback's saved state
    and the logged history are the uninterrupted run's. The chunks are the fixture's (its programs, compiled)."""
    checkpoint = Checkpoint(every_n_steps=20, keep=(Last(n=1),), async_save=False)
    loop = _loop(callbacks=(checkpoint, Seen(), TermAtLog()))

    def run(name: str, resume: str = "never") -> Any:
        with run_settings(store=False, run_dir=str(tmp_path / name), resume=resume):
            return loop.run()

    full, artifact = run("full")
    assert artifact.backend_info["steps_per_call"] == 10
    for a, b in zip(_weights(full), runs["plain"]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    TermAtLog.armed = True
    try:
        with pytest.raises(TrainingInterrupted):
            run("part")
    finally:
        TermAtLog.armed = False
    resumed, _ = run("part", resume="auto")
    for a, b in zip(_weights(full), _weights(resumed), strict=True):
        np.testing.assert_array_equal(a, b)

    def saved_states(name: str) -> Any:
        with Checkpointer(tmp_path / name / "stage0" / "checkpoints", async_save=False) as ckpt:
            return ckpt.restore("latest")[2]["callbacks"]

    full_states, resumed_states = saved_states("full"), saved_states("part")
    assert full_states == resumed_states and full_states["Seen:0"]["steps"] == 40
    assert history_difference(tmp_path / "full", tmp_path / "part") is None  # the same logged history
