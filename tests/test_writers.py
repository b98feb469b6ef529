"""Metric writers: JSON Lines append semantics, console lines, fan-out, and a TensorBoard round trip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train.tracking._writers import (
    ConsoleWriter,
    JsonLinesWriter,
    MetricWriter,
    MultiWriter,
    NullWriter,
    TensorBoardWriter,
    read_jsonl,
)


def _metrics(step: int, **values: float) -> dict:
    return {"type": "metrics", "context": "train", "step": step, "epoch": step // 10, **values}


def test_jsonl_appends_across_two_open_close_cycles(tmp_path: Path):
    writer = JsonLinesWriter()
    writer.open(str(tmp_path))
    writer.write({"type": "params", "context": "train", "step": 0, "epoch": 0, "optimizer": {"name": "adamw"}})
    writer.write(_metrics(1, loss=1.0))
    writer.close()
    # A resumed run opens the same writer (or an equal one) again and extends the file.
    writer = JsonLinesWriter()
    writer.open(str(tmp_path))
    writer.write(_metrics(2, loss=np.float32(0.5)))
    writer.write({"type": "finish", "context": "train", "step": 2, "epoch": 0, "status": "completed"})
    writer.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["type"] for r in records] == ["params", "metrics", "metrics", "finish"]
    assert [r["step"] for r in records] == [0, 1, 2, 2]
    assert records[0]["optimizer"] == {"name": "adamw"}
    assert records[2]["loss"] == 0.5 and isinstance(records[2]["loss"], float)
    assert all(isinstance(r["time"], float) for r in records)
    assert records[0]["time"] <= records[-1]["time"]


def test_jsonl_is_flushed_per_line_while_open(tmp_path: Path):
    path = tmp_path / "sub" / "m.jsonl"
    writer = JsonLinesWriter(path=str(path))
    writer.open(None)
    writer.write(_metrics(1, loss=2.0))
    # Read back before close: another process (a dashboard, a crash) sees every written line.
    assert [r["loss"] for r in read_jsonl(path)] == [2.0]
    writer.close()
    writer.close()  # closing twice is harmless


def test_jsonl_resume_after_a_torn_last_line(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_metrics(1, loss=1.0)) + "\n" + '{"type": "metr')
    assert len(read_jsonl(path)) == 1  # the torn tail of an interrupted write is skipped
    writer = JsonLinesWriter()
    writer.open(str(tmp_path))
    writer.write(_metrics(2, loss=0.5))
    writer.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_read_jsonl_names_file_and_line_of_a_bad_record(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON record"):
        read_jsonl(path)


def test_jsonl_errors_say_what_to_do():
    with pytest.raises(ConfigError, match=r"JsonLinesWriter.path is None and the run has no run_dir"):
        JsonLinesWriter().open(None)
    with pytest.raises(RuntimeError, match=r"write called before open"):
        JsonLinesWriter(path="x.jsonl").write(_metrics(1, loss=1.0))


def test_console_writer_prints_one_line_per_record_and_honours_every(capsys):
    writer = ConsoleWriter(every=2)
    writer.open(None)
    writer.write(_metrics(1, loss=1.0))
    writer.write(_metrics(2, loss=0.123456, accuracy=0.5))
    writer.write({"type": "metrics", "context": "validate", "step": 3, "epoch": 0, "accuracy": 0.75})
    writer.write({"type": "finish", "context": "train", "step": 3, "epoch": 0, "status": "completed"})
    writer.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[train] step 2 epoch 0 | loss 0.1235 accuracy 0.5000",
        "[validate] step 3 epoch 0 | accuracy 0.7500",
        "[finish] step 3 epoch 0 | status completed",
    ]


def test_console_writer_every_must_be_positive():
    with pytest.raises(ConfigError, match=r"ConsoleWriter.every must be a positive int, got 0"):
        ConsoleWriter(every=0)


def test_multi_writer_fans_out_and_null_writer_drops(tmp_path: Path, capsys):
    writer = MultiWriter(writers=(JsonLinesWriter(), ConsoleWriter(), NullWriter()))
    writer.open(str(tmp_path))
    writer.write(_metrics(1, loss=1.0))
    writer.close()
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0]
    assert capsys.readouterr().err == "[train] step 1 epoch 0 | loss 1.0000\n"


def test_writers_are_operators_with_yaml_round_trip_and_no_handles_in_fields(tmp_path: Path):
    writer = MultiWriter(writers=(JsonLinesWriter(path="m.jsonl"), TensorBoardWriter(logdir="tb")))
    assert pipekit.loads(pipekit.dumps(writer)) == writer
    opened = JsonLinesWriter(path=str(tmp_path / "m.jsonl"))
    opened.open(None)
    try:
        assert opened == JsonLinesWriter(path=str(tmp_path / "m.jsonl"))
        assert "m.jsonl" in pipekit.dumps(opened)
    finally:
        opened.close()
    assert isinstance(NullWriter(), MetricWriter)
    with pytest.raises(pipekit.ConfigError, match=r"writers\[0\] must be MetricWriter"):
        MultiWriter(writers=("console",))


def test_tensorboard_round_trip_through_tensorboards_reader(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter()
    writer.open(str(tmp_path))
    writer.write({"type": "params", "context": "train", "step": 0, "epoch": 0, "lr": 0.001, "opt": {"name": "adam"}})
    for step in (1, 2, 3):
        writer.write(_metrics(step, loss=1.0 / step, note="skipped"))
    writer.write({"type": "metrics", "context": "validate", "step": 3, "epoch": 0, "accuracy": 0.875})
    writer.write({"type": "finish", "context": "train", "step": 3, "epoch": 0, "status": "completed"})
    writer.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "validate/accuracy"]
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [(e.step, e.value) for e in events.Scalars("validate/accuracy")] == [(3, 0.875)]
    params = events.Tensors("params")
    assert len(params) == 1
    table = params[0].tensor_proto.string_val[0].decode()
    assert "| lr | 0.001 |" in table and "| opt.name | adam |" in table


def test_tensorboard_without_the_package_names_the_extra(monkeypatch, tmp_path: Path):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what Python does for a package that is not there
    with pytest.raises(ImportError, match=r"pip install 'pipekit-train\[tensorboard\]'"):
        TensorBoardWriter().open(str(tmp_path))


def test_tensorboard_needs_a_directory():
    with pytest.raises(ConfigError, match=r"TensorBoardWriter.logdir is None and the run has no run_dir"):
        TensorBoardWriter().open(None)


def test_every_writer_and_mlflow_hold_the_same_numbers_under_the_same_names(tmp_path: Path, monkeypatch):
    """One real run into JSONL, TensorBoard and MLflow; each reader finds every logged number under one name."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipekit_train import (
        MSE,
        ArraySource,
        EquinoxModel,
        LogToExperiment,
        TrainingDataset,
        TrainingLoop,
        run_settings,
    )

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": x.sum(axis=1, keepdims=True)}))
    uri = (tmp_path / "mlruns").as_uri()
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=data,
        val_dataset=data.replace(shuffle=False),
        test_dataset=data.replace(shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=12,
        batch_size=16,  # 4 batches per epoch, and no steps_per_epoch: epoch comes from the data
        log_every_n_steps=4,
        eval_every_n_steps=6,
        metric_writer=MultiWriter(writers=(JsonLinesWriter(), TensorBoardWriter())),
        callbacks=(LogToExperiment(tracking_uri=uri),),
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _, artifact = loop.run()

    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["type"] != "metrics":
            continue
        for key, value in r.items():
            if key not in ("type", "context", "step", "epoch", "time"):
                expected.setdefault(f"{r['context']}/{key}", []).append((r["step"], value))
    train = [r for r in records if r["type"] == "metrics" and r["context"] == "train"]
    assert [(r["step"], r["epoch"]) for r in train] == [(4, 1), (8, 2), (12, 3)]
    assert {"train/loss", "train/lr", "validate/loss", "test/loss", "time/compile_s", "time/step_s"} <= set(expected)
    assert [s for s, _ in expected["validate/loss"]] == [6, 12]

    events = EventAccumulator(str(tmp_path / "run" / "stage0" / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    client = MlflowClient(uri)
    run_id = artifact.tracker_run_id
    assert set(client.get_run(run_id).data.metrics) == set(expected)  # no "/" inside these keys: names agree
    for name, points in expected.items():
        board = [(e.step, e.value) for e in events.Scalars(name)]
        assert board == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], name  # float32 in event files
        tracked = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert tracked == sorted(points), name
    # train/loss is the mean over the logging window in every writer (MLflow once logged one step's loss)
    assert artifact.final_metrics["train/loss"] == expected["train/loss"][-1][1]
    assert artifact.final_metrics["train/lr"] == expected["train/lr"][-1][1]


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_mlflow_holds_loss_terms_in_a_file_store_and_a_database(tmp_path: Path, monkeypatch, store: str):
    """`train/loss` and its terms `train/loss/MSE_0` both reach MLflow (once "Not a directory" in a file store)."""
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    from pipekit_train import (
        MSE,
        ArraySource,
        Composite,
        EquinoxModel,
        LogToExperiment,
        TrainingDataset,
        TrainingLoop,
        run_settings,
    )

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = (tmp_path / "mlruns").as_uri() if store == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    x = np.random.default_rng(1).normal(size=(32, 2)).astype(np.float32)
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]}))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=data,
        val_dataset=data.replace(shuffle=False),
        loss=Composite(components=((1.0, MSE()), (0.5, MSE(reduction="sum")))),
        optimizer_config={"name": "sgd", "lr": 0.01},
        max_steps=4,
        batch_size=16,
        log_every_n_steps=2,
        eval_every_n_steps=4,
        callbacks=(LogToExperiment(tracking_uri=uri),),
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _, artifact = loop.run()

    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    jsonl = {(r["context"], r["step"]): r for r in records if r["type"] == "metrics"}
    assert "loss/MSE_0" in jsonl[("train", 4)]  # the other writers keep the "/"
    client = MlflowClient(uri)
    run = client.get_run(artifact.tracker_run_id)
    assert run.info.status == "FINISHED"
    names = set(run.data.metrics)
    assert {"train/loss", "train/loss.MSE_0", "train/loss.MSE_1", "validate/loss", "validate/loss.MSE_0"} <= names
    assert not any(a != b and b.startswith(a + "/") for a in names for b in names)  # no name is another's folder
    for context, key, name in [
        ("train", "loss/MSE_1", "train/loss.MSE_1"),
        ("validate", "loss/MSE_0", "validate/loss.MSE_0"),
    ]:
        history = client.get_metric_history(artifact.tracker_run_id, name)
        expected = sorted((s, r[key]) for (c, s), r in jsonl.items() if c == context)
        assert sorted((m.step, m.value) for m in history) == expected, name


def test_mlflow_metric_names_keep_one_level_below_the_context():
    from pipekit_train.tracking._experiment import mlflow_metric_name

    assert mlflow_metric_name("train", "loss") == "train/loss"
    assert mlflow_metric_name("train", "loss/MSE_0") == "train/loss.MSE_0"
    assert mlflow_metric_name("validate", "validate/precision/0") == "validate/precision.0"
    assert mlflow_metric_name("train", "schedule/weight/KL_1") == "train/schedule.weight.KL_1"
    assert mlflow_metric_name("time", "compile_s") == "time/compile_s"
