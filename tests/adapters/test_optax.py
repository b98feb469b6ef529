"""build_optimizer: every optimizer and schedule, config errors, the decay mask, accumulation, the lr scale."""

from __future__ import annotations

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from pipekit import ConfigError, PipekitError
from pipekit_train.backends._optax import build_optimizer
from pipekit_train.backends._optax_schedule import (
    LrScaleState,
    build_schedule,
    get_lr_scale,
    learning_rate_at,
    set_lr_scale,
)
from pipekit_train.optim._config import check_optimizer_config

NAMES = ["adamw", "adam", "sgd", "lion", "rmsprop"]
SCHEDULES = ["constant", "warmup_cosine", "onecycle", "exponential"]


def _params():
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    return eqx.filter(model, eqx.is_array)


def _grads(params, seed=1):
    # Drawn with NumPy: any gradients will do, and a `jax.random` draw compiles a program for every leaf shape.
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)


def _is_array_tree(tree):
    return all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize(("name", "schedule"), list(itertools.product(NAMES, SCHEDULES)))
def test_every_optimizer_and_schedule_builds_and_steps(name, schedule):
    params = _params()
    opt = build_optimizer({"name": name, "schedule": schedule, "lr": 1e-2}, max_steps=20)
    state = opt.init(params)
    assert _is_array_tree(state)
    step = jax.jit(opt.update)
    for i in range(3):
        updates, state = step(_grads(params, i), state, params)
        params = optax.apply_updates(params, updates)
    assert _is_array_tree(state)
    # Checked with NumPy: the same test, with no program compiled for every leaf shape and comparison.
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
    assert any((np.asarray(u) != 0).any() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("accum", [1, 3])
def test_optimizer_state_checkpoints_with_orbax_standard_save(tmp_path, accum):
    params = _params()
    opt = build_optimizer({"name": "adamw", "schedule": "warmup_cosine", "warmup_steps": 2}, max_steps=10, accum=accum)
    state = opt.init(params)
    # Jitted: one program, where eager updates compile every operation and, with accumulation, a `cond` per call.
    update = jax.jit(opt.update)
    for i in range(4):
        _, state = update(_grads(params, i), state, params)
    state = set_lr_scale(state, 0.25)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(4, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, opt.init(params))
        restored = mngr.restore(4, args=ocp.args.StandardRestore(abstract))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert get_lr_scale(restored) == 0.25


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"weigth_decay": 0.1},
            r"unknown optimizer_config key 'weigth_decay' \(did you mean 'weight_decay'\?\); "
            r"allowed keys: name, lr, schedule, b1",
        ),
        ({"learning_rate": 0.1}, r"unknown optimizer_config key 'learning_rate'.*allowed keys: name, lr"),
        ({"name": "adma"}, r"optimizer_config.name must be one of adamw, adam, sgd, lion, rmsprop, got 'adma' \(did"),
        ({"schedule": "cosine"}, r"schedule must be one of .*, got 'cosine' \(did you mean 'warmup_cosine'\?\)"),
        ({"name": "adam", "momentum": 0.9}, r"optimizer_config.momentum does not apply to name='adam'; adam takes b1"),
        ({"name": "adam", "weight_decay": 0.1}, r"does not apply to name='adam' \(use name: adamw"),
        ({"name": "sgd", "eps": 1e-6}, r"eps does not apply to name='sgd'; sgd takes momentum, .*eps applies to adamw"),
        ({"name": "lion", "nesterov": True}, r"nesterov does not apply to name='lion'"),
        ({"decay_rate": 0.5}, r"decay_rate does not apply to schedule='constant'; constant takes warmup_steps"),
        ({"schedule": "onecycle", "decay_rate": 0.5}, r"decay_rate applies to exponential"),
        ({"lr": -1.0}, r"optimizer_config.lr must be a float > 0, got -1.0"),
        ({"lr": "1e-3"}, r"lr must be a float > 0, got '1e-3', a string \(YAML reads 1e-3 as text; write 1.0e-3\)"),
        ({"lr": True}, r"lr must be a float > 0, got True"),
        ({"b1": 1.0}, r"optimizer_config.b1 must be a float in \[0, 1\), got 1.0"),
        ({"schedule": "warmup_cosine", "warmup_steps": 2.5}, r"warmup_steps must be an int >= 0, got 2.5"),
        ({"decay_biases": "no"}, r"decay_biases must be true or false, got 'no'"),
        ({"name": "sgd", "nesterov": True}, r"nesterov: true needs momentum > 0, got momentum=0.0"),
        ({"schedule": "onecycle", "end_lr": 0.0}, r"end_lr must be a float > 0 for schedule 'onecycle', got 0.0"),
    ],
)
def test_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        check_optimizer_config(config)
    with pytest.raises(ConfigError, match=message):
        build_optimizer(config, max_steps=10)


def test_build_argument_errors():
    with pytest.raises(ConfigError, match=r"optimizer_config must be a mapping, got list"):
        build_optimizer([("lr", 1.0)], max_steps=10)
    with pytest.raises(ConfigError, match=r"max_steps must be an int >= 1, got 0"):
        build_optimizer({}, max_steps=0)
    with pytest.raises(ConfigError, match=r"accum must be an int >= 1, got 0"):
        build_optimizer({}, max_steps=10, accum=0)
    with pytest.raises(ConfigError, match=r"grad_clip_norm must be a float > 0 or None, got -1.0"):
        build_optimizer({}, max_steps=10, grad_clip_norm=-1.0)
    with pytest.raises(
        ConfigError,
        match=r"warmup_steps must be < 10 for schedule 'warmup_cosine' \(decay_steps defaults to max_steps=10\)",
    ):
        build_optimizer({"schedule": "warmup_cosine", "warmup_steps": 10}, max_steps=10)
    with pytest.raises(ConfigError, match=r"warmup_steps \(30\) is more than max_steps \(20\)"):
        check_optimizer_config({"warmup_steps": 30}, max_steps=20)
    with pytest.raises(ConfigError, match=r"warmup_steps must be in \(0, 10\) for schedule 'onecycle'"):
        build_optimizer({"schedule": "onecycle", "warmup_steps": 0}, max_steps=10)


def test_defaults_are_adamw_constant():
    check_optimizer_config({})
    params = _params()
    ours = build_optimizer({}, max_steps=10)
    ref = optax.adamw(1e-3, weight_decay=1e-4, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    grads = _grads(params)
    # Jitted: one program each, where an eager update compiles a program for every operation.
    ours_u, _ = jax.jit(ours.update)(grads, ours.init(params), params)
    ref_u, _ = jax.jit(ref.update)(grads, ref.init(params), params)
    for a, b in zip(jax.tree.leaves(ours_u), jax.tree.leaves(ref_u)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion", "rmsprop"])
def test_weight_decay_skips_biases_unless_asked(name):
    params = {"w": jnp.full((2, 2), 2.0), "b": jnp.full((2,), 2.0)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt = build_optimizer({"name": name, "lr": 0.1, "weight_decay": 0.5}, max_steps=10)
    updates, _ = opt.update(zeros, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)  # decay alone moves the matrix ...
    np.testing.assert_array_equal(updates["b"], 0.0)  # ... and leaves the bias unchanged
    opt = build_optimizer({"name": name, "lr": 0.1, "weight_decay": 0.5, "decay_biases": True}, max_steps=10)
    updates, _ = opt.update(zeros, opt.init(params), params)
    np.testing.assert_allclose(updates["b"], -0.1 * 0.5 * 2.0, rtol=1e-6)


def test_weight_decay_mask_on_an_equinox_model():
    params = _params()
    opt = build_optimizer({"name": "sgd", "lr": 1.0, "weight_decay": 0.1}, max_steps=10)
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    for layer_u, layer_p in zip(updates.layers, params.layers):
        np.testing.assert_allclose(layer_u.weight, -0.1 * layer_p.weight, rtol=1e-6)
        np.testing.assert_array_equal(layer_u.bias, 0.0)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_accumulation_averages_and_updates_every_k_calls(name):
    params = _params()
    g1, g2 = _grads(params, 1), _grads(params, 2)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
    config = {"name": name, "lr": 0.1}
    acc = build_optimizer(config, max_steps=10, accum=2)
    single = build_optimizer(config, max_steps=10)
    state = acc.init(params)
    update = jax.jit(acc.update)  # one program; an eager accumulating update compiles a `cond` on every call
    u1, state = update(g1, state, params)
    assert all(bool((u == 0).all()) for u in jax.tree.leaves(u1))  # accumulating: no update yet
    u2, state = update(g2, state, params)
    ref, _ = jax.jit(single.update)(mean, single.init(params), params)
    for a, b in zip(jax.tree.leaves(u2), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_accumulated_schedule_counts_loop_steps():
    config = {"name": "sgd", "lr": 1.0, "warmup_steps": 4}
    params = {"w": jnp.zeros(())}
    ones = {"w": jnp.ones(())}
    opt = build_optimizer(config, max_steps=10, accum=2)
    state = opt.init(params)
    update = jax.jit(opt.update)  # one program; an eager accumulating update compiles a `cond` on every call
    applied = []
    for _ in range(8):
        u, state = update(ones, state, params)
        applied.append(-float(u["w"]))
    # real updates on loop steps 1, 3, 5, 7 use the schedule at loop steps 0, 2, 4, 6
    np.testing.assert_allclose(applied[1::2], [learning_rate_at(config, s, 10) for s in (0, 2, 4, 6)], rtol=1e-6)
    np.testing.assert_allclose(applied[1::2], [0.0, 0.5, 1.0, 1.0], rtol=1e-6)


def test_grad_clip_norm_clips_the_global_norm():
    params = {"a": jnp.zeros(3), "b": jnp.zeros(4)}
    grads = {"a": jnp.full(3, 3.0), "b": jnp.full(4, 4.0)}
    opt = build_optimizer({"name": "sgd", "lr": 1.0}, max_steps=10, grad_clip_norm=2.0)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)  # one program, not one per operation
    norm = float(optax.tree.norm(updates))
    np.testing.assert_allclose(norm, 2.0, rtol=1e-5)


@pytest.mark.parametrize("accum", [1, 2])
def test_lr_scale_get_set_changes_the_update_magnitude(accum):
    params = _params()
    grads = _grads(params)
    opt = build_optimizer({"name": "adamw", "lr": 0.01}, max_steps=10, accum=accum)
    state = opt.init(params)
    assert get_lr_scale(state) == 1.0
    halved = set_lr_scale(state, 0.5)
    assert get_lr_scale(halved) == 0.5
    assert get_lr_scale(state) == 1.0  # the original is unchanged
    assert jax.tree.structure(halved) == jax.tree.structure(state)
    traces = []

    def update(g, s, p):
        traces.append(1)
        return opt.update(g, s, p)

    step = jax.jit(update)
    for _ in range(accum):
        full, _ = step(grads, state, params)
        half, _ = step(grads, halved, params)
    assert len(traces) == 1  # a changed scale is a new value, not a new structure
    for f, h in zip(jax.tree.leaves(full), jax.tree.leaves(half)):
        np.testing.assert_allclose(h, 0.5 * f, rtol=1e-6)


def test_lr_scale_errors_and_state():
    opt = build_optimizer({}, max_steps=10)
    state = opt.init(_params())
    found = [
        n for n in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, LrScaleState)) if isinstance(n, LrScaleState)
    ]
    assert len(found) == 1
    assert found[0].scale.dtype == jnp.float32 and found[0].scale.shape == ()
    with pytest.raises(ConfigError, match=r"set_lr_scale: value must be a finite float >= 0, got -0.5"):
        set_lr_scale(state, -0.5)
    plain = optax.sgd(0.1).init(_params())
    with pytest.raises(PipekitError, match="opt_state holds no learning-rate scale; build the optimizer with"):
        get_lr_scale(plain)
    with pytest.raises(PipekitError, match="opt_state holds no learning-rate scale"):
        set_lr_scale(plain, 0.5)


@pytest.mark.parametrize(
    ("config", "reference"),
    [
        ({"lr": 0.1}, optax.constant_schedule(0.1)),
        (
            {"lr": 0.1, "warmup_steps": 5},
            optax.join_schedules([optax.linear_schedule(0.0, 0.1, 5), optax.constant_schedule(0.1)], [5]),
        ),
        (
            {"lr": 0.1, "schedule": "warmup_cosine", "warmup_steps": 5, "end_lr": 0.01},
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 5, 50, 0.01),
        ),
        (
            {"lr": 0.1, "schedule": "warmup_cosine", "decay_steps": 30},
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 0, 30, 0.0),
        ),
        ({"lr": 0.1, "schedule": "onecycle"}, optax.cosine_onecycle_schedule(50, 0.1)),
        (
            {"lr": 0.1, "schedule": "onecycle", "warmup_steps": 10, "end_lr": 1e-4},
            optax.cosine_onecycle_schedule(50, 0.1, pct_start=0.2, final_div_factor=(0.1 / 25) / 1e-4),
        ),
        (
            {"lr": 0.1, "schedule": "exponential", "decay_rate": 0.5, "decay_steps": 10},
            optax.exponential_decay(0.1, 10, 0.5),
        ),
        ({"lr": 0.1, "schedule": "exponential"}, optax.exponential_decay(0.1, 50, 0.1)),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_learning_rate_at_matches_the_optax_schedule(config, reference):
    for step in (0, 1, 4, 5, 6, 15, 25, 49, 50):
        np.testing.assert_allclose(learning_rate_at(config, step, 50), float(reference(step)), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(float(build_schedule(config, max_steps=50)(step)), float(reference(step)), rtol=1e-6)


def test_learning_rate_at_is_the_rate_applied():
    config = {"name": "sgd", "lr": 0.2, "schedule": "warmup_cosine", "warmup_steps": 3}
    params = {"w": jnp.zeros(())}
    opt = build_optimizer(config, max_steps=12)
    state = opt.init(params)
    for step in range(12):
        u, state = opt.update({"w": jnp.ones(())}, state, params)
        np.testing.assert_allclose(-float(u["w"]), learning_rate_at(config, step, 12), rtol=1e-6, atol=1e-9)
