"""Model comparison of sampler posteriors by leave-one-out cross-validation: ArviZ's ``az.compare`` (PSIS-LOO)
over the pointwise log-likelihood each stage recorded with its draws (``posterior_groups.npz``), with each model's
Pareto-k diagnostics. ArviZ is imported only here."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipekit import PipekitError

__all__ = ["compare_loo"]

#: Pareto-k above this makes a model's PSIS-LOO estimate unreliable (Vehtari et al. 2024; ArviZ's threshold).
PARETO_K_BAD = 0.7


def _idata(label: str, model: Any, stage_dir: str | None) -> Any:
    from ._posterior import read_groups

    groups = read_groups(stage_dir) if stage_dir else {}
    if not groups.get("log_likelihood"):
        raise PipekitError(
            f"{label}: its stage recorded no pointwise log-likelihood (posterior_groups.npz in {stage_dir!r} has no "
            "log_likelihood group); sample it again with the kernel's log_likelihood: true (the default)"
        )
    keep = {g: groups[g] for g in ("log_likelihood", "observed_data") if groups.get(g)}
    return model.posterior.to_arviz(None, keep.get("observed_data"), {}, groups=keep)


def compare_loo(entries: Sequence[tuple[str, Any, str | None]]) -> dict[str, Any]:
    """``az.compare`` of the posteriors `entries` (``(label, bound NumpyroModel, stage_dir)``) by PSIS-LOO:
    ``{"text", "rows", "warnings"}``. Each row holds ArviZ's columns (``rank``, ``elpd_loo``, ``p_loo``,
    ``elpd_diff``, ``weight``, ``se``, ``dse``) and ``pareto_k_max``, ``pareto_k_bad`` (observations above 0.7)
    and ``observations``; a model with bad Pareto-k values gets a warning line, as ArviZ warns."""
    from ._arviz import _arviz

    az = _arviz()
    if len(entries) < 2:
        raise PipekitError(f"compare --loo needs at least two models, got {len(entries)}")
    datas = {label: _idata(label, model, stage_dir) for label, model, stage_dir in entries}
    shapes = {label: {k: v.shape[2:] for k, v in d.log_likelihood.data_vars.items()} for label, d in datas.items()}
    if len({repr(sorted(s.items())) for s in shapes.values()}) > 1:
        raise PipekitError(
            "compare --loo needs the models' likelihoods over the same observations; their observed sites and "
            f"shapes differ: {shapes}"
        )
    notes: list[str] = []
    rows: dict[str, dict[str, float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ's own Pareto-k warnings: reported below, per model
        table = az.compare(datas, ic="loo")
        for label, data in datas.items():
            loo = az.loo(data, pointwise=True)
            k = np.asarray(loo.pareto_k).ravel()
            bad = int((k > PARETO_K_BAD).sum())
            row = {col: float(table.loc[label, col]) for col in ("rank", "elpd_loo", "p_loo", "elpd_diff", "weight")}
            row.update(se=float(table.loc[label, "se"]), dse=float(table.loc[label, "dse"]))
            row.update(pareto_k_max=float(k.max()), pareto_k_bad=float(bad), observations=float(k.size))
            rows[label] = row
            if bad:
                notes.append(
                    f"{label}: {bad} of {k.size} observations have Pareto k > {PARETO_K_BAD} (max {k.max():.2f}): "
                    "its PSIS-LOO estimate is unreliable; refit without them (exact LOO) or use K-fold CV"
                )
    shown = table.drop(columns=[c for c in ("warning", "scale") if c in table.columns])
    text = shown.to_string(float_format=lambda v: f"{v:.2f}")
    return {"text": text, "rows": rows, "warnings": notes}
