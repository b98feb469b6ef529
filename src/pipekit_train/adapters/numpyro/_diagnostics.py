"""Convergence diagnostics of MCMC draws as ArviZ computes them, in NumPy (and SciPy, which both sampler extras
install): rank-normalised split R-hat (``az.rhat(method="rank")``), bulk ESS and tail ESS (``az.ess(method="bulk")``,
``method="tail"``), following Vehtari et al. (2021). ArviZ itself is not needed to compute them: ``until`` checks
them between chunks, and the posterior summary reports them; tests compare them with ArviZ's own.

Every function takes draws ``(chains, draws)`` of one scalar, or ``(chains, draws, k)`` of ``k`` scalars at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["diagnostics", "ess_bulk", "ess_tail", "r_hat"]


def load_scipy() -> None:
    """Import what the diagnostics use (the first import takes about a second)."""
    import scipy.fft
    import scipy.special
    import scipy.stats  # noqa: F401


def _columns(x: Any) -> np.ndarray:
    """`x` as ``(chains, draws, k)``; floating draws keep their dtype, as in ArviZ (the tail R-hat folds float32
    draws in float32, and the fold's ties decide its ranks)."""
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    return a[..., None] if a.ndim == 2 else a.reshape(a.shape[0], a.shape[1], -1)


def _split(x: np.ndarray) -> np.ndarray:
    """ArviZ's ``_split_chains``: the first and the last half of every chain as chains of their own."""
    half = x.shape[1] // 2
    return np.concatenate([x[:, :half], x[:, x.shape[1] - half :]], axis=0)


def _average_ranks(flat: np.ndarray) -> np.ndarray:
    """``scipy.stats.rankdata(method="average")`` of every column of ``(n, k)`` (the same algorithm: ties get the
    mean of their ranks, which are exact in float64, so the ranks are the same numbers). Each column is sorted as
    a contiguous row: an ``axis=0`` sort of the strided columns took 25x longer."""
    n, k = flat.shape
    ranks = np.empty((k, n), np.float64)
    rows = np.ascontiguousarray(flat.T)
    for j in range(k):
        order = np.argsort(rows[j])
        xs = rows[j][order]
        first = np.empty(n, bool)
        first[0] = True
        np.not_equal(xs[1:], xs[:-1], out=first[1:])
        dense = np.cumsum(first)
        bounds = np.r_[np.flatnonzero(first), n]
        ranks[j, order] = 0.5 * (bounds[dense] + bounds[dense - 1] + 1)
    return ranks.T


def _z_scale(x: np.ndarray) -> np.ndarray:
    """Rank-normalised values: average ranks over all chains and draws (per column), Blom's back-transform."""
    from scipy.special import ndtri

    flat = x.reshape(-1, x.shape[-1])
    out: np.ndarray = ndtri((_average_ranks(flat) - 0.375) / (flat.shape[0] + 0.25))
    return out.reshape(x.shape)


def _rhat_plain(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    n = x.shape[1]
    between = n * np.var(x.mean(axis=1), axis=0, ddof=1)
    within = np.mean(np.var(x, axis=1, ddof=1), axis=0)
    out: np.ndarray = np.sqrt((between / within + n - 1) / n)
    return out


def r_hat(x: Any) -> np.ndarray | float:
    """Rank-normalised split R-hat: the larger of the bulk (z-scaled) and the tail (folded, z-scaled) R-hat;
    NaN with one chain or fewer than 4 draws (as ArviZ)."""
    a = _columns(x)
    if a.shape[0] < 2 or a.shape[1] < 4:
        return _shaped(np.full(a.shape[-1], np.nan), x)
    split = _split(a)
    return _shaped(_r_hat_split(split, _z_scale(split)), x)


def _r_hat_split(split: np.ndarray, z: np.ndarray) -> np.ndarray:
    """R-hat of split chains `split` whose rank-normalised values are `z`."""
    bulk = _rhat_plain(z)
    folded = np.abs(split - np.median(split.reshape(-1, split.shape[-1]), axis=0))
    tail = _rhat_plain(_z_scale(folded))
    out: np.ndarray = np.maximum(bulk, tail)
    return out


def _autocov(x: np.ndarray) -> np.ndarray:
    """Autocovariance of every chain at every lag (ArviZ's FFT estimate), ``(chains, draws, k)``."""
    from scipy.fft import next_fast_len

    n = x.shape[1]
    m = next_fast_len(2 * n)
    rows = np.ascontiguousarray(np.moveaxis(x, 1, -1))  # (chains, k, draws): each FFT over contiguous memory
    centred = rows - rows.mean(axis=-1, keepdims=True)
    f = np.fft.rfft(centred, n=m, axis=-1)
    f *= np.conjugate(f)
    out: np.ndarray = np.moveaxis(np.fft.irfft(f, n=m, axis=-1)[..., :n] / n, -1, 1)
    return out


def _ess_one(acov_mean: list[float], chain_var: float, n_chain: int, n_draw: int) -> float:
    """ArviZ's ``_ess`` of one column from the chains' mean autocovariance at every lag: Geyer's initial positive
    and initial monotone sequences."""
    mean_var = acov_mean[0] * n_draw / (n_draw - 1.0)
    var_plus = mean_var * (n_draw - 1.0) / n_draw
    if n_chain > 1:
        var_plus += chain_var
    rho = [0.0] * n_draw
    rho_even = 1.0
    rho[0] = rho_even
    rho_odd = 1.0 - (mean_var - acov_mean[1]) / var_plus
    rho[1] = rho_odd
    t = 1
    while t < (n_draw - 3) and (rho_even + rho_odd) > 0.0:
        rho_even = 1.0 - (mean_var - acov_mean[t + 1]) / var_plus
        rho_odd = 1.0 - (mean_var - acov_mean[t + 2]) / var_plus
        if (rho_even + rho_odd) >= 0:
            rho[t + 1] = rho_even
            rho[t + 2] = rho_odd
        t += 2
    max_t = t - 2
    if rho_even > 0:
        rho[max_t + 1] = rho_even
    t = 1
    while t <= max_t - 2:
        if (rho[t + 1] + rho[t + 2]) > (rho[t - 1] + rho[t]):
            rho[t + 1] = (rho[t - 1] + rho[t]) / 2.0
            rho[t + 2] = rho[t + 1]
        t += 2
    ess = n_chain * n_draw
    head = np.asarray(rho[: max_t + 2], dtype=np.float64)
    tau = -1.0 + 2.0 * np.sum(head[: max_t + 1]) + np.sum(head[max_t + 1 : max_t + 2])
    tau = max(tau, 1 / np.log10(ess))
    return float("nan") if np.isnan(head).any() else float(ess / tau)


def _ess(x: np.ndarray) -> np.ndarray:
    """ArviZ's ``_ess`` of every column of ``(chains, draws, k)`` (a constant column: its number of values)."""
    x = x.astype(np.float64)
    n_chain, n_draw, k = x.shape
    acov = _autocov(x)
    acov_mean = acov.mean(axis=0)  # (draws, k): the mean over chains of every lag
    chain_var = np.var(x.mean(axis=1), axis=0, ddof=1) if n_chain > 1 else np.zeros(k)
    lo, hi = x.min(axis=(0, 1)), x.max(axis=(0, 1))
    nan = np.isnan(x).any(axis=(0, 1))
    out = np.empty(k)
    for j in range(k):
        if nan[j]:
            out[j] = np.nan
        elif hi[j] - lo[j] < np.finfo(float).resolution:
            out[j] = n_chain * n_draw
        else:
            out[j] = _ess_one(acov_mean[:, j].tolist(), float(chain_var[j]), n_chain, n_draw)
    return out


def ess_bulk(x: Any) -> np.ndarray | float:
    """Bulk ESS: the ESS of the rank-normalised split chains (NaN below 4 draws)."""
    a = _columns(x)
    if a.shape[1] < 4:
        return _shaped(np.full(a.shape[-1], np.nan), x)
    return _shaped(_ess(_z_scale(_split(a))), x)


def ess_tail(x: Any, prob: tuple[float, float] = (0.05, 0.95)) -> np.ndarray | float:
    """Tail ESS: the smaller ESS of the indicators ``x <= q05`` and ``x <= q95`` on split chains."""
    a = _columns(x)
    if a.shape[1] < 4:
        return _shaped(np.full(a.shape[-1], np.nan), x)
    flat = np.sort(np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T), axis=1).T
    out = None
    for p in prob:
        q = _type7(flat, p)
        e = _ess(_split((a <= q).astype(np.float64)))
        out = e if out is None else np.minimum(out, e)
    assert out is not None
    out = np.where(np.isnan(a).any(axis=(0, 1)), np.nan, out)  # ArviZ: NaN in, NaN out
    return _shaped(out, x)


def _type7(xs: np.ndarray, p: float) -> np.ndarray:
    """ArviZ's quantile, ``scipy.stats.mstats.mquantiles(alphap=1, betap=1)``, of sorted columns ``(n, k)``: the
    same arithmetic (R's type 7), in the same order."""
    n = xs.shape[0]
    if n == 1:
        first: np.ndarray = xs[0].astype(np.float64)
        return first
    pp = np.asarray([p], dtype=np.float64)
    aleph = n * pp + (1.0 + pp * (1.0 - 1.0 - 1.0))
    k = np.floor(aleph.clip(1, n - 1)).astype(int)
    gamma = (aleph - k).clip(0, 1)
    out: np.ndarray = (1.0 - gamma) * xs[k - 1] + gamma * xs[k]
    return out.reshape(-1)


def _shaped(values: np.ndarray, x: Any) -> np.ndarray | float:
    return float(values[0]) if np.ndim(x) == 2 else values.reshape(np.shape(x)[2:])


def _worst(values: Any, pick: Any) -> float:
    """`pick` (max or min) of the finite values; NaN when there is none."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(pick(v)) if v.size else float("nan")


def diagnostics(draws: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The worst of every scalar over every site of `draws` (``(chains, draws, ...)`` by site): the largest R-hat,
    the smallest bulk and tail ESS. NaNs are left out; a statistic with no finite value is NaN."""
    cols = [_columns(v) for v in draws.values() if np.ndim(v) >= 2]
    if not cols:
        return {"r_hat_max": float("nan"), "ess_bulk_min": float("nan"), "ess_tail_min": float("nan")}
    x = np.concatenate(cols, axis=-1)

    if x.shape[1] < 4:
        return {"r_hat_max": float("nan"), "ess_bulk_min": float("nan"), "ess_tail_min": float("nan")}
    split = _split(x)
    z = _z_scale(split)  # shared by R-hat and bulk ESS
    rhat = _r_hat_split(split, z) if x.shape[0] >= 2 else np.full(x.shape[-1], np.nan)
    return {
        "r_hat_max": _worst(rhat, np.max),
        "ess_bulk_min": _worst(_ess(z), np.min),
        "ess_tail_min": _worst(ess_tail(x), np.min),
    }


def meets(draws: Mapping[str, np.ndarray], until: Mapping[str, Any]) -> bool:
    """Whether `draws` meet every criterion of a kernel's ``until`` (the same values as `diagnostics`), computing
    only the criteria given and stopping at the first one that fails: bulk ESS (which shares its rank-normalised
    split chains with R-hat), then R-hat, then tail ESS (the dearest: two autocovariances)."""
    cols = [_columns(v) for v in draws.values() if np.ndim(v) >= 2]
    if not cols or cols[0].shape[1] < 4:
        return False
    x = np.concatenate(cols, axis=-1)
    split = _split(x)
    z = _z_scale(split)

    if "ess_bulk_min" in until and not _worst(_ess(z), np.min) >= until["ess_bulk_min"]:
        return False
    rhat_fails = "r_hat_max" in until and (
        x.shape[0] < 2 or not _worst(_r_hat_split(split, z), np.max) <= until["r_hat_max"]
    )
    if rhat_fails:
        return False
    return not ("ess_tail_min" in until and not _worst(ess_tail(x), np.min) >= until["ess_tail_min"])
