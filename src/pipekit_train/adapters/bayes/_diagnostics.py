"""Convergence diagnostics of MCMC draws as ArviZ computes them, in NumPy (and SciPy, which both sampler extras
install): rank-normalised split R-hat (``az.rhat(method="rank")``), bulk ESS and tail ESS (``az.ess(method="bulk")``,
``method="tail"``), following Vehtari et al. (2021). ArviZ itself is not needed to compute them: ``until`` checks
them between chunks, and the posterior summary reports them; tests compare them with ArviZ's own.

Every function takes draws ``(chains, draws)`` of one scalar, or ``(chains, draws, k)`` of ``k`` scalars at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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


def _column_ranks(flat: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """For every column of ``(n, k)``: its average ranks, as ``scipy.stats.rankdata(method="average")`` computes
    them (the same algorithm: ties get the mean of their ranks, exact in float64, so the same numbers), and, when
    the column has no ties, the permutation that sorts it (its ranks are then the positions ``1..n``). Each
    column is sorted as a contiguous row: an ``axis=0`` sort of the strided columns took 25x longer."""
    n, k = flat.shape
    rows = np.ascontiguousarray(flat.T)
    first = np.empty(n, bool)
    first[0] = True
    for j in range(k):
        order = np.argsort(rows[j])
        xs = rows[j][order]
        np.not_equal(xs[1:], xs[:-1], out=first[1:])
        ranks = np.empty(n, np.float64)
        if first.all():  # no ties (continuous draws)
            ranks[order] = np.arange(1.0, n + 1.0)
            yield ranks, order
            continue
        dense = np.cumsum(first)
        bounds = np.r_[np.flatnonzero(first), n]
        ranks[order] = 0.5 * (bounds[dense] + bounds[dense - 1] + 1)
        yield ranks, None


def _z_scale(x: np.ndarray) -> np.ndarray:
    """Rank-normalised values: average ranks over all chains and draws (per column), Blom's back-transform. A
    column without ties has the ranks ``1..n`` in some order, so its values are one table's, computed once."""
    from scipy.special import ndtri

    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    out = np.empty(flat.shape[::-1], np.float64)
    table = None
    for j, (ranks, order) in enumerate(_column_ranks(flat)):
        if order is None:
            out[j] = ndtri((ranks - 0.375) / (n + 0.25))
            continue
        if table is None:
            table = ndtri((np.arange(1.0, n + 1.0) - 0.375) / (n + 0.25))
        out[j, order] = table
    return out.T.reshape(x.shape)


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
    from scipy.fft import irfft, next_fast_len, rfft

    n = x.shape[1]
    m = next_fast_len(2 * n)
    rows = np.ascontiguousarray(np.moveaxis(x, 1, -1))  # (chains, k, draws): each FFT over contiguous memory
    centred = rows - rows.mean(axis=-1, keepdims=True)
    f = rfft(centred, n=m, axis=-1)  # SciPy's: the same numbers as NumPy's, in less time
    f *= np.conjugate(f)
    out: np.ndarray = np.moveaxis(irfft(f, n=m, axis=-1)[..., :n] / n, -1, 1)
    return out


def _ess_one(acov_mean: np.ndarray, chain_var: float, n_chain: int, n_draw: int) -> float:
    """ArviZ's ``_ess`` of one column from the chains' mean autocovariance at every lag: Geyer's initial positive
    and initial monotone sequences. ArviZ walks the lags in Python; this is the same arithmetic on arrays (every
    autocorrelation, pair sum and comparison the same numbers in the same order), so the same result, bit for bit.
    """
    mean_var = acov_mean[0] * n_draw / (n_draw - 1.0)
    var_plus = mean_var * (n_draw - 1.0) / n_draw
    if n_chain > 1:
        var_plus += chain_var
    r = 1.0 - (mean_var - acov_mean) / var_plus  # the autocorrelation at every lag
    rho = np.zeros(n_draw)
    rho[0], rho[1] = 1.0, r[1]
    # Initial positive sequence: the pairs (t + 1, t + 2), t = 1, 3, ... below n_draw - 3, while the previous pair's
    # sum (the first: 1 + rho[1]) is positive; a pair is kept when its sum is >= 0.
    ts = np.arange(1, n_draw - 3, 2)
    sums = r[ts + 1] + r[ts + 2]
    going = np.concatenate([[1.0 + r[1]], sums[:-1]]) > 0 if ts.size else np.zeros(0, bool)
    taken = int(np.argmin(going)) if ts.size and not going.all() else ts.size
    rho_even = 1.0
    max_t = -1
    if taken:
        pairs = ts[:taken]
        keep = pairs[sums[:taken] >= 0]
        rho[keep + 1], rho[keep + 2] = r[keep + 1], r[keep + 2]
        max_t = int(pairs[-1])
        rho_even = r[max_t + 1]
    if rho_even > 0:
        rho[max_t + 1] = rho_even
    # Initial monotone sequence: a pair whose sum exceeds the previous pair's becomes that sum's halves, so the pair
    # sums are their running minimum (x / 2 + x / 2 == x: the halves sum to it exactly).
    if max_t >= 3:
        q = rho[0 : max_t + 1 : 2] + rho[1 : max_t + 1 : 2]
        floor = np.minimum.accumulate(q)
        up = np.flatnonzero(q[1:] > floor[:-1]) + 1
        rho[2 * up] = rho[2 * up + 1] = floor[up - 1] / 2.0
    ess = n_chain * n_draw
    head = rho[: max_t + 2]
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
            out[j] = _ess_one(acov_mean[:, j], float(chain_var[j]), n_chain, n_draw)
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
    return evaluate(draws, {}, every=True)[1]


def meets(draws: Mapping[str, np.ndarray], until: Mapping[str, Any]) -> bool:
    """Whether `draws` meet every criterion of a kernel's ``until`` (the same values as `diagnostics`)."""
    return evaluate(draws, until)[0]


#: The order `evaluate` checks the criteria in: bulk ESS (its rank-normalised split chains are R-hat's too), R-hat,
#: then tail ESS (the dearest: two autocovariances).
_ORDER = ("ess_bulk_min", "r_hat_max", "ess_tail_min")


def evaluate(
    draws: Mapping[str, np.ndarray], until: Mapping[str, Any], *, every: bool = False
) -> tuple[bool, dict[str, float]]:
    """Whether `draws` meet every criterion of a kernel's ``until``, and the values computed: the criteria given,
    in `_ORDER`, up to the first that fails; all three (`diagnostics`) when every criterion is met or with
    `every`. One ranking of the draws serves all of them."""
    nan = float("nan")
    cols = [_columns(v) for v in draws.values() if np.ndim(v) >= 2]
    if not cols or cols[0].shape[1] < 4:
        return False, dict.fromkeys(("r_hat_max", "ess_bulk_min", "ess_tail_min"), nan)
    x = np.concatenate(cols, axis=-1)
    split = _split(x)
    z = _z_scale(split)

    def value(name: str) -> float:
        if name == "ess_bulk_min":
            return _worst(_ess(z), np.min)
        if name == "r_hat_max":
            return _worst(_r_hat_split(split, z), np.max) if x.shape[0] >= 2 else nan
        return _worst(ess_tail(x), np.min)

    values: dict[str, float] = {}
    met = True
    for name in (n for n in _ORDER if n in until):
        values[name] = value(name)
        bound = until[name]
        if not (values[name] <= bound if name == "r_hat_max" else values[name] >= bound):  # NaN fails
            met = False
            break
    if met or every:
        values.update({name: value(name) for name in _ORDER if name not in values})
    return met, {name: values[name] for name in ("r_hat_max", "ess_bulk_min", "ess_tail_min") if name in values}
