"""Eight schools (non-centered): one chunk of ``numpyro-mcmc`` is NumPyro's own ``MCMC.run`` bit for bit, and
``numpyro-mcmc`` and ``blackjax`` agree on the posterior within Monte-Carlo error."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from pipekit_train import ArraySource, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.numpyro import NUTS, NumpyroModel

from .conftest import SIGMA, Y8

pytestmark = pytest.mark.xdist_group("bayes-eight-schools")  # one worker: each posterior is sampled once

#: The agreement runs: 4 chains of 500 + 1000 iterations per backend (ESS of every element in the hundreds).
WARMUP, SAMPLES, CHAINS, SEED = 500, 1000, 4, 1


def _run(model_op: Any, backend: str, tmp: Any, chains: int, warmup: int, samples: int, seed: int) -> Any:
    """One stage sampled in one chunk (``steps_per_call = max_steps``)."""
    loop = TrainingLoop(
        model_op=model_op,
        dataset=TrainingDataset(source=ArraySource(arrays={"sigma": SIGMA, "y": Y8}), shuffle=False),
        task=NUTS(num_warmup=warmup, num_samples=samples, num_chains=chains),
        backend=backend,
        batch_size=8,
        max_steps=warmup + samples,
        steps_per_call=warmup + samples,
        log_every_n_steps=warmup + samples,
        progress=False,
        seed=seed,
        name=backend,
    )
    with run_settings(run_dir=str(tmp), store=False):
        return loop.run()


def _numpyro_mcmc_run(chains: int, warmup: int, samples: int, seed: int) -> dict[str, np.ndarray]:
    """NumPyro's own ``MCMC.run`` with ``PRNGKey(seed)`` (vectorized chains), grouped by chain."""
    from numpyro.infer import MCMC
    from numpyro.infer import NUTS as NumpyroNUTS

    from pipekit_train.adapters.bayes import get_numpyro_model

    mcmc = MCMC(
        NumpyroNUTS(get_numpyro_model("eight_schools").fn),
        num_warmup=warmup,
        num_samples=samples,
        num_chains=chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(seed), sigma=SIGMA, y=Y8)
    return {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}


@pytest.fixture(scope="module")
def numpyro_posterior(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("np")
    model, artifact = _run(NumpyroModel(model="eight_schools"), "numpyro-mcmc", tmp, CHAINS, WARMUP, SAMPLES, SEED)
    return model.posterior.draws, artifact


def test_one_chunk_of_vectorized_chains_equals_numpyro_mcmc_run_bitwise(numpyro_posterior):
    ours = numpyro_posterior[0]
    ref = _numpyro_mcmc_run(CHAINS, WARMUP, SAMPLES, SEED)
    assert ours.keys() == ref.keys() == {"mu", "tau", "theta"}
    for site in ref:
        assert ours[site].shape == ref[site].shape and np.array_equal(ours[site], ref[site]), site


def test_one_chunk_of_a_single_chain_equals_numpyro_mcmc_run_bitwise(tmp_path):
    """The case that used to differ (see design/numpyro_adapter.md): the kernel's data are literals of the jitted
    iteration, constant-folded by XLA as in ``MCMC.run``, not loop-carried values computed at run time."""
    model, _ = _run(NumpyroModel(model="eight_schools"), "numpyro-mcmc", tmp_path, 1, 100, 100, 3)
    ref = _numpyro_mcmc_run(1, 100, 100, 3)
    for site in ref:
        assert model.posterior.draws[site].shape == ref[site].shape == (1, 100, *ref[site].shape[2:])
        assert np.array_equal(model.posterior.draws[site], ref[site]), site


def _mean_and_mcse(draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-element posterior mean and its Monte-Carlo standard error (sd / sqrt(ESS)), draws (chains, n, ...)."""
    from numpyro.diagnostics import effective_sample_size

    flat = draws.reshape(draws.shape[0], draws.shape[1], -1).astype(np.float64)
    ess = np.array([effective_sample_size(flat[:, :, j]) for j in range(flat.shape[-1])])
    return flat.mean(axis=(0, 1)), flat.std(axis=(0, 1)) / np.sqrt(ess)


def test_blackjax_and_numpyro_mcmc_agree_within_monte_carlo_error(numpyro_posterior, tmp_path):
    """Both backends sample the same posterior, so the difference of two means is Monte-Carlo error alone: each of
    the 10 elements (mu, tau, theta[0..7]) within 4 combined standard errors (|z| > 4 has probability 6e-5 per
    element). The MCSEs rest on ESS estimates, so the runs are long enough for those to be reliable (4 chains of
    1000 draws; every ESS in the hundreds, asserted) and the runs converged (R-hat, no divergences)."""
    pytest.importorskip("blackjax")
    from pipekit_train.adapters.blackjax import BlackjaxModel

    ref, ref_artifact = numpyro_posterior
    model, artifact = _run(BlackjaxModel(model="eight_schools"), "blackjax", tmp_path, CHAINS, WARMUP, SAMPLES, SEED)
    ours = model.posterior.draws
    assert ours.keys() == ref.keys() == {"mu", "tau", "theta"}
    for a in (artifact, ref_artifact):
        assert a.final_metrics["posterior/r_hat_max"] <= 1.01
        assert a.final_metrics["posterior/ess_bulk_min"] >= 400
        assert a.final_metrics["posterior/divergences"] <= 0.01 * CHAINS * SAMPLES
    for site in ("mu", "tau", "theta"):
        m1, e1 = _mean_and_mcse(ours[site])
        m2, e2 = _mean_and_mcse(ref[site])
        z = np.abs(m1 - m2) / np.sqrt(e1**2 + e2**2)
        assert (z < 4).all(), (site, m1, m2, z)
