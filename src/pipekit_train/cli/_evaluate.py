"""``pipekit-train evaluate``, ``predict`` and ``evaluations``: a trained model on new data, and what was measured.

``evaluate ARTIFACT_ID|MODEL_URI --data FILE.yaml|FILE.npz|FILE.csv [--metric M]... [--import MODULE]...`` prints
the metrics and records the evaluation in the artifact store, linked to the artifact (a ``.csv`` is read with the
training stage's `CsvSource` settings); ``predict ... --data FILE -o out.npz|out.csv`` writes the model's outputs
(a ``.csv``: the row, the predicted class name and one probability per class) and records what they came from;
both import the artifact's recorded modules, then ``$PIPEKIT_IMPORT`` and ``--import``, before reading the stage's
pipeline; ``evaluations [--dataset-hash H] [--artifact ID] [--metric NAME]`` lists the recorded evaluations. Exit
codes: 0 done, 2 a mistake in what was asked (one line on standard error), 1 a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ._common import EXIT_OK, UsageError, guarded, run_commands
from ._imports import add_import_flag, import_modules, reimport_recorded, requested_imports

__all__ = ["add_evaluate_commands", "main"]


def parse_metric(text: str) -> Any:
    """``Accuracy`` or ``{type: PrecisionRecallF1, num_classes: 10}`` → a `Metric` operator."""
    from pipekit import ConfigError
    from pipekit._yaml import load_value

    from ..tracking._metrics import Metric

    node = text.strip()
    value = load_value(node if node.startswith("{") else f"{{type: {node}}}", f"--metric {text}")
    if not isinstance(value, Metric):
        raise ConfigError(f"--metric {text}: {type(value).__name__} is not a Metric (Accuracy, MAE, ...)")
    return value


def _store(args: argparse.Namespace) -> Any:
    from ..provenance._store import ArtifactStore

    return ArtifactStore(args.store)


def _import_user_modules(args: argparse.Namespace) -> None:
    """The artifact's recorded imports (as `reproduce` does), then ``$PIPEKIT_IMPORT`` and ``--import``: the
    stage's pipeline YAML names the user's types, which load only once their modules are imported."""
    from ..inference._export import MODEL_URI_PREFIX
    from ..provenance._model_registry import parse_model_uri
    from ..provenance._store import ArtifactStore, UnknownArtifactError

    store = ArtifactStore(args.store)
    artifact_id = None
    if store.path.exists():
        with store:
            if args.model.startswith(MODEL_URI_PREFIX):
                digest, _ = parse_model_uri(args.model)
                found = [a for a in store.query(model_hash=f"sha256:{digest}") if a.status == "completed"]
                artifact_id = found[0].artifact_id if found else None
            else:
                try:
                    artifact_id = store.get(args.model).artifact_id
                except UnknownArtifactError:
                    artifact_id = None  # evaluate / predict say so, with the store's hint
            if artifact_id is not None:
                reimport_recorded(store, artifact_id, args.imports, say=sys.stderr)
                return
    import_modules(requested_imports(args.imports))


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Evaluate a trained model on a dataset; print and record the metrics."""
    from ..inference._evaluate import evaluate

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be a positive int, got {args.batch_size}")
    _import_user_modules(args)
    metrics = [parse_metric(m) for m in args.metric] if args.metric else None
    result = evaluate(
        args.model,
        args.data,
        metrics=metrics,
        batch_size=args.batch_size,
        store=_store(args),
        record=not args.no_record,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return EXIT_OK
    origin = f"artifact {result.artifact_id[:12]}" if result.artifact_id else result.model_uri.split("?")[0]
    print(f"{origin} on {result.data} ({result.records} records, dataset {result.dataset_hash[:19]})")
    width = max((len(k) for k in result.metrics), default=0)
    for name, value in result.metrics.items():
        print(f"  {name:<{width}}  {value:.6g}")
    if not args.no_record:
        print(f"recorded evaluation {result.evaluation_id[:12]}")
    return EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    """Write a trained model's outputs for every record of a dataset."""
    from ..inference._evaluate import predict

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be a positive int, got {args.batch_size}")
    _import_user_modules(args)
    if str(args.output).lower().endswith(".nc"):  # a posterior's predictive draws, as ArviZ netCDF
        from ..inference._draws import predict_draws

        written = predict_draws(args.model, args.data, args.output, store=_store(args), record=not args.no_record)
        print(f"wrote {written['path']}: {written['summary']}")
        return EXIT_OK
    out = predict(
        args.model,
        args.data,
        output=args.output,
        batch_size=args.batch_size,
        store=_store(args),
        record=not args.no_record,
    )
    if str(args.output).lower().endswith(".csv"):
        print(f"wrote {args.output} ({out.shape[0]} rows; outputs {out.dtype}{list(out.shape)})")
    else:
        print(f"wrote {args.output} (predictions {out.dtype}{list(out.shape)})")
    return EXIT_OK


def cmd_evaluations(args: argparse.Namespace) -> int:
    """List recorded evaluations: which models were evaluated on which data, and how they scored."""
    store = _store(args)
    if not store.path.exists():
        raise UsageError(f"no artifact store at {store.path}; pass --store PATH")
    with store:
        found = store.evaluations(dataset_hash=args.dataset_hash, artifact_id=args.artifact, metric=args.metric)
    if args.json:
        print(json.dumps(found, indent=2))
        return EXIT_OK
    for e in found:
        shown = {k: v for k, v in e["metrics"].items() if args.metric is None or k == args.metric}
        scores = " ".join(f"{k} {v:.6g}" for k, v in list(shown.items())[:6])
        model = (e["artifact_id"] or e["model_hash"])[:12]
        if e.get("kind") == "prediction":
            scores = f"prediction -> {e.get('output') or '(not written)'}"
        print(f"{e['evaluation_id'][:12]}  {e['created_at']}  {model}  {e['dataset_hash'][:19]}  {scores}")
    return EXIT_OK


def add_evaluate_commands(sub: Any) -> None:
    """Add ``evaluate``, ``predict`` and ``evaluations`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "evaluate",
        help="a trained model's metrics on a dataset, recorded in the artifact store",
        description="Evaluate the model an artifact (or a model URI) names on a dataset and record the result.",
    )
    p.add_argument("model", metavar="ARTIFACT_ID|MODEL_URI")
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="an .npz file, a YAML TrainingDataset, or a .csv read with the training stage's CsvSource settings",
    )
    p.add_argument(
        "--metric",
        action="append",
        metavar="METRIC",
        help="Accuracy, or '{type: PrecisionRecallF1, num_classes: 10}' (repeatable; default: the stage's metrics)",
    )
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.add_argument("--no-record", action="store_true", help="print the metrics without recording them")
    p.add_argument("--json", action="store_true", help="print the evaluation record as JSON")
    add_import_flag(p)
    p.set_defaults(func=guarded("evaluate", cmd_evaluate))

    p = sub.add_parser(
        "predict",
        help="a trained model's outputs for a dataset, into an .npz or a .csv",
        description="Write the outputs of the model an artifact (or a model URI) names for every record of a dataset.",
    )
    p.add_argument("model", metavar="ARTIFACT_ID|MODEL_URI")
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="an .npz file, a YAML TrainingDataset, or a .csv read with the training stage's CsvSource settings",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.npz|OUT.csv|OUT.nc",
        help="an .npz ('predictions': the outputs), a .csv (row, predicted class, one probability per class), or "
        "for a sampler's posterior an .nc (ArviZ: posterior-predictive draws for the inputs of a .json/.npz --data)",
    )
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.add_argument("--no-record", action="store_true", help="do not record the prediction in the artifact store")
    add_import_flag(p)
    p.set_defaults(func=guarded("predict", cmd_predict))

    p = sub.add_parser(
        "evaluations",
        help="recorded evaluations: which models, on which data, how they scored",
        description="List the evaluations recorded in the artifact store, oldest first.",
    )
    p.add_argument("--dataset-hash", metavar="H", help="only evaluations on the dataset with this content hash")
    p.add_argument("--artifact", metavar="ID", help="only evaluations of this artifact's model")
    p.add_argument("--metric", metavar="NAME", help="only evaluations that measured NAME (and show only it)")
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.set_defaults(func=guarded("evaluations", cmd_evaluations))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``evaluate``, ``predict`` or ``evaluations`` with `argv`."""
    return run_commands(add_evaluate_commands, argv, description="Evaluate and predict with trained models.")
