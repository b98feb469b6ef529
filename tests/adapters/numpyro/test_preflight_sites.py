"""A sampler or SVI stage's pre-flight reads the model's sites from an abstract trace: it compiles nothing, and it
still refuses what it refused when it ran the model eagerly (see `_data.check_sites`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train.adapters.bayes import check_sites
from pipekit_train.adapters.numpyro import NumpyroModel, register_numpyro_model
from pipekit_train.tracking._progress import CompileWatch

from .conftest import SIGMA, Y8


@register_numpyro_model("test_sites_discrete", observed=("y",))
def _discrete(y: Any = None) -> None:
    import numpyro
    import numpyro.distributions as dist

    k = numpyro.sample("k", dist.Bernoulli(0.5))
    numpyro.sample("y", dist.Normal(k, 1.0), obs=y)


@register_numpyro_model("test_sites_concrete", observed=("y",))
def _concrete(y: Any = None) -> None:
    """Python control flow on the data: an abstract trace cannot run it, an eager one can."""
    import numpyro
    import numpyro.distributions as dist

    scale = 2.0 if float(np.asarray(y).mean()) > 0 else 1.0
    mu = numpyro.sample("mu", dist.Normal(0.0, scale))
    numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@register_numpyro_model("test_sites_broken", observed=("y",))
def _broken(y: Any = None) -> None:
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(jnp.zeros(3), 1.0).to_event(1))
    numpyro.sample("y", dist.Normal(jnp.dot(mu, y), 1.0), obs=y)  # (3,) against the data's (8,)


def test_the_site_check_compiles_nothing():
    CompileWatch.install()
    jax.clear_caches()  # an eager trace would compile each distribution's sampling and log-density afresh
    before = CompileWatch.count
    sites = check_sites(NumpyroModel(model="eight_schools"), {"sigma": SIGMA, "y": Y8}, "s")
    assert CompileWatch.count == before
    assert {n: (s["type"], s["is_observed"], s["discrete"]) for n, s in sites.items() if s["type"] == "sample"} == {
        "mu": ("sample", False, False),
        "tau": ("sample", False, False),
        "theta": ("sample", False, False),
        "y": ("sample", True, False),
    }


def test_a_discrete_latent_is_refused():
    with pytest.raises(ConfigError, match=r"the latent site\(s\) \['k'\] are discrete"):
        check_sites(NumpyroModel(model="test_sites_discrete"), {"y": Y8}, "s")


def test_a_model_that_needs_concrete_data_is_checked_eagerly():
    sites = check_sites(NumpyroModel(model="test_sites_concrete"), {"y": Y8}, "s")
    assert sites["y"]["is_observed"] and not sites["mu"]["is_observed"]


def test_a_model_that_fails_on_the_data_is_one_config_error():
    with pytest.raises(ConfigError, match=r"stage 's' .*: the model failed on the stage's data: ") as info:
        check_sites(NumpyroModel(model="test_sites_broken"), {"y": Y8}, "s")
    assert "\n" not in str(info.value)
