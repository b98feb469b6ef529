"""`history`: the metrics two real runs logged, as plain data equal to their metrics.jsonl; resumes; errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, read_jsonl, run_settings
from pipekit_train.tracking._history import HistoryError, format_table, history, metric_mode, summary

MODEL = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1})

#: One xdist worker for the module (--dist loadgroup): the two runs of `runs` train and compile once.
pytestmark = pytest.mark.xdist_group("history")


def _dataset(seed: int) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": x.sum(axis=1, keepdims=True)}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two 20-step runs (different learning rates), logging every 5 steps and validating every 10."""
    root = tmp_path_factory.mktemp("history")
    out = []
    for name, lr in (("a", 0.01), ("b", 0.003)):
        loop = TrainingLoop(
            model_op=MODEL,
            dataset=_dataset(0),
            val_dataset=_dataset(1).replace(shuffle=False),
            loss=MSE(),
            optimizer_config={"name": "adam", "lr": lr},
            max_steps=20,
            batch_size=16,
            log_every_n_steps=5,
            eval_every_n_steps=10,
            progress=False,
        )
        run_dir = str(root / name)
        with run_settings(run_dir=run_dir, store=False):
            loop.run()
        out.append(run_dir)
    return out


def _expected(run_dir: str) -> dict[str, dict[str, dict[str, list[Any]]]]:
    """``{context: {metric: {"steps", "values"}}}`` read by hand from the run's one metrics.jsonl."""
    out: dict[str, dict[str, dict[str, list[Any]]]] = {}
    for r in read_jsonl(Path(run_dir) / "stage0" / "metrics.jsonl"):
        if r["type"] != "metrics":
            continue
        for k, v in r.items():
            if k in ("type", "context", "step", "epoch", "time"):
                continue
            s = out.setdefault(r["context"], {}).setdefault(k, {"steps": [], "values": []})
            s["steps"].append(r["step"])
            s["values"].append(v)
    return out


def test_history_is_what_metrics_jsonl_holds(runs: list[str]) -> None:
    hist = history(runs)
    assert list(hist) == runs
    for run in runs:
        assert list(hist[run]) == ["stage0"]
        stage = hist[run]["stage0"]
        assert list(stage) == ["train", "validate", "time"]  # time: where the stage's time went (docs/metrics.md)
        assert stage == _expected(run)
        assert stage["train"]["loss"]["steps"] == [5, 10, 15, 20]
        assert stage["validate"]["loss"]["steps"] == [10, 20]
    # two runs with different learning rates: different numbers, and plain data all the way down
    assert hist[runs[0]]["stage0"]["train"]["loss"]["values"] != hist[runs[1]]["stage0"]["train"]["loss"]["values"]
    assert json.loads(json.dumps(hist)) == hist


def test_one_run_dir_a_stage_dir_and_a_path_object(runs: list[str]) -> None:
    assert history(runs[0]) == {runs[0]: history(runs)[runs[0]]}
    stage_dir = Path(runs[0]) / "stage0"
    assert history([stage_dir])[str(stage_dir)] == {"stage0": history(runs[0])[runs[0]]["stage0"]}


def test_metric_filter_bare_and_qualified(runs: list[str]) -> None:
    only_val = history(runs, metrics=["validate/loss"])[runs[0]]["stage0"]
    assert only_val["train"] == {}
    assert list(only_val["validate"]) == ["loss"]
    both = history(runs, metrics=["loss"])[runs[1]]["stage0"]
    assert list(both["train"]) == ["loss"] and list(both["validate"]) == ["loss"]
    assert list(history(runs, metrics=["train/lr"])[runs[0]]["stage0"]["train"]) == ["lr"]


def test_unknown_metric_suggests_the_closest(runs: list[str]) -> None:
    with pytest.raises(HistoryError, match=r"'validate/los'.*did you mean 'validate/loss'\?.*logged metrics: "):
        history(runs, metrics=["validate/los"])


def test_table_has_last_and_best(runs: list[str]) -> None:
    hist = history(runs)
    rows = {(r["run"], r["metric"]): r for r in summary(hist)}
    train = hist[runs[0]]["stage0"]["train"]["loss"]
    row = rows[(runs[0], "train/loss")]
    assert row["last"] == train["values"][-1] and row["last_step"] == 20 and row["points"] == 4
    assert row["best"] == min(train["values"])
    assert rows[(runs[0], "train/lr")]["best"] is None  # a learning rate is neither better high nor low
    table = format_table(hist).splitlines()
    assert table[0].split() == ["RUN", "STAGE", "METRIC", "POINTS", "LAST", "BEST"]
    # two runs x (train/loss, train/lr, validate/loss), and the time/... rows (docs/metrics.md)
    assert len([line for line in table if " time/" not in line]) == 1 + 2 * 3
    assert f"{train['values'][-1]:.4g} @20" in "\n".join(table)


def _write(path: Path, records: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _m(step: int, context: str = "train", **values: Any) -> dict[str, Any]:
    return {"type": "metrics", "context": context, "step": step, "epoch": 0, **values}


def test_a_resumed_run_replaces_what_it_logged_again(tmp_path: Path) -> None:
    first = [_m(5, loss=3.0), _m(10, loss=2.0), _m(10, "validate", loss=2.5), _m(15, loss=1.5)]
    resumed = [_m(15, loss=1.4), _m(20, loss=1.0), _m(20, "validate", loss=1.2)]
    _write(tmp_path / "run" / "stage0" / "metrics.jsonl", first + resumed, tail='{"type": "metr')
    stage = history(tmp_path / "run")[str(tmp_path / "run")]["stage0"]
    assert stage["train"]["loss"] == {"steps": [5, 10, 15, 20], "values": [3.0, 2.0, 1.4, 1.0]}
    assert stage["validate"]["loss"] == {"steps": [10, 20], "values": [2.5, 1.2]}


def test_numbers_only_nested_names_dotted_nan_kept(tmp_path: Path) -> None:
    records = [
        {"type": "params", "context": "train", "step": 0, "params": {"lr": 0.1}},
        _m(1, loss=float("nan"), note="warmup", flag=True, grad={"norm": 2.0}),
        {"type": "finish", "context": "train", "step": 1, "status": "completed", "train/loss": 1.0},
    ]
    _write(tmp_path / "r" / "s" / "metrics.jsonl", records)
    train = history(tmp_path / "r")[str(tmp_path / "r")]["s"]["train"]
    assert sorted(train) == ["grad.norm", "loss"]
    assert math.isnan(train["loss"]["values"][0]) and train["grad.norm"]["values"] == [2.0]


def test_stages_in_the_order_they_ran(tmp_path: Path) -> None:
    _write(tmp_path / "r" / "pretrain" / "metrics.jsonl", [{**_m(1, loss=1.0), "time": 100.0}])
    _write(tmp_path / "r" / "finetune" / "metrics.jsonl", [{**_m(1, loss=0.5), "time": 200.0}])
    assert list(history(tmp_path / "r")[str(tmp_path / "r")]) == ["pretrain", "finetune"]


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no such run directory"):
        history(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HistoryError, match="holds no metrics.jsonl"):
        history(tmp_path / "empty")
    with pytest.raises(HistoryError, match="at least one run directory"):
        history([])
    _write(tmp_path / "bad" / "s" / "metrics.jsonl", [], tail='not json\n{"type": "metrics"}\n')
    with pytest.raises(HistoryError, match=r"metrics.jsonl:1: not a JSON record"):
        history(tmp_path / "bad")


@pytest.mark.parametrize(
    "name,mode",
    [
        ("loss", "min"),
        ("validate/loss", "min"),
        ("recon_error", "min"),
        ("accuracy", "max"),
        ("top5", "max"),
        ("f1_macro", "max"),
        ("lr", None),
        ("time/compile_s", None),
    ],
)
def test_metric_mode(name: str, mode: str | None) -> None:
    assert metric_mode(name) == mode


def test_history_does_not_import_jax(runs: list[str]) -> None:
    code = (
        "import sys, json\n"
        "from pipekit_train.tracking._history import history, format_table\n"
        f"h = history({runs!r})\n"
        "format_table(h)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'equinox'))\n"
        "print(json.dumps(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_sigterm_and_resume_read_like_the_uninterrupted_run(tmp_path: Path) -> None:
    """A SIGTERM between two log steps once left an extra point at the stop step in every series (31 where the
    uninterrupted run has 30) and a next train/loss averaged over the resumed steps only. A real signal here."""
    import os
    import signal

    from pipekit_train import Callback, Checkpoint, TrainingInterrupted

    armed = [False]

    class SigtermAt15(Callback, register=False):
        def fingerprint(self) -> None:
            return None

        def on_step_end(self, ctx: Any, metrics: Any) -> None:
            if armed[0] and ctx.step == 15:
                os.kill(os.getpid(), signal.SIGTERM)

    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": x.sum(axis=1, keepdims=True)}))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 5, "depth": 1}),
        dataset=data,
        val_dataset=data.replace(shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.01},
        max_steps=30,
        batch_size=16,
        log_every_n_steps=10,
        eval_every_n_steps=10,
        progress=False,
        callbacks=(Checkpoint(every_n_steps=10), SigtermAt15()),
    )
    with run_settings(run_dir=str(tmp_path / "ref"), store=False):
        loop.run()
    armed[0] = True
    with run_settings(run_dir=str(tmp_path / "cut"), store=False), pytest.raises(TrainingInterrupted):
        loop.run()
    armed[0] = False
    stopped = history([str(tmp_path / "cut")])[str(tmp_path / "cut")]["stage0"]
    assert stopped["train"]["loss"]["steps"] == [10, 15]  # not resumed yet: the stop's values are the latest
    with run_settings(run_dir=str(tmp_path / "cut"), store=False, resume="auto"):
        loop.run()
    ref = history([str(tmp_path / "ref")])[str(tmp_path / "ref")]["stage0"]
    cut = history([str(tmp_path / "cut")])[str(tmp_path / "cut")]["stage0"]
    for context in ("train", "validate"):
        assert cut[context]["loss"] == ref[context]["loss"], context  # steps [10, 20, 30] and the same values
    marked = [r for r in read_jsonl(tmp_path / "cut" / "stage0" / "metrics.jsonl") if r.get("interrupted")]
    assert {(r["context"], r["step"]) for r in marked} == {("time", 15), ("train", 15), ("validate", 15)}


def test_the_plot_puts_a_pretrain_mse_and_a_finetune_cross_entropy_on_a_log_axis(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from pipekit_train.tracking._history import history_figure, plot_history

    _write(tmp_path / "run" / "pretrain" / "metrics.jsonl", [_m(s, loss=0.015 + 0.01 / s) for s in (1, 2, 3)])
    _write(
        tmp_path / "run" / "finetune" / "metrics.jsonl",
        [_m(s, loss=1.8 - 0.1 * s, accuracy=0.1 * s) for s in (1, 2, 3)],
    )
    hist = history(tmp_path / "run")
    scales = {ax.get_title(): ax.get_yscale() for ax in history_figure(hist).axes if ax.get_visible()}
    assert scales == {"loss": "log", "accuracy": "linear"}  # 0.015 .. 1.7: log; 0.1 .. 0.3 on one linear axis
    out = plot_history(hist, tmp_path / "plots" / "h.png")
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
