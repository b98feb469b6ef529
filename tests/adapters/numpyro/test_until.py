"""Sampling until converged (``until``), the diagnostics it checks (ArviZ's, in NumPy), the ArviZ export and the
multi-chain progress line."""

from __future__ import annotations

import contextlib
import io
import re
import warnings

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import ArraySource, TrainingDataset, TrainingLoop, load_model, run_settings
from pipekit_train.adapters.bayes import UNTIL_DEFAULT_CHECK_GROWTH, check_after, diagnostics, ess_bulk, ess_tail, r_hat
from pipekit_train.adapters.numpyro import NUTS, NumpyroModel
from pipekit_train.stage.preflight import check

from .conftest import Y, cli_run_killed_after, committed_steps, subprocess_env

WARMUP, CHAINS, EVERY, CHUNK, MAX_DRAWS, SEED = 100, 4, 50, 50, 2000, 3
UNTIL = {"r_hat_max": 1.01, "ess_bulk_min": 400, "check_every": EVERY, "max_draws": MAX_DRAWS}

with warnings.catch_warnings():
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    pytestmark = pytest.mark.xdist_group("bayes-until")


def _arviz():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return pytest.importorskip("arviz")


# The diagnostics are ArviZ's ----------------------------------------------------------------------------------
def test_r_hat_bulk_and_tail_ess_equal_arviz():
    """Autocorrelated chains, a stuck chain, ties, a constant, one chain, an odd number of draws: every value is
    ArviZ's own to 1e-9 (relative), NaN where ArviZ gives NaN."""
    az = _arviz()
    rng = np.random.default_rng(1)
    walk = rng.normal(size=(4, 301)).cumsum(axis=1) * 0.1 + rng.normal(size=(4, 301))
    stuck = rng.normal(size=(4, 300)) + np.array([[0], [0], [0], [2.0]])
    ties = rng.integers(0, 5, size=(3, 200)).astype(np.float64)
    cases = [walk, stuck, ties, rng.normal(size=(1, 400)), np.ones((2, 50)), rng.normal(size=(2, 5))]
    cases.append(walk.astype(np.float32))  # float32 draws: ArviZ folds them in float32
    for x in cases:
        with np.errstate(invalid="ignore"), warnings.catch_warnings():  # the constant: 0/0, NaN in both
            warnings.simplefilter("ignore", RuntimeWarning)
            ours = [r_hat(x), ess_bulk(x), ess_tail(x)]
            theirs = [az.rhat(x, method="rank"), az.ess(x, method="bulk"), az.ess(x, method="tail")]
        np.testing.assert_allclose(ours, [float(t) for t in theirs], rtol=1e-9, equal_nan=True)
    # Several scalars at once (what `until` checks): the worst of each.
    stacked = np.stack([walk[:, :300], stuck], axis=-1)
    d = diagnostics({"a": stacked})
    assert d["r_hat_max"] == pytest.approx(max(r_hat(walk[:, :300]), r_hat(stuck)), rel=1e-12)
    assert d["ess_bulk_min"] == pytest.approx(min(ess_bulk(walk[:, :300]), ess_bulk(stuck)), rel=1e-12)


# Bad `until`: one line each, before sampling ------------------------------------------------------------------
def _loop(**kernel):
    return TrainingLoop(
        model_op=NumpyroModel(model="conjugate_normal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": Y})),
        task=NUTS(**{"num_warmup": WARMUP, "num_chains": CHAINS, **kernel}),
        backend="numpyro-mcmc",
        batch_size=len(Y),
        max_steps=WARMUP + MAX_DRAWS,
        steps_per_call=CHUNK,
        progress=False,
        name="s",
    )


@pytest.mark.parametrize(
    ("until", "message"),
    [
        ({"rhat_max": 1.01}, r"NUTS.until: unknown key 'rhat_max' \(did you mean 'r_hat_max'\?\)"),
        ({"ess_bulk_min": 0}, r"NUTS.until.ess_bulk_min must be > 0, got 0"),
        ({"ess_bulk_min": 400, "check_every": -5}, r"NUTS.until.check_every must be > 0, got -5"),
        ({"r_hat_max": 0.99}, r"NUTS.until.r_hat_max must be > 1"),
        ({"check_every": 100}, r"NUTS.until names no criterion"),
        ({"ess_bulk_min": 400, "max_draws": 2.5}, r"NUTS.until.max_draws must be an int, got 2.5"),
        ({"ess_bulk_min": 400, "check_growth": -0.5}, r"NUTS.until.check_growth must be >= 0 .*got -0.5"),
        ({"ess_bulk_min": 400, "check_grow": 0.5}, r"unknown key 'check_grow' \(did you mean 'check_growth'"),
    ],
)
def test_bad_until_keys_and_values_are_refused_in_one_line(until, message):
    with pytest.raises(ConfigError, match=message) as e:
        NUTS(num_warmup=WARMUP, until=until)
    assert "\n" not in str(e.value)


def test_until_against_the_stage_is_refused_before_sampling():
    with pytest.raises(ConfigError, match=r"check_every \(75\) must be a multiple of steps_per_call \(50\).*75"):
        check(_loop(until={**UNTIL, "check_every": 75}), None, "s")
    with pytest.raises(ConfigError, match=r"r_hat_max needs num_chains >= 2"):
        check(_loop(num_chains=1, until=UNTIL), None, "s")
    with pytest.raises(ConfigError, match=r"max_draws \(2000\) and NUTS.num_samples \(500\) disagree"):
        NUTS(num_samples=500, until=UNTIL)
    with pytest.raises(ConfigError, match=r"set max_steps: 2100"):
        check(_loop(until=UNTIL).replace(max_steps=600), None, "s")
    check(_loop(until=UNTIL), None, "s")  # the good one passes


# A run that stops when converged ------------------------------------------------------------------------------
PIPELINE = f"""\
pipekit: 1
type: TrainingLoop
name: nuts
model_op: {{{{type: NumpyroModel, model: conjugate_normal}}}}
dataset: {{{{type: TrainingDataset, source: {{{{type: NpzSource, path: {{data}}}}}}, shuffle: false}}}}
task: {{{{type: NUTS, num_warmup: {WARMUP}, num_chains: {CHAINS}, until: {{{{r_hat_max: 1.01, ess_bulk_min: 400,
  check_every: {EVERY}, max_draws: {MAX_DRAWS}}}}}}}}}
backend: numpyro-mcmc
batch_size: 10
max_steps: {WARMUP + MAX_DRAWS}
steps_per_call: {CHUNK}
log_every_n_steps: {CHUNK}
progress: {{progress}}
seed: {SEED}
callbacks:
- type: Checkpoint
  every_n_steps: {CHUNK}
  async_save: false
"""


@pytest.fixture(scope="module")
def converged(tmp_path_factory):
    """One uninterrupted `until` stage (artifact store on, progress shown on a captured plain stream)."""
    data = tmp_path_factory.mktemp("data") / "data.npz"
    np.savez(data, y=Y)
    work = tmp_path_factory.mktemp("until")
    err = io.StringIO()
    with run_settings(run_dir=str(work / "run"), store=str(work / "store.sqlite")), contextlib.redirect_stderr(err):
        model, artifact = pipekit.loads(PIPELINE.format(data=data, progress="true")).run()
    return model, artifact, work, data, err.getvalue()


def _check_points(budget: int, every: int = EVERY, growth: float = UNTIL_DEFAULT_CHECK_GROWTH) -> list[int]:
    """The sampling iterations `until` checks at: `check_after` from the warm-up's end, and the budget's end."""
    points = [check_after(0, every, growth)]
    while points[-1] < budget:
        points.append(min(budget, check_after(points[-1], every, growth)))
    return points


def test_checks_are_spaced_by_check_every_then_in_proportion_to_the_draws():
    assert _check_points(2000, growth=0.25)[:10] == [50, 100, 150, 200, 250, 350, 450, 600, 750, 950]
    assert _check_points(2000, growth=0.25)[-3:] == [1500, 1900, 2000]  # the last check: the budget's end
    assert _check_points(500, growth=0) == list(range(50, 501, 50))  # growth 0: every check_every
    # The total of the draws read by the checks grows in proportion to the budget, not with its square.
    assert sum(_check_points(20_000, 250)) < 6 * 20_000 < sum(_check_points(20_000, 250, growth=0)) / 6


def test_until_stops_at_the_first_check_that_meets_every_criterion(converged):
    model, artifact, _, _, _ = converged
    until = artifact.backend_info["until"]
    assert until["stopped"] == "converged"
    draws = model.posterior.draws["mu"]
    n = draws.shape[1]
    points = _check_points(MAX_DRAWS)
    assert until["draws"] == until["iterations"] == n and n in points and n < MAX_DRAWS
    assert artifact.backend_info["steps"] == WARMUP + n == until["step"]
    # The values at the stop are the draws' diagnostics; they meet the criteria, the previous check's did not.
    values = diagnostics(model.posterior.draws)
    assert until["r_hat_max"] == values["r_hat_max"] <= 1.01 and until["ess_bulk_min"] == values["ess_bulk_min"] >= 400
    assert until["ess_tail_min"] == values["ess_tail_min"]  # not a criterion: the posterior report's value
    before = diagnostics({"mu": draws[:, : points[points.index(n) - 1]]})
    assert before["r_hat_max"] > 1.01 or before["ess_bulk_min"] < 400
    assert until["checks"] == points.index(n) + 1 and until["config"] == UNTIL
    assert artifact.status == "completed" and artifact.final_metrics["posterior/ess_bulk_min"] >= 400


@pytest.mark.slow
def test_a_sigkilled_until_run_resumed_stops_at_the_same_draw_with_the_same_bits(converged, tmp_path, xla_cache_env):
    """SIGKILL a CLI run after its first sampling checkpoint (checks have run, it has not converged), resume
    it: it stops at the same draw, and every draw is the uninterrupted run's, byte for byte. The killed process
    shares the run's persistent XLA cache, so it loads the programs the uninterrupted run (`converged`) compiled."""
    straight, artifact, _, data, _ = converged
    stop = artifact.backend_info["until"]["step"]
    kill_at = WARMUP + EVERY
    assert stop > kill_at + EVERY, "the run converged too early for a kill during sampling"
    yaml_text = PIPELINE.format(data=data, progress="false")
    (tmp_path / "p.yaml").write_text(yaml_text)
    run_dir = tmp_path / "killed"
    env = {**subprocess_env(tmp_path / "xla-cache"), **xla_cache_env}
    cli_run_killed_after(tmp_path, run_dir, "nuts", kill_at, False, env)
    assert WARMUP < max(committed_steps(run_dir / "nuts" / "checkpoints")) < stop
    with run_settings(run_dir=str(run_dir), store=False, resume="auto"):
        resumed, resumed_artifact = pipekit.loads(yaml_text).run()
    assert resumed_artifact.backend_info["until"]["step"] == stop
    assert resumed_artifact.backend_info["until"]["stopped"] == "converged"
    assert resumed.posterior.draws["mu"].tobytes() == straight.posterior.draws["mu"].tobytes()


# ArviZ export -------------------------------------------------------------------------------------------------
def test_export_arviz_is_read_by_arviz_with_the_groups_and_summary_of_the_artifact(converged, capsys):
    az = _arviz()
    from pipekit_train.cli import main

    model, artifact, work, _, _ = converged
    out = work / "post.nc"
    rc = main(["export", artifact.artifact_id[:12], "--format", "arviz", "-o", str(out), "--store",
               str(work / "store.sqlite")])  # fmt: skip
    assert rc == 0 and "ArviZ InferenceData" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        idata = az.from_netcdf(str(out))
    assert {"posterior", "sample_stats", "observed_data"} <= set(idata.groups())
    draws = model.posterior.draws["mu"]
    assert np.array_equal(idata.posterior["mu"].values, draws)
    stats = idata.sample_stats
    assert {"diverging", "energy", "step_size", "n_steps", "acceptance_rate", "lp"} <= set(stats.data_vars)
    assert stats["diverging"].shape == draws.shape and stats["diverging"].dtype == bool
    assert int(stats["diverging"].sum()) == artifact.final_metrics["posterior/divergences"]
    assert np.array_equal(idata.observed_data["y"].values, Y)
    assert idata.attrs["pipekit_artifact_id"] == artifact.artifact_id
    assert idata.posterior.attrs["pipekit_weights_hash"] == artifact.trained_model_hash
    summary = az.summary(idata, round_to="none")
    m = artifact.final_metrics
    assert summary["r_hat"].max() == pytest.approx(m["posterior/r_hat_max"], rel=1e-6)
    assert summary["ess_bulk"].min() == pytest.approx(m["posterior/ess_bulk_min"], rel=1e-6)
    assert summary["ess_tail"].min() == pytest.approx(m["posterior/ess_tail_min"], rel=1e-6)
    # The registered model's own posterior converts too (posterior group only: the model holds the draws).
    loaded = load_model(artifact.model_registry_uri).posterior.to_arviz()
    assert np.array_equal(loaded.posterior["mu"].values, draws)


# The progress line shows the chains ---------------------------------------------------------------------------
def test_the_progress_line_shows_each_chains_phase_and_divergences(converged):
    *_, err = converged
    lines = [line for line in err.splitlines() if re.match(r"nuts: step \d+/", line)]  # the progress lines
    pattern = re.compile(
        r"chains 0-3 (warm-up (\d+)/100|sampling (\d+)/2000) \| divergences \[(\d+) (\d+) (\d+) (\d+)\]"
    )
    found = [pattern.search(line) for line in lines]
    assert lines and all(found), lines
    steps = [int(re.match(r"nuts: step (\d+)", line).group(1)) for line in lines]  # type: ignore[union-attr]
    for step, match in zip(steps, found):
        assert match is not None
        if step < WARMUP:
            assert match.group(2) == str(step)
        else:
            assert match.group(3) == str(step - WARMUP)


# BlackJAX: the same `until`, and NUTS's tree depth in the sample statistics ------------------------------------
def test_blackjax_until_stops_when_converged_and_keeps_the_tree_depth(tmp_path):
    pytest.importorskip("blackjax")
    from pipekit_train.adapters.bayes import read_groups
    from pipekit_train.adapters.blackjax import BlackjaxModel

    until = {"r_hat_max": 1.02, "ess_bulk_min": 200, "check_every": EVERY, "max_draws": 1000}
    loop = _loop(until=until, num_chains=2).replace(
        model_op=BlackjaxModel(model="conjugate_normal"), backend="blackjax", max_steps=WARMUP + 1000
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        model, artifact = loop.run()
    info = artifact.backend_info["until"]
    draws = model.posterior.draws["mu"]
    assert info["stopped"] == "converged" and info["draws"] == draws.shape[1] < 1000
    assert info["step"] == artifact.backend_info["steps"] == WARMUP + draws.shape[1]
    assert info["ess_bulk_min"] == diagnostics(model.posterior.draws)["ess_bulk_min"] >= 200
    stats = read_groups(str(tmp_path / "run" / "s"))["sample_stats"]
    assert {"tree_depth", "energy", "diverging", "step_size", "n_steps", "acceptance_rate", "lp"} <= set(stats)
    assert stats["tree_depth"].shape == draws.shape and stats["tree_depth"].min() >= 1
    # NUTS's leapfrog steps fit in the tree: at most 2**depth - 1.
    assert np.all(stats["n_steps"] <= 2 ** stats["tree_depth"].astype(np.int64) - 1)
