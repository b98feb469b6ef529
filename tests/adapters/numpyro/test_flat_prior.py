"""A model with NumPyro's flat prior (`ImproperUniform`, which has no ``sample``) passes pre-flight on every Bayesian
backend and samples its posterior; a model error without a message still says what and where."""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import ArraySource, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.bayes import check_sites, describe_error
from pipekit_train.adapters.numpyro import NUTS, NumpyroGuide, NumpyroModel, Trace_ELBO, register_numpyro_model
from pipekit_train.stage.preflight import check

from .conftest import Y


@register_numpyro_model("test_flat_prior", observed=("y",))
def _flat(y: Any = None) -> None:
    """``mu`` under a flat prior, unit noise: the posterior of mu is Normal(mean(y), n ** -0.5)."""
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), ()))
    numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@register_numpyro_model("test_bare_error", observed=("y",))
def _bare(y: Any = None) -> None:
    import numpyro
    import numpyro.distributions as dist

    numpyro.sample("y", dist.Normal(0.0, 1.0), obs=y)
    raise NotImplementedError  # no message, as NumPyro's own Distribution.sample


def _loop(backend: str, **changes: Any) -> TrainingLoop:
    from pipekit_train.adapters.blackjax import BlackjaxModel

    model_op: Any = {
        "numpyro-mcmc": NumpyroModel(model="test_flat_prior"),
        "numpyro-svi": NumpyroGuide(model="test_flat_prior", guide="AutoNormal"),
        "blackjax": BlackjaxModel(model="test_flat_prior"),
    }[backend]
    fields: dict[str, Any] = dict(
        model_op=model_op,
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y}), shuffle=False),
        backend=backend,
        batch_size=10,
        max_steps=200,
        steps_per_call=100,
        log_every_n_steps=100,
        progress=False,
        seed=3,
        name="flat",
    )
    if backend == "numpyro-svi":
        fields.update(loss=Trace_ELBO(), optimizer_config={"name": "adam", "lr": 0.05}, batch_size=len(Y))
    else:
        fields.update(task=NUTS(num_warmup=100, num_samples=100))
    fields.update(changes)
    return TrainingLoop(**fields)


@pytest.mark.parametrize("backend", ["numpyro-mcmc", "numpyro-svi", "blackjax"])
def test_a_flat_prior_passes_preflight(backend):
    if backend == "blackjax":
        pytest.importorskip("blackjax")
    plan = check(_loop(backend), None, "s")
    assert plan is not None


def test_a_flat_prior_reads_its_sites():
    sites = check_sites(NumpyroModel(model="test_flat_prior"), {"y": Y}, "s")
    kinds = {n: (s["is_observed"], s["discrete"]) for n, s in sites.items()}
    assert kinds == {"mu": (False, False), "y": (True, False)}


def test_a_flat_prior_samples_its_posterior(tmp_path):
    """NUTS from NumPyro's initial point: the posterior mean within 4 Monte Carlo standard errors of mean(y)."""
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        model, artifact = _loop("numpyro-mcmc").run()
    draws = model.posterior.draws["mu"]
    sd = len(Y) ** -0.5
    mcse = sd / np.sqrt(artifact.final_metrics["posterior/ess_bulk_min"])
    assert abs(draws.mean() - float(Y.astype(np.float64).mean())) < 4 * mcse
    assert abs(draws.std() / sd - 1) < 0.3


def test_a_model_error_without_a_message_names_its_type_and_where_it_was_raised():
    with pytest.raises(ConfigError) as info:
        check_sites(NumpyroModel(model="test_bare_error"), {"y": Y}, "s")
    raised_at = _bare.__code__.co_firstlineno + inspect.getsource(_bare).splitlines().index(
        "    raise NotImplementedError  # no message, as NumPyro's own Distribution.sample"
    )
    found = re.search(r": the model failed on the stage's data: (.*)$", str(info.value))
    assert found is not None, str(info.value)
    assert re.fullmatch(
        rf"NotImplementedError \(no message\) raised at \S*test_flat_prior\.py:{raised_at} in _bare", found[1]
    ), found[1]


def test_a_message_is_its_first_line():
    assert describe_error(ValueError("shapes differ\nmore detail")) == "ValueError: shapes differ"
