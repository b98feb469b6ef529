"""``numpyro-mcmc``: bitwise NumPyro, the analytic posterior, the posterior as the artifact, kill-and-resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from pipekit_train import ArraySource, TrainingDataset, TrainingLoop, load_model, read_jsonl, run_settings
from pipekit_train.adapters.numpyro import NUTS, NumpyroModel

from .conftest import POST_MEAN, POST_SD, Y

WARMUP, SAMPLES, CHAINS, SEED = 300, 500, 2, 7

# The tests sharing the module's sampled stage run on one xdist worker (``--dist loadgroup``), so it is sampled once.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    pytestmark = pytest.mark.xdist_group("bayes-mcmc")


@pytest.fixture(scope="module")
def conjugate(tmp_path_factory):
    """One NUTS stage of the conjugate model, sampled in a single chunk."""
    run_dir = tmp_path_factory.mktemp("conj") / "run"
    loop = TrainingLoop(
        model_op=NumpyroModel(model="conjugate_normal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y}), shuffle=False),
        task=NUTS(num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS),
        backend="numpyro-mcmc",
        batch_size=10,
        max_steps=WARMUP + SAMPLES,
        steps_per_call=WARMUP + SAMPLES,
        log_every_n_steps=WARMUP + SAMPLES,
        progress=False,
        seed=SEED,
        name="nuts",
    )
    with run_settings(run_dir=str(run_dir), store=False):
        model, artifact = loop.run()
    return model, artifact, run_dir


def test_one_chunk_equals_numpyro_mcmc_run_bitwise(conjugate):
    from numpyro.infer import MCMC
    from numpyro.infer import NUTS as NumpyroNUTS

    from pipekit_train.adapters.numpyro._models import conjugate_normal

    model, _, _ = conjugate
    mcmc = MCMC(
        NumpyroNUTS(conjugate_normal),
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
    assert ours.tobytes() == ref.tobytes()


def test_posterior_mean_within_4_mcse_of_the_analytic_one(conjugate):
    model, artifact, _ = conjugate
    draws = model.posterior.draws["mu"]
    ess = artifact.final_metrics["posterior/ess_bulk_min"]
    mcse = POST_SD / np.sqrt(ess)
    assert abs(draws.mean() - POST_MEAN) < 4 * mcse, (draws.mean(), POST_MEAN, mcse)
    assert abs(draws.std() / POST_SD - 1) < 0.15
    assert artifact.final_metrics["posterior/r_hat_max"] <= 1.01
    assert artifact.final_metrics["posterior/divergences"] == 0


def test_the_posterior_is_the_artifact(conjugate):
    model, artifact, run_dir = conjugate
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
PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: nuts
model_op: {{type: NumpyroModel, model: conjugate_normal}}
dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: {data}}}, shuffle: false}}
task: {{type: NUTS, num_warmup: 40, num_samples: 60, num_chains: 2, thinning: 2}}
backend: numpyro-mcmc
batch_size: 10
max_steps: 100
steps_per_call: 10
log_every_n_steps: 20
progress: false
seed: 3
callbacks:
- type: Checkpoint
  every_n_steps: 20
  async_save: false
"""


def _cli(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-m", "pipekit_train.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _kill_after_checkpoint(proc: subprocess.Popen, ckpt_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _in_manifest(ckpt_dir, step):
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before checkpoint {step}: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no checkpoint {step} within {timeout}s")


def _in_manifest(ckpt_dir: Path, step: int) -> bool:
    import json

    try:
        manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return step in [int(e["step"]) for e in manifest.get("checkpoints", manifest.get("entries", []))]


@pytest.mark.slow
def test_sigkill_in_warmup_and_in_sampling_then_resume_gives_bitwise_the_same_draws(tmp_path):
    import pipekit

    np.savez(tmp_path / "data.npz", y=Y)
    text = PIPELINE.format(data=tmp_path / "data.npz")
    (tmp_path / "p.yaml").write_text(text)
    run = tmp_path / "killed"
    ckpt = run / "nuts" / "checkpoints"
    first = _cli(["run", "p.yaml", "--run-dir", str(run)], tmp_path)
    _kill_after_checkpoint(first, ckpt, 20)  # during warm-up (iterations 0-39)
    second = _cli(["run", "p.yaml", "--run-dir", str(run), "--resume", "auto"], tmp_path)
    _kill_after_checkpoint(second, ckpt, 60)  # during sampling
    third = _cli(["run", "p.yaml", "--run-dir", str(run), "--resume", "auto"], tmp_path)
    assert third.wait(180) == 0, third.stderr.read().decode()[-3000:]

    import json

    final = json.loads((run / "nuts" / "final.json").read_text())
    uri = final["model_uri"]
    if "root=" in uri and not uri.split("root=", 1)[1].startswith("/"):
        uri = uri.split("?", 1)[0] + "?root=" + str(run / uri.split("root=", 1)[1])
    resumed = load_model(uri)
    os.chdir(tmp_path)
    with run_settings(run_dir=str(tmp_path / "straight"), store=False):
        straight, _ = pipekit.loads(text).run()
    assert resumed.posterior.draws.keys() == straight.posterior.draws.keys()
    for site, value in straight.posterior.draws.items():
        assert value.shape == (2, 30)
        assert resumed.posterior.draws[site].tobytes() == value.tobytes(), site
