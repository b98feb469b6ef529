"""ArviZ export of a sampler stage's posterior: ``InferenceData`` with ``posterior``, ``sample_stats``,
``log_likelihood``, ``posterior_predictive``, ``prior``, ``prior_predictive`` and ``observed_data`` (those the stage
recorded), and the run's provenance in the attributes; written as netCDF (h5netcdf). ArviZ is imported
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


#: The groups besides ``posterior`` an export may hold, in ArviZ's names (``az.from_dict``'s keywords).
GROUPS = (
    "sample_stats",
    "log_likelihood",
    "posterior_predictive",
    "prior",
    "prior_predictive",
    "observed_data",
)


def inference_data(
    draws: Mapping[str, np.ndarray],
    sample_stats: Mapping[str, np.ndarray],
    observed_data: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    groups: Mapping[str, Mapping[str, np.ndarray]] | None = None,
) -> Any:
    """``az.from_dict`` of the groups (draws, statistics and the other `groups`, each ``(chains, draws, ...)``;
    `GROUPS` names those `groups` may hold); empty groups are left out. Each observed site's dimensions are named
    alike in every group that holds it (``y_dim_0``), so ArviZ lines up ``observed_data``, ``log_likelihood`` and
    ``posterior_predictive`` (``az.loo``, ``az.plot_ppc``)."""
    az = _arviz()
    given: dict[str, Mapping[str, np.ndarray]] = {
        **(groups or {}),
        "sample_stats": sample_stats,
        "observed_data": observed_data,
    }
    kwargs: dict[str, Any] = {"posterior": {k: np.asarray(v) for k, v in draws.items()}}
    for group in GROUPS:
        values = given.get(group) or {}
        if values:
            kwargs[group] = {k: np.asarray(v) for k, v in values.items()}
    dims = {}
    for name, value in (observed_data or {}).items():
        dims[name] = [f"{name}_dim_{i}" for i in range(np.ndim(value))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "More chains than draws" for short runs
        # On the file (the root group) and on each group, where `xarray.open_dataset` of one group finds them.
        return az.from_dict(
            **kwargs,
            dims=dims or None,
            attrs=dict(attrs),
            posterior_attrs=dict(attrs),
            sample_stats_attrs=dict(attrs),
        )


def write_arviz(posterior: Any, path: str, *, attrs: Mapping[str, str], stage_dir: str | None) -> dict[str, Any]:
    """Write `posterior` (a `Posterior`) with the groups the stage recorded (``posterior_groups.npz`` in
    `stage_dir`, when given: sample statistics, observed data, log-likelihood, predictive draws) to netCDF at
    `path`, `attrs` on every group; returns ``{"path", "summary", "groups", "variables"}``."""
    from ._posterior import read_groups

    if path.endswith(".zarr"):
        raise PipekitError(f"{path}: zarr is not supported (the zarr package is not a dependency); write .nc")
    groups = read_groups(stage_dir) if stage_dir else {}
    idata = posterior.to_arviz(groups.get("sample_stats"), groups.get("observed_data"), attrs, groups=groups)
    return write_netcdf(idata, path)


def write_netcdf(idata: Any, path: str) -> dict[str, Any]:
    """Write `idata` to `path` as netCDF (h5netcdf), atomically; returns ``{"path", "summary", "groups",
    "variables"}``."""
    if path.endswith(".zarr"):
        raise PipekitError(f"{path}: zarr is not supported (the zarr package is not a dependency); write .nc")
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
