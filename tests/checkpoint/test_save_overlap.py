"""A periodic save overlaps the next chunk: the state is held before the next dispatch, the rest of the save runs
while the device computes that chunk, and the checkpoint is the one an immediate save would have written.

Counted and compared, never timed: the order of dispatches and saves, and the saved bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Checkpoint,
    Checkpointer,
    EquinoxModel,
    Last,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.adapters.equinox._adapter import EquinoxBackend
from pipekit_train.callbacks import Callback
from pipekit_train.checkpoint import HeldState

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)


def _loop(max_steps: int, **overrides: Any) -> TrainingLoop:
    fields: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": X.sum(axis=1, keepdims=True)})),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 1e-2},  # a constant rate: the steps do not depend on max_steps
        max_steps=max_steps,
        batch_size=8,
        log_every_n_steps=50,
        progress=False,
        name="s",
        callbacks=(Checkpoint(every_n_steps=100, keep=(Last(n=5),)),),
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``("dispatch", first step)`` for every chunk the Equinox backend is given, ``("save", step)`` for every
    `Checkpointer.save`, with whether it was given a held state (``"save-held"``)."""
    seen: list[tuple[str, int]] = []
    for name in ("train", "train_window"):
        original = getattr(EquinoxBackend, name)

        def spy(self: Any, *args: Any, _original: Any = original) -> Any:
            seen.append(("dispatch", int(args[-1])))
            return _original(self, *args)

        monkeypatch.setattr(EquinoxBackend, name, spy)
    save = Checkpointer.save

    def spy_save(self: Checkpointer, step: int, **kw: Any) -> bool:
        seen.append(("save-held" if isinstance(kw["state"], HeldState) else "save", step))
        return save(self, step, **kw)

    monkeypatch.setattr(Checkpointer, "save", spy_save)
    return seen


def _params(directory: Path, step: int) -> list[np.ndarray]:
    with Checkpointer(directory) as ckpt:
        state, _, _ = ckpt.restore(step)
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def test_a_periodic_save_is_finished_after_the_next_chunk_is_dispatched(tmp_path, events):
    """The save's checks and hand-off follow the next dispatch: the save of step 100 comes after the dispatch of
    the chunk starting at 100, and holds step 100's state though that chunk was given the same (donated) buffers.
    The last save, with nothing after it, is made at once. Each checkpoint equals the one a run ending at that
    step saves last, bit for bit."""
    with run_settings(run_dir=str(tmp_path / "long"), store=False):
        _loop(300).run()
    assert events == [
        ("dispatch", 0),
        ("dispatch", 50),
        ("dispatch", 100),
        ("save-held", 100),
        ("dispatch", 150),
        ("dispatch", 200),
        ("save-held", 200),
        ("dispatch", 250),
        ("save", 300),
    ]
    with run_settings(run_dir=str(tmp_path / "short"), store=False):
        _loop(200).run()  # its step 200 is its last: saved at once
    assert events[-2:] == [("dispatch", 150), ("save", 200)]
    long, short = tmp_path / "long" / "s" / "checkpoints", tmp_path / "short" / "s" / "checkpoints"
    for step in (100, 200):
        for a, b in zip(_params(long, step), _params(short, step), strict=True):
            assert a.tobytes() == b.tobytes()
    assert any(a.tobytes() != b.tobytes() for a, b in zip(_params(long, 300), _params(long, 200), strict=True))


def test_a_save_begun_before_a_failure_is_finished(tmp_path, monkeypatch, events):
    """The state of step 100 was held when the next dispatch failed: the checkpoint of step 100 is still
    written, as it was when saves finished before the next dispatch, and the run's error is the one raised."""
    original = EquinoxBackend.train_window

    def failing(self: Any, window: Any, n: int, step: int) -> Any:
        if step == 100:
            raise RuntimeError("the device went away")
        return original(self, window, n, step)

    monkeypatch.setattr(EquinoxBackend, "train_window", failing)
    with (
        run_settings(run_dir=str(tmp_path / "r"), store=False),
        pytest.raises(RuntimeError, match="the device went away"),
    ):
        _loop(300).run()
    assert ("save-held", 100) in events
    with Checkpointer(tmp_path / "r" / "s" / "checkpoints") as ckpt:
        assert ckpt.steps() == [100]


def test_a_held_state_is_saved_as_it_was_when_held(tmp_path):
    """`Checkpointer.hold` then a donating step then `save`: the checkpoint has the held values (CPU buffers are
    held as views, which keeps the step from donating them; NumPy arrays are copied)."""
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    state = {"w": jnp.arange(6.0), "n": np.arange(3)}
    with Checkpointer(tmp_path, keep=(Last(n=1),)) as ckpt:
        held = ckpt.hold(state)
        state = {"w": step(state["w"]), "n": state["n"]}
        state["n"] += 10  # the caller overwrites its NumPy array in place
        ckpt.save(7, state=held, data_iter={}, meta={})
        ckpt.wait()
        restored, _, _ = ckpt.restore(7)
    np.testing.assert_array_equal(restored["w"], np.arange(6.0))
    np.testing.assert_array_equal(restored["n"], np.arange(3))


SEEN: dict[int, list[np.ndarray]] = {}


class _ModelAtCheckpoint(Callback):
    """Keeps `ctx.model`'s weights at every `on_checkpoint` in `SEEN` (a callback is a frozen operator)."""

    def on_checkpoint(self, ctx: Any, step: int) -> None:
        SEEN[step] = [np.asarray(x) for x in ctx.model.weights().values()]


def test_a_callback_that_hears_of_saves_gets_them_at_once_with_the_saved_model(tmp_path, events):
    """A callback overriding `on_checkpoint` (or `on_phase`, `on_log`) may read `ctx.model` there: such a stage
    saves before the next dispatch, so the model it sees is the checkpoint's."""
    SEEN.clear()
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        _loop(300, callbacks=(*_loop(300).callbacks, _ModelAtCheckpoint())).run()
    assert [e for e in events if e[0].startswith("save")] == [("save", 100), ("save", 200), ("save", 300)]
    directory = tmp_path / "r" / "s" / "checkpoints"
    for step in (100, 200):
        saved = sorted(a.tobytes() for a in _params(directory, step))
        assert sorted(a.tobytes() for a in SEEN[step]) == saved


class _ModelAtCheckpointStart(Callback):
    """Keeps `ctx.model`'s weights when a checkpoint starts (`on_phase_start`), in `SEEN` by step."""

    def on_phase_start(self, ctx: Any, phase: str) -> None:
        if phase == "checkpointing":
            SEEN[ctx.step] = [np.asarray(x) for x in ctx.model.weights().values()]


def test_a_callback_that_hears_of_a_checkpoints_start_sees_the_saved_model(tmp_path, events):
    """`on_phase_start` counts as hearing of saves: the stage saves before the next dispatch, so the model a
    callback reads at a checkpoint's start is the one the checkpoint holds."""
    SEEN.clear()
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        _loop(300, callbacks=(*_loop(300).callbacks, _ModelAtCheckpointStart())).run()
    assert [e for e in events if e[0].startswith("save")] == [("save", 100), ("save", 200), ("save", 300)]
    directory = tmp_path / "r" / "s" / "checkpoints"
    for step in (100, 200):
        saved = sorted(a.tobytes() for a in _params(directory, step))
        assert sorted(a.tobytes() for a in SEEN[step]) == saved
