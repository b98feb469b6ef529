"""What a sampler stage records of its model besides the draws, for model comparison and predictive checks: the
observed sites' values, the pointwise log-likelihood of the observed sites at every draw, and posterior and prior
predictive draws, each ``(chains, draws, *site_shape)`` by site name, as ArviZ's groups hold them.

The observed data are the observed *sites*' values (what the likelihood covers: ``log_earn`` for a model that
observes ``log(earn)``, ``y[5:]`` for one whose likelihood covers ``y[5:]``), read from one trace of the model, not
the model's arguments. The log-likelihood is NumPyro's own ``numpyro.infer.log_likelihood`` on the draws; the
predictive draws are ``numpyro.infer.Predictive``'s with the observed arguments set to ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["log_likelihood", "observed_sites", "predictive_for", "predictive_groups", "stage_groups"]


def _observed(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every observed site's value, by name, of one trace of `fn` on `kwargs` (latent sites at NumPyro's
    ``init_to_uniform`` values: observations do not depend on them)."""
    import jax
    from numpyro import handlers
    from numpyro.infer import init_to_uniform

    with handlers.block():
        seeded = handlers.substitute(handlers.seed(fn, jax.random.PRNGKey(0)), substitute_fn=init_to_uniform)
        trace = handlers.trace(seeded).get_trace(**kwargs)
    return {n: s["value"] for n, s in trace.items() if s["type"] == "sample" and s.get("is_observed")}


def observed_sites(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The value of every observed site of `fn` run on `kwargs`, by site name (one compiled trace)."""
    import jax

    return {k: np.asarray(v) for k, v in jax.device_get(jax.jit(lambda: _observed(fn, kwargs))()).items()}


def log_likelihood(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], draws: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``numpyro.infer.log_likelihood`` of every observed site at each draw: ``(chains, draws, *site_shape)``.
    Run as NumPyro runs it (not compiled as one program, which XLA may fuse into different last bits)."""
    import jax
    from numpyro.infer import log_likelihood as numpyro_log_likelihood

    out = numpyro_log_likelihood(fn, dict(draws), batch_ndims=2, **kwargs)
    return {k: np.asarray(v) for k, v in jax.device_get(out).items()}


def _unobserved(kwargs: Mapping[str, Any], observed_params: tuple[str, ...]) -> dict[str, Any]:
    """`kwargs` with the parameters that carry observations set to ``None`` (the model then samples them)."""
    return {**kwargs, **dict.fromkeys(observed_params)}


#: The compiled predictive programs (`_call`), by what they specialise on; bounded, oldest dropped first.
_PROGRAMS: dict[tuple[Any, ...], Any] = {}  # False: the model's arrays cannot be arguments
_KEEP = 16


def _arrays_apart(kwargs: Mapping[str, Any]) -> tuple[tuple[tuple[str, Any], ...], dict[str, Any]] | None:
    """A model's arguments as (the rest, hashable, by name; the arrays), so that a compiled program takes the data
    as arguments and serves every stage of the model; ``None`` when the rest cannot be a cache key."""
    import jax

    arrays = {k: v for k, v in kwargs.items() if isinstance(v, (np.ndarray, jax.Array)) and np.ndim(v) > 0}
    rest = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    try:
        hash(rest)
    except TypeError:
        return None
    return rest, arrays


def _call(kind: Any, fn: Callable[..., Any], kwargs: Mapping[str, Any], body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args, kwargs)`` compiled, the program reused by every stage of the same model and arguments but the
    arrays' values: one built per call (a closure over the data) compiled again at every finished stage, an
    extended one included (`make bench` row 10).

    The data go in as arguments rather than constants of the program. A model that cannot be traced so (it reads an
    array's value: a size taken from the data) is compiled as a closure over its arguments, as before, and that
    closure's outcome is the call's: a model that fails fails as it did, with the closure's error."""
    import jax

    apart = _arrays_apart(kwargs)
    if apart is not None:
        rest, arrays = apart
        key = (kind, fn, rest, tuple(sorted(arrays)))
        jitted = _PROGRAMS.get(key)
        if jitted is None:
            fixed = dict(rest)
            jitted = jax.jit(lambda *a: body(*a[:-1], {**fixed, **a[-1]}))
        if jitted is not False:
            try:
                out = jitted(*args, arrays)
            except Exception:  # reading a traced value, or any other failure: the closure decides
                _PROGRAMS[key] = False  # a closure over its arguments for this model from now on, as before
            else:
                if len(_PROGRAMS) >= _KEEP and key not in _PROGRAMS:
                    del _PROGRAMS[next(iter(_PROGRAMS))]  # the oldest
                _PROGRAMS[key] = jitted
                return out
    return jax.jit(lambda *a: body(*a, kwargs))(*args)


def predictive_groups(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    draws: Mapping[str, np.ndarray] | None,
    num_prior: int,
    observed_params: tuple[str, ...],
    seed: int,
) -> dict[str, dict[str, np.ndarray]]:
    """In one compiled program: ``observed_data`` (the observed sites' values), with `draws` (``(chains, draws,
    ...)``) ``posterior_predictive`` (the observed sites given each draw), and with `num_prior` ``prior`` and
    ``prior_predictive`` (that many draws from the prior, as one chain: ``(1, num_prior, ...)``). The predictive
    draws run the model on `kwargs` with its observed arguments (`observed_params`) set to ``None``."""
    import jax
    from numpyro.infer import Predictive

    def run(key: Any, draws: dict[str, Any] | None, kwargs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        given = _unobserved(kwargs, observed_params)
        observed = _observed(fn, kwargs)
        sites = list(observed)
        out: dict[str, dict[str, Any]] = {"observed_data": observed}
        k_post, k_prior = jax.random.split(key)
        if draws is not None:
            pred = Predictive(fn, posterior_samples=draws, batch_ndims=2, return_sites=sites)
            out["posterior_predictive"] = pred(k_post, **given)
        if num_prior:
            prior = Predictive(fn, num_samples=num_prior)(k_prior, **given)
            out["prior"] = {k: v[None] for k, v in prior.items() if k not in sites}
            out["prior_predictive"] = {k: v[None] for k, v in prior.items() if k in sites}
        return out

    kind = ("groups", num_prior, observed_params)
    out = jax.device_get(
        _call(kind, fn, kwargs, run, jax.random.PRNGKey(seed), dict(draws) if draws is not None else None)
    )
    return {group: {k: np.asarray(v) for k, v in values.items()} for group, values in out.items()}


def predictive_for(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    draws: Mapping[str, np.ndarray],
    observed_params: tuple[str, ...],
    seed: int,
) -> dict[str, dict[str, np.ndarray]]:
    """For new data `kwargs`: ``posterior_predictive``, draws of every site the posterior `draws` do not hold
    (the observed sites, sampled: the observed arguments unset) given each draw, in one compiled program; and
    ``observed_data`` when `kwargs` gives every observed argument (the observed sites' values)."""
    import jax
    from numpyro.infer import Predictive

    def run(key: Any, draws: dict[str, Any], kwargs: Mapping[str, Any]) -> Any:
        return Predictive(fn, posterior_samples=draws, batch_ndims=2)(key, **_unobserved(kwargs, observed_params))

    out = jax.device_get(_call(("for", observed_params), fn, kwargs, run, jax.random.PRNGKey(seed), dict(draws)))
    # What the draws hold (deterministic sites, recomputed) is the posterior's, not a prediction.
    groups = {"posterior_predictive": {k: np.asarray(v) for k, v in out.items() if k not in draws}}
    if all(kwargs.get(p) is not None for p in observed_params):
        groups["observed_data"] = observed_sites(fn, kwargs)
    return groups


def stage_groups(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    draws: Mapping[str, np.ndarray],
    kernel: Any,
    observed_params: tuple[str, ...],
    seed: int,
) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
    """The groups a finished sampler stage records beside its draws, as `kernel` asks (``log_likelihood``,
    ``posterior_predictive``, ``prior_predictive``), and a note for each one the model could not give (a model
    that cannot run with its observations unset has no predictive draws; the stage does not fail for it)."""
    from ._data import describe_error

    notes: list[str] = []
    post = draws if kernel.posterior_predictive and draws else None
    try:
        groups = predictive_groups(fn, kwargs, post, kernel.prior_predictive, observed_params, seed)
    except Exception as e:  # the model needs its observations to run (e.g. it transforms them)
        if post is None and not kernel.prior_predictive:
            raise
        notes.append(
            f"predictive draws not recorded: the model failed with its observations unset: {describe_error(e)}"
        )
        groups = {"observed_data": observed_sites(fn, kwargs)}
    if kernel.log_likelihood and draws:
        groups["log_likelihood"] = log_likelihood(fn, kwargs, draws)
    return groups, notes
