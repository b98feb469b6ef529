"""`TrainingLoop.gradient: SAM`: the compiled step against a hand-written two-pass SAM step, bit for bit."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import MSE, SAM, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, run_settings

MLP = EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 1, "width_size": 16, "depth": 2})


def _data() -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(128, 1))).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=MLP,
        dataset=_data(),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=12,
        batch_size=32,
        log_every_n_steps=4,
        seed=3,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _hand_sam(loop: TrainingLoop, rho: float, adaptive: bool) -> list[np.ndarray]:
    """Two-pass SAM written with plain optax and Equinox (Foret et al. 2021; ASAM: Kwon et al. 2021)."""
    init_key, _ = jax.random.split(jax.random.key(loop.seed))
    params, static = eqx.partition(MLP.build(init_key), eqx.is_array)
    optimizer = optax.sgd(0.05, momentum=0.9)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

        g = jax.grad(loss_fn)(params)
        if adaptive:
            norm = optax.tree.norm(jax.tree.map(lambda p, gi: jnp.abs(p) * gi, params, g))
            e = jax.tree.map(lambda p, gi: rho * (p * p) * gi / (norm + 1e-12), params, g)
        else:
            norm = optax.tree.norm(g)
            e = jax.tree.map(lambda gi: rho * gi / (norm + 1e-12), g)
        g_sharp = jax.grad(loss_fn)(jax.tree.map(lambda p, ei: p + ei, params, e))
        updates, opt_state = optimizer.update(g_sharp, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    batches = loop.dataset.iterator(loop.batch_size, loop.seed)
    for _ in range(loop.max_steps):
        batch = next(batches)
        params, opt_state = step(params, opt_state, batch["x"], batch["y"])
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.parametrize("adaptive,rho", [(False, 0.05), (True, 0.5)], ids=["SAM", "ASAM"])
def test_sam_step_is_bitwise_a_hand_written_two_pass_step(adaptive, rho):
    loop = _loop(gradient=SAM(rho=rho, adaptive=adaptive))
    with run_settings(store=False):
        trained, _ = loop.run()
    ours = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(trained.module, eqx.is_array))]
    theirs = _hand_sam(loop, rho, adaptive)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    with run_settings(store=False):
        plain, _ = _loop().run()
    assert plain.weights_hash() != trained.weights_hash()  # the rule did change the training


def test_sam_reads_from_yaml_and_refuses_bad_rho():
    op = pipekit.loads("type: SAM\nrho: 0.1\nadaptive: true\n")
    assert op == SAM(rho=0.1, adaptive=True)
    with pytest.raises(ConfigError, match=r"SAM.rho must be a float > 0, got 0.0"):
        SAM(rho=0.0)
    with pytest.raises(ConfigError, match=r"SAM.rho must be a float > 0, got -1.0"):
        pipekit.loads("type: SAM\nrho: -1\n")
