"""`LogToExperiment`: the callback that logs a run to an experiment tracker (MLflow) as it trains.

It mirrors a run into MLflow (parameters, metrics at the logging cadence, the pipeline YAML as an artifact file)
and puts the MLflow run id in the stage's artifact. Its run-time state is in ``ctx.state_of(self)`` (JSON,
checkpointed), so a resumed run continues the same MLflow run.
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import re
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

import pipekit
from pipekit import ConfigError, Operator

from ..callbacks._base import Callback, TrainContext
from ._progress import STARTED_PHASES

__all__ = ["LogToExperiment", "mlflow_metric_name", "pipeline_params"]

_MSG_MLFLOW = (
    "LogToExperiment(backend='mlflow') needs the 'mlflow' package (mlflow-skinny is enough), which is not "
    "installed; install the extra: pip install 'pipekit-train[mlflow]'"
)
_MSG_MLFLOW_DB = (
    "LogToExperiment.tracking_uri {uri!r} is a database, which MLflow opens through SQLAlchemy and Alembic; "
    "they are not installed: pip install 'pipekit-train[mlflow]' (or a file: folder or an http:// server URI)"
)
#: The URI schemes MLflow opens with SQLAlchemy (mlflow.store.db.db_types.DATABASE_ENGINES).
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
#: MLflow's limits (mlflow.utils.validation): value length, key length, entries per log_batch call.
_MAX_VALUE = 6000
_MAX_KEY = 250
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- ]")
#: Keys of a record that describe it rather than hold a value (as in `pipekit_train.tracking._writers.RESERVED_KEYS`).
_RESERVED = ("type", "context", "step", "epoch", "time", "interrupted")


def _import_mlflow() -> Any:
    """``mlflow.entities`` and ``MlflowClient`` (the one import point), or an error naming the extra."""
    try:
        import mlflow.entities as entities
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ImportError(_MSG_MLFLOW) from None
    return entities, MlflowClient


def _name(key: str) -> str:
    """`key` as a valid MLflow parameter or metric name (odd characters become ``_``)."""
    key = _BAD_NAME_CHARS.sub("_", key)
    key = posixpath.normpath(key).lstrip("/") if key else "_"
    return key[:_MAX_KEY] if key not in ("", ".") else "_"


def mlflow_metric_name(context: str, key: str) -> str:
    """The MLflow name of the metric `key` of a `context` record: ``<context>/<key>`` with the key's ``/`` as ``.``.

    MLflow's file store keeps each metric in a file named after it, so ``train/loss`` (a file) and
    ``train/loss/MSE_0`` (a file inside it) cannot both exist; a database store takes both. One level, the
    context, keeps every store readable: ``train/loss``, ``train/loss.MSE_0``, ``validate/precision.0``,
    ``train/schedule.weight.KL_1``. Every other writer keeps the ``/`` (docs/metrics.md).

    Example:
        >>> mlflow_metric_name("train", "loss/MSE_0"), mlflow_metric_name("validate", "validate/loss")
        ('train/loss.MSE_0', 'validate/loss')
    """
    if key.startswith(f"{context}/"):
        key = key[len(context) + 1 :]
    return _name(f"{context}/{key.replace('/', '.')}")


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts and lists as ``{"a.b": "1", "stages.0.type": "TrainingLoop"}`` with string values."""
    out: dict[str, str] = {}
    if isinstance(value, Operator):
        name = type(value)._pipekit_name or type(value).__name__
        value = {"type": name, **value.non_default_fields()}
    if isinstance(value, Mapping):
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, (list, tuple)) and value and not all(isinstance(v, (int, float, str)) for v in value):
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        text = f"array(shape={tuple(value.shape)}, dtype={value.dtype})"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(str(v) for v in value) + "]"
    else:
        text = "null" if value is None else str(value)
    if len(text) > _MAX_VALUE:
        text = text[: _MAX_VALUE - 3] + "..."
    out[prefix or "value"] = text
    return out


def pipeline_params(loop: Any) -> dict[str, str]:
    """The loop's configuration as flat MLflow parameters: from its YAML when it has one, else its fields."""
    try:
        plain = yaml.safe_load(pipekit.dumps(loop))
        plain.pop("pipekit", None)
    except (ConfigError, AttributeError, TypeError):
        plain = loop.non_default_fields() if isinstance(loop, Operator) else {}
    return {_name(k): v for k, v in _flatten(plain).items()}


class LogToExperiment(Callback):
    """Mirror the run into an experiment tracker (MLflow).

    On start it creates (or, on resume, reopens) an MLflow run and logs the pipeline's configuration as
    parameters; then every metrics record the loop writes (``on_log``) under the names a `TensorBoardWriter`
    uses, ``<context>/<metric>`` (``train/loss`` is the mean over the logging window, as in every writer; see
    docs/metrics.md), except that a ``/`` inside the metric's key becomes ``.`` (``train/loss.MSE_0``; see
    `mlflow_metric_name`) so that every MLflow store, files or database, can hold them; the phase running now as
    the run's tag ``pipekit.phase`` (``compiling``, ``evaluating``, ``checkpointing`` while they run, ``stepping``
    between them, then ``done`` or ``failed``); at the end the pipeline YAML as the artifact file
    ``pipeline.yaml``, then it ends the MLflow run. The MLflow run id goes to the stage's
    artifact (``tracker_run_id``) and to this callback's checkpointed state.

    Args:
        backend: The tracker. Only ``"mlflow"`` for now (the ``mlflow`` extra).
        tracking_uri: Where MLflow stores runs: a folder (``file:``), a database (``sqlite:///runs/mlflow.db``;
            MLflow opens it with SQLAlchemy and Alembic, both in the ``mlflow`` extra) or a server
            (``http://...``). Default: ``$MLFLOW_TRACKING_URI``, else a local file store at ``<run_dir>/mlruns``,
            else ``./runs/mlruns``. MLflow 3 refuses local file stores unless ``MLFLOW_ALLOW_FILE_STORE=true``;
            for a ``file:`` URI this callback sets that variable when it is unset.
        experiment: The MLflow experiment name (created when missing).

    Runs after the other callbacks (``order=10``), so the model URI a `RegisterModel` records is tagged too.
    """

    backend: Literal["mlflow"] = "mlflow"
    tracking_uri: str | None = None
    experiment: str = "pipekit"
    order: int = 10

    def fingerprint(self) -> None:
        """Not part of a resume's fingerprint: it changes what is recorded, not what is trained."""
        return None

    def validate(self) -> None:
        if not self.experiment:
            raise ConfigError("LogToExperiment.experiment must be a non-empty name, got ''")

    def initial_state(self) -> dict[str, Any]:
        return {"mlflow_run_id": None, "tracking_uri": None, "params_logged": False}

    # Handles ----------------------------------------------------------------------------------------------
    def resolve_tracking_uri(self, run_dir: str | None) -> str:
        """The tracking URI this callback uses for a run in `run_dir`."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            folder = Path(run_dir) / "mlruns" if run_dir else Path("runs") / "mlruns"
            uri = folder.absolute().as_uri()
        return uri

    def _client(self, uri: str) -> Any:
        clients: dict[str, Any] = self.__dict__.setdefault("_clients", {})
        client = clients.get(uri)
        if client is None:
            _, client_cls = _import_mlflow()
            scheme = urllib.parse.urlparse(uri).scheme
            if scheme in ("", "file"):
                # MLflow 3 keeps local file stores behind an opt-in. A user who set the variable keeps their choice.
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            elif scheme.split("+")[0] in _DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
                raise ImportError(_MSG_MLFLOW_DB.format(uri=uri))
            client = clients[uri] = client_cls(tracking_uri=uri)
        return client

    def _experiment_id(self, client: Any) -> str:
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(client.create_experiment(self.experiment))
        except Exception:  # another process created it in between
            found = client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return str(found.experiment_id)

    def _run(self, ctx: TrainContext) -> tuple[Any, str] | None:
        state = ctx.state_of(self)
        if not state.get("mlflow_run_id"):
            return None
        return self._client(state["tracking_uri"]), state["mlflow_run_id"]

    # Hooks ------------------------------------------------------------------------------------------------
    def on_train_start(self, ctx: TrainContext) -> None:
        entities, _ = _import_mlflow()
        state = ctx.state_of(self)
        uri = state.get("tracking_uri") or self.resolve_tracking_uri(ctx.run_dir)
        client = self._client(uri)
        run_id = state.get("mlflow_run_id")
        if run_id:
            try:
                client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
            except Exception:  # the tracking store lost the run: start a new one rather than fail the training
                run_id = None
                state["params_logged"] = False
        if not run_id:
            run = client.create_run(
                self._experiment_id(client),
                run_name=f"{ctx.run_id}/{ctx.stage}",
                tags={"pipekit.run_id": ctx.run_id, "pipekit.stage": ctx.stage},
            )
            run_id = run.info.run_id
        state.update(mlflow_run_id=run_id, tracking_uri=uri)
        ctx.artifact_fields["tracker_run_id"] = run_id
        if not state.get("params_logged"):
            params = [entities.Param(k, v) for k, v in pipeline_params(ctx.loop).items()]
            for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
                client.log_batch(run_id, params=params[i : i + _MAX_PARAMS_PER_BATCH])
            state["params_logged"] = True
        if ctx.step:
            client.set_tag(run_id, "pipekit.resumed_at_step", str(ctx.step))

    def on_log(self, ctx: TrainContext, record: Mapping[str, Any]) -> None:
        """Log a metrics record's numbers as ``<context>/<name>`` at the record's step (other records: nothing).

        The records a signal's stop shows (``interrupted``) are left out: an MLflow metric's history cannot take
        a point back, and the resumed run logs the uninterrupted run's points."""
        if record.get("type") != "metrics" or record.get("interrupted") is True:
            return
        handle = self._run(ctx)
        if handle is None:
            return
        entities, _ = _import_mlflow()
        client, run_id = handle
        context = str(record.get("context", "train"))
        step = int(record.get("step") or 0)
        stamp = int(time.time() * 1000)
        entries = []
        for key, value in record.items():
            if key in _RESERVED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            entries.append(entities.Metric(mlflow_metric_name(context, key), float(value), stamp, step))
        for i in range(0, len(entries), _MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=entries[i : i + _MAX_METRICS_PER_BATCH])

    def on_phase_start(self, ctx: TrainContext, phase: str) -> None:
        """Tag the MLflow run with the phase now running (``pipekit.phase``: ``compiling``, ``evaluating``,
        ``checkpointing``), so a long compile or evaluation shows in MLflow while it runs."""
        self._tag_phase(ctx, phase)

    def on_phase(self, ctx: TrainContext, phase: str, duration_s: float) -> None:
        """When a started phase ends the run is stepping again; ``done`` and ``failed`` end the stage."""
        if phase in STARTED_PHASES:
            self._tag_phase(ctx, "stepping")
        elif phase in ("done", "failed"):
            self._tag_phase(ctx, phase)

    def _tag_phase(self, ctx: TrainContext, phase: str) -> None:
        handle = self._run(ctx)
        if handle is not None:
            client, run_id = handle
            client.set_tag(run_id, "pipekit.phase", phase)

    def on_train_end(self, ctx: TrainContext) -> None:
        handle = self._run(ctx)
        if handle is None:
            return
        client, run_id = handle
        try:
            client.log_text(run_id, pipekit.dumps(ctx.loop, strict=False), "pipeline.yaml")
        except ConfigError as e:  # a loop over in-memory arrays has no YAML; say why rather than fail the run
            client.set_tag(run_id, "pipekit.pipeline_yaml", f"unavailable: {e}"[:_MAX_VALUE])
        client.set_tag(run_id, "pipekit.status", f"stopped: {ctx.stop_reason}" if ctx.stop_reason else "completed")
        for key in ("model_registry_uri", "trained_model_hash"):
            if ctx.artifact_fields.get(key):
                client.set_tag(run_id, f"pipekit.{key}", str(ctx.artifact_fields[key]))
        client.set_terminated(run_id, "FINISHED")

    def on_exception(self, ctx: TrainContext, exc: BaseException) -> None:
        handle = self._run(ctx)
        if handle is None:
            return
        client, run_id = handle
        client.set_tag(run_id, "pipekit.error", f"{type(exc).__name__}: {exc}"[:_MAX_VALUE])
        client.set_terminated(run_id, "FAILED")
