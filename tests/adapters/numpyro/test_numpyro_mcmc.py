"""``numpyro-mcmc``: bitwise NumPyro, the analytic posterior, the posterior as the artifact, kill-and-resume."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import pipekit
from pipekit_train import (
    load_model,
    read_jsonl,
    run_settings,
)
from pipekit_train.adapters.numpyro import NumpyroModel

from .conftest import POST_MEAN, POST_SD, Y, kill_in_warmup_and_in_sampling_then_resume

WARMUP, SAMPLES, CHAINS, SEED, CHUNK = 200, 400, 2, 7, 50

# The tests sharing the module's sampled stage run on one xdist worker (``--dist loadgroup``), so it is sampled once;
# the resumed runs of the kill test share its compiled chunk (same model, data, kernel and chunk size).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    pytestmark = pytest.mark.xdist_group("bayes-numpyro")


@pytest.fixture(scope="module")
def conjugate(tmp_path_factory):
    """One uninterrupted NUTS stage of the conjugate model, in chunks of 50 iterations (the kill test's pipeline)."""
    data = tmp_path_factory.mktemp("data") / "data.npz"
    np.savez(data, y=Y)
    run_dir = tmp_path_factory.mktemp("conj") / "run"
    loop = pipekit.loads(PIPELINE.format(data=data))
    with run_settings(run_dir=str(run_dir), store=False):
        model, artifact = loop.run()
    return model, artifact, run_dir, data


def test_chunked_draws_equal_numpyro_mcmc_run_bitwise(conjugate):
    """Chunks of 50 iterations give NumPyro's own ``MCMC.run`` draws (one chunk: test_eight_schools.py)."""
    from numpyro.infer import MCMC
    from numpyro.infer import NUTS as NumpyroNUTS

    from pipekit_train.adapters.bayes import get_numpyro_model

    model = conjugate[0]
    mcmc = MCMC(
        NumpyroNUTS(get_numpyro_model("conjugate_normal").fn),
        num_warmup=WARMUP,
        num_samples=SAMPLES,
        num_chains=CHAINS,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(SEED), y=Y)
    ref = np.asarray(mcmc.get_samples(group_by_chain=True)["mu"])
    ours = model.posterior.draws["mu"]
    assert ours.shape == ref.shape == (CHAINS, SAMPLES)
    assert np.array_equal(ours, ref)


def test_posterior_mean_within_4_mcse_of_the_analytic_one(conjugate):
    model, artifact = conjugate[:2]
    draws = model.posterior.draws["mu"]
    ess = artifact.final_metrics["posterior/ess_bulk_min"]
    mcse = POST_SD / np.sqrt(ess)
    assert abs(draws.mean() - POST_MEAN) < 4 * mcse, (draws.mean(), POST_MEAN, mcse)
    assert abs(draws.std() / POST_SD - 1) < 0.15
    assert artifact.final_metrics["posterior/r_hat_max"] <= 1.01
    assert artifact.final_metrics["posterior/divergences"] == 0


def test_the_posterior_is_the_artifact(conjugate):
    model, artifact, run_dir, _ = conjugate
    loaded = load_model(artifact.model_registry_uri)
    assert isinstance(loaded, NumpyroModel) and loaded == model
    assert loaded.weights_hash() == model.weights_hash() == artifact.trained_model_hash
    assert loaded.posterior.draws["mu"].tobytes() == model.posterior.draws["mu"].tobytes()
    pred = loaded.predictive({"y": Y[:3]})  # the posterior predictive of three new observations
    assert pred["y"].shape == (CHAINS * SAMPLES, 3)
    assert abs(loaded({"y": Y[:3]}).mean() - POST_MEAN) < 0.2
    summary = (run_dir / "nuts" / "posterior_summary.txt").read_text()
    assert "mu" in summary and "r_hat" in summary and "ess_bulk" in summary
    assert artifact.backend_info["num_chains"] == CHAINS and artifact.backend_info["draws_per_chain"] == SAMPLES
    train = [r for r in read_jsonl(str(run_dir / "nuts" / "metrics.jsonl")) if r.get("type") == "metrics"]
    assert {"loss", "accept_prob", "step_size", "diverging", "warmup"} <= set(train[-1])


# Kill and resume ----------------------------------------------------------------------------------------
PIPELINE = f"""\
pipekit: 1
type: TrainingLoop
name: nuts
model_op: {{{{type: NumpyroModel, model: conjugate_normal}}}}
dataset: {{{{type: TrainingDataset, source: {{{{type: NpzSource, path: {{data}}}}}}, shuffle: false}}}}
task: {{{{type: NUTS, num_warmup: {WARMUP}, num_samples: {SAMPLES}, num_chains: {CHAINS}}}}}
backend: numpyro-mcmc
batch_size: 10
max_steps: {WARMUP + SAMPLES}
steps_per_call: {CHUNK}
log_every_n_steps: {CHUNK}
progress: false
seed: {SEED}
callbacks:
- type: Checkpoint
  every_n_steps: {CHUNK}
  async_save: false
"""


@pytest.mark.slow
def test_sigkill_in_warmup_and_in_sampling_then_resume_auto_gives_bitwise_the_same_draws(
    conjugate, tmp_path, xla_cache_env
):
    """A CLI run SIGKILLed after its warm-up checkpoint at 50, resumed with ``--resume auto`` and SIGKILLed again after
    its sampling checkpoint at 250, then resumed to the end: every draw is the uninterrupted run's, byte for byte."""
    straight, _, _, data = conjugate
    resumed = kill_in_warmup_and_in_sampling_then_resume(
        tmp_path, PIPELINE.format(data=data), "nuts", CHUNK, WARMUP + CHUNK, WARMUP, WARMUP + SAMPLES, xla_cache_env
    )
    assert resumed.posterior.draws.keys() == straight.posterior.draws.keys() == {"mu"}
    for site, value in straight.posterior.draws.items():
        assert value.shape == (CHAINS, SAMPLES)
        assert resumed.posterior.draws[site].tobytes() == value.tobytes(), site
