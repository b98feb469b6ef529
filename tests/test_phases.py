"""Phase events: callbacks and writers see compiling, stepping, evaluating, checkpointing, done/failed; time/..."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit_train import (
    MSE,
    ArraySource,
    Best,
    Callback,
    Checkpoint,
    EquinoxModel,
    NonFiniteLossError,
    TrainingDataset,
    TrainingLoop,
    read_jsonl,
    run_settings,
)
from pipekit_train.tracking._progress import STARTED_PHASES, CompileWatch

# A width no other test uses, so this process compiles its step here (the compiled step is cached by structure).
MODEL = EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 11, "depth": 1})


class _Phases(Callback, register=False):
    """Records every phase event and every record `on_log` sees (plain lists: a test-only observer)."""

    def __init__(self) -> None:
        object.__setattr__(self, "events", [])
        object.__setattr__(self, "records", [])

    def fingerprint(self) -> None:
        return None

    def on_phase(self, ctx, phase, duration_s):
        self.events.append((phase, ctx.step, duration_s))

    def on_log(self, ctx, record):
        self.records.append(dict(record))


def _data(scale: float = 1.0) -> TrainingDataset:
    x = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": scale * x.sum(axis=1, keepdims=True)}))


def test_a_run_reports_its_phases_to_callbacks_and_writers(tmp_path: Path):
    watcher = _Phases()
    loop = TrainingLoop(
        model_op=MODEL,
        dataset=_data(),
        val_dataset=_data().replace(shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=12,
        batch_size=16,
        log_every_n_steps=3,
        eval_every_n_steps=6,
        callbacks=(Checkpoint(every_n_steps=6, async_save=False), watcher),
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _, artifact = loop.run()

    phases = [p for p, _, _ in watcher.events]
    assert phases[0] == "compiling" and phases[-1] == "done"
    assert set(phases) == {"compiling", "stepping", "evaluating", "checkpointing", "done"}
    assert [s for p, s, _ in watcher.events if p == "evaluating"] == [6, 12]
    assert {s for p, s, _ in watcher.events if p == "checkpointing"} == {6, 12}
    assert all(d >= 0 for _, _, d in watcher.events)
    # no two stepping spans in a row: a span ends only where another phase begins
    assert all(not (a == b == "stepping") for a, b in itertools.pairwise(phases))

    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    written = [r for r in records if r["type"] == "phase"]
    assert [(r["phase"], r["step"], r["duration_s"]) for r in written] == watcher.events
    # on_log saw exactly what the writer wrote
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {k: v for k, v in r.items() if k != "time"} for r in map(_plain_json, watcher.records)
    ]
    final = artifact.final_metrics
    assert {"time/compile_s", "time/step_s", "time/data_wait_frac", "time/checkpoint_s", "time/eval_s"} <= set(final)
    assert final["time/compile_s"] > 0 and final["time/checkpoint_s"] > 0 and 0 <= final["time/data_wait_frac"] < 1
    assert records[-1]["type"] == "finish" and records[-1]["time/step_s"] == final["time/step_s"]
    times = [r for r in records if r["type"] == "metrics" and r["context"] == "time"]
    assert [r["step"] for r in times] == [3, 6, 9, 12]


def _plain_json(record: dict) -> dict:
    import json

    from pipekit_train.tracking._writers import _plain

    return json.loads(json.dumps(_plain(record)))


def test_a_failed_run_ends_with_a_failed_phase(tmp_path: Path):
    watcher = _Phases()
    loop = TrainingLoop(
        model_op=MODEL,
        dataset=_data(100.0),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 1e38},
        max_steps=4,
        batch_size=8,
        callbacks=(watcher,),
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False), pytest.raises(NonFiniteLossError):
        loop.run()
    assert watcher.events[-1][0] == "failed"
    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    assert records[-2]["type"] == "phase" and records[-2]["phase"] == "failed"
    assert records[-1]["type"] == "finish" and records[-1]["status"] == "failed"


# Phase starts: a long phase is seen while it runs ------------------------------------------------------------------
class _Timeline(Callback, register=False):
    """Every phase start and end, evaluation end and checkpoint in the order the hooks hear of them, with the XLA
    compile count then (`CompileWatch`), and the records `on_log` sees."""

    def __init__(self) -> None:
        object.__setattr__(self, "events", [])
        object.__setattr__(self, "records", [])

    def fingerprint(self) -> None:
        return None

    def on_phase_start(self, ctx, phase):
        self.events.append(("start", phase, ctx.step, CompileWatch.count))

    def on_phase(self, ctx, phase, duration_s):
        self.events.append(("end", phase, ctx.step, CompileWatch.count))

    def on_eval_end(self, ctx, metrics):
        self.events.append(("eval_end", "", ctx.step, CompileWatch.count))

    def on_checkpoint(self, ctx, step):
        self.events.append(("checkpoint", "", step, CompileWatch.count))

    def on_log(self, ctx, record):
        self.records.append(dict(record))


def _paired(events: list[tuple[str, str, int, int]]) -> None:
    """Every end of a started phase has its start before it, with no other end of that phase in between."""
    open_phases: list[str] = []
    for kind, phase, _, _ in events:
        if kind == "start" and phase != "stepping":
            open_phases.append(phase)
        elif kind == "end" and phase in STARTED_PHASES:
            assert phase in open_phases, f"an end of {phase} without its start in {events}"
            open_phases.remove(phase)
        elif kind == "start" and phase == "stepping":  # a started phase that did nothing
            assert open_phases, f"a stepping start without a phase it replaces in {events}"
            open_phases.pop()
    assert not open_phases, f"phases started and never ended: {open_phases}"


def test_each_long_phase_reports_its_start_before_it_runs(tmp_path: Path):
    watcher = _Timeline()
    loop = TrainingLoop(
        # A width no other test uses: the stage compiles its own step.
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 13, "depth": 1}),
        dataset=_data(),
        val_dataset=_data().replace(shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=12,
        batch_size=16,
        log_every_n_steps=3,
        eval_every_n_steps=6,
        callbacks=(Checkpoint(every_n_steps=6, async_save=False), watcher),
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    events = watcher.events
    starts = [(p, s) for k, p, s, _ in events if k == "start"]
    assert starts[0] == ("compiling", 0)  # before the first dispatch
    assert {("evaluating", 6), ("evaluating", 12), ("checkpointing", 6), ("checkpointing", 12)} <= set(starts)
    _paired(events)
    # The compile happened after its start was heard: the count at the start is lower than at the end.
    first_start = next(e for e in events if e[:2] == ("start", "compiling"))
    first_end = next(e for e in events if e[:2] == ("end", "compiling"))
    assert events.index(first_start) < events.index(first_end) and first_start[3] < first_end[3]
    # An evaluation and a checkpoint are announced before they run.
    for step in (6, 12):
        assert events.index(("start", "evaluating", step, _count(events, "start", "evaluating", step))) < next(
            i for i, e in enumerate(events) if e[0] == "eval_end" and e[2] == step
        )
        assert events.index(("start", "checkpointing", step, _count(events, "start", "checkpointing", step))) < next(
            i for i, e in enumerate(events) if e[0] == "checkpoint" and e[2] == step
        )
    # The records: one ``phase_start`` per start, in the same order; every ``phase`` record keeps its keys.
    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    written = [(r["phase"], r["step"]) for r in records if r["type"] == "phase_start"]
    assert written == starts
    assert all(
        set(r) == {"type", "context", "step", "epoch", "phase", "time"} for r in records if r["type"] == "phase_start"
    )
    assert all(
        set(r) == {"type", "context", "step", "epoch", "phase", "duration_s", "time"}
        for r in records
        if r["type"] == "phase"
    )
    assert [r["type"] for r in records][:2] == ["params", "phase_start"]
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {k: v for k, v in r.items() if k != "time"} for r in map(_plain_json, watcher.records)
    ]


def _count(events, kind, phase, step) -> int:
    return next(c for k, p, s, c in events if (k, p, s) == (kind, phase, step))


def test_a_started_phase_that_does_nothing_is_followed_by_a_stepping_start(tmp_path: Path):
    """The second of two stages of one structure finds its program compiled; a checkpoint whose step retention does
    not keep writes nothing. Each says ``stepping`` starts again, in place of its end."""
    first, second = _Timeline(), _Timeline()

    def stage(name: str, watcher: _Timeline) -> TrainingLoop:
        return TrainingLoop(
            model_op=MODEL,
            dataset=_data(),
            loss=MSE(),
            # The learning rate falls every step: with `mode: max` on it, a later checkpoint is never kept.
            optimizer_config={"name": "sgd", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 0},
            max_steps=9,
            batch_size=16,
            log_every_n_steps=3,
            callbacks=(
                Checkpoint(every_n_steps=3, keep=(Best(k=1),), monitor="train/lr", mode="max", async_save=False),
                watcher,
            ),
            progress=False,
            name=name,
        )

    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        pipekit.Sequential([stage("a", first), stage("b", second)]).run()
    events = second.events
    _paired(events)
    assert events[-1][:2] == ("end", "done") and events[-1][3] == events[0][3]  # stage b compiled nothing
    kinds = [(k, p, s) for k, p, s, _ in events]
    assert kinds[:2] == [("start", "compiling", 0), ("start", "stepping", 0)]
    assert ("end", "compiling") not in {(k, p) for k, p, _ in kinds}
    # step 3 is kept (the best so far); 6 and 9 are not: no checkpoint, no checkpointing end, stepping again
    assert [s for k, p, s in kinds if (k, p) == ("end", "checkpointing")] == [3]
    for step in (6, 9):
        at = kinds.index(("start", "checkpointing", step))
        assert kinds[at + 1] == ("start", "stepping", step)
    assert [s for k, _, s, _ in events if k == "checkpoint"] == [3]
