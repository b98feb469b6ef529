"""Built-in NumPyro models: the textbook examples the docs, the examples and the tests use."""

from __future__ import annotations

from typing import Any

from ._registry import register_numpyro_model


@register_numpyro_model("eight_schools", observed=("y",))
def eight_schools(sigma: Any, y: Any = None) -> None:
    """Rubin's eight schools, non-centered: ``y_j ~ Normal(mu + tau * theta_j, sigma_j)``."""
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("schools", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(mu + tau * theta, sigma), obs=y)


@register_numpyro_model("conjugate_normal", observed=("y",))
def conjugate_normal(y: Any = None, prior_mu: float = 0.0, prior_sd: float = 1.0, noise_sd: float = 1.0) -> None:
    """``mu ~ Normal(prior_mu, prior_sd)``, ``y_i ~ Normal(mu, noise_sd)``: the posterior of `mu` is analytic."""
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(prior_mu, prior_sd))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, noise_sd), obs=y)


@register_numpyro_model("linear_regression", observed=("y",))
def linear_regression(x: Any, y: Any = None, prior_sd: float = 1.0) -> None:
    """``y ~ Normal(x @ w + b, sigma)`` with ``w, b ~ Normal(0, prior_sd)``, ``sigma ~ HalfNormal(1)``."""
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, prior_sd).expand([x.shape[-1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, prior_sd))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, sigma), obs=None if y is None else y.reshape(-1))


@register_numpyro_model("logistic_regression", observed=("y",))
def logistic_regression(x: Any, y: Any = None, prior_sd: float = 1.0) -> None:
    """``y ~ Bernoulli(logits=x @ w + b)`` with ``w, b ~ Normal(0, prior_sd)``."""
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, prior_sd).expand([x.shape[-1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, prior_sd))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=None if y is None else y.reshape(-1))


# Eight schools as Stan writes it: data ``J``, ``y``, ``sigma`` (posteriordb's ``eight_schools.json``) --------
@register_numpyro_model("eight_schools_centered", observed=("y",))
def eight_schools_centered(J: int, sigma: Any, y: Any = None) -> None:
    """Stan's centered eight schools: ``theta_j ~ Normal(mu, tau)``, ``y_j ~ Normal(theta_j, sigma_j)``."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", J):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(theta, jnp.asarray(sigma, jnp.result_type(float))), obs=y)


@register_numpyro_model("eight_schools_noncentered", observed=("y",))
def eight_schools_noncentered(J: int, sigma: Any, y: Any = None) -> None:
    """Stan's non-centered eight schools: ``theta_tilde_j ~ Normal(0, 1)``, ``theta = mu + tau * theta_tilde``
    (a deterministic site), ``y_j ~ Normal(theta_j, sigma_j)``."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", J):
        theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        theta = numpyro.deterministic("theta", mu + tau * theta_tilde)
        numpyro.sample("y", dist.Normal(theta, jnp.asarray(sigma, jnp.result_type(float))), obs=y)
