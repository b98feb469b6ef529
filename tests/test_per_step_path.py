"""The one-step-per-call path's own work, counted (never timed; `make bench` row 1 times it): the compiled chunk's
static configuration is compared once per stage, not at every dispatch; the checkpoint hook is called only after
the chunks where it can act; the Flax backend carries its optimizer state across the `jax.jit` boundary as leaves;
a log record reads the learning rate from the state's leaves with the configuration resolved once per stage, and
waits for no chunk to read it (Equinox, Flax, NumPyro SVI).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    EquinoxModel,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.adapters.equinox import _steps as equinox_steps
from pipekit_train.engine import _hooks

MLP = {"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}


def _data() -> TrainingDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1] * 2.0}))


def _loop(steps: int, model_op: Any = None, **kw: Any) -> TrainingLoop:
    settings: dict[str, Any] = {"batch_size": 8, "steps_per_call": 1, "log_every_n_steps": 4, "progress": False}
    settings.update(dataset=_data(), loss=MSE())
    return TrainingLoop(
        model_op=model_op or EquinoxModel(factory="mlp", kwargs=MLP), max_steps=steps, **{**settings, **kw}
    )


def _run(loop: TrainingLoop, run_dir: Any) -> Any:
    with run_settings(store=False, run_dir=str(run_dir)):
        model, _ = loop.run()
    return model


def test_the_static_configuration_is_compared_once_per_stage_not_per_step(tmp_path, monkeypatch):
    calls = {"n": 0}
    hash_, eq = equinox_steps.Static.__hash__, equinox_steps.Static.__eq__

    def counted_hash(self: Any) -> int:
        calls["n"] += 1
        return hash_(self)

    def counted_eq(self: Any, other: object) -> bool:
        calls["n"] += 1
        return eq(self, other)

    _run(_loop(4), tmp_path / "warm")  # compiles; the counts below are of stages that find the program
    monkeypatch.setattr(equinox_steps.Static, "__hash__", counted_hash)
    monkeypatch.setattr(equinox_steps.Static, "__eq__", counted_eq)
    counts = []
    for steps in (4, 20):
        calls["n"] = 0
        _run(_loop(steps), tmp_path / f"run{steps}")
        counts.append(calls["n"])
    # Passed as static arguments, they were hashed and compared at every dispatch: 16 more steps, 16x more calls.
    assert counts[0] == counts[1], counts


def test_the_checkpoint_hook_is_called_only_where_it_can_act(tmp_path, monkeypatch):
    seen: list[int] = []
    after_chunk = _hooks.CheckpointHooks.after_chunk

    def counted(self: Any, call: Any, data_state: Any) -> Any:
        seen.append(call.step)
        return after_chunk(self, call, data_state)

    monkeypatch.setattr(_hooks.CheckpointHooks, "after_chunk", counted)
    _run(_loop(12), tmp_path / "plain")
    assert seen == []  # no checkpoints, no signal, one process: nothing to do after any chunk
    _run(_loop(12, callbacks=(Checkpoint(every_n_steps=4),)), tmp_path / "saving")
    assert seen == [4, 8, 12]  # after exactly the chunks the cadence names
    assert (
        tmp_path / "saving" / "stage0" / "checkpoints" / "12"
    ).is_dir()  # the hook still saves (retention: the last)


def test_the_flax_backend_carries_its_optimizer_state_as_leaves(tmp_path, monkeypatch):
    pytest.importorskip("flax")
    from pipekit_train.adapters.flax import FlaxModel, _adapter

    made: list[Any] = []
    init = _adapter.FlaxBackend.__init__

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(_adapter.FlaxBackend, "__init__", keep)
    _run(_loop(6, model_op=FlaxModel(factory="mlp", kwargs=MLP)), tmp_path / "flax")
    backend = made[-1]
    leaves = backend.state[2]
    assert isinstance(leaves, list) and all(isinstance(a, jax.Array) for a in leaves)
    tree = backend.optimizer_state()  # optax's tree, rebuilt from the leaves (what the next stage and checkpoints get)
    assert jax.tree.structure(tree) == backend.layout.value.opt_state
    assert all(a is b for a, b in zip(jax.tree.leaves(tree), leaves, strict=True))
    backend.set_lr_scale(0.25)  # a callback's change goes through the tree and back to leaves
    assert backend.get_lr_scale() == 0.25 and isinstance(backend.state[2], list)


@pytest.mark.parametrize(
    "config, groups, accum, clip",
    [
        ({"name": "adamw", "lr": 1e-3}, (), 1, None),
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": "warmup_cosine", "warmup_steps": 3}, (), 2, 1.0),
        ({"name": "adam", "lr": 1e-2}, ("layers.1.*",), 1, None),
    ],
    ids=["adamw", "accumulated-clipped-cosine", "groups"],
)
def test_the_logged_learning_rate_reads_the_scale_where_the_tree_has_it(config, groups, accum, clip, monkeypatch):
    import equinox as eqx

    from pipekit_train import ParamGroup
    from pipekit_train.backends import _optax_schedule
    from pipekit_train.backends.kit import (
        LearningRateLog,
        build_optimizer,
        get_lr_scale,
        learning_rate_at,
        set_lr_scale,
    )

    model = eqx.nn.MLP(4, 1, 8, 1, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    param_groups = [ParamGroup(pattern=g, lr_scale=0.5) for g in groups]
    optimizer = build_optimizer(config, max_steps=50, grad_clip_norm=clip, accum=accum, groups=param_groups)
    state = set_lr_scale(optimizer.init(params), 0.375)
    leaves, treedef = jax.tree.flatten(state)
    expected = {step: learning_rate_at(config, step, 50) * get_lr_scale(state) for step in (0, 2, 7, 49)}
    searched = []
    position = _optax_schedule.lr_scale_position
    monkeypatch.setattr(_optax_schedule, "lr_scale_position", lambda tree: searched.append(1) or position(tree))
    log = LearningRateLog()
    for step, rate in expected.items():
        assert log.rate(config, 50, step, leaves, treedef) == rate
    assert log.scale(leaves, treedef) == 0.375
    assert len(searched) == 1  # the tree is searched once for the scale's place; the records read the leaf

    # The compiled step carries the scale: the value read holds for the leaf it returns ...
    stepped = [jax.numpy.array(x) for x in leaves]
    log.stepped(leaves, stepped)
    assert log.scale(stepped, treedef) == 0.375
    # ... but not for a leaf the host wrote since (set_lr_scale between two records), nor for what a step made of it.
    host_set = jax.tree.leaves(set_lr_scale(jax.tree.unflatten(treedef, stepped), 0.5))
    after = [jax.numpy.array(x) for x in host_set]
    log.stepped(host_set, after)
    assert log.scale(after, treedef) == 0.5


def test_a_log_record_resolves_the_optimizer_configuration_once_per_stage(tmp_path, monkeypatch):
    from pipekit_train.backends import _optax_schedule

    resolved = {"n": 0}
    resolve = _optax_schedule.resolve_optimizer_config

    def counted(config: Any) -> Any:
        resolved["n"] += 1
        return resolve(config)

    monkeypatch.setattr(_optax_schedule, "resolve_optimizer_config", counted)
    counts = []
    for steps in (8, 40):  # 2 and 10 log records
        resolved["n"] = 0
        _run(_loop(steps), tmp_path / f"run{steps}")
        counts.append(resolved["n"])
    assert counts[0] == counts[1] >= 1, counts  # it was once per record: 8 more records, 8 more resolutions


class _CountedNumPy:
    """`numpy` for one module, counting its ``asarray`` calls (a read of a device array)."""

    def __init__(self) -> None:
        self.reads = 0

    def asarray(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return np.asarray(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


@pytest.mark.parametrize("backend", ["equinox", "flax", "numpyro-svi"])
def test_a_log_record_does_not_wait_for_the_chunk_to_read_the_learning_rate_scale(tmp_path, monkeypatch, backend):
    from pipekit_train.backends import _optax_schedule

    kw: dict[str, Any] = {}
    if backend == "flax":
        pytest.importorskip("flax")
        from pipekit_train.adapters.flax import FlaxModel

        model_op: Any = FlaxModel(factory="mlp", kwargs=MLP)
    elif backend == "numpyro-svi":
        pytest.importorskip("numpyro")
        from pipekit_train.adapters.numpyro import NumpyroGuide, Trace_ELBO

        y = np.random.default_rng(0).normal(1.5, 1.0, size=64).astype(np.float32)
        model_op = NumpyroGuide(model="conjugate_normal", guide="AutoNormal")
        kw = {"dataset": TrainingDataset(source=ArraySource(arrays={"y": y})), "loss": Trace_ELBO()}
        kw["backend"] = "numpyro-svi"
    else:
        model_op = EquinoxModel(factory="mlp", kwargs=MLP)
    counted = _CountedNumPy()
    monkeypatch.setattr(_optax_schedule, "np", counted)
    loop = _loop(40, model_op=model_op, steps_per_call="auto", **kw)  # chunks of 4 steps, a record after each
    _run(loop, tmp_path / backend)
    records = [
        json.loads(line)
        for line in (tmp_path / backend / "stage0" / "metrics.jsonl").read_text().splitlines()
        if '"lr"' in line
    ]
    assert len(records) == 10 and len({r["lr"] for r in records}) == 1  # the default optimizer: a constant rate
    # Read once, from the initial state; then carried through the steps (it read the output of the chunk just
    # dispatched at each of the 10 records, which made the host wait for it).
    assert counted.reads == 1


class _HalveTheRateAt20(Callback, register=False):
    """Sets the run-time scale between two chunks: a leaf the host wrote, which the next record reads."""

    def on_log(self, ctx: Any, record: Any) -> None:
        if ctx.step == 20:
            ctx.lr_scale = 0.5


def test_a_scale_set_between_records_is_the_one_logged_next_on_the_svi_backend(tmp_path):
    pytest.importorskip("numpyro")
    from pipekit_train.adapters.numpyro import NumpyroGuide, Trace_ELBO

    y = np.random.default_rng(0).normal(1.5, 1.0, size=64).astype(np.float32)
    loop = _loop(
        40,
        model_op=NumpyroGuide(model="conjugate_normal", guide="AutoNormal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": y})),
        loss=Trace_ELBO(),
        backend="numpyro-svi",
        steps_per_call="auto",
        callbacks=(_HalveTheRateAt20(),),
    )
    _run(loop, tmp_path)
    lines = (tmp_path / "stage0" / "metrics.jsonl").read_text().splitlines()
    rates = {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}
    assert sorted(rates) == list(range(4, 41, 4))
    assert {rates[s] for s in rates if s <= 20} == {rates[4]} and {rates[s] for s in rates if s > 20} == {rates[4] / 2}


def test_stepped_trees_follows_the_scale_without_flattening_the_state(monkeypatch):
    """A backend that keeps its optimizer state as a tree (NumPyro SVI's ``(i, (params, opt_state))``) hands
    `LearningRateLog.stepped_trees` the states around each compiled call: it fetches the scale's leaf by its path
    (found once) and judges it as `stepped` does, with no flatten of the state per call."""
    from pipekit_train.backends.kit import LearningRateLog, build_optimizer, set_lr_scale

    params = {"loc": jnp.zeros(3), "scale": jnp.ones(3), "w": {"a": jnp.zeros((2, 2))}}
    opt = set_lr_scale(build_optimizer({"name": "adamw", "lr": 0.01}, max_steps=50).init(params), 0.375)
    state = (jnp.array(0), (params, opt))
    log = LearningRateLog()
    assert log.scale(*jax.tree.flatten(state)) == 0.375

    def step(s: Any) -> Any:  # what a compiled call returns: new arrays, the scale carried unchanged
        return jax.tree.map(lambda x: jnp.array(x, copy=True), s)

    flattened = {"n": 0}
    for name in ("leaves", "flatten"):
        real = getattr(jax.tree, name)
        monkeypatch.setattr(
            jax.tree, name, lambda *a, _real=real, **k: flattened.__setitem__("n", flattened["n"] + 1) or _real(*a, **k)
        )
    log.stepped_trees(state, state)  # the path is found here, once
    found = flattened["n"]
    for _ in range(5):
        before, state = state, step(state)
        log.stepped_trees(before, state)
    assert flattened["n"] == found  # five calls, no flatten
    monkeypatch.undo()
    assert log._known is not None and log._known[0] is jax.tree.leaves(state)[log._scale_at]
    assert log.scale(*jax.tree.flatten(state)) == 0.375
    # A scale the host set between two calls is another leaf: forgotten, read again at the next record.
    host = (state[0], (state[1][0], set_lr_scale(state[1][1], 0.5)))
    after = step(host)
    log.stepped_trees(host, after)
    assert log._known is None
    assert log.scale(*jax.tree.flatten(after)) == 0.5
