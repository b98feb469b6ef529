"""A Stan user's workflow on eight schools: the data from a Stan-format JSON file (no batch_size), the centered and
non-centered models sampled once each (one module fixture), and what is recorded with the posterior: the pointwise
log-likelihood (equal to NumPyro's ``log_likelihood`` on the same draws), posterior and prior predictive draws, the
observed sites' values, NUTS's tree depth and the precision, all in the ArviZ export."""

from __future__ import annotations

import contextlib
import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import run_settings
from pipekit_train.adapters.numpyro import register_numpyro_model
from pipekit_train.stage.preflight import check

from .conftest import SIGMA, Y8

pytestmark = pytest.mark.xdist_group("bayes-stan-workflow")

WARMUP, SAMPLES, CHAINS, PRIOR = 150, 150, 2, 40

STAGE = """
pipekit: 1
type: TrainingLoop
name: {name}
model_op: {{type: NumpyroModel, model: eight_schools_{model}}}
dataset: {{type: TrainingDataset, source: {{type: DataFile, path: {data}}}}}
task:
  type: NUTS
  num_warmup: {warmup}
  num_samples: {samples}
  num_chains: {chains}
  posterior_predictive: {predictive}
  prior_predictive: {prior}
max_steps: {steps}
progress: {progress}
seed: {seed}
"""


def _stage(name: str, data: Any, **fields: Any) -> Any:
    values = dict(warmup=WARMUP, samples=SAMPLES, chains=CHAINS, steps=WARMUP + SAMPLES, seed=1)
    values.update(model="noncentered", predictive="false", prior=0, progress="false")
    return pipekit.loads(STAGE.format(name=name, data=data, **{**values, **fields}))


def _arviz() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return pytest.importorskip("arviz")


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: Any) -> dict[str, Any]:
    """Eight schools (non-centered) sampled twice from ``eight_schools.json`` into one artifact store: ``a`` with
    posterior and prior predictive draws and its progress lines (captured), ``b`` another seed of the same program
    (compiled once)."""
    work = tmp_path_factory.mktemp("stan")
    data = work / "eight_schools.json"
    data.write_text(json.dumps({"J": 8, "y": Y8.astype(int).tolist(), "sigma": SIGMA.astype(int).tolist()}))
    out: dict[str, Any] = {"work": work, "data": data, "store": str(work / "store.sqlite")}
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with run_settings(run_dir=str(work / "a"), store=out["store"]):
            out["a"] = _stage("a", data, predictive="true", prior=PRIOR, progress="true").run()
        with run_settings(run_dir=str(work / "b"), store=out["store"]):
            out["b"] = _stage("b", data, seed=2).run()
    out["err"] = err.getvalue()
    return out


def _export(sampled: dict[str, Any], name: str) -> Any:
    from pipekit_train.cli import main

    path = sampled["work"] / f"{name}.nc"
    if not path.exists():
        artifact = sampled[name][1]
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(
                ["export", artifact.artifact_id, "--format", "arviz", "-o", str(path), "--store", sampled["store"]]
            )
        assert rc == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _arviz().from_netcdf(str(path))


def test_a_stan_json_file_needs_no_batch_size_and_its_hash_is_the_artifacts(sampled: dict[str, Any]) -> None:
    model, artifact = sampled["a"]
    assert model.posterior.draws["theta"].shape == (CHAINS, SAMPLES, 8)
    loop = _stage("a", sampled["data"])
    assert loop.batch_size == 32  # the default, unused: the data is one record
    assert artifact.dataset_hash == loop.dataset.content_hash()
    assert artifact.backend_info["precision"] == "float32"
    assert "batch_size" not in sampled["err"]  # no note: batch_size was not set


def test_the_samplers_log_speaks_of_draws_not_of_epochs_losses_or_parameters(sampled: dict[str, Any]) -> None:
    err = sampled["err"]
    lines = [line for line in err.splitlines() if line.startswith("a: step ")]
    assert lines, err
    for word in ("epoch", "loss", "ex/s", "parameters", "steps/s"):
        assert word not in err, (word, err)
    last = lines[-1]
    assert re.search(r"chains 0-1 sampling 150/150 \| divergences \[\d+ \d+\] \| step size \[\S+ \S+\]", last), last
    assert re.search(r"accept \[0\.\d+ 0\.\d+\] \| tree depth \[\d+ \d+\]", last), last
    assert "draws/s" in err and "train/potential_energy" in err


def test_a_name_the_model_does_not_take_is_refused_naming_the_file_key_shape_and_parameters(tmp_path: Path) -> None:
    path = tmp_path / "schools.json"
    path.write_text(json.dumps({"J": 8, "y": Y8.tolist(), "sigma": SIGMA.tolist(), "sigmas": [1.0, 2.0]}))
    with pytest.raises(ConfigError) as info:
        check(_stage("s", path, model="centered"), None, "s")
    assert str(info.value) == (
        f"stage 's' (NumpyroModel(model='eight_schools_centered')): DataFile '{path}' has 'sigmas' (shape (2,)), "
        "which is not a parameter of model 'eight_schools_centered' (did you mean 'sigma'?); the model takes: J, "
        "sigma, y (drop the name from the file, or select names with keys: [...])"
    )


def test_a_batch_size_set_on_a_sampler_stage_is_noted_as_unused(sampled: dict[str, Any], capsys: Any) -> None:
    check(_stage("s", sampled["data"]).replace(batch_size=8), None, "s")
    assert (
        "note: stage 's': batch_size (8) is unused: a sampler takes the data whole; remove it"
        in capsys.readouterr().err
    )


def test_the_export_holds_log_likelihood_equal_to_numpyros_and_predictive_groups(sampled: dict[str, Any]) -> None:
    from numpyro.infer import log_likelihood

    from pipekit_train.adapters.bayes import get_numpyro_model

    az = _arviz()
    idata = _export(sampled, "a")
    groups = set(idata.groups())
    assert {"posterior", "sample_stats", "log_likelihood", "posterior_predictive", "observed_data"} <= groups
    assert {"prior", "prior_predictive"} <= groups
    draws = {k: idata.posterior[k].values for k in idata.posterior.data_vars}
    fn = get_numpyro_model("eight_schools_noncentered").fn
    expected = log_likelihood(fn, draws, batch_ndims=2, J=8, sigma=SIGMA.astype(int), y=Y8.astype(int))["y"]
    assert np.array_equal(idata.log_likelihood["y"].values, np.asarray(expected))
    assert np.array_equal(idata.observed_data["y"].values, Y8)
    assert idata.posterior_predictive["y"].shape == (CHAINS, SAMPLES, 8)
    assert idata.prior_predictive["y"].shape == (1, PRIOR, 8) and idata.prior["tau"].shape == (1, PRIOR)
    stats = idata.sample_stats
    assert stats["tree_depth"].shape == (CHAINS, SAMPLES)  # NumPyro's NUTS: from its leapfrog steps
    assert np.all(2 ** (stats["tree_depth"].values - 1) <= stats["n_steps"].values)
    assert np.all(stats["n_steps"].values <= 2 ** stats["tree_depth"].values - 1)
    loo = az.loo(idata, pointwise=True)
    assert np.isfinite(loo.elpd_loo) and loo.pareto_k.shape == (8,)
    import matplotlib

    matplotlib.use("Agg")
    az.plot_ppc(idata, num_pp_samples=5)


@register_numpyro_model("test_stan_covered", observed=("earn",))
def _covered(earn: Any = None) -> None:
    """Observes ``log(earn)`` and only from the third record on: the observed data is that site's value."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    numpyro.sample("log_earn", dist.Normal(mu, 1.0).expand([3]), obs=jnp.log(earn[2:]))


def test_observed_data_is_the_observed_sites_value_not_the_argument() -> None:
    from pipekit_train.adapters.bayes import get_numpyro_model
    from pipekit_train.adapters.bayes._predictive import observed_sites

    earn = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    observed = observed_sites(get_numpyro_model("test_stan_covered").fn, {"earn": earn})
    assert list(observed) == ["log_earn"] and np.allclose(observed["log_earn"], np.log(earn[2:]))


def test_artifacts_compare_loo_prints_and_records_evaluations(sampled: dict[str, Any], capsys: Any) -> None:
    _arviz()
    from pipekit_train.cli import main
    from pipekit_train.provenance import ArtifactStore

    a, b = sampled["a"][1].artifact_id, sampled["b"][1].artifact_id
    rc = main(["artifacts", "compare", a[:12], b[:12], "--loo", "--store", sampled["store"]])
    out = capsys.readouterr().out
    assert rc == 0, out
    header = out.splitlines()[0].split()
    assert header[:5] == ["rank", "elpd_loo", "p_loo", "elpd_diff", "weight"], out
    assert a in out and b in out and "recorded 2 evaluation(s) of kind 'comparison'" in out
    records = ArtifactStore(sampled["store"]).evaluations(artifact_id=a)
    (record,) = [r for r in records if r["kind"] == "comparison"]
    assert record["data"] == f"compare loo: {a},{b}" and record["records"] == 8
    metrics = record["metrics"]
    assert {"loo/elpd_loo", "loo/p_loo", "loo/weight", "loo/pareto_k_max", "loo/se"} <= set(metrics)
    assert np.isfinite(metrics["loo/elpd_loo"]) and 0 <= metrics["loo/weight"] <= 1
    assert main(["artifacts", "compare", a[:12], "--loo", "--store", sampled["store"]]) == 2
    assert "compare needs at least two artifacts, got 1" in capsys.readouterr().err


def test_predict_writes_posterior_predictive_draws_for_new_data(sampled: dict[str, Any], capsys: Any) -> None:
    from pipekit_train.cli import main
    from pipekit_train.provenance import ArtifactStore

    az = _arviz()
    artifact = sampled["b"][1]
    new = sampled["work"] / "new.json"
    new.write_text(json.dumps({"J": 8, "sigma": (SIGMA / 2).tolist()}))  # new standard errors, no observations
    out = sampled["work"] / "pp.nc"
    rc = main(["predict", artifact.artifact_id, "--data", str(new), "-o", str(out), "--store", sampled["store"]])
    assert rc == 0 and "posterior_predictive (y)" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        idata = az.from_netcdf(str(out))
    assert {"posterior", "posterior_predictive"} <= set(idata.groups()) and "observed_data" not in idata.groups()
    assert idata.posterior_predictive["y"].shape == (CHAINS, SAMPLES, 8)
    assert idata.attrs["pipekit_artifact_id"] == artifact.artifact_id
    records = ArtifactStore(sampled["store"]).evaluations(artifact_id=artifact.artifact_id)
    (record,) = [r for r in records if r["kind"] == "prediction"]
    assert record["output"] == str(out) and record["output_hash"].startswith("sha256:")
    new.write_text(json.dumps({"J": 8, "sigma": SIGMA.tolist(), "sigmas": [1.0]}))
    assert main(["predict", artifact.artifact_id, "--data", str(new), "-o", str(out), "--store", sampled["store"]]) == 2
    assert "has 'sigmas' (shape (1,)), which is not a parameter" in capsys.readouterr().err


def test_the_recorded_precision_is_the_one_jax_samples_in() -> None:
    """``backend_info["precision"]`` follows JAX's 64-bit mode (``JAX_ENABLE_X64=1`` for a whole run)."""
    import jax

    from pipekit_train.adapters.bayes import precision

    assert precision() == "float32"
    with jax.enable_x64(True):
        assert precision() == "float64"


def test_the_eight_schools_example_passes_pre_flight_from_the_repository_root(monkeypatch: Any) -> None:
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    for name in ("centered", "noncentered"):
        loop = pipekit.load(f"examples/bayes/eight_schools/{name}.yaml")
        assert loop.dataset.num_records() == 1 and loop.batch_size == 32  # Stan's file, no batch_size
        check(loop, None, name)  # data names against the model's parameters, sites (one abstract trace)


def test_svi_refuses_a_data_file_it_would_batch(tmp_path: Path) -> None:
    from pipekit_train.adapters.numpyro import NumpyroGuide, Trace_ELBO

    data = tmp_path / "schools.json"
    data.write_text(json.dumps({"J": 8, "y": Y8.tolist(), "sigma": SIGMA.tolist()}))
    loop = _stage("s", data).replace(
        model_op=NumpyroGuide(model="eight_schools_noncentered"), task=None, loss=Trace_ELBO(), batch_size=1
    )
    with pytest.raises(ConfigError, match=r"numpyro-svi fits on mini-batches of records, and a DataFile is one"):
        check(loop, None, "s")
