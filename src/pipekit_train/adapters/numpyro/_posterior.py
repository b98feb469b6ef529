"""Posterior diagnostics and the summary table: NumPyro's split R-hat and ESS (bulk ESS on rank-normalised
split chains, as in Vehtari et al. 2021), the metrics every sampler stage records, and the table it writes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

SUMMARY_TXT = "posterior_summary.txt"
SUMMARY_JSON = "posterior_summary.json"


def _rank_normalise(x: np.ndarray) -> np.ndarray:
    """Rank-normalised split chains, ``(2 * chains, draws // 2)``, of draws ``(chains, draws)``."""
    from scipy.special import ndtri
    from scipy.stats import rankdata

    n = x.shape[1]
    half = n // 2
    split = np.concatenate([x[:, :half], x[:, n - half :]], axis=0) if half >= 2 else x
    ranks = rankdata(split, method="average").reshape(split.shape)
    normalised: np.ndarray = ndtri((ranks - 0.375) / (split.size + 0.25))
    return normalised


def site_table(draws: Mapping[str, np.ndarray], prob: float = 0.9) -> list[dict[str, Any]]:
    """One row per scalar element of every site: mean, sd, quantiles, r_hat, ess_bulk (draws: (chains, n, ...))."""
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin

    lo, hi = (1 - prob) / 2, 1 - (1 - prob) / 2
    rows = []
    for site, value in draws.items():
        v = np.asarray(value, dtype=np.float64)
        if v.ndim < 2 or v.shape[1] < 4:
            continue
        flat = v.reshape(v.shape[0], v.shape[1], -1)
        for j in range(flat.shape[-1]):
            x = flat[:, :, j]
            name = site if flat.shape[-1] == 1 and v.ndim == 2 else f"{site}[{j}]"
            r_hat = float(split_gelman_rubin(x)) if x.shape[1] >= 4 else float("nan")
            ess = float(effective_sample_size(_rank_normalise(x))) if np.ptp(x) > 0 else float("nan")
            rows.append(
                {
                    "site": name,
                    "mean": float(x.mean()),
                    "sd": float(x.std(ddof=1)),
                    f"{lo:.0%}": float(np.quantile(x, lo)),
                    "50%": float(np.quantile(x, 0.5)),
                    f"{hi:.0%}": float(np.quantile(x, hi)),
                    "ess_bulk": ess,
                    "r_hat": r_hat,
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
            cells.append(f"{r[c]:11.1f}" if c == "ess_bulk" else f"{r[c]:11.3f}")
        lines.append(r["site"].ljust(width) + "".join(cells))
    return "\n".join(lines) + "\n"


def metrics_of(rows: list[dict[str, Any]], divergences: int) -> dict[str, float]:
    """The artifact's posterior metrics: ``posterior/r_hat_max``, ``posterior/ess_bulk_min``, ``divergences``."""
    r_hats = [r["r_hat"] for r in rows if np.isfinite(r["r_hat"])]
    esses = [r["ess_bulk"] for r in rows if np.isfinite(r["ess_bulk"])]
    return {
        "posterior/r_hat_max": float(max(r_hats)) if r_hats else float("nan"),
        "posterior/ess_bulk_min": float(min(esses)) if esses else float("nan"),
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
