"""Posterior diagnostics and the summary table: ArviZ's rank-normalised split R-hat, bulk and tail ESS (Vehtari et
al. 2021; computed in NumPy by `_diagnostics`), the metrics every sampler stage records, the table it writes, and
the file of the groups an ArviZ export adds to the posterior (sample statistics, observed data)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

SUMMARY_TXT = "posterior_summary.txt"
SUMMARY_JSON = "posterior_summary.json"


def site_table(draws: Mapping[str, np.ndarray], prob: float = 0.9) -> list[dict[str, Any]]:
    """One row per scalar element of every site: mean, sd, quantiles, ess_bulk, ess_tail, r_hat (draws:
    ``(chains, n, ...)``); the diagnostics are ArviZ's (`_diagnostics`: rank-normalised split R-hat, NaN for one
    chain; bulk and tail ESS), so ``az.summary`` of the exported file gives the same numbers."""
    from ._diagnostics import ess_bulk, ess_tail, r_hat

    lo, hi = (1 - prob) / 2, 1 - (1 - prob) / 2
    rows = []
    for site, value in draws.items():
        raw = np.asarray(value)
        v = raw.astype(np.float64)
        if v.ndim < 2 or v.shape[1] < 4:
            continue
        flat = v.reshape(v.shape[0], v.shape[1], -1)
        as_sampled = raw.reshape(flat.shape)  # the diagnostics in the draws' dtype, as ArviZ computes them
        rhat, bulk, tail = r_hat(as_sampled), ess_bulk(as_sampled), ess_tail(as_sampled)
        for j in range(flat.shape[-1]):
            x = flat[:, :, j]
            name = site if flat.shape[-1] == 1 and v.ndim == 2 else f"{site}[{j}]"
            rows.append(
                {
                    "site": name,
                    "mean": float(x.mean()),
                    "sd": float(x.std(ddof=1)),
                    f"{lo:.0%}": float(np.quantile(x, lo)),
                    "50%": float(np.quantile(x, 0.5)),
                    f"{hi:.0%}": float(np.quantile(x, hi)),
                    "ess_bulk": float(np.asarray(bulk)[j]),
                    "ess_tail": float(np.asarray(tail)[j]),
                    "r_hat": float(np.asarray(rhat)[j]),
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    if not rows:
        return f"{title}: no draws\n"
    cols = [c for c in rows[0] if c != "site"]
    width = max(12, *(len(r["site"]) for r in rows)) + 2
    lines = [title, "site".ljust(width) + "".join(c.rjust(11) for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            cells.append(f"{r[c]:11.1f}" if c.startswith("ess_") else f"{r[c]:11.3f}")
        lines.append(r["site"].ljust(width) + "".join(cells))
    return "\n".join(lines) + "\n"


def metrics_of(rows: list[dict[str, Any]], divergences: int) -> dict[str, float]:
    """The artifact's posterior metrics: ``posterior/r_hat_max``, ``ess_bulk_min``, ``ess_tail_min``,
    ``divergences``."""
    r_hats = [r["r_hat"] for r in rows if np.isfinite(r["r_hat"])]
    esses = [r["ess_bulk"] for r in rows if np.isfinite(r["ess_bulk"])]
    tails = [r["ess_tail"] for r in rows if np.isfinite(r["ess_tail"])]
    return {
        "posterior/r_hat_max": float(max(r_hats)) if r_hats else float("nan"),
        "posterior/ess_bulk_min": float(min(esses)) if esses else float("nan"),
        "posterior/ess_tail_min": float(min(tails)) if tails else float("nan"),
        "posterior/divergences": float(divergences),
    }


def report(
    draws: Mapping[str, np.ndarray], divergences: int, stage: str, stage_dir: str | None, show: bool = True
) -> dict[str, float]:
    """Diagnostics of `draws`: the summary written to the stage directory (and printed), and the metrics."""
    rows = site_table(draws)
    text = format_table(rows, f"posterior of stage {stage!r} ({divergences} divergences after warm-up)")
    if stage_dir:
        os.makedirs(stage_dir, exist_ok=True)
        with open(os.path.join(stage_dir, SUMMARY_TXT), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(stage_dir, SUMMARY_JSON), "w", encoding="utf-8") as f:
            json.dump({"sites": rows, "divergences": divergences}, f, indent=1, allow_nan=True)
    if show:
        print(text, end="", flush=True)
    return metrics_of(rows, divergences)


GROUPS_NPZ = "posterior_groups.npz"


def write_groups(stage_dir: str, groups: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """``posterior_groups.npz`` in the stage directory: ``<group>/<name>`` for every group an ArviZ export adds
    to the registered draws (``sample_stats``, ``observed_data``, ``log_likelihood``, ``posterior_predictive``,
    ``prior``, ``prior_predictive``), each array ``(chains, draws, ...)`` (observed data as observed)."""
    arrays = {f"{group}/{k}": np.asarray(v) for group, values in groups.items() for k, v in values.items()}
    os.makedirs(stage_dir, exist_ok=True)
    tmp = os.path.join(stage_dir, GROUPS_NPZ + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy stubs take allow_pickle for a key
    os.replace(tmp, os.path.join(stage_dir, GROUPS_NPZ))


def read_groups(stage_dir: str) -> dict[str, dict[str, np.ndarray]]:
    """The groups `write_groups` wrote (``sample_stats`` and ``observed_data`` empty when the file is not there)."""
    out: dict[str, dict[str, np.ndarray]] = {"sample_stats": {}, "observed_data": {}}
    path = os.path.join(stage_dir, GROUPS_NPZ)
    if not os.path.exists(path):
        return out
    with np.load(path, allow_pickle=False) as z:
        for key in z.files:
            group, name = key.split("/", 1)
            out.setdefault(group, {})[name] = z[key]
    return out
