"""Schedules for any value (`pipekit_train.optim._schedules`): a loss weight and the EMA decay follow the traced step,
are logged as ``schedule/<name>``, compile once and resume bitwise."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    EMA,
    ArraySource,
    Checkpoint,
    Composite,
    Constant,
    Cosine,
    CrossEntropy,
    EquinoxModel,
    Exponential,
    Linear,
    Piecewise,
    TrainingDataset,
    TrainingLoop,
    current_step,
    read_jsonl,
    run_settings,
    schedule_value,
    step_context,
)
from pipekit_train.adapters.equinox._steps import chunk_cache_size
from pipekit_train.optim._schedules import schedules_in
from pipekit_train.stage.preflight import check_pipeline

CLF = EquinoxModel(factory="classifier", kwargs={"in_size": 8, "num_classes": 3, "latent_size": 4, "hidden": [8]})
REPO = Path(__file__).resolve().parents[2]
COSINE_DECAY = Cosine(start=0.5, end=0.9, steps=4)


def _data() -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :3].argmax(axis=1).astype(np.int32)}))


def _annealed(weight) -> Composite:
    """Cross-entropy plus a smoothed cross-entropy whose weight follows `weight` (the KL-annealing shape)."""
    return Composite(components=((1.0, CrossEntropy()), (weight, CrossEntropy(label_smoothing=0.5))))


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=CLF,
        dataset=_data(),
        loss=_annealed(Linear(start=0.0, end=1.0, steps=6, begin=2)),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=12,
        batch_size=32,
        log_every_n_steps=1,
        steps_per_call=1,
        seed=3,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _train_records(run_dir: Path, stage: str = "stage0") -> list[dict]:
    records = read_jsonl(run_dir / stage / "metrics.jsonl")
    return [r for r in records if r.get("context") == "train" and r.get("type") == "metrics"]


# The schedules themselves ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "schedule,expected",
    [
        (Linear(start=0.0, end=1.0, steps=4, begin=2), {0: 0.0, 2: 0.0, 3: 0.25, 6: 1.0, 100: 1.0}),
        (Cosine(start=1.0, end=0.0, steps=10), {0: 1.0, 5: 0.5, 10: 0.0, 50: 0.0}),
        (Exponential(start=1.0, end=0.01, steps=10), {0: 1.0, 5: 0.1, 10: 0.01}),
        (Piecewise(values=(0.0, 0.5, 1.0), boundaries=(3, 7)), {0: 0.0, 2: 0.0, 3: 0.5, 6: 0.5, 7: 1.0}),
        (Constant(value=0.25), {0: 0.25, 9: 0.25}),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, dict) else "",
)
def test_schedule_values_on_the_host_and_traced(schedule, expected):
    traced = jax.jit(schedule)
    for step, value in expected.items():
        assert math.isclose(schedule(step), value, rel_tol=1e-6, abs_tol=1e-7)
        assert math.isclose(float(traced(jnp.int32(step))), value, rel_tol=1e-5, abs_tol=1e-6)
    assert schedule.final() == list(expected.values())[-1]
    low, high = schedule.bounds()
    assert all(low - 1e-7 <= v <= high + 1e-7 for v in expected.values())
    assert pipekit.loads(pipekit.dumps(schedule)) == schedule


@pytest.mark.parametrize(
    "text,message",
    [
        ("{type: Linear, start: 0.0, end: 1.0, steps: 0}", r"Linear.steps must be an int >= 1 .*, got 0"),
        ("{type: Linear, start: 0.0, end: 1.0, steps: 5, begin: -1}", r"Linear.begin must be an int >= 0"),
        ("{type: Cosine, start: .nan, end: 1.0, steps: 5}", r"Cosine.start must be a finite float, got nan"),
        ("{type: Exponential, start: 0.0, end: 1.0, steps: 5}", r"Exponential.start and end must both be > 0"),
        ("{type: Piecewise, values: [0.0, 1.0], boundaries: []}", r"Piecewise.values must hold one more value"),
        ("{type: Piecewise, values: [0, 1, 2], boundaries: [5, 5]}", r"strictly increasing .* \(boundaries\[1\] = 5\)"),
        (
            "{type: Linaer, start: 0.0, end: 1.0, steps: 5}",
            r"unknown operator type 'Linaer' \(did you mean 'Linear'\?\)",
        ),
        ("{type: Linear, start: 0.0, end: 1.0}", r"Linear is missing required field\(s\): steps"),
    ],
)
def test_bad_schedules_are_one_line_errors_at_their_position(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        pipekit.loads(text)
    assert "\n" not in str(info.value) and str(info.value).startswith("<string>:1:")


def test_schedule_value_follows_the_context_and_is_final_outside_it():
    ramp = Linear(start=0.0, end=2.0, steps=4)
    assert schedule_value(0.5, "w") == 0.5
    assert schedule_value(ramp, "w") == 2.0  # no step: the final value (validation, test, direct calls)
    assert current_step() is None
    with step_context(jnp.int32(1)) as ctx:
        assert float(schedule_value(ramp, "w")) == 0.5
        assert int(current_step()) == 1
    assert {k: float(v) for k, v in ctx.metrics().items()} == {"schedule/w": 0.5}
    assert current_step() is None
    with step_context(0) as ctx, pytest.raises(ConfigError, match="two different schedules are logged as"):
        schedule_value(ramp, "w")
        schedule_value(Linear(start=0.0, end=1.0, steps=4), "w")


def test_composite_weights_accept_schedules_in_yaml():
    text = """
type: Composite
components:
- [1.0, {type: CrossEntropy}]
- [{type: Linear, start: 0.0, end: 1.0, steps: 1000}, {type: CrossEntropy, label_smoothing: 0.5}]
"""
    loss = pipekit.loads(text)
    assert loss == _annealed(Linear(start=0.0, end=1.0, steps=1000))
    assert pipekit.loads(pipekit.dumps(loss)) == loss
    assert schedules_in(loss) == [("components[1][0]", Linear(start=0.0, end=1.0, steps=1000))]
    with pytest.raises(ConfigError, match=r"components\[1\]\[0\] must be float or Schedule .*, got 'fast'"):
        pipekit.loads(text.replace("{type: Linear, start: 0.0, end: 1.0, steps: 1000}", "fast"))


# In training --------------------------------------------------------------------------------------------------
def test_annealed_weight_reaches_its_values_at_the_given_steps_and_weights_the_loss(tmp_path):
    before = chunk_cache_size()
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _loop().run()
    assert chunk_cache_size() - before <= 1  # one compiled step for every value of the weight
    records = _train_records(tmp_path / "run")
    # The record at step t holds the value used by step t - 1 (steps taken before it): 0 up to step 2, then a
    # straight line to 1 at step 8.
    weights = {r["step"]: r["schedule/weight/CrossEntropy_1"] for r in records}
    assert [weights[t] for t in range(1, 13)] == pytest.approx(
        [0.0, 0.0, 0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0, 1.0, 1.0, 1.0], abs=1e-6
    )
    for r in records:  # the logged weight is the one the loss used
        total = r["loss/CrossEntropy_0"] + r["schedule/weight/CrossEntropy_1"] * r["loss/CrossEntropy_1"]
        assert r["loss"] == pytest.approx(total, rel=1e-5)


def test_fused_steps_follow_the_scan_step_and_records_average_the_window(tmp_path):
    """Four steps per compiled call (`lax.scan`): each step reads its own step; a record averages its window."""
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _loop(steps_per_call=4, log_every_n_steps=4).run()
    weights = [r["schedule/weight/CrossEntropy_1"] for r in _train_records(tmp_path / "run")]
    ramp = [min(max((t - 2) / 6, 0.0), 1.0) for t in range(12)]
    assert weights == pytest.approx([sum(ramp[i : i + 4]) / 4 for i in (0, 4, 8)], abs=1e-6)


def test_a_run_without_schedules_logs_none(tmp_path):
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _loop(loss=_annealed(0.5), max_steps=2).run()
    records = _train_records(tmp_path / "run")
    assert records and not any(k.startswith("schedule/") for r in records for k in r)


def test_ema_decay_schedule_is_logged_and_a_constant_schedule_is_bitwise_the_float(tmp_path):
    def run(decay, name):
        loop = _loop(callbacks=(EMA(decay=decay, warmup=False),))
        with run_settings(run_dir=str(tmp_path / name), store=False):
            model, _ = loop.run()
        return model, _train_records(tmp_path / name)

    plain, _ = run(0.8, "plain")
    constant, _ = run(Constant(value=0.8), "constant")
    assert constant.weights_hash() == plain.weights_hash()
    cosine, records = run(COSINE_DECAY, "cosine")
    assert cosine.weights_hash() != plain.weights_hash()
    logged = [r["schedule/ema_decay"] for r in records]
    expected = [0.9 - 0.4 * (1 + math.cos(math.pi * min(t, 4) / 4)) / 2 for t in range(12)]  # by hand
    assert logged == pytest.approx(expected, abs=1e-6)
    assert expected[:3] == pytest.approx([0.5, 0.9 - 0.2 * (1 + math.sqrt(0.5)), 0.7])


def test_ema_decay_schedule_must_stay_in_its_range():
    with pytest.raises(
        ConfigError, match=r"EMA.decay must stay in \(0, 1\) at every step, but Linear\(.*\) ranges over \[0.0, 0.9\]"
    ):
        EMA(decay=Linear(start=0.0, end=0.9, steps=10))
    assert EMA(decay=Linear(start=0.5, end=0.9, steps=10)).decay.final() == 0.9


def test_resume_after_a_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path, interrupted_and_resumed):
    loop = _loop(
        callbacks=(
            EMA(decay=COSINE_DECAY, warmup=False),  # the same step as the EMA test's: compiled once
            Checkpoint(every_n_steps=4, async_save=False),
        ),
    )
    reference, resumed = interrupted_and_resumed(loop, crash_at=7)
    assert resumed.weights_hash() == reference.weights_hash()
    ref = {r["step"]: r for r in _train_records(tmp_path / "ref")}
    cut = {r["step"]: r for r in _train_records(tmp_path / "cut")}
    for step in range(5, 13):  # the steps the resumed run took again
        for key in ("schedule/weight/CrossEntropy_1", "schedule/ema_decay", "loss"):
            assert cut[step][key] == ref[step][key], (step, key)


def test_a_backend_without_schedules_refuses_them_before_running():
    pytest.importorskip("numpyro")
    from pipekit_train.adapters.numpyro import NumpyroGuide, Trace_ELBO

    y = np.random.default_rng(0).normal(1.0, 1.0, size=(20,)).astype(np.float32)
    loop = TrainingLoop(
        model_op=NumpyroGuide(model="conjugate_normal", guide="AutoNormal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": y})),
        loss=Trace_ELBO(),
        backend="numpyro-svi",
        batch_size=20,
        max_steps=10,
        progress=False,
        name="svi",
        callbacks=(EMA(decay=Linear(start=0.5, end=0.9, steps=5)),),
    )
    message = (
        r"stage 'svi': backend 'numpyro-svi' cannot follow a schedule \(TrainingLoop.callbacks\[0\].decay is "
        r"Linear\(start=0.5, end=0.9, steps=5\)\); use a fixed value"
    )
    with pytest.raises(ConfigError, match=message):
        check_pipeline(loop)


def test_the_example_runs_briefly_and_logs_its_schedules(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    pytest.importorskip("sklearn")
    pipeline = pipekit.load(REPO / "examples" / "recipes" / "scheduled_values.yaml")
    assert pipekit.loads(pipekit.dumps(pipeline)) == pipeline
    assert len(schedules_in(pipeline)) == 2
    short = pipeline.replace(max_steps=60, log_every_n_steps=20, eval_every_n_steps=60)
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        short.run()
    last = _train_records(tmp_path / "run", "scheduled")[-1]
    assert last["step"] == 60
    assert 0.0 < last["schedule/weight/CrossEntropy_1"] < 1.0 and 0.9 < last["schedule/ema_decay"] < 0.999


def test_the_reference_train_step_follows_the_state_step():
    """The hand-written-loop building block (`train_step`) sets the same context as the loop's compiled step."""
    import optax

    from pipekit_train.adapters.equinox._primitives import init_state, make_task, train_step

    model = CLF.build(jax.random.key(0))
    optimizer = optax.sgd(0.1)
    state = init_state(model, optimizer)
    task = make_task(_annealed(Linear(start=0.0, end=1.0, steps=4)))
    x = np.random.default_rng(1).normal(size=(8, 8)).astype(np.float32)
    batch = {"x": x, "y": x[:, :3].argmax(axis=1).astype(np.int32)}
    weights = []
    for _ in range(6):
        state, metrics = train_step(state, batch, jax.random.key(1), task, optimizer)
        weights.append(float(metrics["schedule/weight/CrossEntropy_1"]))
    assert weights == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
