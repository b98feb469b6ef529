"""`TrainingLoop.param_groups`: learning-rate scales, freezing, gradual unfreezing, L2-SP; and `diagnostics`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    SAM,
    ArraySource,
    Checkpoint,
    CheckpointMismatchError,
    CrossEntropy,
    EquinoxModel,
    ParamGroup,
    TrainingDataset,
    TrainingLoop,
    read_jsonl,
    run_settings,
)
from pipekit_train.adapters.equinox._steps import chunk_cache_size
from pipekit_train.backends._optax import build_optimizer
from pipekit_train.backends._optax_transforms import L2SPState, reset_anchor

CLF = EquinoxModel(factory="classifier", kwargs={"in_size": 8, "num_classes": 3, "latent_size": 4, "hidden": [8]})


def _data() -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    y = (x[:, :3].argmax(axis=1)).astype(np.int32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=CLF,
        dataset=_data(),
        loss=CrossEntropy(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=8,
        batch_size=32,
        log_every_n_steps=4,
        seed=1,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _start(loop: TrainingLoop):
    return loop.model_op.build(jax.random.split(jax.random.key(loop.seed))[0])


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# The optax recipe, by hand ---------------------------------------------------------------------------------------
def test_groups_scale_the_learning_rate_and_frozen_groups_have_no_state():
    params = {"encoder": {"w": jnp.ones(3)}, "head": {"w": jnp.ones(2)}, "bias": jnp.ones(1)}
    grads = jax.tree.map(jnp.ones_like, params)
    groups = (ParamGroup(pattern="encoder.*", lr_scale=0.5), ParamGroup(pattern="bias", frozen=True))
    opt = build_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9}, max_steps=10, groups=groups)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    np.testing.assert_allclose(updates["encoder"]["w"], -0.05)
    np.testing.assert_allclose(updates["head"]["w"], -0.1)
    np.testing.assert_array_equal(updates["bias"], 0.0)
    # momentum buffers: 3 encoder + 2 head entries; nothing for the frozen bias
    sizes = sorted(x.size for x in jax.tree.leaves(state) if x.ndim == 1)
    assert sizes == [2, 3], sizes


def test_l2sp_update_is_the_hand_computation():
    """sgd + L2-SP: ``w <- w - lr (g + a (w - w_start))``, for the group only; the rest decays toward nothing."""
    p0 = {"encoder": jnp.array([1.0, -2.0]), "head": jnp.array([3.0])}
    opt = build_optimizer({"name": "sgd", "lr": 0.1}, max_steps=10, groups=(ParamGroup(pattern="encoder", l2sp=0.5),))
    state = opt.init(p0)
    p1 = {"encoder": jnp.array([1.5, -1.0]), "head": jnp.array([2.0])}  # the weights have moved since the start
    g = {"encoder": jnp.array([0.2, 0.4]), "head": jnp.array([1.0])}
    updates, _ = opt.update(g, state, p1)
    by_hand = -0.1 * (np.array([0.2, 0.4]) + 0.5 * (np.array([1.5, -1.0]) - np.array([1.0, -2.0])))
    np.testing.assert_allclose(np.asarray(updates["encoder"]), by_hand, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(updates["head"]), [-0.1], rtol=1e-6)


def test_unfreezing_is_a_mask_inside_one_compiled_update():
    params = {"encoder": jnp.ones(2), "head": jnp.ones(2)}
    groups = (ParamGroup(pattern="encoder", frozen=True, unfreeze_at=3),)
    opt = build_optimizer({"name": "adam", "lr": 0.1}, max_steps=10, groups=groups)
    update = jax.jit(opt.update)
    state = opt.init(params)
    moved = []
    for _ in range(5):
        updates, state = update(jax.tree.map(jnp.ones_like, params), state, params)
        moved.append(bool(jnp.any(updates["encoder"] != 0)))
        assert bool(jnp.all(updates["head"] != 0))
    assert moved == [False, False, False, True, True]
    assert update._cache_size() == 1
    # Adam starts at the unfreezing step: its first update there is the first update of a fresh Adam
    fresh, _ = optax.adam(0.1).update(jnp.ones(2), optax.adam(0.1).init(jnp.ones(2)), jnp.ones(2))
    first = opt.init(params)
    for _ in range(4):
        out, first = opt.update(jax.tree.map(jnp.ones_like, params), first, params)
    np.testing.assert_allclose(out["encoder"], fresh, rtol=1e-6)


# TrainingLoop ----------------------------------------------------------------------------------------------------
def test_a_frozen_encoder_stays_bitwise_and_the_head_trains():
    loop = _loop(param_groups=(ParamGroup(pattern="encoder.*", frozen=True),))
    with run_settings(store=False):
        trained, _ = loop.run()
    start = _start(loop)
    assert _same(eqx.filter(trained.module.encoder, eqx.is_array), eqx.filter(start.encoder, eqx.is_array))
    assert not _same(eqx.filter(trained.module.head, eqx.is_array), eqx.filter(start.head, eqx.is_array))


def test_gradual_unfreezing_compiles_one_step_and_trains_the_encoder_after():
    loop = _loop(max_steps=8, param_groups=(ParamGroup(pattern="encoder.*", frozen=True, unfreeze_at=4),))
    before = chunk_cache_size()
    with run_settings(store=False):
        trained, _ = loop.run()
    assert chunk_cache_size() - before <= 1  # at most one new compile (none when cached): no recompile at 4
    start = _start(loop)
    assert not _same(eqx.filter(trained.module.encoder, eqx.is_array), eqx.filter(start.encoder, eqx.is_array))


def test_diagnostics_ride_in_the_metrics_and_match_a_hand_computation(tmp_path):
    groups = (ParamGroup(pattern="encoder.*", name="encoder"),)
    loop = _loop(
        max_steps=1,
        log_every_n_steps=1,
        diagnostics=True,
        param_groups=groups,
        optimizer_config={"name": "sgd", "lr": 0.1},
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    record = next(r for r in read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl") if "train/loss" in r)
    params, static = eqx.partition(_start(loop), eqx.is_inexact_array)
    batch = next(loop.dataset.iterator(loop.batch_size, loop.seed))

    def loss_fn(p):
        logits = jax.vmap(eqx.combine(p, static))(batch["x"])
        return CrossEntropy()(logits, batch["y"])[0]

    g = jax.grad(loss_fn)(params)
    np.testing.assert_allclose(record["train/diag/grad_norm"], float(optax.tree.norm(g)), rtol=1e-5)
    np.testing.assert_allclose(record["train/diag/grad_norm/encoder"], float(optax.tree.norm(g.encoder)), rtol=1e-5)
    np.testing.assert_allclose(
        record["train/diag/update_ratio"], 0.1 * float(optax.tree.norm(g)) / float(optax.tree.norm(params)), rtol=1e-5
    )
    assert "train/diag/param_norm/encoder" in record


def test_group_labels_are_metric_safe_names():
    assert [ParamGroup(pattern=p).label for p in ("encoder.*", "*.bias", "head.layers.1.*")] == [
        "encoder",
        "any.bias",
        "head.layers.1",
    ]
    assert ParamGroup(pattern="encoder.*", name="enc").label == "enc"


def test_bad_groups_are_one_line_errors_before_compiling():
    with pytest.raises(
        ConfigError,
        match=r"param_groups\[0\] pattern 'encodr.\*': it matches no parameter; the "
        r"model's parameters are encoder.layers.0.weight",
    ):
        _loop(param_groups=(ParamGroup(pattern="encodr.*"),)).run()
    with pytest.raises(ConfigError, match=r"unfreeze_at \(8\) must be < max_steps \(8\)"):
        _loop(param_groups=(ParamGroup(pattern="encoder.*", frozen=True, unfreeze_at=8),))
    with pytest.raises(ConfigError, match=r"unfreeze_at needs frozen: true"):
        ParamGroup(pattern="encoder.*", unfreeze_at=3)
    with pytest.raises(ConfigError, match=r"lr_scale must be a float >= 0, got -1.0"):
        pipekit.loads("type: ParamGroup\npattern: 'x'\nlr_scale: -1\n")


def test_sam_groups_l2sp_and_unfreezing_resume_bitwise(tmp_path, interrupted_and_resumed):
    """Interrupted after the step-4 checkpoint and resumed: the same weights as the uninterrupted run."""
    loop = _loop(
        max_steps=8,
        gradient=SAM(rho=0.05),
        param_groups=(ParamGroup(pattern="encoder.*", frozen=True, unfreeze_at=3, l2sp=1.0),),
        callbacks=(Checkpoint(every_n_steps=4, async_save=False),),
    )
    reference, resumed = interrupted_and_resumed(loop, crash_at=5)
    assert resumed.weights_hash() == reference.weights_hash()
    changed = run_settings(run_dir=str(tmp_path / "cut"), store=False, resume="auto")
    with pytest.raises(CheckpointMismatchError, match=r'\+\s+"lr_scale": 0.5'), changed:
        loop.replace(param_groups=(ParamGroup(pattern="encoder.*", lr_scale=0.5),)).run()


def test_reset_anchor_moves_only_the_l2sp_anchor():
    """A warm start (`init_from`) moves the L2-SP anchor to the loaded weights; the rest of the state stays."""
    opt = build_optimizer({"name": "adam", "lr": 0.1}, max_steps=10, groups=(ParamGroup(pattern="a", l2sp=1.0),))
    p0, p1 = {"a": jnp.zeros(2), "b": jnp.zeros(1)}, {"a": jnp.ones(2), "b": jnp.ones(1)}
    state = opt.init(p0)
    _, state = opt.update({"a": jnp.ones(2), "b": jnp.ones(1)}, state, p0)
    moved = reset_anchor(state, opt.init(p1))
    anchors = [
        n.anchor for n in jax.tree.leaves(moved, is_leaf=lambda n: isinstance(n, L2SPState)) if isinstance(n, L2SPState)
    ]
    assert len(anchors) == 1 and np.array_equal(anchors[0]["a"], np.ones(2))
    assert len(jax.tree.leaves(moved)) == len(jax.tree.leaves(state))
    assert _same(
        [x for x in jax.tree.leaves(optax.tree_utils.tree_get_all_with_path(moved, "mu"))],
        [x for x in jax.tree.leaves(optax.tree_utils.tree_get_all_with_path(state, "mu"))],
    )
