"""EarlyStopping, ReduceLROnPlateau and EMA: their rules, and their effect on real runs."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from tests.test_loop import _loop, _regression

from pipekit import ConfigError
from pipekit_train import EMA, Callback, EarlyStopping, ReduceLROnPlateau, TrainContext, run_settings
from pipekit_train.tracking._writers import NullWriter


def _ctx(callback, lr_scale=None):
    class Scale:
        value = 1.0

        def get(self):
            return self.value

        def set(self, v):
            self.value = v

    scale = lr_scale or Scale()
    ctx = TrainContext(
        loop=None,
        stage="s",
        run_id="r",
        run_dir=None,
        writer=NullWriter(),
        callback_states={0: callback.initial_state()},
        callbacks=(callback,),
        get_model=lambda: None,
        lr_scale=scale,
    )
    return ctx, scale


def test_early_stopping_counts_patience_and_names_the_reason():
    cb = EarlyStopping(patience=2, min_delta=0.01)
    ctx, _ = _ctx(cb)
    for step, value in enumerate([1.0, 0.5, 0.495, 0.6], start=1):
        ctx.step = step * 10
        cb.on_eval_end(ctx, {"validate/loss": value})
        if step < 4:
            assert ctx.stop_reason is None
    assert ctx.stop_reason.startswith("early stopping: validate/loss did not improve")
    assert "best 0.5 at step 20" in ctx.stop_reason
    assert ctx.state_of(cb)["bad_evals"] == 2


def test_early_stopping_unknown_monitor_suggests():
    cb = EarlyStopping(monitor="validate/los")
    ctx, _ = _ctx(cb)
    with pytest.raises(ConfigError, match=r"'validate/los' is not among.*did you mean 'validate/loss'"):
        cb.on_eval_end(ctx, {"validate/loss": 1.0})


def test_reduce_lr_on_plateau_follows_pytorchs_rule():
    # Hand-worked with torch.optim.lr_scheduler.ReduceLROnPlateau(mode="min", factor=0.5, patience=1,
    # cooldown=1, threshold=0.1, threshold_mode="rel"): reductions after the 4th and 7th values.
    cb = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=1, threshold=0.1)
    ctx, scale = _ctx(cb)
    scales = []
    for i, value in enumerate([10.0, 9.5, 9.4, 9.3, 9.2, 9.1, 9.0, 8.0]):
        ctx.step = i
        cb.on_eval_end(ctx, {"validate/loss": value})
        scales.append(scale.value)
    assert scales == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    assert ctx.state_of(cb)["reductions"] == [[2, 0.5], [5, 0.25]]


def test_plateau_scale_reaches_the_optimizer():
    loop = _loop(
        max_steps=40,
        val_dataset=_regression(seed=1),
        eval_every_n_steps=10,
        callbacks=(ReduceLROnPlateau(patience=0, threshold=10.0, factor=0.5),),
    )
    with run_settings(store=False):
        _, artifact = loop.run()
    # Evaluations at steps 10..40; the first sets the best, each later one halves the scale. The train record of
    # step 40 is written before that step's evaluation, so it shows the two reductions made at steps 20 and 30.
    assert artifact.final_metrics["train/lr"] == pytest.approx(0.05 * 0.5**2)


def test_early_stopping_ends_a_real_run_early():
    loop = _loop(
        max_steps=400,
        val_dataset=_regression(seed=1),
        eval_every_n_steps=10,
        optimizer_config={"name": "sgd", "lr": 1e-6},
        callbacks=(EarlyStopping(patience=2, min_delta=1.0),),
    )
    with run_settings(store=False):
        _, artifact = loop.run()
    assert artifact.status.startswith("stopped: early stopping")
    assert artifact.backend_info["steps"] == 30


def test_ema_weights_follow_the_rule_and_are_returned():
    loop = _loop(max_steps=1, callbacks=(EMA(decay=0.9),))
    plain = _loop(max_steps=1)
    with run_settings(store=False):
        ema_model, _ = loop.run()
        raw_model, _ = plain.run()
    init = plain.model_op.build(jax.random.split(jax.random.key(plain.seed))[0])
    d = min(0.9, 2.0 / 11.0)
    for e, p0, p1 in zip(
        jax.tree.leaves(eqx.filter(ema_model.module, eqx.is_array)),
        jax.tree.leaves(eqx.filter(init, eqx.is_array)),
        jax.tree.leaves(eqx.filter(raw_model.module, eqx.is_array)),
    ):
        np.testing.assert_allclose(np.asarray(e), d * np.asarray(p0) + (1 - d) * np.asarray(p1), rtol=1e-6)


def test_control_arguments_are_checked():
    with pytest.raises(ConfigError, match=r"EarlyStopping.patience must be a positive int, got 0"):
        EarlyStopping(patience=0)
    with pytest.raises(ConfigError, match=r"ReduceLROnPlateau.factor must be in \(0, 1\), got 1.5"):
        ReduceLROnPlateau(factor=1.5)
    with pytest.raises(ConfigError, match=r"EMA.decay must be in \(0, 1\), got 1.0"):
        EMA(decay=1.0)


_SEEN: list = []


class DayOneFieldsRecorder(Callback):
    """Puts a user's values in the artifact and notes what `ctx.model` is at the end (for the test below)."""

    def on_train_end(self, ctx) -> None:
        ctx.artifact_fields["dataset_version"] = "v3"
        ctx.artifact_fields.update(scaler={"mean": [1.5, -2.0], "std": [0.5, 2.0]})
        try:
            ctx.artifact_fields["weights"] = np.zeros(2)
        except TypeError as e:
            _SEEN.append(str(e))
        _SEEN.append(ctx.model.weights_hash())


@pytest.mark.parametrize("return_ema", [True, False])
def test_artifact_keeps_a_users_fields_and_ctx_model_is_the_returned_model(tmp_path, return_ema):
    """Unknown ``ctx.artifact_fields`` keys were dropped; they go to ``artifact.user``. ``ctx.model`` is the model
    the stage returns: the EMA with ``return_ema``, the raw weights without."""
    from pipekit_train import ArtifactStore

    _SEEN.clear()
    loop = _loop(max_steps=2, callbacks=(EMA(decay=0.9, return_ema=return_ema), DayOneFieldsRecorder()))
    with run_settings(run_dir=str(tmp_path / "run"), store=str(tmp_path / "s.sqlite")):
        model, artifact = loop.run()
    message, seen_hash = _SEEN
    assert message.startswith("ctx.artifact_fields['weights'] must be JSON data") and "ndarray" in message
    assert artifact.user == {"dataset_version": "v3", "scaler": {"mean": [1.5, -2.0], "std": [0.5, 2.0]}}
    assert ArtifactStore(str(tmp_path / "s.sqlite")).get(artifact.artifact_id).user == artifact.user
    assert seen_hash == model.weights_hash() == artifact.trained_model_hash
    raw = _loop(max_steps=2)
    with run_settings(store=False):
        raw_model, _ = raw.run()
    assert (seen_hash == raw_model.weights_hash()) is (not return_ema)
