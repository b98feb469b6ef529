"""`TrainingLoop.carry`: continue the previous stage's optimizer state, or start from its EMA weights, exactly."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    EMA,
    MSE,
    ArraySource,
    Checkpoint,
    EquinoxModel,
    Last,
    ParamGroup,
    PipekitTrainWarning,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train._trees import flatten as _flatten
from pipekit_train.checkpoint import Checkpointer
from pipekit_train.stage.preflight import check_pipeline


def _data() -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 4)).astype(np.float32)  # 10 batches of 16: epoch 1 repeats epoch 0 (no shuffle)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": np.tanh(x[:, :1] - x[:, 1:2])}), shuffle=False)


def _ckpt() -> Checkpoint:
    return Checkpoint(every_n_steps=5, keep=(Last(n=1),), async_save=False)


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=_data(),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=10,
        batch_size=16,
        log_every_n_steps=5,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model.module, eqx.is_inexact_array))]


def _by_name(tree) -> dict[str, np.ndarray]:
    """Leaves by path (a model's trained arrays, or a checkpoint's subtree restored as dicts)."""
    if hasattr(tree, "module"):
        tree = eqx.filter(tree.module, eqx.is_inexact_array)
    return {name: np.asarray(x) for name, x in _flatten(tree)}


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


def test_continuing_the_optimizer_state_equals_one_longer_stage_bitwise(tmp_path):
    first = _loop(name="a", callbacks=(_ckpt(),))
    second = _loop(name="b", carry={"optimizer_state": True})
    with run_settings(run_dir=str(tmp_path / "two"), store=False):
        (model, _), _ = pipekit.Sequential([first, second])._apply(None, None)
    with run_settings(run_dir=str(tmp_path / "one"), store=False):
        whole, _ = _loop(name="whole", max_steps=20).run()
    # Adam's moments and count go on; the constant schedule restarts at the same rate; the data repeats per epoch.
    assert _same(model, whole)
    with run_settings(run_dir=str(tmp_path / "fresh"), store=False):
        (restarted, _), _ = pipekit.Sequential([first, second.replace(carry=None)])._apply(None, None)
    assert not _same(restarted, whole)  # a fresh optimizer (moments at zero) takes other steps


def test_a_resume_that_skips_the_finished_stage_carries_the_same_state(tmp_path):
    first = _loop(name="a", callbacks=(_ckpt(),), optimizer_config={"name": "adamw", "lr": 0.01})
    second = _loop(
        name="b",
        carry={"optimizer_state": True},
        optimizer_config={"name": "adamw", "lr": 0.003, "schedule": "warmup_cosine", "warmup_steps": 3},
    )
    pipe = pipekit.Sequential([first, second])
    with run_settings(run_dir=str(tmp_path / "straight"), store=False):
        (straight, _), _ = pipe._apply(None, None)
    # Killed after stage a finished: the resumed run reads a's result back (not trained) and carries from disk.
    with run_settings(run_dir=str(tmp_path / "resumed"), store=False):
        pipekit.Sequential([first])._apply(None, None)
    with (
        run_settings(run_dir=str(tmp_path / "resumed"), store=False, resume="auto"),
        pytest.warns(PipekitTrainWarning, match="nothing to resume"),  # stage b has no checkpoint of its own
    ):
        (resumed, _), _ = pipe._apply(None, None)
    assert _same(straight, resumed)


def test_starting_from_the_ema_weights_or_the_raw_parameters(tmp_path):
    ema = EMA(decay=0.9, warmup=False, return_ema=False, evaluate_with_ema=False)
    first = _loop(name="a", callbacks=(_ckpt(), ema))
    frozen = (ParamGroup(pattern="*", frozen=True),)  # the second stage keeps the weights it starts from
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        (from_ema, _), _ = pipekit.Sequential(
            [first, _loop(name="b", carry={"weights": "ema"}, param_groups=frozen, max_steps=1)]
        )._apply(None, None)
    saved = Checkpointer(tmp_path / "r" / "a" / "checkpoints").restore(10)[0]
    assert _equal(_by_name(from_ema), _by_name(saved["ema"]))
    assert not _equal(_by_name(from_ema), _by_name(saved["params"]))
    # A stage that returned its EMA: `weights: params` starts from the trained parameters instead.
    first_ema = _loop(name="a", callbacks=(_ckpt(), ema.replace(return_ema=True)))
    with run_settings(run_dir=str(tmp_path / "p"), store=False):
        (from_params, _), _ = pipekit.Sequential(
            [first_ema, _loop(name="b", carry={"weights": "params"}, param_groups=frozen, max_steps=1)]
        )._apply(None, None)
    saved = Checkpointer(tmp_path / "p" / "a" / "checkpoints").restore(10)[0]
    assert _equal(_by_name(from_params), _by_name(saved["params"]))


def test_errors_come_before_training_as_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"TrainingLoop.carry has no key 'optimiser_state' \(did you mean 'optimizer_state'\?\)"
    ):
        _loop(carry={"optimiser_state": True})
    with pytest.raises(
        ConfigError, match=r"TrainingLoop.carry.weights must be one of returned, ema, params, got 'emma'"
    ):
        _loop(carry={"weights": "emma"})
    with pytest.raises(ConfigError, match=r"TrainingLoop.carry.optimizer_state must be true or false, got 'yes'"):
        _loop(carry={"optimizer_state": "yes"})
    with pytest.raises(ConfigError, match=r"stage 'b': .* the previous stage has no Checkpoint callback; add"):
        check_pipeline(pipekit.Sequential([_loop(name="a"), _loop(name="b", carry={"optimizer_state": True})]))
    with pytest.raises(ConfigError, match=r"stage 'a': TrainingLoop.carry .* the stage is the first of its pipeline"):
        check_pipeline(_loop(name="a", carry={"optimizer_state": True}))
    with pytest.raises(
        ConfigError, match=r"stage 'b': TrainingLoop.carry.weights is 'ema' but the previous stage kept no EMA"
    ):
        check_pipeline(
            pipekit.Sequential([_loop(name="a", callbacks=(_ckpt(),)), _loop(name="b", carry={"weights": "ema"})])
        )
    # Another optimizer: the states do not match, said before the second stage trains.
    pipe = pipekit.Sequential(
        [
            _loop(name="a", callbacks=(_ckpt(),), optimizer_config={"name": "sgd", "lr": 0.1, "momentum": 0.9}),
            _loop(name="b", carry={"optimizer_state": True}),
        ]
    )
    with (
        run_settings(run_dir=str(tmp_path / "r"), store=False),
        pytest.raises(
            ConfigError,
            match=r"stage 'b': TrainingLoop.carry cannot continue the previous stage's optimizer state: it has "
            r"another structure than this stage's \(not in the previous stage's: ",
        ),
    ):
        pipe._apply(None, None)
    assert not (tmp_path / "r" / "b" / "metrics.jsonl").exists()


def test_carry_round_trips_through_yaml():
    text = (
        "type: TrainingLoop\nname: tune\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\nloss: {type: MSE}\n"
        "carry: {optimizer_state: true, weights: ema}\n"
    )
    loop = pipekit.loads(text)
    assert loop.carry == {"optimizer_state": True, "weights": "ema"}
    assert pipekit.loads(pipekit.dumps(loop)) == loop
    with pytest.raises(ConfigError, match=r"TrainingLoop.carry has no key 'weight' \(did you mean 'weights'\?\)"):
        pipekit.loads(text.replace("weights: ema", "weight: ema"))
