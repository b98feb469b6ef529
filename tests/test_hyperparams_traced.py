"""Hyperparameters are values, not programs: the optimizer's numbers live in its state (backends/_optax*.py).

Two stages or a sweep that differ only in numbers compile the train step once; the numbers still decide the
result (bitwise the numbers of plain optax), and a checkpoint's numbers give way to the configuration's.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipekit
from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    EquinoxModel,
    ParamGroup,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.adapters.equinox._steps import CompileCounter, chunk_cache_size
from pipekit_train.backends import _optax as pk_optax
from pipekit_train.backends._optax import StructuredOptimizer, build_optimizer
from pipekit_train.backends._optax_numbers import Hyperparams, refresh_hyperparams
from pipekit_train.backends._optax_schedule import LrScaleState, learning_rate_at, set_lr_scale


def _regression(n: int = 128, d: int = 8, seed: int = 0) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=(d, 1))).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _mlp(width: int) -> EquinoxModel:
    # A width no other test uses: the first stage of each test compiles a step of its own.
    return EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": width, "depth": 2})


def _loop(model: EquinoxModel, config: dict, max_steps: int, **kw) -> TrainingLoop:
    base = dict(
        model_op=model,
        dataset=_regression(),
        loss=MSE(),
        optimizer_config=config,
        max_steps=max_steps,
        batch_size=16,
        log_every_n_steps=10,
        steps_per_call=1,
        seed=5,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


_MARKS: list[tuple[str, str, int]] = []


class _CountCompiles(Callback, register=False):
    """Records the compile counter at the start and end of each stage (test-only)."""

    def on_train_start(self, ctx):
        _MARKS.append((ctx.stage, "start", _COUNTER[0].count))

    def on_train_end(self, ctx):
        _MARKS.append((ctx.stage, "end", _COUNTER[0].count))


_COUNTER: list[CompileCounter] = []


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model.module, eqx.is_array))]


def _random_grads(params, seed: int):
    """Gradients shaped like `params`, drawn with NumPy: any will do, and a `jax.random` draw compiles a program for
    every leaf shape."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)


# The compile counts ----------------------------------------------------------------------------------------
def test_two_stages_with_other_numbers_compile_the_train_step_once():
    """pretrain → finetune with another lr, weight decay, warm-up and max_steps: one train step program."""
    model = _mlp(23)
    first = {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4, "schedule": "warmup_cosine", "warmup_steps": 5}
    second = {"name": "adamw", "lr": 1e-3, "weight_decay": 1e-2, "schedule": "warmup_cosine", "warmup_steps": 8}
    seq = pipekit.Sequential(
        [
            _loop(model, first, 12, callbacks=(_CountCompiles(),)),
            _loop(model, second, 16, callbacks=(_CountCompiles(),)),
        ]
    )
    _MARKS.clear()
    before = chunk_cache_size()
    with CompileCounter() as counter, run_settings(store=False):
        _COUNTER[:] = [counter]
        seq.run()
    assert chunk_cache_size() - before == 1  # the second stage found the first stage's program
    (s0, _, a0), (_, _, b0), (s1, _, a1), (_, _, b1) = _MARKS
    assert s0 != s1
    assert b0 - a0 >= 1  # the first stage compiled its step ...
    assert b1 - a1 == 0  # ... and the second compiled nothing at all


def test_a_learning_rate_sweep_compiles_once_and_each_point_has_its_own_numbers():
    model = _mlp(19)
    before = chunk_cache_size()
    finals = []
    counts = []
    for lr in (0.003, 0.01, 0.03):
        with CompileCounter() as counter, run_settings(store=False):
            trained, _ = _loop(model, {"name": "adam", "lr": lr}, 12).run()
        counts.append(counter.count)
        finals.append(_leaves(trained))
    assert chunk_cache_size() - before == 1
    assert counts[0] >= 1 and counts[1:] == [0, 0]
    # The reused program trained with the last point's rate: bitwise a hand-written optax.adam(0.03) loop.
    loop = _loop(model, {"name": "adam", "lr": 0.03}, 12)
    params, static = eqx.partition(model.build(jax.random.split(jax.random.key(loop.seed))[0]), eqx.is_array)
    opt = optax.adam(0.03)
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(lambda p: jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return eqx.apply_updates(params, updates), state

    batches = loop.dataset.iterator(loop.batch_size, loop.seed)
    for _ in range(loop.max_steps):
        batch = next(batches)
        params, state = step(params, state, batch["x"], batch["y"])
    for ours, theirs in zip(finals[2], jax.tree.leaves(params)):
        np.testing.assert_array_equal(ours, np.asarray(theirs))
    assert not all(np.array_equal(a, b) for a, b in zip(finals[0], finals[2]))


# What is structure and what is a value -----------------------------------------------------------------------
BASE = {"name": "adamw", "lr": 1e-3, "schedule": "warmup_cosine", "warmup_steps": 2}


@pytest.mark.parametrize(
    ("config", "kwargs"),
    [
        ({"lr": 0.5}, {}),
        ({"b1": 0.8, "b2": 0.95, "eps": 1e-6}, {}),
        ({"weight_decay": 0.3}, {}),
        ({"warmup_steps": 7, "decay_steps": 40, "end_lr": 1e-5}, {}),
        ({}, {"max_steps": 1000}),
        ({}, {"grad_clip_norm": 3.0}),
    ],
    ids=["lr", "betas-eps", "weight_decay", "schedule", "max_steps", "clip"],
)
def test_numbers_are_values(config, kwargs):
    args = {"max_steps": 20, "grad_clip_norm": 1.0, **kwargs}
    a = build_optimizer(BASE, max_steps=20, grad_clip_norm=1.0)
    b = build_optimizer({**BASE, **config}, **args)
    assert a == b and hash(a) == hash(b) and a.update is b.update
    assert jax.tree.structure(a.init({"w": jnp.ones(2)})) == jax.tree.structure(b.init({"w": jnp.ones(2)}))


def test_group_numbers_are_values():
    g = (
        ParamGroup(pattern="a", lr_scale=0.5, weight_decay=0.1, l2sp=0.2),
        ParamGroup(pattern="b", frozen=True, unfreeze_at=3),
    )
    h = (
        ParamGroup(pattern="a", lr_scale=0.1, weight_decay=0.7, l2sp=2.0),
        ParamGroup(pattern="b", frozen=True, unfreeze_at=9),
    )
    assert build_optimizer(BASE, max_steps=20, groups=g) == build_optimizer(BASE, max_steps=20, groups=h)


@pytest.mark.parametrize(
    ("config", "kwargs"),
    [
        ({"name": "adam"}, {}),
        ({"schedule": "constant"}, {}),
        ({"weight_decay": 0.0}, {}),  # no decay verb at all
        ({"decay_biases": True}, {}),
        ({}, {"grad_clip_norm": None}),
        ({}, {"accum": 2}),
        ({}, {"groups": (ParamGroup(pattern="a", lr_scale=0.5),)}),
    ],
    ids=["name", "schedule-kind", "no-decay", "decay-mask", "no-clip", "accum", "groups"],
)
def test_structure_is_structure(config, kwargs):
    a = build_optimizer(BASE, max_steps=20, grad_clip_norm=1.0)
    b = build_optimizer({**BASE, **config}, **{"max_steps": 20, "grad_clip_norm": 1.0, **kwargs})
    assert a != b


def test_a_structured_optimizer_is_a_pytree_without_leaves_compared_by_structure():
    a = build_optimizer({"name": "sgd", "lr": 0.1}, max_steps=10)
    b = build_optimizer({"name": "sgd", "lr": 0.2}, max_steps=99)
    assert isinstance(a, StructuredOptimizer) and isinstance(a, optax.GradientTransformation)
    assert jax.tree.leaves(a) == [] and jax.tree.structure(a) == jax.tree.structure(b)
    assert "StructuredOptimizer(structure=" in repr(a)


_CASES = [
    (
        {"name": "adamw", "lr": 0.01, "b1": 0.8, "weight_decay": 0.05, "schedule": "warmup_cosine", "warmup_steps": 3},
        {},
    ),
    ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, {"grad_clip_norm": 0.5}),
    ({"name": "lion", "lr": 1e-3, "b1": 0.95, "b2": 0.98, "schedule": "onecycle"}, {}),
    ({"name": "rmsprop", "lr": 1e-3, "momentum": 0.5, "schedule": "exponential", "warmup_steps": 2}, {"accum": 2}),
    (
        {"name": "adam", "lr": 0.01},
        {
            "groups": (
                ParamGroup(pattern="layers.0.*", lr_scale=0.3, l2sp=0.5),
                ParamGroup(pattern="layers.1.*", frozen=True, unfreeze_at=2),
            )
        },
    ),
]
_OTHER = {"lr": 0.7, "b1": 0.5, "weight_decay": 0.2, "warmup_steps": 2, "momentum": 0.3, "b2": 0.8, "eps": 1e-3}


def _other(config: dict, kwargs: dict) -> tuple[dict, dict]:
    """The same structure with every number changed."""
    cfg = {k: _OTHER.get(k, v) for k, v in config.items()}
    kw = dict(kwargs, max_steps=7)
    if "grad_clip_norm" in kw:
        kw["grad_clip_norm"] = 0.05
    if "groups" in kw:
        kw["groups"] = (
            ParamGroup(pattern="layers.0.*", lr_scale=2.0, l2sp=0.01),
            ParamGroup(pattern="layers.1.*", frozen=True, unfreeze_at=1),
        )
    return cfg, kw


@pytest.mark.parametrize(("config", "kwargs"), _CASES, ids=lambda v: str(v)[:40])
def test_update_reads_every_number_from_the_state(monkeypatch, config, kwargs):
    """Built apart (no shared update), the update of one configuration applied to the state of another of the same
    structure gives bitwise the other's own result: nothing numeric is a constant of the program."""
    monkeypatch.setattr(pk_optax, "_UPDATES", {})
    params = eqx.filter(eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0)), eqx.is_array)
    a = build_optimizer(config, **{"max_steps": 20, **kwargs})
    monkeypatch.setattr(pk_optax, "_UPDATES", {})
    other, other_kwargs = _other(config, kwargs)
    b = build_optimizer(other, **other_kwargs)
    assert a == b and a.update is not b.update
    sa, sb1, sb2 = a.init(params), b.init(params), b.init(params)
    differs = False
    update_a, update_b = jax.jit(a.update), jax.jit(b.update)
    for i in range(4):  # with accum=2 and a warm-up of 2 the first real update with lr > 0 is the 4th call
        grads = _random_grads(params, i)
        ua, sa = update_a(grads, sa, params)
        u1, sb1 = update_a(grads, sb1, params)  # a's program, b's numbers
        u2, sb2 = update_b(grads, sb2, params)
        for x, y in zip(jax.tree.leaves((u1, sb1)), jax.tree.leaves((u2, sb2))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        differs |= not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(u1)))
    assert differs  # the numbers matter


# Bitwise the numbers of plain optax ----------------------------------------------------------------------------
def _mask(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)


_REFERENCES = [
    ({"name": "adamw", "lr": 3e-3}, lambda: optax.adamw(3e-3, weight_decay=1e-4, mask=_mask)),
    ({"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True}, lambda: optax.sgd(0.05, 0.9, nesterov=True)),
    ({"name": "lion", "lr": 1e-3, "weight_decay": 0.0}, lambda: optax.lion(1e-3, weight_decay=0.0)),
    ({"name": "rmsprop", "lr": 1e-3}, lambda: optax.rmsprop(1e-3, decay=0.9, eps=1e-8)),
    (
        {"name": "adam", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 3, "end_lr": 1e-3},
        lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 0.01, 3, 12, 1e-3)),
    ),
    (
        {"name": "sgd", "lr": 0.1, "schedule": "exponential", "decay_rate": 0.5, "warmup_steps": 2},
        lambda: optax.sgd(
            optax.join_schedules([optax.linear_schedule(0.0, 0.1, 2), optax.exponential_decay(0.1, 12, 0.5)], [2])
        ),
    ),
    (
        {"name": "sgd", "lr": 0.1, "schedule": "onecycle"},
        lambda: optax.sgd(optax.cosine_onecycle_schedule(12, 0.1, 4 / 12)),
    ),
]


@pytest.mark.parametrize(("config", "reference"), _REFERENCES, ids=lambda v: str(v)[:50] if isinstance(v, dict) else "")
def test_bitwise_the_numbers_of_optax(config, reference):
    """XLA folds optax's constants (``x / c`` becomes ``x * (1 / c)``, constant factors are multiplied together);
    the schedule does the same arithmetic on the numbers in the state, so the bits agree."""
    params = eqx.filter(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(1)), eqx.is_array)

    def run(opt):
        @jax.jit
        def step(p, s, g):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p, s = params, opt.init(params)
        for i in range(12):
            p, s = step(p, s, _random_grads(params, i))
        return jax.tree.leaves(p)

    for ours, theirs in zip(run(build_optimizer(config, max_steps=12)), run(reference())):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_learning_rate_at_is_bitwise_the_rate_applied():
    config = {"name": "sgd", "lr": 0.3, "schedule": "warmup_cosine", "warmup_steps": 3, "end_lr": 0.01}
    opt = build_optimizer(config, max_steps=15)
    params = {"w": jnp.zeros(())}
    state = opt.init(params)
    update = jax.jit(opt.update)
    for step in range(15):
        u, state = update({"w": jnp.ones(())}, state, params)
        assert -float(u["w"]) == learning_rate_at(config, step, 15)


# Checkpoints -----------------------------------------------------------------------------------------------
def test_refresh_hyperparams_takes_the_numbers_and_keeps_the_rest():
    params = {"w": jnp.ones(3)}
    old = build_optimizer({"name": "adam", "lr": 0.1}, max_steps=10)
    new = build_optimizer({"name": "adam", "lr": 0.5, "b1": 0.5}, max_steps=10)
    state = old.init(params)
    for _ in range(2):
        _, state = old.update({"w": jnp.ones(3)}, state, params)
    state = set_lr_scale(state, 0.25)
    refreshed = refresh_hyperparams(state, new.init(params))
    hypers = [
        n
        for n in jax.tree.leaves(refreshed, is_leaf=lambda n: isinstance(n, Hyperparams))
        if isinstance(n, Hyperparams)
    ]
    assert {float(h.values["lr"]) for h in hypers if "lr" in h.values} == {0.5}
    assert {float(h.values["b1"]) for h in hypers if "b1" in h.values} == {0.5}
    scale = next(
        n
        for n in jax.tree.leaves(refreshed, is_leaf=lambda n: isinstance(n, LrScaleState))
        if isinstance(n, LrScaleState)
    )
    assert int(scale.count) == 2 and float(scale.scale) == 0.25  # the counter and the run-time factor stay
    np.testing.assert_array_equal(refreshed[0].mu["w"], state[0].mu["w"])  # and the moments


def test_every_number_in_the_state_is_a_float32_or_int32_scalar():
    opt = build_optimizer(
        {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.1, "schedule": "onecycle"},
        max_steps=10,
        grad_clip_norm=1.0,
        accum=2,
        groups=(ParamGroup(pattern="a", l2sp=0.1), ParamGroup(pattern="b", frozen=True, unfreeze_at=2)),
    )
    state = opt.init({"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones((2, 2))})
    hypers = [
        n for n in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, Hyperparams)) if isinstance(n, Hyperparams)
    ]
    names = {k for h in hypers for k in h.values}
    assert {"peak", "max_norm", "decay", "weight_decay", "strength", "until", "group_scale"} <= names
    for h in hypers:
        for value in h.values.values():
            assert value.shape == () and value.dtype in (jnp.float32, jnp.int32)
