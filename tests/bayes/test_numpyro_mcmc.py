"""``numpyro-mcmc``: bitwise NumPyro, the analytic posterior, the posterior as the artifact, kill-and-resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import pipekit
from pipekit_train import (
    Callback,
    TrainingInterrupted,
    load_model,
    read_jsonl,
    run_settings,
)
from pipekit_train.adapters.numpyro import NumpyroModel

from .conftest import POST_MEAN, POST_SD, Y

WARMUP, SAMPLES, CHAINS, SEED, CHUNK = 300, 500, 2, 7, 100

# The tests sharing the module's sampled stage run on one xdist worker (``--dist loadgroup``), so it is sampled once;
# the resumed runs of the kill test share its compiled chunk (same model, data, kernel and chunk size).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    pytestmark = pytest.mark.xdist_group("bayes-numpyro")


@pytest.fixture(scope="module")
def conjugate(tmp_path_factory):
    """One uninterrupted NUTS stage of the conjugate model, in chunks of 100 iterations (the kill test's pipeline)."""
    data = tmp_path_factory.mktemp("data") / "data.npz"
    np.savez(data, y=Y)
    run_dir = tmp_path_factory.mktemp("conj") / "run"
    loop = pipekit.loads(PIPELINE.format(data=data))
    with run_settings(run_dir=str(run_dir), store=False):
        model, artifact = loop.run()
    return model, artifact, run_dir, data


def test_chunked_draws_equal_numpyro_mcmc_run_bitwise(conjugate):
    from numpyro.infer import MCMC
    from numpyro.infer import NUTS as NumpyroNUTS

    from pipekit_train.adapters.numpyro._models import conjugate_normal

    model = conjugate[0]
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


def _kill_after_checkpoint(proc: subprocess.Popen, ckpt_dir: Path, step: int, timeout: float = 240) -> None:
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


class TermAt(Callback, register=False):
    """Sends this process SIGTERM after step `at`: the loop finishes the chunk, checkpoints and stops."""

    at: int

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if ctx.step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def fingerprint(self) -> None:
        return None  # it interrupts the run; it does not change what is sampled


@pytest.mark.slow
def test_sigkill_in_warmup_then_sigterm_in_sampling_then_resume_gives_bitwise_the_same_draws(
    conjugate, tmp_path, monkeypatch
):
    """The CLI run is SIGKILLed after its warm-up checkpoint at 200; ``resume=auto`` continues it in this process
    until a SIGTERM at 700 (sampling), and again to the end: the draws are bitwise the uninterrupted run's."""
    straight, _, _, data = conjugate
    text = PIPELINE.format(data=data)
    (tmp_path / "p.yaml").write_text(text)
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipekit_train.cli", "run", "p.yaml", "--run-dir", str(run), "--no-store"],
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _kill_after_checkpoint(proc, run / "nuts" / "checkpoints", 2 * CHUNK)  # during warm-up (iterations 0-299)
    monkeypatch.chdir(tmp_path)
    stopped = pipekit.loads(text).replace(callbacks=(*pipekit.loads(text).callbacks, TermAt(at=700)))
    with run_settings(run_dir=str(run), store=False, resume="auto"), pytest.raises(TrainingInterrupted) as stop:
        stopped.run()
    assert stop.value.reason == "SIGTERM" and stop.value.artifact.backend_info["steps"] == 700
    with run_settings(run_dir=str(run), store=False, resume="auto"):
        resumed, _ = pipekit.loads(text).run()
    assert resumed.posterior.draws.keys() == straight.posterior.draws.keys()
    for site, value in straight.posterior.draws.items():
        assert value.shape == (CHAINS, SAMPLES)
        assert resumed.posterior.draws[site].tobytes() == value.tobytes(), site
