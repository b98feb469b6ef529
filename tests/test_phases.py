"""Phase events: callbacks and writers see compiling, stepping, evaluating, checkpointing, done/failed; time/..."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    EquinoxModel,
    NonFiniteLossError,
    TrainingDataset,
    TrainingLoop,
    read_jsonl,
    run_settings,
)

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
