"""ArviZ export of a sampler stage's posterior: ``InferenceData`` with ``posterior``, ``sample_stats`` and
``observed_data``, and the run's provenance in the attributes; written as netCDF (h5netcdf). ArviZ is imported
only here, when an export asks for it."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipekit import PipekitError

__all__ = ["export_arviz", "inference_data", "provenance_attrs"]

_MSG_MISSING = (
    "ArviZ export needs the 'arviz' and 'h5netcdf' packages: pip install 'pipekit-train[numpyro]' (or [blackjax])"
)


def _arviz() -> Any:
    try:
        with warnings.catch_warnings():  # arviz 0.23 announces its 1.x refactor on import
            warnings.simplefilter("ignore", FutureWarning)
            import arviz
    except ImportError as e:
        raise PipekitError(_MSG_MISSING) from e
    return arviz


def inference_data(
    draws: Mapping[str, np.ndarray],
    sample_stats: Mapping[str, np.ndarray],
    observed_data: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
) -> Any:
    """``az.from_dict`` of the groups (draws and statistics ``(chains, draws, ...)``); empty groups are left out."""
    az = _arviz()
    kwargs: dict[str, Any] = {"posterior": {k: np.asarray(v) for k, v in draws.items()}}
    if sample_stats:
        kwargs["sample_stats"] = {k: np.asarray(v) for k, v in sample_stats.items()}
    if observed_data:
        kwargs["observed_data"] = {k: np.asarray(v) for k, v in observed_data.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "More chains than draws" for short runs
        # On the file (the root group) and on each group, where `xarray.open_dataset` of one group finds them.
        return az.from_dict(**kwargs, attrs=dict(attrs), posterior_attrs=dict(attrs), sample_stats_attrs=dict(attrs))


def provenance_attrs(artifact: Any, model_uri: str) -> dict[str, str]:
    """The provenance an exported file carries in its attributes (netCDF attributes are strings or numbers)."""
    info = artifact.backend_info or {}
    attrs = {
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
    return attrs


def export_arviz(artifact: Any, model: Any, model_uri: str, path: str) -> dict[str, Any]:
    """Write `model`'s posterior (a bound `NumpyroModel`/`BlackjaxModel`) with the stage's sample statistics and
    observed data (``posterior_groups.npz`` in the artifact's stage folder) to netCDF at `path`; returns what was
    written (groups, variables, the file)."""
    from ._posterior import read_groups

    posterior = getattr(model, "posterior", None)
    if posterior is None or not hasattr(posterior, "to_arviz"):
        raise PipekitError(
            f"--format arviz exports a sampler's posterior (numpyro-mcmc, blackjax); {type(model).__name__} "
            f"(backend {getattr(model, 'backend', '?')!r}) has none"
        )
    groups = read_groups(artifact.run_dir) if artifact is not None and artifact.run_dir else {}
    attrs = provenance_attrs(artifact, model_uri) if artifact is not None else {"pipekit_model_uri": model_uri}
    idata = posterior.to_arviz(groups.get("sample_stats"), groups.get("observed_data"), attrs)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if path.endswith(".zarr"):
            raise PipekitError(f"{path}: zarr is not supported (the zarr package is not a dependency); write .nc")
        idata.to_netcdf(tmp, engine="h5netcdf")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {
        "path": path,
        "groups": list(idata.groups()),
        "variables": {g: sorted(getattr(idata, g).data_vars) for g in idata.groups()},
    }
