"""``predict`` for a model whose predictions are draws (a sampler's posterior): its predictive distribution for
the inputs in a file, written as the model writes it (`ModelOp.predict_draws`: ArviZ netCDF with a
``posterior_predictive`` group) and recorded in the artifact store as a prediction."""

from __future__ import annotations

import hashlib
import os
from typing import Any

__all__ = ["predict_draws"]


def predict_draws(
    model: str, data: str | os.PathLike[str], output: str | os.PathLike[str], *, store: Any = None, record: bool = True
) -> dict[str, Any]:
    """Write the predictive draws of the model `model` names (an artifact id or prefix in `store`, or a model URI)
    for the inputs in the file `data` to `output` (``.nc``); with `record`, an `Evaluation` of kind
    ``"prediction"`` in `store` (the file's hash as ``output_hash``). Returns what the model wrote (``path``,
    ``summary``) and ``evaluation_id``."""
    from ..provenance._artifact import new_artifact_id, utc_now
    from ..provenance._store import ArtifactStore
    from ._evaluate import Evaluation
    from ._export import _resolve
    from ._formats import provenance_attrs

    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    bound, artifact, uri = _resolve(model, store, None)
    written = dict(bound.predict_draws(os.fspath(data), os.fspath(output), attrs=provenance_attrs(artifact, uri)))
    written["evaluation_id"] = None
    if record:
        with open(output, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        with open(data, "rb") as f:
            data_hash = "sha256:" + hashlib.sha256(f.read()).hexdigest()
        prediction = Evaluation(
            evaluation_id=new_artifact_id(),
            artifact_id=artifact.artifact_id if artifact is not None else None,
            model_uri=uri,
            model_hash=bound.weights_hash(),
            dataset_hash=data_hash,
            data=os.fspath(data),
            metrics={},
            records=0,
            created_at=utc_now(),
            kind="prediction",
            output=os.fspath(output),
            output_hash=f"sha256:{digest}",
        )
        with store:
            store.record_evaluation(prediction.to_dict())
        written["evaluation_id"] = prediction.evaluation_id
    return written
