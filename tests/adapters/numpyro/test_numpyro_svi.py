"""``numpyro-svi``: the analytic posterior, bad input before anything compiles, and the SVI → NUTS hand-off."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import ArraySource, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.numpyro import NUTS, NumpyroGuide, NumpyroModel, Trace_ELBO
from pipekit_train.stage.preflight import check

from .conftest import POST_MEAN, POST_SD, Y, stage_model


def _svi(**changes):
    fields = dict(
        model_op=NumpyroGuide(model="conjugate_normal", guide="AutoNormal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y})),
        loss=Trace_ELBO(num_particles=16),
        optimizer_config={"name": "adam", "lr": 0.05, "schedule": "exponential", "decay_rate": 0.01},
        backend="numpyro-svi",
        batch_size=len(Y),
        max_steps=1500,
        steps_per_call=100,
        log_every_n_steps=500,
        progress=False,
        name="svi",
    )
    fields.update(changes)
    return TrainingLoop(**fields)


def test_svi_autonormal_is_within_2_percent_then_nuts_starts_at_the_guide_median(tmp_path, capsys):
    """One Sequential([svi, nuts]): the SVI stage's guide matches the analytic posterior, and the NUTS stage after
    it starts every chain at the guide's median, with the SVI stage as its parent."""
    nuts = TrainingLoop(
        model_op=NumpyroModel(model="conjugate_normal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y})),
        task=NUTS(num_warmup=50, num_samples=50),
        backend="numpyro-mcmc",
        batch_size=10,
        max_steps=100,
        steps_per_call=100,
        log_every_n_steps=100,
        progress=False,
        name="nuts",
    )
    run_dir = tmp_path / "run"
    with run_settings(run_dir=str(run_dir), store=False):
        model, artifact = pipekit.Sequential([_svi(), nuts]).run()
    guide = stage_model(run_dir, "svi")
    loc, scale = float(guide.params["mu_auto_loc"]), float(guide.params["mu_auto_scale"])
    assert abs(loc / POST_MEAN - 1) < 0.02, (loc, POST_MEAN)
    assert abs(scale / POST_SD - 1) < 0.02, (scale, POST_SD)
    assert guide.guide == "AutoNormal"
    svi_id = json.loads((run_dir / "svi" / "final.json").read_text())["artifact_id"]
    assert artifact.backend_info["init"] == f"median of AutoNormal ({svi_id})"
    assert svi_id in artifact.parent_ids  # the lineage: the NUTS posterior's parent is the SVI stage's guide
    assert abs(model.posterior.draws["mu"].mean() - POST_MEAN) < 0.1
    out = capsys.readouterr().out  # the summary table is printed at the end of the stage, and written
    assert "posterior of stage 'nuts'" in out and "r_hat" in out
    assert (run_dir / "nuts" / "posterior_summary.txt").read_text() in out


# Bad input: one line, before sampling ------------------------------------------------------------------------
def _preflight(loop):
    return check(loop, None, "s")


def test_an_unregistered_model_name_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"'eight_school' is not a registered NumPyro model \(did you mean"):
        NumpyroModel(model="eight_school")


def test_an_observed_site_without_data_is_refused():
    loop = _svi(dataset=TrainingDataset(source=ArraySource(arrays={"obs": Y})))
    with pytest.raises(ConfigError, match="not a parameter of model|has no data"):
        _preflight(loop)
    mcmc = TrainingLoop(
        model_op=NumpyroModel(model="eight_schools"),
        dataset=TrainingDataset(source=ArraySource(arrays={"sigma": np.ones(8, np.float32)})),
        task=NUTS(num_warmup=5, num_samples=5),
        backend="numpyro-mcmc",
        batch_size=4,
        max_steps=10,
    )
    with pytest.raises(ConfigError, match="the observed site 'y' has no data"):
        _preflight(mcmc)


def test_nan_in_the_data_is_refused():
    bad = Y.copy()
    bad[7] = np.nan
    # The core's pre-flight refuses it first, for every backend (the sampler's own check says the same later).
    with pytest.raises(
        ConfigError, match=r"TrainingLoop.dataset: 'y' holds 1 NaN or infinite value\(s\) \(the first in record 7\)"
    ):
        _preflight(_svi(dataset=TrainingDataset(source=ArraySource(arrays={"y": bad}))))


def test_a_guide_that_does_not_fit_the_model_is_refused():
    from pipekit_train.adapters.numpyro import register_numpyro_guide

    @register_numpyro_guide("test_wrong_guide")
    def make(model):
        def guide(**kwargs):
            import numpyro
            import numpyro.distributions as dist

            numpyro.sample("sigma", dist.Normal(0.0, 1.0))  # the model has `mu`, not `sigma`

        return guide

    with pytest.raises(ConfigError, match="guide 'test_wrong_guide' does not fit model 'conjugate_normal'"):
        _preflight(_svi(model_op=NumpyroGuide(model="conjugate_normal", guide="test_wrong_guide")))


def test_the_guide_check_of_the_pre_flight_compiles_nothing():
    """The pre-flight traces the guide and the model abstractly: run eagerly, each of their operations compiled a
    program of its own (104 for the logistic-regression example) before the stage had compiled anything."""
    import jax.monitoring

    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.clear_caches()  # what an earlier test compiled is compiled again (or loaded: counted the same)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _preflight(_svi())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_a_guide_that_needs_concrete_values_is_checked_eagerly():
    """A guide with Python control flow on a drawn value cannot be traced abstractly: the check traces it eagerly,
    as the model's own trace does, and a guide that fits is not refused."""
    from pipekit_train.adapters.numpyro import register_numpyro_guide

    @register_numpyro_guide("test_concrete_guide")
    def make(model):
        def guide(**kwargs):
            import numpyro
            import numpyro.distributions as dist

            scale = 0.5 if float(numpyro.sample("u", dist.Uniform(0.0, 1.0), infer={"is_auxiliary": True})) > 2 else 1
            numpyro.sample("mu", dist.Normal(0.0, scale))

        return guide

    _preflight(_svi(model_op=NumpyroGuide(model="conjugate_normal", guide="test_concrete_guide")))


def test_max_steps_must_match_the_kernel():
    loop = TrainingLoop(
        model_op=NumpyroModel(model="conjugate_normal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y})),
        task=NUTS(num_warmup=50, num_samples=50),
        backend="numpyro-mcmc",
        batch_size=10,
        max_steps=1000,
    )
    with pytest.raises(ConfigError, match="set max_steps: 100"):
        _preflight(loop)


def test_operators_round_trip_through_yaml():
    for op in (NUTS(num_warmup=10, num_chains=2), Trace_ELBO(num_particles=3), NumpyroGuide(model="eight_schools")):
        assert pipekit.loads(pipekit.dumps(op)) == op


BAD_PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: nuts
model_op: {{type: NumpyroModel, model: {model}}}
dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: data.npz}}, shuffle: false}}
task: {{type: NUTS, num_warmup: 5, num_samples: 5}}
backend: numpyro-mcmc
batch_size: 10
max_steps: 10
"""


@pytest.mark.parametrize(
    "model,bad_record,expected",
    [
        ("conjugate_normall", None, r"'conjugate_normall' is not a registered NumPyro model \(did you mean"),
        ("conjugate_normal", 3, r"stage 'nuts': .*'y' holds 1 NaN or infinite value\(s\) \(the first in record 3\)"),
    ],
    ids=["unregistered-model", "nan"],
)
def test_the_cli_refuses_bad_input_in_one_line_with_exit_code_2(model, bad_record, expected, tmp_path, capsys):
    from pipekit_train.cli import main

    y = Y.copy()
    if bad_record is not None:
        y[bad_record] = np.nan
    np.savez(tmp_path / "data.npz", y=y)
    (tmp_path / "p.yaml").write_text(BAD_PIPELINE.format(model=model))
    rc = main(["run", str(tmp_path / "p.yaml"), "--run-dir", str(tmp_path / "run"), "--no-store"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert re.search(expected, err[0]), err[0]
    assert not (tmp_path / "run" / "nuts" / "checkpoints").exists()  # refused before sampling


def test_two_fits_of_one_structure_compile_once(tmp_path):
    """The SVI programs are cached by structure: a second fit (another seed and learning rate, the same model,
    guide, ELBO, optimizer structure, data size and batch shape) compiles nothing, and ends where a fit with the
    same settings ends (the cached programs are the same computation)."""
    from pipekit_train.tracking._progress import CompileWatch

    y = Y[:37]  # a data size no other test fits: the first fit here compiles its own programs
    fit = dict(dataset=TrainingDataset(source=ArraySource(arrays={"y": y})), batch_size=len(y), max_steps=20)
    fit.update(steps_per_call=10, log_every_n_steps=10)
    CompileWatch.install()
    counts, params = [], []
    for i, changes in enumerate([{}, {"seed": 3, "optimizer_config": {**_svi().optimizer_config, "lr": 0.01}}, {}]):
        before = CompileWatch.count
        with run_settings(run_dir=str(tmp_path / f"r{i}"), store=False):
            model, _ = _svi(**fit, **changes).run()
        counts.append(CompileWatch.count - before)
        params.append(model.params)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
    assert all(np.array_equal(params[0][k], params[2][k]) for k in params[0])  # bitwise: a cached program's result
    assert not np.array_equal(params[0]["mu_auto_loc"], params[1]["mu_auto_loc"])


def _fitted(model: str, **extra: np.ndarray) -> NumpyroGuide:
    """An AutoNormal guide of `model` bound to chosen parameters with small scales (as if SVI had fitted them)."""
    params = {
        "params/w_auto_loc": np.array([0.5, -1.0, 0.2], np.float32),
        "params/w_auto_scale": np.full(3, 0.01, np.float32),
        "params/b_auto_loc": np.float32(0.1),
        "params/b_auto_scale": np.float32(0.01),
        **extra,
    }
    return NumpyroGuide(model=model, guide="AutoNormal").with_weights(params)


@pytest.mark.parametrize("model", ["linear_regression", "logistic_regression"])
def test_a_fitted_guide_predicts_new_inputs_from_the_models_likelihood(model):
    """The guide's prototype, traced on inputs without observations, took the observed site `y` for a latent: a
    fitted linear regression then predicted ~0 everywhere (the guide's own initial `y`), and a logistic
    regression's discrete `y` made NumPyro ask for funsor. The prediction is the model's, under the fitted
    parameters, and the exported function (`inference_function` under `jax.jit`) agrees."""
    import jax

    sigma = {"params/sigma_auto_loc": np.float32(-2.0), "params/sigma_auto_scale": np.float32(0.01)}
    guide = _fitted(model, **(sigma if model == "linear_regression" else {}))
    x = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    mean = x @ np.array([0.5, -1.0, 0.2], np.float32) + 0.1
    expected = mean if model == "linear_regression" else 1 / (1 + np.exp(-mean))
    predicted = guide(x)
    # 500 draws: the Monte Carlo error of the mean is ~0.01 (regression) and ~0.02 (a Bernoulli's mean)
    np.testing.assert_allclose(predicted, expected, atol=0.03 if model == "linear_regression" else 0.07)
    np.testing.assert_allclose(jax.jit(guide.inference_function())(x), predicted, rtol=1e-5, atol=1e-6)
    draws = guide.predictive(x, num_samples=50)
    assert draws["y"].shape == (50, 6)  # the posterior-predictive draws of the observed site


def test_calling_a_fitted_guide_again_or_another_fit_of_it_compiles_nothing():
    """`NumpyroGuide.__call__` is compiled once per configuration and input shapes (`_compiled_mean`): NumPyro's
    eager `Predictive` compiled its draws' loop again on every call. Another fit's parameters are arguments, not
    constants: the same program gives that fit's predictions. Counted, not timed."""
    from pipekit_train.adapters.equinox._steps import CompileCounter

    guide = _fitted("logistic_regression")
    other = _fitted("logistic_regression", **{"params/w_auto_loc": np.array([-0.5, 1.0, 0.2], np.float32)})
    # The shape of test_a_fitted_guide_predicts_new_inputs_from_the_models_likelihood's inputs: where that test ran
    # first in this process, the first call here is its program again (loaded from the run's XLA cache otherwise).
    x = np.random.default_rng(1).normal(size=(6, 3)).astype(np.float32)
    first = guide(x)
    with CompileCounter() as again:
        second = guide(x)
        theirs = other(x)
    assert again.count == 0
    np.testing.assert_array_equal(first, second)
    assert np.abs(theirs - first).max() > 0.1  # the other fit's weights, not the first's baked in


def test_a_restored_svi_state_is_the_programs_argument_type_again(tmp_path, monkeypatch):
    """`load_state_tree` keeps each leaf's dtype and weak type: NumPyro's step count is weakly typed, and restored
    strongly typed it made the step compile again after a resume or an extension in the same process."""
    import jax

    from pipekit_train.adapters.equinox._steps import CompileCounter
    from pipekit_train.adapters.numpyro._svi import SVIBackend

    made: list = []
    init = SVIBackend.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SVIBackend, "__init__", keep)
    loop = _svi(max_steps=8, batch_size=8, steps_per_call=4, log_every_n_steps=4, loss=Trace_ELBO())
    with run_settings(run_dir=str(tmp_path), store=False):
        loop.run()
    backend = made[-1]

    def types(state):
        return [(x.shape, x.dtype, x.weak_type) for x in jax.tree.leaves(state)]

    before = types(backend.state)
    backend.load_state_tree(backend.state_tree())
    assert types(backend.state) == before
    with CompileCounter() as again:  # the chunk of 4 steps the stage ran, on the restored state
        backend.train([{"y": Y[:8]}] * 4, 8)
    assert again.count == 0
