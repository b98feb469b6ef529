"""Compare trained models by a criterion their backend computes (``"loo"``: a sampler posterior's expected log
predictive density by leave-one-out cross-validation), and record the comparison in the artifact store: one
`Evaluation` of kind ``"comparison"`` per model, its metrics ``loo/<name>``. ``pipekit-train artifacts compare``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipekit import ConfigError

from ._evaluate import Evaluation

__all__ = ["CRITERIA", "compare"]

#: The criteria `compare` knows, and what each measures.
CRITERIA = {"loo": "expected log predictive density by Pareto-smoothed leave-one-out cross-validation (PSIS-LOO)"}


def compare(ids: Sequence[str], criterion: str = "loo", *, store: Any = None, record: bool = True) -> dict[str, Any]:
    """Compare the models of the artifacts `ids` (ids or unique prefixes in `store`) by `criterion`.

    Returns ``{"text", "rows", "warnings", "evaluations"}``: the backend's table, its numbers by artifact id, its
    warnings, and (with `record`) the evaluation ids recorded in `store`, one per model, of kind ``"comparison"``
    with the metrics ``<criterion>/<name>`` and ``data`` naming every compared artifact.
    """
    from ..provenance._artifact import new_artifact_id, utc_now
    from ..provenance._store import ArtifactStore
    from ._export import _resolve

    if criterion not in CRITERIA:
        raise ConfigError(f"compare: unknown criterion {criterion!r}; one of: {', '.join(CRITERIA)}")
    if len(ids) < 2:
        raise ConfigError(f"compare needs at least two artifacts, got {len(ids)}")
    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    resolved = [_resolve(i, store, None) for i in ids]
    labels = [artifact.artifact_id if artifact is not None else uri for _, artifact, uri in resolved]
    if len(set(labels)) < len(labels):
        raise ConfigError(f"compare: an artifact is given twice: {list(ids)}")
    hashes = {label: a.dataset_hash for label, (_, a, _) in zip(labels, resolved) if a is not None}
    if len(set(hashes.values())) > 1:
        raise ConfigError(
            "compare: the models were fitted to different data (dataset hashes differ: "
            + ", ".join(f"{label[:12]} {h[:19]}" for label, h in hashes.items())
            + "); a comparison of predictive accuracy needs the same observations"
        )
    entries = [
        (label, model, artifact.run_dir if artifact is not None and artifact.run_dir else None)
        for label, (model, artifact, _) in zip(labels, resolved)
    ]
    result = dict(entries[0][1].compare(entries, criterion))
    result["evaluations"] = []
    if not record:
        return result
    together = ",".join(labels)
    with store:
        for label, (model, artifact, uri) in zip(labels, resolved):
            row = result["rows"][label]
            evaluation = Evaluation(
                evaluation_id=new_artifact_id(),
                artifact_id=artifact.artifact_id if artifact is not None else None,
                model_uri=uri,
                model_hash=model.weights_hash(),
                dataset_hash=hashes.get(label, ""),
                data=f"compare {criterion}: {together}",
                metrics={f"{criterion}/{name}": float(value) for name, value in row.items()},
                records=int(row.get("observations", 0)),
                created_at=utc_now(),
                kind="comparison",
            )
            store.record_evaluation(evaluation.to_dict())
            result["evaluations"].append(evaluation.evaluation_id)
    return result
