"""ArviZ export of a sampler stage's posterior: ``InferenceData`` with ``posterior``, ``sample_stats`` and
``observed_data``, and the run's provenance in the attributes; written as netCDF (h5netcdf). ArviZ is imported
only here, when an export asks for it."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipekit import PipekitError

__all__ = ["inference_data", "write_arviz"]

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


def write_arviz(posterior: Any, path: str, *, attrs: Mapping[str, str], stage_dir: str | None) -> dict[str, Any]:
    """Write `posterior` (a `Posterior`) with the stage's sample statistics and observed data
    (``posterior_groups.npz`` in `stage_dir`, when given) to netCDF at `path`, `attrs` on every group; returns
    ``{"path", "summary", "groups", "variables"}``."""
    from ._posterior import read_groups

    if path.endswith(".zarr"):
        raise PipekitError(f"{path}: zarr is not supported (the zarr package is not a dependency); write .nc")
    groups = read_groups(stage_dir) if stage_dir else {}
    idata = posterior.to_arviz(groups.get("sample_stats"), groups.get("observed_data"), attrs)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        idata.to_netcdf(tmp, engine="h5netcdf")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    variables = {g: sorted(getattr(idata, g).data_vars) for g in idata.groups()}
    summary = ", ".join(f"{g} ({', '.join(v)})" for g, v in variables.items())
    return {
        "path": path,
        "summary": f"ArviZ InferenceData, netCDF: {summary}",
        "groups": list(idata.groups()),
        "variables": variables,
    }
