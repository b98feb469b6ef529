"""``blackjax``: the analytic posterior, agreement with ``numpyro-mcmc``, bitwise resume, the posterior as artifact."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    ArraySource,
    Callback,
    Checkpoint,
    Last,
    TrainingDataset,
    TrainingInterrupted,
    TrainingLoop,
    load_model,
    run_settings,
)
from pipekit_train.adapters.blackjax import HMC, MALA, NUTS, BlackjaxModel
from pipekit_train.adapters.numpyro import NumpyroModel
from pipekit_train.stage.preflight import check

from ..numpyro.conftest import POST_MEAN, POST_SD, Y, kill_in_warmup_and_in_sampling_then_resume

pytest.importorskip("blackjax")
pytestmark = pytest.mark.xdist_group("bayes-blackjax")  # one worker: the fixture is sampled once

WARMUP, SAMPLES, CHAINS, SEED, CHUNK = 200, 400, 2, 5, 50
CKPT = Checkpoint(every_n_steps=CHUNK, keep=(Last(n=1),), async_save=False)


def _loop(kernel: Any = None, callbacks: tuple[Any, ...] = (CKPT,), **changes: Any) -> TrainingLoop:
    kernel = kernel or NUTS(num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS)
    fields = dict(
        model_op=BlackjaxModel(model="conjugate_normal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y}), shuffle=False),
        task=kernel,
        backend="blackjax",
        batch_size=10,
        max_steps=kernel.num_warmup + kernel.num_samples,
        steps_per_call=CHUNK,
        log_every_n_steps=CHUNK,
        callbacks=callbacks,
        progress=False,
        seed=SEED,
        name="bj",
    )
    fields.update(changes)
    return TrainingLoop(**fields)


#: The same stage as `_loop()`, for the CLI (the SIGKILL test).
PIPELINE = f"""\
pipekit: 1
type: TrainingLoop
name: bj
model_op: {{{{type: BlackjaxModel, model: conjugate_normal}}}}
dataset: {{{{type: TrainingDataset, source: {{{{type: NpzSource, path: {{data}}}}}}, shuffle: false}}}}
task: {{{{type: NUTS, num_warmup: {WARMUP}, num_samples: {SAMPLES}, num_chains: {CHAINS}}}}}
backend: blackjax
batch_size: 10
max_steps: {WARMUP + SAMPLES}
steps_per_call: {CHUNK}
log_every_n_steps: {CHUNK}
progress: false
seed: {SEED}
callbacks:
- {{{{type: Checkpoint, every_n_steps: {CHUNK}, keep: [{{{{type: Last, n: 1}}}}], async_save: false}}}}
"""


@pytest.fixture(scope="module")
def conjugate(tmp_path_factory):
    """One uninterrupted NUTS stage of the conjugate model (the resume tests' reference, too)."""
    run_dir = tmp_path_factory.mktemp("bj") / "run"
    with run_settings(run_dir=str(run_dir), store=False):
        model, artifact = _loop().run()
    return model, artifact, run_dir


@pytest.mark.slow
def test_sigkill_in_warmup_and_in_sampling_then_resume_auto_gives_bitwise_the_same_draws(
    conjugate, tmp_path, xla_cache_env
):
    """A CLI run SIGKILLed after its warm-up checkpoint at 50, resumed with ``--resume auto`` and SIGKILLed again after
    its sampling checkpoint at 250, then resumed to the end: every draw is the uninterrupted run's, byte for byte."""
    straight = conjugate[0]
    np.savez(tmp_path / "data.npz", y=Y)
    text = PIPELINE.format(data=tmp_path / "data.npz")
    resumed = kill_in_warmup_and_in_sampling_then_resume(
        tmp_path, text, "bj", CHUNK, WARMUP + CHUNK, WARMUP, WARMUP + SAMPLES, xla_cache_env
    )
    assert resumed.posterior.draws.keys() == straight.posterior.draws.keys() == {"mu"}
    for site, value in straight.posterior.draws.items():
        assert resumed.posterior.draws[site].tobytes() == value.tobytes(), site


def test_nuts_posterior_mean_within_4_mcse_of_the_analytic_one(conjugate):
    model, artifact, _ = conjugate
    draws = model.posterior.draws["mu"]
    assert draws.shape == (CHAINS, SAMPLES)
    mcse = POST_SD / np.sqrt(artifact.final_metrics["posterior/ess_bulk_min"])
    assert abs(draws.mean() - POST_MEAN) < 4 * mcse, (draws.mean(), POST_MEAN, mcse)
    assert abs(draws.std() / POST_SD - 1) < 0.15
    assert artifact.final_metrics["posterior/r_hat_max"] <= 1.01
    assert artifact.final_metrics["posterior/divergences"] == 0


def test_the_posterior_is_the_artifact(conjugate):
    model, artifact, run_dir = conjugate
    loaded = load_model(artifact.model_registry_uri)
    assert isinstance(loaded, BlackjaxModel) and loaded == model
    assert loaded.weights_hash() == model.weights_hash() == artifact.trained_model_hash
    assert abs(loaded({"y": Y[:3]}).mean() - POST_MEAN) < 0.2
    summary = (run_dir / "bj" / "posterior_summary.txt").read_text()
    assert "mu" in summary and "r_hat" in summary and "ess_bulk" in summary
    info = artifact.backend_info
    assert info["backend"] == "blackjax" and info["kernel"] == "NUTS" and info["draws_per_chain"] == SAMPLES
    assert len(info["step_size"]) == CHAINS and all(0.1 < s < 5 for s in info["step_size"])


class TermAt(Callback, register=False):
    """Sends this process SIGTERM after step `at`: the loop finishes the chunk, checkpoints and stops."""

    at: int

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if ctx.step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def fingerprint(self) -> None:
        return None  # it interrupts the run; it does not change what is sampled


def test_sigterm_in_warmup_and_in_sampling_then_resume_gives_bitwise_the_same_draws(conjugate, tmp_path, monkeypatch):
    """Also: a later stage of the same program (the fixture's) traces no NUTS iteration, neither for the chunk
    (its jit is kept with the program) nor for the draws buffer's shapes (kept with it too)."""
    from pipekit_train.adapters.blackjax._sampler import BlackjaxBackend

    traced = []
    one = BlackjaxBackend._one
    monkeypatch.setattr(BlackjaxBackend, "_one", lambda self, *a: traced.append(1) or one(self, *a))
    straight, _, _ = conjugate
    run_dir = str(tmp_path / "part")
    for at, resume in ((WARMUP - CHUNK, None), (WARMUP + CHUNK, "auto")):  # stop in warm-up, then in sampling
        with run_settings(run_dir=run_dir, store=False, resume=resume), pytest.raises(TrainingInterrupted) as stop:
            _loop(callbacks=(CKPT, TermAt(at=at))).run()
        assert stop.value.reason == "SIGTERM" and stop.value.artifact.backend_info["steps"] == at
    with run_settings(run_dir=run_dir, store=False, resume="auto"):
        resumed, _ = _loop().run()
    for site, value in straight.posterior.draws.items():
        assert resumed.posterior.draws[site].tobytes() == value.tobytes(), site
    assert traced == []


@pytest.mark.parametrize("kernel", [HMC(num_steps=5), MALA()], ids=["HMC", "MALA"])
def test_hmc_and_mala_find_the_analytic_posterior(kernel, tmp_path):
    kernel = kernel.replace(num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS)
    with run_settings(run_dir=str(tmp_path), store=False):
        model, artifact = _loop(kernel, callbacks=(), steps_per_call=WARMUP + SAMPLES).run()
    draws = model.posterior.draws["mu"]
    mcse = POST_SD / np.sqrt(artifact.final_metrics["posterior/ess_bulk_min"])
    assert abs(draws.mean() - POST_MEAN) < 4 * mcse, (draws.mean(), POST_MEAN, mcse)
    assert artifact.final_metrics["posterior/r_hat_max"] <= 1.01


# Bad input, before sampling ------------------------------------------------------------------------------------
def test_kernels_and_models_are_checked_before_sampling():
    with pytest.raises(ConfigError, match="MALA has no mass matrix"):
        MALA(dense_mass=True)
    with pytest.raises(ConfigError, match="set backend: blackjax"):
        _loop(backend="numpyro-mcmc")
    np_loop = _loop(model_op=NumpyroModel(model="conjugate_normal"), backend="numpyro-mcmc", task=MALA())
    with pytest.raises(ConfigError, match="needs its kernel as `task` \\(NUTS/HMC"):
        check(np_loop, None, "s")
    loop = _loop(max_steps=10)
    with pytest.raises(ConfigError, match=f"set max_steps: {WARMUP + SAMPLES}"):
        check(loop, None, "s")


def test_operators_round_trip_through_yaml():
    for op in (BlackjaxModel(model="eight_schools"), MALA(num_warmup=10, num_chains=2)):
        assert pipekit.loads(pipekit.dumps(op)) == op
