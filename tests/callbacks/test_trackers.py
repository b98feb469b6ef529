"""LogToExperiment and RegisterModel, driven through a hand-built TrainContext and read back with real MLflow."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import pytest

import pipekit
from pipekit import Operator
from pipekit_train.adapters.equinox import EquinoxModel
from pipekit_train.callbacks._base import TrainContext
from pipekit_train.provenance import RegisterModel
from pipekit_train.provenance._model_registry import load_model
from pipekit_train.stage.loop import TrainingLoop
from pipekit_train.tracking._experiment import LogToExperiment, pipeline_params
from pipekit_train.tracking._writers import NullWriter

mlflow_tracking = pytest.importorskip("mlflow.tracking")


@pytest.fixture(autouse=True)
def _file_store_env(monkeypatch):
    # The callback sets MLFLOW_ALLOW_FILE_STORE when it is unset; monkeypatch puts the environment back afterwards.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _model(seed: int = 1) -> EquinoxModel:
    op = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1})
    return op.bind(op.build(jax.random.key(seed)))


def _context(loop, callbacks, states, run_dir: Path, model) -> TrainContext:
    return TrainContext(
        loop=loop,
        stage="pretrain",
        run_id="run-123",
        run_dir=str(run_dir),
        writer=NullWriter(),
        callback_states=states,
        callbacks=callbacks,
        get_model=lambda: model,
    )


def _steps(ctx: TrainContext, callbacks, first: int, last: int) -> None:
    """The records the loop sends `on_log`: a train record every `log_every_n_steps`, a validate one every 4."""
    for step in range(first, last + 1):
        ctx.step = step
        records = []
        if step % ctx.loop.log_every_n_steps == 0:
            records.append({"context": "train", "loss": 1.0 / step, "grad_norm": float(step), "note": "text"})
        if step % 4 == 0:
            records.append({"context": "validate", "accuracy": step / 10})
        for record in records:
            for cb in callbacks:
                cb.on_log(ctx, {"type": "metrics", "step": step, "epoch": 0, **record})
        for cb in callbacks:
            cb.on_log(ctx, {"type": "phase", "context": "train", "step": step, "epoch": 0, "duration_s": 0.1})


def test_log_to_experiment_and_register_model_round_trip(tmp_path: Path):
    uri = (tmp_path / "mlruns").as_uri()
    log = LogToExperiment(tracking_uri=uri, experiment="digits")
    reg = RegisterModel(registry=str(tmp_path / "models"))
    callbacks = tuple(sorted((log, reg), key=lambda c: c.order))  # as the loop runs them
    assert callbacks == (reg, log)
    loop = TrainingLoop.example().replace(max_steps=6, log_every_n_steps=2, callbacks=(log, reg))
    model = _model()
    states = {i: cb.initial_state() for i, cb in enumerate(callbacks)}
    ctx = _context(loop, callbacks, states, tmp_path / "stage0", model)

    for cb in callbacks:
        cb.on_train_start(ctx)
    _steps(ctx, callbacks, 1, 6)
    for cb in callbacks:
        cb.on_train_end(ctx)

    run_id = ctx.artifact_fields["tracker_run_id"]
    assert ctx.state_of(log)["mlflow_run_id"] == run_id
    json.dumps(states)  # the callbacks' state is plain JSON
    assert ctx.artifact_fields["trained_model_hash"] == model.weights_hash()
    assert load_model(ctx.artifact_fields["model_registry_uri"]).weights_hash() == model.weights_hash()

    client = mlflow_tracking.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "digits"
    params = run.data.params
    assert params["type"] == "TrainingLoop"
    assert params["max_steps"] == "6" and params["log_every_n_steps"] == "2"
    assert params["model_op.factory"] == "mlp" and params["model_op.kwargs.in_size"] == "4"
    assert params["optimizer_config.lr"] == "0.1" and params["dataset.source.path"] == "data/train.npz"
    assert "pipekit" not in params
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(2, 0.5), (4, 0.25), (6, pytest.approx(1 / 6))]
    assert [m.step for m in client.get_metric_history(run_id, "train/grad_norm")] == [2, 4, 6]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "validate/accuracy")] == [(4, 0.4)]
    assert [f.path for f in client.list_artifacts(run_id)] == ["pipeline.yaml"]
    local = client.download_artifacts(run_id, "pipeline.yaml", str(tmp_path / "download"))
    assert Path(local).read_text() == pipekit.dumps(loop)
    tags = run.data.tags
    assert tags["pipekit.run_id"] == "run-123" and tags["pipekit.stage"] == "pretrain"
    assert tags["pipekit.status"] == "completed"
    assert tags["pipekit.model_registry_uri"] == ctx.artifact_fields["model_registry_uri"]


def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path: Path):
    uri = (tmp_path / "mlruns").as_uri()
    loop = TrainingLoop.example().replace(max_steps=8, log_every_n_steps=2)
    log = LogToExperiment(tracking_uri=uri)
    states = {0: log.initial_state()}
    ctx = _context(loop, (log,), states, tmp_path, _model())
    log.on_train_start(ctx)
    _steps(ctx, (log,), 1, 4)
    saved = {int(k): v for k, v in json.loads(json.dumps(states)).items()}  # a checkpoint keeps it; the process dies

    log2 = LogToExperiment(tracking_uri=uri)  # a new process: an equal callback, the state from the checkpoint
    ctx2 = _context(loop, (log2,), saved, tmp_path, _model())
    ctx2.step = 4
    log2.on_train_start(ctx2)
    _steps(ctx2, (log2,), 5, 8)
    ctx2.request_stop("patience")
    log2.on_train_end(ctx2)

    run_id = ctx.artifact_fields["tracker_run_id"]
    assert ctx2.artifact_fields["tracker_run_id"] == run_id
    client = mlflow_tracking.MlflowClient(uri)
    experiment = client.get_experiment_by_name("pipekit")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [2, 4, 6, 8]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["pipekit.resumed_at_step"] == "4"
    assert run.data.tags["pipekit.status"] == "stopped: patience"


def test_a_failed_run_is_marked_failed(tmp_path: Path):
    uri = (tmp_path / "mlruns").as_uri()
    log = LogToExperiment(tracking_uri=uri)
    ctx = _context(TrainingLoop.example(), (log,), {0: log.initial_state()}, tmp_path, _model())
    log.on_train_start(ctx)
    log.on_exception(ctx, FloatingPointError("loss became nan"))
    run = mlflow_tracking.MlflowClient(uri).get_run(ctx.artifact_fields["tracker_run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags["pipekit.error"] == "FloatingPointError: loss became nan"


def test_the_run_is_tagged_with_the_phase_running_now(tmp_path: Path):
    """``pipekit.phase`` says what the stage is doing while it does it: a long compile or evaluation shows in MLflow."""
    uri = (tmp_path / "mlruns").as_uri()
    log = LogToExperiment(tracking_uri=uri)
    ctx = _context(TrainingLoop.example(), (log,), {0: log.initial_state()}, tmp_path, _model())
    log.on_phase_start(ctx, "compiling")  # before the MLflow run exists: nothing to tag, no error
    log.on_train_start(ctx)
    client = mlflow_tracking.MlflowClient(uri)

    def phase() -> str | None:
        return client.get_run(ctx.artifact_fields["tracker_run_id"]).data.tags.get("pipekit.phase")

    assert phase() is None
    log.on_phase_start(ctx, "compiling")
    assert phase() == "compiling"
    log.on_phase(ctx, "compiling", 2.0)
    assert phase() == "stepping"
    log.on_phase_start(ctx, "evaluating")
    log.on_phase(ctx, "stepping", 0.5)  # the end of a stepping span says nothing new
    assert phase() == "evaluating"
    log.on_phase(ctx, "evaluating", 1.0)
    assert phase() == "stepping"
    log.on_phase_start(ctx, "checkpointing")
    assert phase() == "checkpointing"
    log.on_phase_start(ctx, "stepping")  # a checkpoint its retention did not keep
    assert phase() == "stepping"
    log.on_train_end(ctx)
    log.on_phase(ctx, "done", 3.0)
    assert phase() == "done"


def test_default_tracking_uri_is_a_file_store_under_the_run_dir(tmp_path: Path, monkeypatch):
    log = LogToExperiment()
    assert log.resolve_tracking_uri(str(tmp_path)) == (tmp_path / "mlruns").as_uri()
    monkeypatch.chdir(tmp_path)
    assert log.resolve_tracking_uri(None) == (tmp_path / "runs" / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert log.resolve_tracking_uri(str(tmp_path)) == "http://tracker:5000"
    assert LogToExperiment(tracking_uri="file:///x").resolve_tracking_uri(None) == "file:///x"
    ctx = _context(TrainingLoop.example(), (log,), {0: log.initial_state()}, tmp_path, _model())
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    log.on_train_start(ctx)
    log.on_train_end(ctx)
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    assert (tmp_path / "mlruns").is_dir()


def test_params_fall_back_to_fields_when_the_loop_has_no_yaml():
    class Unregistered(Operator, register=False):
        lr: float = 0.1
        sizes: tuple[int, ...] = (1, 2)
        inner: dict = pipekit.field(default_factory=dict)

    params = pipeline_params(Unregistered(lr=0.5, sizes=(3, 4), inner={"a b": {"c": None}}))
    assert params == {"lr": "0.5", "sizes": "[3, 4]", "inner.a b.c": "null"}


def test_callbacks_are_yaml_operators():
    for cb in (LogToExperiment(tracking_uri="file:///tmp/x", experiment="e"), RegisterModel(registry="models")):
        assert pipekit.loads(pipekit.dumps(cb)) == cb
    with pytest.raises(pipekit.ConfigError, match=r"LogToExperiment.backend must be one of 'mlflow', got 'wandb'"):
        LogToExperiment(backend="wandb")
    with pytest.raises(pipekit.ConfigError, match=r"LogToExperiment.experiment must be a non-empty name"):
        LogToExperiment(experiment="")


def test_without_mlflow_the_error_names_the_extra(monkeypatch, tmp_path: Path):
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what Python does for a package that is not there
    log = LogToExperiment(tracking_uri=(tmp_path / "mlruns").as_uri())
    ctx = _context(TrainingLoop.example(), (log,), {0: log.initial_state()}, tmp_path, _model())
    with pytest.raises(ImportError, match=r"pip install 'pipekit-train\[mlflow\]'"):
        log.on_train_start(ctx)
