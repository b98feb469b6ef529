"""Exports in a model's own formats (`ModelOp.export_formats`, e.g. a sampler's posterior as ArviZ netCDF):
`export_file` finds the model, writes the run's provenance into the file's attributes (`provenance_attrs`) and
lets the model operator write the file. The core names no format's library: the backend does.
"""

from __future__ import annotations

import json
from typing import Any

from ._export import ExportError, _resolve

__all__ = ["export_file", "provenance_attrs"]


def provenance_attrs(artifact: Any, model_uri: str) -> dict[str, str]:
    """Where the model came from, as the string attributes an exported file carries (netCDF attributes hold strings
    or numbers): artifact, run, stage, backend, model URI, weights/pipeline/dataset hashes, seed, status, final
    metrics and the backend's info (JSON). Only the model URI when no artifact in the store produced it."""
    if artifact is None:
        return {"pipekit_model_uri": model_uri}
    info = artifact.backend_info or {}
    return {
        "pipekit_artifact_id": artifact.artifact_id,
        "pipekit_run_id": artifact.run_id,
        "pipekit_stage": artifact.stage,
        "pipekit_backend": artifact.backend,
        "pipekit_model_uri": model_uri,
        "pipekit_weights_hash": artifact.trained_model_hash or "",
        "pipekit_pipeline_hash": artifact.pipeline_hash or "",
        "pipekit_dataset_hash": artifact.dataset_hash or "",
        "pipekit_seed": "" if artifact.seed is None else str(artifact.seed),
        "pipekit_status": artifact.status,
        "pipekit_final_metrics": json.dumps(artifact.final_metrics, sort_keys=True, allow_nan=True),
        "pipekit_backend_info": json.dumps(info, sort_keys=True, default=str, allow_nan=True),
        "inference_library": str(artifact.backend),
    }


def export_file(source: str, path: str, fmt: str, *, store: Any = None) -> dict[str, Any]:
    """Write the model of `source` (an artifact id or prefix, or a model URI) as `fmt`, one of its model operator's
    `ModelOp.export_formats`, to `path`. Returns what the model wrote (``path``, ``summary``) and ``origin`` (the
    artifact's short id, or the model URI)."""
    model, artifact, uri = _resolve(source, store, None)
    formats = model.export_formats()
    if fmt not in formats:
        raise ExportError(
            f"--format {fmt}: {type(model).__name__} (backend {model.backend!r}) does not export as {fmt!r}; it "
            f"exports as: {', '.join(('jaxexport', *formats))}"
        )
    stage_dir = artifact.run_dir if artifact is not None and artifact.run_dir else None
    written = dict(model.export(fmt, path, attrs=provenance_attrs(artifact, uri), stage_dir=stage_dir))
    written["origin"] = f"artifact {artifact.artifact_id[:12]}" if artifact is not None else uri.split("?")[0]
    return written
