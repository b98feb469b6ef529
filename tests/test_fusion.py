"""`steps_per_call: auto`: how a stage's steps are cut into compiled calls, what that compiles, what it changes.

Chunk lengths are read from the compiled step's cache (`chunk_cache_size()`, one entry per compiled chunk
length) and from XLA compile events (`CompileCounter`); every test uses a model width of its own so the process-
wide cache starts empty for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import (
    EMA,
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    EarlyStopping,
    EquinoxModel,
    ReduceLROnPlateau,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.adapters.equinox._steps import CompileCounter, chunk_cache_size
from pipekit_train.engine._chunks import AUTO_CHUNK_BYTES, AUTO_MAX_STEPS, ChunkPlan, chunk_plan, needs_every_step


def _data(n: int = 256, d: int = 8, seed: int = 0) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=(d, 1)) + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(width: int, **kw: Any) -> TrainingLoop:
    base: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": width, "depth": 1}),
        dataset=_data(),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=40,
        batch_size=16,
        log_every_n_steps=10,
        seed=1,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _weights(model: Any) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model.module, eqx.is_array))]


def _run(loop: TrainingLoop) -> tuple[Any, Any, int]:
    """Run `loop`; the trained model, its artifact and how many chunk lengths it compiled."""
    before = chunk_cache_size()
    with run_settings(store=False):
        model, artifact = loop.run()
    return model, artifact, chunk_cache_size() - before


SEEN: list[tuple[int, float]] = []


class _Watch(Callback, register=False):
    """Records the steps (and losses) it sees; declares that it does not need the host every step."""

    needs_every_step = False

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        SEEN.append((ctx.step, float(metrics["loss"])))

    def fingerprint(self) -> Any:
        return None


class _StopAt(Callback, register=False):
    """Stops the run after step `at`; needs the host every step (it overrides `on_step_end`, nothing declared)."""

    at: int = 13

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if ctx.step == self.at:
            ctx.request_stop(f"step {self.at}")


class _FusedStopAt(_StopAt, register=False):
    needs_every_step = False


# The plan ------------------------------------------------------------------------------------------------------
def _plan(periods: list[int], max_steps: int = 10_000, batch_bytes: int = 1024, **kw: Any) -> ChunkPlan:
    loop = _loop(7, max_steps=max_steps, **kw)
    return chunk_plan(loop, periods, True, batch_bytes, loop.callbacks)


def test_auto_is_the_default_and_resolves_to_the_common_divisor_of_the_boundaries():
    assert _loop(7).steps_per_call == "auto"
    assert _plan([100]) == ChunkPlan(100, 12, True)  # log every 100: one call per log window
    assert _plan([100, 500, 1000]) == ChunkPlan(100, 12, True)  # + eval, checkpoint cadences
    assert _plan([50, 1000]).size == 50
    assert _plan([1000]).size == AUTO_MAX_STEPS  # capped, and still a divisor: 1000 = 10 x 100
    assert _plan([100], max_steps=40).size == 20  # max_steps counts: 40 steps are two calls of 20
    # No useful common divisor (100 and 33): the shortest period, its stretches filled by chunks of size // 8.
    assert _plan([100, 33]) == ChunkPlan(33, 4, True)
    # An explicit int is kept as it was.
    assert _plan([100], steps_per_call=7) == ChunkPlan(7, 1, False)


def test_auto_caps_the_stacked_batch_memory():
    batch = AUTO_CHUNK_BYTES // 8 + 1  # eight of these would exceed the cap
    plan = _plan([100], batch_bytes=batch)
    assert plan.size * batch <= AUTO_CHUNK_BYTES and plan.size == 5  # the largest divisor of 100 within 7


def test_callbacks_declare_whether_they_need_the_host_every_step():
    # Built-ins whose hooks run at eval, checkpoint or log time keep the steps fused.
    for cb in (EarlyStopping(monitor="validate/loss"), ReduceLROnPlateau(monitor="validate/loss"), EMA(), Checkpoint()):
        assert not needs_every_step(cb), cb
    assert needs_every_step(_StopAt())  # overrides on_step_end without saying, and stops the run: it needs it
    assert not needs_every_step(_FusedStopAt())  # said it does not
    loop = _loop(7, callbacks=(_StopAt(),))
    assert chunk_plan(loop, [100], True, 1024, loop.callbacks) == ChunkPlan(1, 1, True)
    # A backend that cannot fuse (Lightning steps torch in Python) treats auto as 1.
    loop = _loop(7)
    assert chunk_plan(loop, [100], False, 1024, ()) == ChunkPlan(1, 1, True)


def test_steps_per_call_errors_name_the_field_and_auto():
    with pytest.raises(ConfigError, match=r"steps_per_call must be a positive int or auto, got 0"):
        _loop(7, steps_per_call=0)
    with pytest.raises(ConfigError, match=r"steps_per_call must be int or one of 'auto', got 'aut'"):
        _loop(7, steps_per_call="aut")


# Real runs -----------------------------------------------------------------------------------------------------
def test_auto_compiles_one_chunk_length_when_boundaries_divide_evenly_and_is_bitwise_one_step_per_call():
    auto_model, artifact, lengths = _run(_loop(11, max_steps=40, log_every_n_steps=10))
    assert lengths == 1  # four calls of 10 steps
    assert artifact.backend_info["steps_per_call"] == 10
    one_model, one_artifact, one_lengths = _run(_loop(11, max_steps=40, log_every_n_steps=10, steps_per_call=1))
    assert one_lengths == 1 and one_artifact.backend_info["steps_per_call"] == 1
    for a, b in zip(_weights(auto_model), _weights(one_model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_auto_compiles_at_most_three_chunk_lengths_with_awkward_boundaries():
    # log every 10, eval every 7, 45 steps: no common divisor, so chunks of 7 fill, then 1 and single steps.
    def loop(width: int, **kw: Any) -> TrainingLoop:
        settings: dict[str, Any] = dict(max_steps=45, log_every_n_steps=10, eval_every_n_steps=7)
        return _loop(width, val_dataset=_data(64, seed=2), **{**settings, **kw})

    _run(loop(12, steps_per_call=1, max_steps=10))  # what any first run compiles (keys, logging ops)
    with CompileCounter() as one:
        reference, _, one_lengths = _run(loop(13, steps_per_call=1))
    with CompileCounter() as auto:
        model, artifact, lengths = _run(loop(13))
    assert artifact.backend_info["steps_per_call"] == 7
    assert one_lengths == 1 and 1 < lengths <= 3  # chunks of 7, of 7 // 8 = 1, and no third length here
    # The rest is shared with the one-step run (eval step, logging ops): auto adds only its chunk lengths.
    assert auto.count == lengths and one.count >= one_lengths
    for a, b in zip(_weights(model), _weights(reference), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_second_run_of_the_same_structure_compiles_nothing():
    loop = _loop(17, max_steps=30, log_every_n_steps=10)
    _run(loop)
    with CompileCounter() as compiles:
        _, _, lengths = _run(loop.replace(seed=2))
    assert lengths == 0 and compiles.count == 0


def test_callbacks_see_every_step_of_a_fused_chunk():
    SEEN.clear()
    _, artifact, _ = _run(_loop(19, max_steps=30, log_every_n_steps=10, callbacks=(_Watch(),)))
    assert artifact.backend_info["steps_per_call"] == 10  # it declared needs_every_step = False
    fused = list(SEEN)
    SEEN.clear()
    _run(_loop(19, max_steps=30, log_every_n_steps=10, callbacks=(_Watch(),), steps_per_call=1))
    assert [s for s, _ in fused] == list(range(1, 31))
    assert fused == SEEN  # the same step numbers and the same losses as one step per call


def test_a_callback_that_stops_at_a_step_stops_exactly_there_under_auto():
    # It overrides on_step_end without declaring anything: one step per call, and the run stops at step 13.
    _, artifact, _ = _run(_loop(23, max_steps=40, callbacks=(_StopAt(at=13),)))
    assert artifact.backend_info["steps_per_call"] == 1 and artifact.backend_info["steps"] == 13
    # Declared fusable, the same stop waits for the end of its chunk (documented in docs/performance.md).
    _, artifact, _ = _run(_loop(23, max_steps=40, callbacks=(_FusedStopAt(at=13),)))
    assert artifact.backend_info["steps"] == 20


def test_backends_that_cannot_fuse_say_so():
    """Lightning steps torch in Python: `auto` is one step per call there (the engine asks `fuses_steps()`)."""
    pytest.importorskip("torch")
    from pipekit_train.adapters.equinox._adapter import EquinoxBackend
    from pipekit_train.adapters.lightning._adapter import TorchBackend
    from pipekit_train.backends import StepBackend

    assert TorchBackend.fuses_steps is not StepBackend.fuses_steps and TorchBackend.fuses_steps(None) is False  # type: ignore[arg-type]
    assert EquinoxBackend.fuses_steps is StepBackend.fuses_steps  # the default: True
