"""Evaluate and predict with a trained model outside training, and record evaluations in the artifact store.

`evaluate` runs accumulating metrics (`pipekit_train.Metric`) over a dataset with the model an artifact (or a model
URI) names, and records an evaluation linked to that artifact, so a query can ask which models were evaluated on a
dataset hash and how they scored (``ArtifactStore.evaluations(dataset_hash=...)``). `predict` writes the model's
outputs for a dataset and records what it predicted from (the model, the dataset's hash, the output file) the same
way, as a record of kind ``"prediction"`` without metrics. ``pipekit-train evaluate`` and ``pipekit-train predict``
call these.

The stage's pipeline YAML (recorded in its artifact) gives the defaults: the input and target keys, the metrics
and the loss. A YAML that names a type defined in the user's module (``type: Huber2``) loads only after that module
is imported: the CLI imports the artifact's recorded imports first, then ``$PIPEKIT_IMPORT`` and ``--import``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipekit import ConfigError

__all__ = ["Evaluation", "evaluate", "load_data", "predict"]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation of a trained model on a dataset (what the store keeps, as plain data).

    Attributes:
        evaluation_id: Unique id (uuid4 hex).
        artifact_id: The artifact that trained the model, or ``None`` for a model URI no artifact names.
        model_uri: Where the weights are (``pipekit-model:sha256:<hex>...``).
        model_hash: The weights' hash (``ModelOp.weights_hash()``).
        dataset_hash: The evaluated dataset's ``content_hash()``.
        data: The file the dataset came from, as given.
        metrics: The results by name (``accuracy``, ``f1_macro``, ...).
        records: How many records were evaluated.
        created_at: ISO-8601 UTC time of the evaluation.
        kind: ``"evaluation"``, or ``"prediction"`` for what `predict` records (no metrics).
        output: The file `predict` wrote (``None`` for an evaluation, or predictions not written to a file).
        output_hash: ``sha256:<hex>`` of the predictions array's bytes (``predict`` only).
    """

    evaluation_id: str
    artifact_id: str | None
    model_uri: str
    model_hash: str
    dataset_hash: str
    data: str
    metrics: dict[str, float]
    records: int
    created_at: str
    kind: str = "evaluation"
    output: str | None = None
    output_hash: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_data(path: str | os.PathLike[str], loop: Any = None, *, targets: bool = True) -> Any:
    """A `TrainingDataset` (in record order) from an ``.npz`` file, a YAML file holding a `TrainingDataset`, or a
    ``.csv`` file read with the `CsvSource` settings and transforms of `loop`'s training dataset (every row of the
    file: its ``where``, ``split`` and ``fractions`` do not apply; without `targets`, the target columns are not
    read, so the file may lack them)."""
    import pipekit

    from ..data import NpzSource, TrainingDataset

    text = os.fspath(path)
    ext = os.path.splitext(text)[1].lower()
    if ext in (".npz", ".csv") and not os.path.exists(text):
        raise FileNotFoundError(f"--data {text}: no such file")
    if ext == ".npz":
        return TrainingDataset(source=NpzSource(path=text), shuffle=False)
    if ext == ".csv":
        return _csv_dataset(text, loop, targets)
    if ext in (".yaml", ".yml"):
        loaded = pipekit.load(text)
        if not isinstance(loaded, TrainingDataset):
            raise ConfigError(
                f"--data {text}: the file must hold a TrainingDataset (type: TrainingDataset), got "
                f"{type(loaded).__name__}"
            )
        return loaded.replace(shuffle=False)
    raise ConfigError(
        f"--data {text}: expected an .npz file, a .csv file or a .yaml file holding a TrainingDataset, got {ext!r}"
    )


def _csv_dataset(path: str, loop: Any, targets: bool) -> Any:
    """`path` read as the training stage's `CsvSource` reads its file (columns, delimiter, dtypes, encodings), every
    row of it, through the training dataset's transforms."""
    from ..data import CsvSource, TrainingDataset

    source = getattr(getattr(loop, "dataset", None), "source", None)
    if not isinstance(source, CsvSource):
        trained = f"the stage trained on a {type(source).__name__}" if loop is not None else "its stage is not known"
        raise ConfigError(
            f"--data {path}: a .csv file is read with the training stage's CsvSource settings, but {trained}; pass "
            "an .npz file or a YAML TrainingDataset"
        )
    from ..data import Standardize

    source = source.replace(path=path, where={}, split=None, fractions={})
    transforms = tuple(loop.dataset.transforms)
    if not targets and source.targets:  # predict: the labels are not read (a file may lack them, or hold new ones)
        source = source.replace(targets=(), class_labels=False)
        y = source.target_key  # the target's Standardize goes with it (predict inverts the recorded one)
        transforms = tuple(
            Standardize(keys=tuple(k for k in t.keys if k != y), statistics=t.statistics)
            if isinstance(t, Standardize)
            else t
            for t in transforms
            if not (isinstance(t, Standardize) and set(t.keys) <= {y})
        )
    return TrainingDataset(source=source, transforms=transforms, shuffle=False)


def _training_loop(artifact: Any) -> tuple[Any, str]:
    """``(the artifact's TrainingLoop, "")``, or ``(None, why not)`` when there is no artifact or its YAML does not
    load here (a stage trained on in-memory arrays records their shapes, not the arrays; a type from a module that
    was not imported)."""
    import pipekit

    if artifact is None:
        return None, "the model URI names no artifact in this store"
    try:
        return pipekit.loads(artifact.training_pipeline_yaml), ""
    except Exception as e:  # the reason goes into the error of whoever needed the loop
        first = " ".join(str(e).split())
        return None, f"its pipeline YAML does not load here ({type(e).__name__}: {first[:300]})"


_MSG_NO_LOOP = (
    "{what} {model}: name the metrics (--metric MAE, metrics=[MAE()]): {reason}; if the stage used types from "
    "your own module, import it (--import MODULE or $PIPEKIT_IMPORT; the CLI also imports the artifact's recorded "
    "imports)"
)


def _loss_means(loss: Any, bound: Any, dataset: Any, batch_size: int, x_key: str, y_key: str) -> dict[str, float]:
    """The stage's loss (and its aux values) over `dataset`: per-batch values weighted by the batch's records, as
    ``validate/loss`` is computed (docs/metrics.md). Names: ``loss`` and ``<aux_prefix><name>``."""
    import jax

    from ..losses._loss import split_loss_output

    prefix = getattr(loss, "aux_prefix", "loss/")
    step = jax.jit(lambda p, t: split_loss_output(loss(p, t)))
    results = []
    for batch in dataset.epoch_batches(batch_size):
        results.append((len(batch[x_key]), step(bound(batch[x_key]), batch[y_key])))
    totals: dict[str, float] = {}
    count = 0
    for size, (value, aux) in jax.device_get(results):
        count += size
        for name, v in [("loss", value), *((f"{prefix}{k}", a) for k, a in aux.items())]:
            totals[name] = totals.get(name, 0.0) + float(v) * size
    return {k: v / max(count, 1) for k, v in totals.items()}


def _keys(loop: Any, input_key: str | None, target_key: str | None) -> tuple[str, str]:
    return (
        input_key or getattr(loop, "input_key", None) or "x",
        target_key or getattr(loop, "target_key", None) or "y",
    )


def evaluate(
    model: str,
    data: str | os.PathLike[str],
    *,
    metrics: Sequence[Any] | None = None,
    batch_size: int = 256,
    input_key: str | None = None,
    target_key: str | None = None,
    store: Any = None,
    record: bool = True,
) -> Evaluation:
    """Evaluate the model `model` names on the dataset in `data` and record the evaluation in `store`.

    Args:
        model: An artifact id (or a unique prefix) in `store`, or a model URI (``pipekit-model:sha256:...``).
        data: An ``.npz`` file, a YAML file holding a `TrainingDataset` (its transforms apply), or a ``.csv``
            file, read with the training stage's `CsvSource` settings and transforms, with the classes and
            categories its training split recorded (an unseen class is an error naming the line and column).
        metrics: `Metric` operators. Default: the stage's loss (``loss`` and its aux values, such as
            ``accuracy`` for `CrossEntropy`) and the metrics its `TrainingLoop.metrics` names: what the stage
            logged as ``test/...``.
        batch_size: Records per batch.
        input_key: The model input entry of a batch. Default: the artifact's `input_key`, else ``"x"``.
        target_key: The target entry. Default: the artifact's `target_key`, else ``"y"``.
        store: The artifact store (a path, an `ArtifactStore`, or ``None`` for the default).
        record: Whether to record the evaluation in `store`.
    """
    from ..provenance._store import ArtifactStore
    from ..tracking._metrics import Metric, evaluate_metrics
    from ._export import _resolve

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"evaluate: batch_size must be a positive int, got {batch_size!r}")
    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    bound, artifact, uri = _resolve(model, store, None)
    loop, why_not = _training_loop(artifact)
    stage_loss = None
    if metrics is None:
        if loop is None:
            raise ConfigError(_MSG_NO_LOOP.format(what="evaluate", model=model, reason=why_not))
        metrics = tuple(getattr(loop, "metrics", ()) or ())
        stage_loss = getattr(loop, "loss", None)
    for i, m in enumerate(metrics):
        if not isinstance(m, Metric):
            raise ConfigError(f"evaluate: metrics[{i}] must be a Metric operator (Accuracy, MAE, ...), got {m!r}")
    dataset = load_data(data, loop).with_source_statistics(_source_statistics(artifact), f"--data {os.fspath(data)}")
    x_key, y_key = _keys(loop, input_key, target_key)
    _check_keys(dataset, data, x_key, y_key)
    stats = _statistics(artifact)
    prepared = in_data_units(dataset, stats, x_key, y_key, f"--data {os.fspath(data)}")
    unscaled = _Unstandardized(bound, stats, y_key)  # predictions in the data's units (`Standardize` inverted)
    results = {}
    if stage_loss is not None:  # the values the stage logged as test/loss, test/accuracy, ...
        results.update(_loss_means(stage_loss, unscaled, prepared, batch_size, x_key, y_key))
    if metrics:  # whole-split metrics replace a same-named mean, as in training
        results.update(
            evaluate_metrics(
                unscaled, prepared.epoch_batches(batch_size), list(metrics), input_key=x_key, target_key=y_key
            )
        )
    evaluation = _made(artifact, uri, bound, dataset, data, metrics=results, records=dataset.num_records())
    if record:
        with store:
            store.record_evaluation(evaluation.to_dict())
    return evaluation


def _made(artifact: Any, uri: str, bound: Any, dataset: Any, data: Any, **fields: Any) -> Evaluation:
    """A new `Evaluation` of the model `bound` (from `artifact`, or the bare model URI `uri`) on `dataset`."""
    from ..provenance._artifact import new_artifact_id, utc_now

    return Evaluation(
        evaluation_id=new_artifact_id(),
        artifact_id=artifact.artifact_id if artifact is not None else None,
        model_uri=uri,
        model_hash=bound.weights_hash(),
        dataset_hash=dataset.content_hash(),
        data=os.fspath(data),
        created_at=utc_now(),
        **fields,
    )


def _statistics(artifact: Any) -> dict[str, Any]:
    """The `Standardize` statistics the artifact's training split recorded (empty for none, or no artifact)."""
    return dict(getattr(artifact, "data_statistics", None) or {})


def _source_statistics(artifact: Any) -> dict[str, Any]:
    """What the artifact's training source was fitted to (a `CsvSource`'s classes, categories; empty for none)."""
    return dict(getattr(artifact, "source_statistics", None) or {})


def in_data_units(dataset: Any, stats: dict[str, Any], x_key: str, y_key: str, owner: str) -> Any:
    """`dataset` ready for a model trained with the `Standardize` statistics `stats`: its own unfitted
    `Standardize` transforms take the recorded statistics, the target stays in the data's units, and a dataset that
    does not standardize the input itself (an ``.npz`` file) gets the recorded input statistics applied."""
    from ..data._standardize import Standardize

    if not stats:
        return dataset
    transforms = []
    standardized = False
    for t in dataset.with_statistics(stats, owner).transforms:
        if isinstance(t, Standardize):
            standardized = standardized or x_key in t.keys
            keys = tuple(k for k in t.keys if k != y_key)  # the target is compared in the data's units
            if not keys:
                continue
            t = Standardize(keys=keys, statistics={k: t.statistics[k] for k in keys} if t.statistics else None)
        transforms.append(t)
    if not standardized and x_key in stats:
        transforms.append(Standardize(keys=(x_key,), statistics={x_key: stats[x_key]}))
    return dataset.replace(transforms=tuple(transforms))


class _Unstandardized:
    """A bound model whose outputs are brought back to the target's units (`invert` of the recorded statistics)."""

    def __init__(self, bound: Any, stats: dict[str, Any], y_key: str) -> None:
        self.bound, self.stats, self.y_key = bound, stats, y_key

    def __call__(self, x: Any) -> Any:
        from ..data._standardize import invert

        return invert(self.stats, self.y_key, self.bound(x))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bound, name)


def _check_keys(dataset: Any, data: Any, *keys: str) -> None:
    from pipekit import suggestion

    spec = dataset.element_spec()
    for key in keys:
        if key not in spec:
            raise ConfigError(
                f"--data {os.fspath(data)}: no entry {key!r}{suggestion(key, list(spec))}; it holds {', '.join(spec)}"
            )


def predict(
    model: str,
    data: str | os.PathLike[str],
    *,
    output: str | os.PathLike[str] | None = None,
    batch_size: int = 256,
    input_key: str | None = None,
    store: Any = None,
    record: bool = True,
) -> np.ndarray:
    """The outputs of the model `model` names for every record of `data`, in order.

    Args:
        model: An artifact id (or a unique prefix) in `store`, or a model URI (``pipekit-model:sha256:...``).
        data: An ``.npz`` file, a YAML file holding a `TrainingDataset` (its transforms apply), or a ``.csv``
            file, read with the training stage's `CsvSource` settings and transforms (the target columns may be
            absent).
        output: An ``.npz`` file to write (``predictions``), a ``.csv`` file (`_write_csv`: the row, the predicted
            class and one probability per class for a classifier; the outputs otherwise), or ``None``.
        batch_size: Records per batch.
        input_key: The model input entry of a batch. Default: the artifact's `input_key`, else ``"x"``.
        store: The artifact store (a path, an `ArtifactStore`, or ``None`` for the default).
        record: Whether to record in `store` what was predicted from: an `Evaluation` of kind ``"prediction"``
            with the model, the dataset's hash, `output` and the predictions' hash, and no metrics.
    """
    import hashlib

    from ..provenance._store import ArtifactStore
    from ._export import _resolve

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"predict: batch_size must be a positive int, got {batch_size!r}")
    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    bound, artifact, uri = _resolve(model, store, None)
    loop, why_not = _training_loop(artifact)
    fitted = _source_statistics(artifact)
    dataset = load_data(data, loop, targets=False).with_source_statistics(fitted, f"--data {os.fspath(data)}")
    if loop is None and input_key is None and artifact is not None:
        raise ConfigError(
            _MSG_NO_LOOP.format(what="predict", model=model, reason=why_not).replace(
                "name the metrics (--metric MAE, metrics=[MAE()])", "cannot tell the model's input key"
            )
        )
    x_key, y_key = _keys(loop, input_key, None)
    _check_keys(dataset, data, x_key)
    stats = _statistics(artifact)
    prepared = in_data_units(dataset, stats, x_key, y_key, f"--data {os.fspath(data)}")
    unscaled = _Unstandardized(bound, stats, y_key)
    parts = [np.asarray(unscaled(batch[x_key])) for batch in prepared.epoch_batches(batch_size)]
    predictions = np.concatenate(parts) if parts else np.zeros((0,))
    if output is not None and os.fspath(output).lower().endswith(".csv"):
        _write_csv(os.fspath(output), predictions, loop, fitted.get("classes"))
    elif output is not None:
        tmp = os.fspath(output) + ".tmp.npz"
        np.savez(tmp, predictions=predictions)
        os.replace(tmp, output)
    if record:
        digest = hashlib.sha256(np.ascontiguousarray(predictions).tobytes()).hexdigest()
        prediction = _made(
            artifact,
            uri,
            bound,
            dataset,
            data,
            metrics={},
            records=int(predictions.shape[0]) if predictions.ndim else 0,
            kind="prediction",
            output=os.fspath(output) if output is not None else None,
            output_hash=f"sha256:{digest}",
        )
        with store:
            store.record_evaluation(prediction.to_dict())
    return predictions


def _write_csv(path: str, predictions: np.ndarray, loop: Any, classes: Any) -> None:
    """`predictions` as a CSV file, one line per input row: ``row`` (the row's index among the file's data rows, as
    ``pandas.read_csv`` numbers them), then, for a classifier (the stage recorded classes, or trained with
    `CrossEntropy`), ``predicted`` (the class name, or index) and ``p_<class>`` (the softmax probability of each
    class); otherwise one column per output, named after the stage's `CsvSource` targets when they match."""
    import csv

    from ..losses import CrossEntropy

    out = predictions.reshape(len(predictions), -1) if predictions.ndim != 1 else predictions[:, None]
    classifier = classes is not None or isinstance(getattr(loop, "loss", None), CrossEntropy)
    rows: list[list[Any]]
    if classifier and out.shape[1] > 1:
        names = [str(c) for c in classes] if classes is not None else [str(i) for i in range(out.shape[1])]
        if len(names) != out.shape[1]:
            raise ConfigError(
                f"-o {path}: the model gives {out.shape[1]} logits but the stage recorded {len(names)} classes"
            )
        z = out.astype(np.float64) - out.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        header = ["row", "predicted", *(f"p_{n}" for n in names)]
        rows = [[i, names[int(k)], *(f"{v:.6g}" for v in p[i])] for i, k in enumerate(p.argmax(axis=1))]
    else:
        targets = list(getattr(getattr(getattr(loop, "dataset", None), "source", None), "targets", ()) or ())
        names = targets if len(targets) == out.shape[1] else [f"prediction_{j}" for j in range(out.shape[1])]
        if out.shape[1] == 1 and not targets:
            names = ["prediction"]
        header = ["row", *names]
        rows = [[i, *(f"{v:.8g}" for v in r)] for i, r in enumerate(out.tolist())]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(tmp, path)
