"""Step-time benchmarks of pipekit-train against hand-written JAX loops, the reference Equinox step and Keras 3 ``fit``.

Run with ``make bench`` (the set-up installs the ``keras`` extra, as for the tests), or directly::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/run.py            # full run, about 5 minutes on 2 cores
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/run.py --quick    # smoke run, 1-2 minutes

Method (see docs/performance.md):

- Every contender is built and compiled first and then run once untimed (warm-up). Then, for ``--rounds``
  rounds, every contender of a comparison is measured once per round, in an order rotated each round, so that
  drift in the machine's load hits all of them alike. The reported time is the median over rounds; a ratio is the
  median over rounds of the ratio of that round's two measurements (a paired comparison).
- Times are steady-state microseconds per optimizer step. Whole runs (`TrainingLoop.run`, Keras ``fit``) have fixed
  costs per call (building the model, the artifact, git state, Keras' data adapter); they are cancelled by timing a
  short and a long run of the same compiled structure and dividing the difference by the difference in steps.
  Hand-written loops have no such cost: they run N steps and block on the result.
- Throughput ratio = baseline µs / contender µs: >= 1 means pipekit is at least as fast.
- Checkpointing (rows 5, 5b) saves at a realistic cadence (every 1,000 steps; 100 for the compute-bound MLP) and
  also reports the ms the training thread blocks in each periodic save, next to one synchronous save by Keras'
  ``ModelCheckpoint``, ``torch.save`` of a ``state_dict`` and ``np.savez``. Row 5's pair is interleaved on its own
  with three times the rounds (see `bench_size`), and so is row 13b's (the Flax backend against the Equinox
  backend, see `bench_flax`).
- Time to the first step and peak memory (rows 9, 9b) are whole fresh processes: ``benchmarks/startup.py``.
- Row 12 (``--only nuts``) times whole sampler runs, pipekit's chunked and checkpointed ``TrainingLoop.run`` against
  NumPyro's own ``MCMC.run``, each one traced afresh as the first run of a process is (see `bench_nuts`).
- Row 14 (``--only observe``) is the default loop with a user callback that reads every step's loss in
  ``on_step_end`` against none, and (14b, informational) the same callback declared to act between steps.

Results are printed as a Markdown table and written to ``benchmarks/results.json`` and ``benchmarks/results.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras reads it once, at its first import

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipekit_train
from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.equinox import TrainState, make_task, train_step

HERE = Path(__file__).resolve().parent
IN_SIZE = 32
RECORDS = 16_384
LR, WEIGHT_DECAY, B1, B2, EPS = 1e-3, 1e-4, 0.9, 0.999, 1e-8  # pipekit's adamw defaults, given to every contender


# Configuration ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    name: str
    width: int
    depth: int
    batch: int
    short: int  # steps of the short run (run-difference method)
    long: int  # steps of the long run; the hand-written loops run long - short steps
    ck_every: int  # the checkpointing comparison saves every `ck_every` steps (a realistic cadence) ...
    ck_short: int  # ... in a short and a long run; both end the same number of steps after their last periodic
    ck_long: int  # save (or start), so the end-of-run save finds the same state of the writer in both


# The small model's checkpointing pair runs ten periodic saves (10,500 steps), not three: at ~27 µs a step, 3,000
# steps differ by 80 ms, and a few ms of this host's jitter per run moved row 5 by ±3% (0.948-1.007 over three
# runs of one tree); the medium and compute-bound pairs already differ by 0.2 s and more.
SIZES = (
    Size("small", 64, 2, 32, short=200, long=2000, ck_every=1000, ck_short=500, ck_long=10500),
    Size("medium", 256, 3, 128, short=100, long=600, ck_every=1000, ck_short=200, ck_long=2200),
    Size("compute-bound", 1024, 4, 256, short=4, long=24, ck_every=100, ck_short=20, ck_long=220),
)
QUICK = {
    "small": dict(short=50, long=500, ck_short=200, ck_long=2200),
    "medium": dict(short=20, long=120, ck_short=100, ck_long=1100),
    "compute-bound": dict(short=2, long=10, ck_short=10, ck_long=110),
}


def quick_size(size: Size) -> Size:
    return dataclasses.replace(size, **QUICK[size.name])


def saves_in(steps: int, every: int) -> int:
    """Checkpoints a run of `steps` writes: every `every` steps, plus one at the end off the cadence."""
    return steps // every + (1 if steps % every else 0)


# Timing --------------------------------------------------------------------------------------------------------
@dataclass
class Contender:
    """Something timed in µs per step: `setup` compiles and warms up, `measure` returns one sample."""

    name: str
    measure: Callable[[], float]
    setup: Callable[[], None] = lambda: None
    samples: list[float] = field(default_factory=list)
    error: str | None = None


def run_interleaved(contenders: list[Contender], rounds: int) -> None:
    """Warm up each contender, then measure them round-robin, rotating the order every round."""
    for c in contenders:
        if c.error is not None:  # known unavailable (Keras missing, checkpointing not importable)
            continue
        try:
            c.setup()
            c.measure()  # untimed warm-up: compile caches, allocator, page faults
        except Exception as e:  # a broken contender is reported, never hidden, and does not stop the rest
            c.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    live = [c for c in contenders if c.error is None]
    for r in range(rounds):
        k = r % max(len(live), 1)
        for c in live[k:] + live[:k]:
            try:
                # The garbage one contender leaves (a hand `nnx.jit` loop's graph objects) is collected before the
                # next is timed, not inside its timing: rotation keeps each contender's cyclic successor, so it was
                # always the same one. (Collections a contender's own allocations cause stay in its time.)
                gc.collect()
                c.samples.append(c.measure())
            except Exception as e:
                c.error = f"{type(e).__name__}: {e}"
                traceback.print_exc()


def run_difference(run: Callable[[int], None], short: int, long: int) -> float:
    """µs per step of `run(n)` with its fixed per-call cost cancelled: (T(long) - T(short)) / (long - short)."""
    t0 = time.perf_counter()
    run(short)
    t1 = time.perf_counter()
    run(long)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (long - short) * 1e6


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def paired_ratio(baseline: Contender, contender: Contender) -> float | None:
    """Median over rounds of baseline µs / contender µs (>= 1: the contender is at least as fast)."""
    pairs = [b / c for b, c in zip(baseline.samples, contender.samples, strict=False) if c > 0 and b > 0]
    return statistics.median(pairs) if pairs else None


# Data ------------------------------------------------------------------------------------------------------------
def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((RECORDS, IN_SIZE)).astype(np.float32)
    w = rng.standard_normal((IN_SIZE, 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.1 * rng.standard_normal((RECORDS, 1))).astype(np.float32)
    return x, y


def prebatched(x: np.ndarray, y: np.ndarray, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One shuffled epoch cut into batches: ``(num_batches, batch, ...)``."""
    perm = np.random.default_rng(seed).permutation(len(x))
    nb = len(x) // batch
    idx = perm[: nb * batch]
    return x[idx].reshape(nb, batch, -1), y[idx].reshape(nb, batch, -1)


def adamw() -> optax.GradientTransformation:
    """optax's adamw with pipekit's defaults (decay on weight matrices, not on biases)."""
    return optax.adamw(
        LR, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
    )


def eqx_mlp(size: Size, seed: int = 0) -> Any:
    return eqx.nn.MLP(IN_SIZE, 1, size.width, size.depth, key=jax.random.key(seed))


# Contenders: pipekit -----------------------------------------------------------------------------------------------
class PipekitRuns:
    """`TrainingLoop.run()` with its defaults; each run gets a fresh run directory under one temporary root."""

    def __init__(self, x: np.ndarray, y: np.ndarray, size: Size, root: str, **loop_kwargs: Any) -> None:
        self.size = size
        self.root = root
        self.dataset = TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))
        self.loop_kwargs = loop_kwargs
        self.count = 0
        self.last_run_dir = ""
        self.lengths = (size.short, size.long)

    def loop(self, steps: int) -> TrainingLoop:
        s = self.size
        kwargs: dict[str, Any] = {
            "model_op": EquinoxModel(
                factory="mlp",
                kwargs={"in_size": IN_SIZE, "out_size": 1, "width_size": s.width, "depth": s.depth},
            ),
            "dataset": self.dataset,
            "loss": MSE(),
            "optimizer_config": {"name": "adamw", "lr": LR},
            "max_steps": steps,
            "batch_size": s.batch,
            "log_every_n_steps": 100,
            "progress": False,
            "steps_per_call": 1,
        }
        kwargs.update(self.loop_kwargs)
        return TrainingLoop(**kwargs)

    def run(self, steps: int) -> None:
        self.count += 1
        run_dir = os.path.join(self.root, f"run{self.count:05d}")
        with run_settings(store=False, run_dir=run_dir):
            model, _artifact = self.loop(steps).run()
        jax.block_until_ready(model.module)
        shutil.rmtree(self.last_run_dir, ignore_errors=True)  # keep the last one for inspection
        self.last_run_dir = run_dir

    def measure(self) -> float:
        return run_difference(self.run, *self.lengths)

    def setup(self) -> None:
        for steps in self.lengths:  # compiles: the optimizer (and so the step) is cached per max_steps
            self.run(steps)


# Contenders: hand-written loops ------------------------------------------------------------------------------------
def jit_step_fn(static: Any, optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    def loss_fn(params: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    def step(params: Any, opt_state: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class HandJit:
    """``jax.jit`` with donation over pre-batched device arrays; ``chunk > 1`` scans ``chunk`` steps per call.

    The params and optimizer state are carried as Equinox/optax pytrees (the idiomatic loop), or with
    ``flat=True`` as plain lists of their leaves, unflattened inside the compiled step: `jax.jit` then flattens
    lists in C++ instead of walking Equinox modules node by node in Python, the fastest hand loop we know.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, size: Size, chunk: int = 1, flat: bool = False) -> None:
        self.size = size
        self.chunk = chunk
        params, self.static = eqx.partition(eqx_mlp(size), eqx.is_inexact_array)
        self.optimizer = adamw()
        self.params = jax.tree.map(jnp.copy, params)
        self.opt_state = self.optimizer.init(self.params)
        xb, yb = prebatched(x, y, size.batch)
        step = jit_step_fn(self.static, self.optimizer)
        if flat:
            p_def, o_def = jax.tree.structure(self.params), jax.tree.structure(self.opt_state)
            tree_step = step

            def step(p: Any, o: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any, jax.Array]:
                params, opt_state, loss = tree_step(jax.tree.unflatten(p_def, p), jax.tree.unflatten(o_def, o), xb, yb)
                return jax.tree.leaves(params), jax.tree.leaves(opt_state), loss

            self.params, self.opt_state = jax.tree.leaves(self.params), jax.tree.leaves(self.opt_state)
        if chunk == 1:
            self.fn = jax.jit(step, donate_argnums=(0, 1))
            self.batches = [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(xb, yb, strict=True)]
        else:

            def chunked(params: Any, opt_state: Any, xs: jax.Array, ys: jax.Array) -> tuple[Any, Any, jax.Array]:
                def body(carry: Any, xy: Any) -> Any:
                    p, o, loss = step(*carry, *xy)
                    return (p, o), loss

                (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
                return params, opt_state, losses

            self.fn = jax.jit(chunked, donate_argnums=(0, 1))
            nc = len(xb) // chunk
            xs = xb[: nc * chunk].reshape(nc, chunk, *xb.shape[1:])
            ys = yb[: nc * chunk].reshape(nc, chunk, *yb.shape[1:])
            self.batches = [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(xs, ys, strict=True)]

    def measure(self) -> float:
        steps = self.size.long - self.size.short
        calls = max(1, steps // self.chunk)
        fn, batches, nb = self.fn, self.batches, len(self.batches)
        params, opt_state = self.params, self.opt_state
        t0 = time.perf_counter()
        for i in range(calls):
            xb, yb = batches[i % nb]
            params, opt_state, loss = fn(params, opt_state, xb, yb)
        jax.block_until_ready((params, loss))
        elapsed = time.perf_counter() - t0
        self.params, self.opt_state = params, opt_state
        return elapsed / (calls * self.chunk) * 1e6


class SeedStep:
    """The reference Equinox step (`eqx.filter_jit` over the whole `TrainState`), once per step, pre-batched data."""

    def __init__(self, x: np.ndarray, y: np.ndarray, size: Size) -> None:
        self.size = size
        model = eqx_mlp(size)
        self.optimizer = adamw()
        self.task = make_task(MSE())
        self.state = TrainState(model=model, opt_state=self.optimizer.init(eqx.filter(model, eqx.is_array)), step=0)
        xb, yb = prebatched(x, y, size.batch)
        self.batches = [{"x": jnp.asarray(a), "y": jnp.asarray(b)} for a, b in zip(xb, yb, strict=True)]
        base = jax.random.key(1)
        self.keys = [jax.random.fold_in(base, i) for i in range(len(self.batches))]  # no per-step key dispatch

    def measure(self) -> float:
        steps = self.size.long - self.size.short
        state, task, opt, batches, keys, nb = (
            self.state,
            self.task,
            self.optimizer,
            self.batches,
            self.keys,
            len(self.batches),
        )
        t0 = time.perf_counter()
        for i in range(steps):
            state, metrics = train_step(state, batches[i % nb], keys[i % nb], task, opt)
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - t0
        self.state = state
        return elapsed / steps * 1e6


# Contenders: Keras -----------------------------------------------------------------------------------------------
class KerasFit:
    """Keras 3 ``fit`` on the JAX backend: same MLP, AdamW (biases not decayed), MSE, data, batch, shuffling."""

    def __init__(self, x: np.ndarray, y: np.ndarray, size: Size, steps_per_execution: int) -> None:
        import keras

        if keras.backend.backend() != "jax":
            raise RuntimeError(f"Keras backend is {keras.backend.backend()!r}; set KERAS_BACKEND=jax before import")
        self.size = size
        self.x, self.y = x, y
        layers = [keras.Input(shape=(IN_SIZE,))]
        layers += [keras.layers.Dense(size.width, activation="relu") for _ in range(size.depth)]
        layers += [keras.layers.Dense(1)]
        self.model = keras.Sequential(layers)
        optimizer = keras.optimizers.AdamW(
            learning_rate=LR, weight_decay=WEIGHT_DECAY, beta_1=B1, beta_2=B2, epsilon=EPS
        )
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        self.model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)

    def run(self, steps: int) -> None:
        n = steps * self.size.batch
        reps = -(-n // len(self.x))
        x = np.concatenate([self.x] * reps)[:n] if reps > 1 else self.x[:n]
        y = np.concatenate([self.y] * reps)[:n] if reps > 1 else self.y[:n]
        self.model.fit(x, y, batch_size=self.size.batch, epochs=1, shuffle=True, verbose=0)

    def measure(self) -> float:
        return run_difference(self.run, self.size.short, self.size.long)


class KerasBackendRuns(PipekitRuns):
    """`TrainingLoop(backend="keras")`: the same MLP as a `KerasModel`, trained by pipekit's own jitted step."""

    def loop(self, steps: int) -> TrainingLoop:
        from pipekit_train.adapters.keras import KerasModel

        s = self.size
        kwargs = {"in_size": IN_SIZE, "out_size": 1, "width_size": s.width, "depth": s.depth}
        return super().loop(steps).replace(backend="keras", model_op=KerasModel(factory="mlp", kwargs=kwargs))

    def run(self, steps: int) -> None:
        self.count += 1
        run_dir = os.path.join(self.root, f"run{self.count:05d}")
        with run_settings(store=False, run_dir=run_dir):
            model, _artifact = self.loop(steps).run()
        jax.block_until_ready(list(model.module.trainable))
        shutil.rmtree(self.last_run_dir, ignore_errors=True)
        self.last_run_dir = run_dir


# Contenders: Lightning -------------------------------------------------------------------------------------------
class TrainerFit:
    """A plain ``pytorch_lightning.Trainer.fit``: the same MLP as a torch module, AdamW (biases not decayed, the
    backend's `build_lightning_module`), MSE, data and batch, the same torch thread count as the backend."""

    def __init__(self, x: np.ndarray, y: np.ndarray, size: Size) -> None:
        import torch

        from pipekit_train.adapters.lightning import TorchModel, build_lightning_module
        from pipekit_train.adapters.lightning._adapter import threads

        torch.set_num_threads(threads())
        self.size = size
        kwargs = {"in_size": IN_SIZE, "out_size": 1, "width_size": size.width, "depth": size.depth}
        op = TorchModel(factory="mlp", kwargs=kwargs)
        self.module = build_lightning_module(MSE(), op, {"name": "adamw", "lr": LR}, max_steps=size.long)
        self.data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    def run(self, steps: int) -> None:
        import pytorch_lightning as pl
        import torch

        loader = torch.utils.data.DataLoader(self.data, batch_size=self.size.batch, shuffle=True, drop_last=True)
        trainer = pl.Trainer(
            max_steps=steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(self.module, loader)

    def measure(self) -> float:
        return run_difference(self.run, self.size.short, self.size.long)


class LightningBackendRuns(PipekitRuns):
    """`TrainingLoop(backend="lightning")`: the same MLP as a `TorchModel`, trained by pipekit's own torch step."""

    def loop(self, steps: int) -> TrainingLoop:
        from pipekit_train.adapters.lightning import TorchModel

        s = self.size
        kwargs = {"in_size": IN_SIZE, "out_size": 1, "width_size": s.width, "depth": s.depth}
        return super().loop(steps).replace(backend="lightning", model_op=TorchModel(factory="mlp", kwargs=kwargs))

    def run(self, steps: int) -> None:
        self.count += 1
        run_dir = os.path.join(self.root, f"run{self.count:05d}")
        with run_settings(store=False, run_dir=run_dir):
            self.loop(steps).run()
        shutil.rmtree(self.last_run_dir, ignore_errors=True)
        self.last_run_dir = run_dir


# Contenders: Flax ------------------------------------------------------------------------------------------------
def flax_available() -> str | None:
    try:
        import flax  # noqa: F401
    except ImportError:
        return "flax is not installed (pip install 'pipekit-train[flax]')"
    import pipekit_train

    if "flax" not in pipekit_train.available_backends():  # installed metadata older than the flax entry point
        pipekit_train.register_backend("flax", "pipekit_train.adapters.flax:backend")
    return None


class HandNnxJit:
    """A hand-written Flax NNX loop as the Flax documentation writes it: an ``nnx.Module`` MLP (the same layers as
    the backend's ``mlp``), ``nnx.Optimizer`` with the same AdamW, and an ``@nnx.jit`` step over pre-batched data."""

    def __init__(self, x: np.ndarray, y: np.ndarray, size: Size) -> None:
        from flax import nnx

        class MLP(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                sizes = [IN_SIZE, *([size.width] * size.depth), 1]
                self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

            def __call__(self, x: jax.Array) -> jax.Array:
                for layer in self.layers[:-1]:
                    x = jax.nn.relu(layer(x))
                return self.layers[-1](x)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
            def loss_fn(model: Any) -> jax.Array:
                return jnp.mean((model(xb) - yb) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        self.size = size
        self.model = MLP(nnx.Rngs(0))
        self.optimizer = nnx.Optimizer(self.model, adamw(), wrt=nnx.Param)
        self.step = step
        xb, yb = prebatched(x, y, size.batch)
        self.batches = [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(xb, yb, strict=True)]

    def measure(self) -> float:
        steps = self.size.long - self.size.short
        step, model, optimizer, batches, nb = self.step, self.model, self.optimizer, self.batches, len(self.batches)
        t0 = time.perf_counter()
        for i in range(steps):
            xb, yb = batches[i % nb]
            loss = step(model, optimizer, xb, yb)
        jax.block_until_ready(loss)
        return (time.perf_counter() - t0) / steps * 1e6


class FlaxBackendRuns(PipekitRuns):
    """`TrainingLoop(backend="flax")`: the same MLP as a `FlaxModel`, trained by pipekit's own jitted step."""

    def loop(self, steps: int) -> TrainingLoop:
        from pipekit_train.adapters.flax import FlaxModel

        s = self.size
        kwargs = {"in_size": IN_SIZE, "out_size": 1, "width_size": s.width, "depth": s.depth}
        return super().loop(steps).replace(backend="flax", model_op=FlaxModel(factory="mlp", kwargs=kwargs))

    def run(self, steps: int) -> None:
        self.count += 1
        run_dir = os.path.join(self.root, f"run{self.count:05d}")
        with run_settings(store=False, run_dir=run_dir):
            model, _artifact = self.loop(steps).run()
        jax.block_until_ready(jax.tree.leaves(model.module.params))
        shutil.rmtree(self.last_run_dir, ignore_errors=True)
        self.last_run_dir = run_dir


def bench_flax(size: Size, x: np.ndarray, y: np.ndarray, rounds: int, root: str) -> list[Row]:
    """Row 13: the Flax backend (``steps_per_call=1``, whole runs by the run-difference method) against a
    hand-written ``nnx.jit`` loop of the same model and against the Equinox backend, interleaved in one round-robin."""
    print(f"\n## flax, {size.name}: MLP {IN_SIZE}->{size.width}x{size.depth}->1, batch {size.batch}", flush=True)
    flax_ok = flax_available()
    holder: dict[str, Any] = {}

    def hand_setup() -> None:
        holder["hand"] = HandNnxJit(x, y, size)

    c_hand = Contender("hand nnx.jit", lambda: holder["hand"].measure(), hand_setup)
    fb = FlaxBackendRuns(x, y, size, os.path.join(root, size.name, "flax-backend"))
    c_fb = Contender("pipekit flax backend", fb.measure, fb.setup)
    c_hand.error = c_fb.error = flax_ok
    run_interleaved([c_hand, c_fb], rounds)
    # 13b pairs the two backends on their own, with three times the rounds (as row 5's pair): beside the hand
    # `nnx.jit` loop, whose graph traversal allocates heavily, one run's samples of either backend spread over 2-3x
    # on small (76-236 µs a step), wider than the 5% the row resolves.
    eq = PipekitRuns(x, y, size, os.path.join(root, size.name, "flax-vs-equinox"))
    c_eq = Contender("pipekit equinox backend", eq.measure, eq.setup)
    c_fb2 = Contender("pipekit flax backend", fb.measure)  # compiled and warmed up above
    c_fb2.error = c_fb.error
    run_interleaved([c_eq, c_fb2], 3 * rounds)
    for c in (c_hand, c_fb, c_eq, c_fb2):
        med = median(c.samples)
        print(f"   {c.name:28s} " + (f"{med:10.1f} µs/step" if med else f"-- {c.error}"), flush=True)
    return [
        row("13 flax backend vs hand nnx.jit", size.name, c_hand, c_fb),
        row("13b flax backend vs equinox backend", size.name, c_eq, c_fb2),
    ]


# Data path ---------------------------------------------------------------------------------------------------------
class DataPath:
    """Batches per second: `TrainingDataset.iterator` vs numpy slicing of a per-epoch permutation."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, batches: int) -> None:
        self.arrays = {"x": x, "y": y}
        self.batch = batch
        self.batches = batches
        self.it = TrainingDataset(source=ArraySource(arrays=self.arrays)).iterator(batch, 0)

    def pipekit(self) -> float:
        it, n = self.it, self.batches
        t0 = time.perf_counter()
        for _ in range(n):
            next(it)
        return (time.perf_counter() - t0) / n * 1e6

    def numpy(self) -> float:
        items, batch, n = tuple(self.arrays.items()), self.batch, self.batches
        records = len(self.arrays["x"])
        per_epoch = records // batch
        epoch, b, perm = 0, 0, np.random.default_rng([0, 0]).permutation(records)
        t0 = time.perf_counter()
        for _ in range(n):
            if b == per_epoch:
                epoch, b = epoch + 1, 0
                perm = np.random.default_rng([0, epoch]).permutation(records)
            idx = perm[b * batch : (b + 1) * batch]
            {k: v[idx] for k, v in items}
            b += 1
        return (time.perf_counter() - t0) / n * 1e6


# Checkpointing -----------------------------------------------------------------------------------------------------
def checkpoint_callback(every: int) -> tuple[Any, str | None]:
    try:
        from pipekit_train.checkpoint import Checkpoint
    except Exception as e:  # the checkpoint layer is being written
        return None, f"cannot import Checkpoint: {type(e).__name__}: {e}"
    return Checkpoint(every_n_steps=every), None


BLOCKING: dict[str, list[float]] = {}  # run directory root -> ms the training thread spent in each periodic save


def time_saves() -> None:
    """Record how long the training thread spends in each periodic save: everything the loop does for a save, on
    its thread: taking the state (`CheckpointHooks.after_chunk` returning the rest of the save, before the next
    dispatch) and the rest (`CheckpointHooks._save`, after that dispatch: the non-finite check, the meta,
    `Checkpointer.save`, waiting for the previous save if it is still being written); or all of it at once.

    Not the wait for the device to finish the chunk being saved: the hold takes the state that chunk returns, and
    the chunk was dispatched just before (the host runs a chunk ahead since a log record no longer waits for it),
    so that wait is the chunk's own compute, which an unsaved step waits for at its next log record anyway. It is
    waited for before the clock starts, and only at a step that saves."""
    from pipekit_train.engine import _hooks as _resume

    hooks = _resume.CheckpointHooks
    if getattr(hooks._save, "_timed", False):
        return
    inner_save, inner_after = hooks._save, hooks.after_chunk
    held_ms: dict[int, float] = {}  # id(hooks) -> the time taken to hold the state of the save now pending

    def after_chunk(self: Any, call: Any, data_state: Any) -> Any:
        if self.config is not None and self.config.should_save(call.step):
            jax.block_until_ready(call.backend.state_tree())
        t0 = time.perf_counter()
        rest = inner_after(self, call, data_state)
        if rest is not None:
            held_ms[id(self)] = (time.perf_counter() - t0) * 1e3
        return rest

    def timed(self: Any, call: Any, data_state: Any, stop_reason: str | None = None, **kw: Any) -> None:
        t0 = time.perf_counter()
        inner_save(self, call, data_state, stop_reason, **kw)
        ms = (time.perf_counter() - t0) * 1e3 + held_ms.pop(id(self), 0.0)
        if stop_reason is None and call.step != self.loop.max_steps:  # periodic saves only, not the final one
            BLOCKING.setdefault(str(Path(self.directory).parents[2]), []).append(ms)

    timed._timed = True  # type: ignore[attr-defined]
    hooks._save = timed  # type: ignore[method-assign]
    hooks.after_chunk = after_chunk  # type: ignore[method-assign]


class SavePeers:
    """One save of the same MLP with its AdamW state, written synchronously by the usual tool of each framework:
    Keras 3's ``ModelCheckpoint`` (``model.save`` of a ``.keras`` file, which it calls every ``save_freq``
    batches), torch's ``torch.save`` of the module's and optimizer's ``state_dict``, and ``np.savez`` of the
    Equinox leaves. Each blocks the training thread for its whole duration; the samples are ms per save."""

    def __init__(self, size: Size, root: str) -> None:
        self.size = size
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def numpy_setup(self) -> None:
        params = eqx.filter(eqx_mlp(self.size), eqx.is_array)
        leaves = jax.tree.leaves((params, adamw().init(params)))
        self.arrays = {f"a{i}": np.asarray(x) for i, x in enumerate(leaves)}

    def numpy(self) -> float:
        self.count += 1
        t0 = time.perf_counter()
        np.savez(self.root / f"np{self.count}.npz", **self.arrays)
        return (time.perf_counter() - t0) * 1e3

    def keras_setup(self) -> None:
        import keras

        x, y = make_data()
        fit = KerasFit(x[: 4 * self.size.batch], y[: 4 * self.size.batch], self.size, 1)
        fit.model.fit(fit.x, fit.y, batch_size=self.size.batch, epochs=1, verbose=0)  # builds the optimizer state
        self.keras_callback = keras.callbacks.ModelCheckpoint(str(self.root / "keras-{batch}.keras"), save_freq=1)
        self.keras_callback.set_model(fit.model)
        self.keras_callback.on_epoch_begin(0)

    def keras(self) -> float:
        self.count += 1
        t0 = time.perf_counter()
        self.keras_callback.on_train_batch_end(self.count, logs={})  # fit calls it after each batch: saves here
        return (time.perf_counter() - t0) * 1e3

    def torch_setup(self) -> None:
        import torch

        from pipekit_train.adapters.lightning import TorchModel

        s = self.size
        kwargs = {"in_size": IN_SIZE, "out_size": 1, "width_size": s.width, "depth": s.depth}
        self.module = TorchModel(factory="mlp", kwargs=kwargs).build(0)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        xb = torch.randn(s.batch, IN_SIZE)
        self.module(xb).pow(2).mean().backward()
        self.optimizer.step()  # the moments exist

    def torch(self) -> float:
        import torch

        self.count += 1
        t0 = time.perf_counter()
        torch.save(
            {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()},
            self.root / f"torch{self.count}.pt",
        )
        return (time.perf_counter() - t0) * 1e3


def checkpointing_works(run_dir: str) -> bool:
    """Whether the run wrote checkpoints at all (a ``manifest.json`` of committed checkpoints)."""
    return any(Path(run_dir).rglob("manifest.json"))


# The suite ---------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    section: str
    size: str
    baseline: str
    contender: str
    baseline_us: float | None
    contender_us: float | None
    ratio: float | None
    target: float
    note: str = ""
    baseline_samples: list[float] = field(default_factory=list)
    contender_samples: list[float] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "N/A"
        return "PASS" if self.ratio >= self.target else "MISS"


TARGETS = {
    # The targets for the default loop (issue 15): >= 0.8x the flat-leaves hand loop, >= 0.9x the hand scan of 10
    # steps, >= 3x Keras fit with steps_per_execution=10.
    "0 default loop vs hand jit": 0.80,
    "0 default loop vs hand lax.scan": 0.90,
    "0b default loop vs Keras fit spe=10": 3.0,
    "1 vs hand jit": {"small": 0.90, "medium": 0.90, "compute-bound": 0.97},
    "2 vs seed filter_jit": 3.0,
    "3 vs Keras fit": 2.0,
    "3b keras backend vs Keras fit": 1.0,
    "3c lightning backend vs Trainer.fit": 1.0,
    "4 steps_per_call=10 vs lax.scan": 0.90,
    "5 checkpoint at a realistic cadence vs none": 0.98,
    "5b blocking per save (ms)": 1.0,
    "6 data path vs numpy": 0.90,
    "7 sharded step (1 device) vs unsharded": 0.97,
    "8 bfloat16 compute vs float32": 0.0,  # informational: what mixed precision costs or gains here
    "9 time to first step (s)": 1.0,  # ratio (hand + 0.3 s) / pipekit
    "9b peak memory (MB)": 1.0,  # ratio 1.15 * hand / pipekit
    "9c import cost (ms)": 1.0,  # ratio numpy / pipekit: import pipekit at most 1.0x import numpy (issue 45)
    "10 extend a finished stage vs one longer stage": 0.95,
    # Informational: the same with each stage recording its pointwise log-likelihood (the MCMC default, issue 43).
    "10b extend, each stage recording its log-likelihood": 0.0,
    "11 a 300-step job, whole process (s)": 1.0,  # ratio 1.10 * hand / pipekit
    "12 chunked, checkpointed NUTS vs MCMC.run (s)": 1.0,  # ratio 1.10 * MCMC.run / pipekit
    # The Flax backend (issue 41): at least 0.95x a hand-written nnx.jit loop and the Equinox backend.
    "13 flax backend vs hand nnx.jit": 0.95,
    "13b flax backend vs equinox backend": 0.95,
    # A callback that reads every step's loss (issue 45): at most 5% on the default loop.
    "14 observing on_step_end callback vs none": 0.95,
    "14b per-step on_step_end callback vs none": 0.0,  # informational: what acting between steps costs
    # Sequence models (issue 42): the transformer stage at least 0.97x a hand-written Equinox + optax loop.
    "15 transformer stage vs hand loop (tokens/s)": 0.97,
    # ... and with LoRA: faster steps than full training of the same stage.
    "15b transformer LoRA vs full training": 1.0,
}


def target_of(section: str, size: str) -> float:
    t = TARGETS[section]
    return t[size] if isinstance(t, dict) else t


BLOCKING_TARGET_MS = 5.0


def blocking_row(size: str, c: Contender, note: str) -> Row:
    """ms the training thread is blocked per save, against the 5 ms target: ratio = 5 ms / median blocking."""
    med = median(c.samples)
    return Row(
        section="5b blocking per save (ms)",
        size=size,
        baseline=f"target {BLOCKING_TARGET_MS:g} ms",
        contender=c.name,
        baseline_us=BLOCKING_TARGET_MS,
        contender_us=med,
        ratio=None if c.error or not med else BLOCKING_TARGET_MS / med,
        target=1.0,
        note=f"error: {c.error}" if c.error else f"{note}; ms, not µs; {len(c.samples)} saves",
        contender_samples=[round(v, 3) for v in c.samples],
    )


def row(section: str, size: str, base: Contender, cont: Contender, note: str = "") -> Row:
    err = base.error or cont.error
    return Row(
        section=section,
        size=size,
        baseline=base.name,
        contender=cont.name,
        baseline_us=median(base.samples),
        contender_us=median(cont.samples),
        ratio=None if err else paired_ratio(base, cont),
        target=target_of(section, size),
        note=(f"error: {err}" if err else note),
        baseline_samples=[round(v, 2) for v in base.samples],
        contender_samples=[round(v, 2) for v in cont.samples],
    )


def bench_size(size: Size, x: np.ndarray, y: np.ndarray, rounds: int, root: str, keras_ok: str | None) -> list[Row]:
    """All step-time comparisons of one model size, interleaved in one round-robin."""
    print(
        f"\n## {size.name}: MLP {IN_SIZE}->{size.width}x{size.depth}->1, batch {size.batch}, "
        f"steps {size.short}/{size.long}, checkpointing every {size.ck_every} in {size.ck_short}/{size.ck_long}",
        flush=True,
    )
    pk = PipekitRuns(x, y, size, os.path.join(root, size.name, "spc1"))
    pk_auto = PipekitRuns(x, y, size, os.path.join(root, size.name, "default"), steps_per_call="auto")
    pk10 = PipekitRuns(x, y, size, os.path.join(root, size.name, "spc10"), steps_per_call=10)
    c_pk = Contender("pipekit steps_per_call=1", pk.measure, pk.setup)
    c_auto = Contender("pipekit default (auto)", pk_auto.measure, pk_auto.setup)
    c_pk10 = Contender("pipekit steps_per_call=10", pk10.measure, pk10.setup)
    holder: dict[str, Any] = {}

    def lazy(key: str, make: Callable[[], Any]) -> Contender:
        def setup() -> None:
            holder[key] = make()

        return Contender(key, lambda: holder[key].measure(), setup)

    c_jit = lazy("hand jax.jit+donate", lambda: HandJit(x, y, size))
    c_flat = lazy("hand jit, flat leaves", lambda: HandJit(x, y, size, flat=True))
    c_scan = lazy("hand lax.scan x10", lambda: HandJit(x, y, size, chunk=10))
    c_seed = lazy("seed eqx.filter_jit step", lambda: SeedStep(x, y, size))
    contenders = [c_auto, c_pk, c_jit, c_flat, c_seed, c_pk10, c_scan]
    keras_c: list[Contender] = []
    for spe in (1, 10):
        c = lazy(f"Keras fit spe={spe}", functools.partial(KerasFit, x, y, size, spe))
        if keras_ok is not None:
            c.error = keras_ok
        keras_c.append(c)
    contenders += keras_c
    kb = KerasBackendRuns(x, y, size, os.path.join(root, size.name, "keras-backend"))
    c_kb = Contender("pipekit keras backend", kb.measure, kb.setup)
    c_kb.error = keras_ok
    contenders.append(c_kb)
    lightning_ok = lightning_available()
    c_tf = lazy("Lightning Trainer.fit", functools.partial(TrainerFit, x, y, size))
    lb = LightningBackendRuns(x, y, size, os.path.join(root, size.name, "lightning-backend"))
    c_lb = Contender("pipekit lightning backend", lb.measure, lb.setup)
    c_tf.error = c_lb.error = lightning_ok
    contenders += [c_tf, c_lb]
    cb, ck_error = checkpoint_callback(size.ck_every)
    time_saves()
    # The default loop (`steps_per_call: auto`): a save every `ck_every` steps is one more chunk boundary.
    plain = PipekitRuns(x, y, size, os.path.join(root, size.name, "plain"), steps_per_call="auto")
    ck_root = os.path.join(root, size.name, "ckpt")
    with_ck = PipekitRuns(x, y, size, ck_root, callbacks=(cb,) if cb else (), steps_per_call="auto")
    plain.lengths = with_ck.lengths = (size.ck_short, size.ck_long)
    c_plain = Contender("pipekit, no checkpoint", plain.measure, plain.setup)

    def ck_setup() -> None:
        with_ck.setup()
        BLOCKING.pop(ck_root, None)  # the first saves import Orbax and build its manager: not the steady state

    c_ck = Contender(f"pipekit + Checkpoint({size.ck_every})", with_ck.measure, ck_setup)
    c_ck.error = ck_error
    # The sharded step (explicit shardings on a one-device mesh: `shard_params` forces the mesh) and bfloat16
    # compute, each against the default loop (docs/scale.md).
    sharded = PipekitRuns(x, y, size, os.path.join(root, size.name, "sharded"), mesh={"shard_params": True})
    # Its baseline is the unsharded step on the same data path: a mesh trains from host batches (device-resident
    # data is for one device without a mesh), so against `c_pk` the row measured the data path, not the shardings.
    on_host = TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}), device_resident=False)
    unsharded_host = PipekitRuns(x, y, size, os.path.join(root, size.name, "host"), dataset=on_host)
    c_host = Contender("pipekit steps_per_call=1, host data", unsharded_host.measure, unsharded_host.setup)
    bf16 = PipekitRuns(x, y, size, os.path.join(root, size.name, "bf16"), precision={"compute": "bfloat16"})
    c_sharded = Contender("pipekit, sharded step", sharded.measure, sharded.setup)
    c_bf16 = Contender("pipekit, bfloat16 compute", bf16.measure, bf16.setup)
    contenders += [c_host, c_sharded, c_bf16]
    t0 = time.perf_counter()
    run_interleaved(contenders, rounds)
    # Row 5 on its own, the two runs of a round back to back, and 3x the rounds: a few saves' cost is a few
    # percent of runs of under a second, and this host's speed drifts by more than that within seconds.
    run_interleaved([c_plain, c_ck], 3 * rounds)
    contenders += [c_plain, c_ck]
    ck_note = ""
    if c_ck.error is None:
        if not checkpointing_works(with_ck.last_run_dir):
            c_ck.error = "the Checkpoint callback is not wired into the loop yet: no checkpoint was written"
        elif c_ck.samples and c_plain.samples:
            # Paired per round, like the ratio: the extra µs per step, times the steps, over the extra saves.
            extra = saves_in(size.ck_long, size.ck_every) - saves_in(size.ck_short, size.ck_every)
            diffs = [c - p for c, p in zip(c_ck.samples, c_plain.samples, strict=False)]
            per_save = statistics.median(diffs) * (size.ck_long - size.ck_short) / extra
            ck_note = f"{per_save / 1e3:.1f} ms of wall time per save; steps {size.ck_short}/{size.ck_long}"
    # What a save blocks the training thread for: pipekit's periodic saves (timed inside the runs above), and one
    # synchronous save by each peer, interleaved like the rest.
    peers = SavePeers(size, os.path.join(root, size.name, "peers"))
    c_np = Contender("np.savez (sync)", peers.numpy, peers.numpy_setup)
    c_keras_ck = Contender("Keras ModelCheckpoint (sync)", peers.keras, peers.keras_setup)
    c_keras_ck.error = keras_ok
    c_torch = Contender("torch.save(state_dict) (sync)", peers.torch, peers.torch_setup)
    c_torch.error = lightning_ok
    run_interleaved([c_np, c_keras_ck, c_torch], rounds + 2)
    c_block = Contender(f"pipekit Checkpoint({size.ck_every}), async", measure=lambda: 0.0)  # timed in the runs
    c_block.samples = BLOCKING.get(ck_root, [])
    c_block.error = c_ck.error or (None if c_block.samples else "no periodic save was timed")
    print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    for c in contenders:
        med = median(c.samples)
        print(f"   {c.name:28s} " + (f"{med:10.1f} µs/step" if med else f"-- {c.error}"), flush=True)
    for c in (c_block, c_np, c_keras_ck, c_torch):
        med = median(c.samples)
        print(f"   {c.name:28s} " + (f"{med:10.2f} ms/save" if med else f"-- {c.error}"), flush=True)
    rows = [
        row("0 default loop vs hand jit", size.name, c_flat, c_auto),
        row("0 default loop vs hand lax.scan", size.name, c_scan, c_auto),
        row("0b default loop vs Keras fit spe=10", size.name, keras_c[1], c_auto),
        row("1 vs hand jit", size.name, c_jit, c_pk),
        row("1 vs hand jit", size.name, c_flat, c_pk),
        row("2 vs seed filter_jit", size.name, c_seed, c_pk),
    ]
    rows += [row("3 vs Keras fit", size.name, c, c_pk) for c in keras_c]
    rows.append(row("3b keras backend vs Keras fit", size.name, keras_c[0], c_kb))
    rows.append(row("3c lightning backend vs Trainer.fit", size.name, c_tf, c_lb))
    rows.append(row("4 steps_per_call=10 vs lax.scan", size.name, c_scan, c_pk10))
    rows.append(row("5 checkpoint at a realistic cadence vs none", size.name, c_plain, c_ck, ck_note))
    rows.append(blocking_row(size.name, c_block, "pipekit: the training thread, periodic saves"))
    for peer in (c_keras_ck, c_torch, c_np):
        rows.append(blocking_row(size.name, peer, "a peer: blocks for the whole save"))
    rows.append(row("7 sharded step (1 device) vs unsharded", size.name, c_host, c_sharded))
    rows.append(row("8 bfloat16 compute vs float32", size.name, c_pk, c_bf16, "informational"))
    return rows


class LossTally(pipekit_train.Callback, register=False):
    """Row 14's user callback: overrides `on_step_end` only to read every step's loss (nothing declared: the loop
    infers from its source that it only observes)."""

    def initial_state(self) -> dict[str, Any]:
        return {"steps": 0, "sum": 0.0}

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        state = ctx.state_of(self)
        state["steps"] += 1
        state["sum"] += float(metrics["loss"])


class LossTallyEveryStep(LossTally, register=False):
    """The same callback declared as acting between steps (`observes_only = False`): one step per call."""

    observes_only = False


def bench_observe(size: Size, x: np.ndarray, y: np.ndarray, rounds: int, root: str) -> list[Row]:
    """Row 14: the default loop with a callback that reads every step's loss, against no callback (issue 45); and,
    for information, the same callback taken to act between steps, which costs the fusion."""
    print(f"\n## observing on_step_end: {size.name}, steps {size.short}/{size.long}", flush=True)
    base = os.path.join(root, size.name, "observe")
    plain = PipekitRuns(x, y, size, base + "-none", steps_per_call="auto")
    watched = PipekitRuns(x, y, size, base + "-tally", steps_per_call="auto", callbacks=(LossTally(),))
    every = PipekitRuns(x, y, size, base + "-every", steps_per_call="auto", callbacks=(LossTallyEveryStep(),))
    c_plain = Contender("pipekit default (auto)", plain.measure, plain.setup)
    c_watch = Contender("+ observing on_step_end", watched.measure, watched.setup)
    c_every = Contender("+ the same, acting per step", every.measure, every.setup)
    run_interleaved([c_plain, c_watch, c_every], rounds)
    for c in (c_plain, c_watch, c_every):
        med = median(c.samples)
        print(f"   {c.name:30s} " + (f"{med:10.1f} µs/step" if med else f"-- {c.error}"), flush=True)
    return [
        row("14 observing on_step_end callback vs none", size.name, c_plain, c_watch),
        row("14b per-step on_step_end callback vs none", size.name, c_plain, c_every, "informational"),
    ]


def bench_data(x: np.ndarray, y: np.ndarray, rounds: int, batches: int) -> list[Row]:
    print(f"\n## data path: batch 32, {batches} batches per sample", flush=True)
    dp = DataPath(x, y, 32, batches)
    c_np = Contender("numpy permutation slicing", dp.numpy)
    c_pk = Contender("TrainingDataset.iterator", dp.pipekit)
    run_interleaved([c_np, c_pk], rounds)
    return [row("6 data path vs numpy", "batch 32", c_np, c_pk, "µs per batch")]


def bench_startup(rounds: int) -> list[Row]:
    """Time to the first finished step and peak memory of fresh processes (`benchmarks/startup.py`)."""
    sys.path.insert(0, str(HERE))
    import startup

    print(f"\n## time to first step: fresh processes, small MLP, {rounds} interleaved rounds", flush=True)
    measured = startup.measure(rounds)
    print(startup.report(measured), flush=True)
    hand = measured["hand"]
    rows = []
    for name in ("api", "cli"):
        c = measured[name]
        err = hand.error or c.error
        first = [s.first_step_s for s in c.samples]
        base = [s.first_step_s for s in hand.samples]
        pairs = [(b + 0.3) / f for b, f in zip(base, first, strict=False) if f > 0]
        label = "pipekit Python API" if name == "api" else "pipekit CLI on YAML"
        rows.append(
            Row(
                section="9 time to first step (s)",
                size="small",
                baseline="hand-written script",
                contender=label,
                baseline_us=hand.median("first_step_s"),
                contender_us=c.median("first_step_s"),
                ratio=None if err or not pairs else statistics.median(pairs),
                target=1.0,
                note=f"error: {err}" if err else "seconds; ratio = (hand + 0.3 s) / pipekit, paired per round",
                baseline_samples=[round(v, 3) for v in base],
                contender_samples=[round(v, 3) for v in first],
            )
        )
        rss = [s.peak_rss_mb for s in c.samples]
        base_rss = [s.peak_rss_mb for s in hand.samples]
        pairs = [1.15 * b / r for b, r in zip(base_rss, rss, strict=False) if r > 0]
        rows.append(
            Row(
                section="9b peak memory (MB)",
                size="small",
                baseline="hand-written script",
                contender=label,
                baseline_us=hand.median("peak_rss_mb"),
                contender_us=c.median("peak_rss_mb"),
                ratio=None if err or not pairs else statistics.median(pairs),
                target=1.0,
                note=f"error: {err}" if err else "peak RSS, MB; ratio = 1.15 * hand / pipekit",
                baseline_samples=[round(v, 1) for v in base_rss],
                contender_samples=[round(v, 1) for v in rss],
            )
        )
    rows.append(bench_job(rounds))
    rows.append(bench_import(max(5 * rounds, 10)))
    return rows


def _import_ms(module: str) -> float:
    """ms a fresh interpreter spends importing `module`: its run less a bare interpreter's run just before."""
    import subprocess

    def wall(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0

    bare = wall("pass")
    return (wall(f"import {module}") - bare) * 1e3


def bench_import(rounds: int) -> Row:
    """Row 9c: ``import pipekit`` against ``import numpy`` in fresh processes (issue 45: at most 1.0x), each less a
    bare interpreter's start measured just before it, interleaved."""
    print(f"\n## import cost: fresh processes, {rounds} interleaved rounds", flush=True)
    base = Contender("import numpy", functools.partial(_import_ms, "numpy"))
    cont = Contender("import pipekit", functools.partial(_import_ms, "pipekit"))
    run_interleaved([base, cont], rounds)
    return row("9c import cost (ms)", "-", base, cont, "ms per fresh process, less a bare interpreter's start")


def bench_extend(rounds: int, quick: bool) -> list[Row]:
    """Row 10: a sampler stage of W + S iterations, then `extend` by N, against one stage of W + S + N from the
    start (bitwise the same draws): µs per iteration of the whole thing (both stages' fixed costs included: the
    artifact, final.json, the posterior report, the end-of-stage checkpoint), per backend. The programs are
    compiled in the untimed warm-up, as a second run in a process finds them.

    Row 10 samples with ``log_likelihood: false``: what extending costs. Row 10b (informational) keeps the
    default, under which every finished stage records its pointwise log-likelihood (``(chains, draws, 2000)``
    floats): the extended pair records it twice (the first stage's draws, then all of them), one longer stage
    once, so 10b adds the first stage's log-likelihood to the comparison."""
    from pipekit_train import Checkpoint, Last, NpzSource
    from pipekit_train.adapters.numpyro import NUTS, BlackjaxModel, NumpyroModel
    from pipekit_train.stage import extend

    warmup, samples, more, chains = (100, 400, 400, 4) if quick else (200, 2000, 2000, 4)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(2000, 8)).astype(np.float32)
    ys = (rng.random(2000) < 1 / (1 + np.exp(-(xs @ rng.normal(size=8))))).astype(np.float32)
    root = tempfile.mkdtemp(prefix="pipekit-bench-extend-")
    data = os.path.join(root, "data.npz")
    np.savez(data, x=xs, y=ys)
    total = warmup + samples + more
    counter = iter(range(10**6))

    def loop(backend: str, n: int, log_likelihood: bool) -> TrainingLoop:
        model = BlackjaxModel if backend == "blackjax" else NumpyroModel
        return TrainingLoop(
            model_op=model(model="logistic_regression"),
            dataset=TrainingDataset(source=NpzSource(path=data), shuffle=False),
            task=NUTS(num_warmup=warmup, num_samples=n, num_chains=chains, log_likelihood=log_likelihood),
            backend=backend,
            max_steps=warmup + n,
            steps_per_call=100,
            log_every_n_steps=100,
            callbacks=(Checkpoint(every_n_steps=total, keep=(Last(n=1),), async_save=False),),
            progress=False,
            name="post",
        )

    def whole(backend: str, log_likelihood: bool) -> float:
        run_dir = os.path.join(root, f"r{next(counter)}")
        t0 = time.perf_counter()
        with run_settings(run_dir=run_dir, store=False):
            loop(backend, samples + more, log_likelihood).run()
        return (time.perf_counter() - t0) / total * 1e6

    def extended(backend: str, log_likelihood: bool) -> float:
        run_dir = os.path.join(root, f"r{next(counter)}")
        t0 = time.perf_counter()
        with run_settings(run_dir=run_dir, store=False):
            loop(backend, samples, log_likelihood).run()
        extend(run_dir, "post", more, store=False)
        return (time.perf_counter() - t0) / total * 1e6

    rows = []
    try:
        for section, log_likelihood in (
            ("10 extend a finished stage vs one longer stage", False),
            ("10b extend, each stage recording its log-likelihood", True),
        ):
            for backend in ("blackjax", "numpyro-mcmc"):
                base = Contender(f"one {backend} stage of {total}", functools.partial(whole, backend, log_likelihood))
                cont = Contender(
                    f"{warmup + samples}, then extend {more}", functools.partial(extended, backend, log_likelihood)
                )
                run_interleaved([base, cont], rounds)
                note = f"µs per iteration ({chains} chains, logistic regression 2000 x 8), both stages' fixed costs"
                rows.append(row(section, backend, base, cont, note))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


NUTS_WARMUP, NUTS_SAMPLES, NUTS_CHAINS, NUTS_CHUNK = 500, 1000, 4, 250


@contextlib.contextmanager
def persistent_compilation_cache() -> Iterator[None]:
    """JAX's persistent compilation cache in a temporary directory, every program cached (then as it was)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {n: getattr(jax.config, n) for n in names}
    root = tempfile.mkdtemp(prefix="pipekit-bench-xla-cache-")
    for name, value in zip(names, (root, 0.0, -1), strict=True):
        jax.config.update(name, value)
    cc.reset_cache()
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        cc.reset_cache()
        shutil.rmtree(root, ignore_errors=True)


def bench_nuts(rounds: int) -> list[Row]:
    """Row 12 (issue 29): eight schools, NUTS, 4 vectorized chains, 500 + 1,000 iterations. Pipekit's
    `numpyro-mcmc` stage in chunks of 250 with a `Checkpoint` every 250 steps, the whole `TrainingLoop.run`
    (pre-flight, NumPyro's search for the initial point, the chunks, the checkpoints, the posterior report and its
    diagnostics, the artifact), against NumPyro's own ``MCMC(NUTS(model), ..., chain_method="vectorized").run(key,
    ...)`` and ``get_samples`` (the same draws bitwise: checked in the warm-up). Seconds per whole run.

    The same compiled state for both: before every timed run, jitted programs are dropped (`jax.clear_caches()` and
    pipekit's sampler program cache), so both trace and lower their programs as the first run of a process does;
    XLA's compile is served from JAX's persistent compilation cache (filled in the warm-up) for both. ``MCMC.run``
    traces and compiles again on every call (a second call on the same object compiles as long as the first), so
    keeping programs in memory would time NumPyro's compile against none of pipekit's; with both compiling, the
    compile (about 10 s of a 13 s run here) would hide what differs. Imports are done before the first round.
    """
    import io

    from numpyro.infer import MCMC
    from numpyro.infer import NUTS as NumpyroNUTS

    from pipekit_train import Checkpoint
    from pipekit_train.adapters.bayes import (
        _sampling,  # its program cache, cleared for every cold run
        get_numpyro_model,
    )
    from pipekit_train.adapters.numpyro import NUTS, NumpyroModel

    eight_schools = get_numpyro_model("eight_schools").fn

    sigma = np.array([15, 10, 16, 11, 9, 11, 10, 18], np.float32)
    y = np.array([28, 8, -3, 7, -1, 1, 18, 12], np.float32)
    total = NUTS_WARMUP + NUTS_SAMPLES
    root = tempfile.mkdtemp(prefix="pipekit-bench-nuts-")
    counter = iter(range(10**6))
    draws: dict[str, dict[str, np.ndarray]] = {}
    cpu: dict[str, list[float]] = {"bare": [], "chunked": [], "whole": []}  # CPU seconds of each run, all threads

    def cold() -> None:
        jax.clear_caches()
        _sampling._PROGRAMS.clear()

    def bare() -> float:
        cold()
        c0, t0 = time.process_time(), time.perf_counter()
        mcmc = MCMC(
            NumpyroNUTS(eight_schools),
            num_warmup=NUTS_WARMUP,
            num_samples=NUTS_SAMPLES,
            num_chains=NUTS_CHAINS,
            chain_method="vectorized",
            progress_bar=False,
        )
        mcmc.run(jax.random.PRNGKey(0), sigma=sigma, y=y)
        samples = jax.block_until_ready(mcmc.get_samples(group_by_chain=True))
        seconds = time.perf_counter() - t0
        cpu["bare"].append(time.process_time() - c0)
        draws.setdefault("bare", {k: np.asarray(v) for k, v in samples.items()})
        return seconds

    def ours(key: str, chunk: int, checkpoint: bool) -> float:
        cold()
        run_dir = os.path.join(root, f"r{next(counter)}")
        loop = TrainingLoop(
            model_op=NumpyroModel(model="eight_schools"),
            dataset=TrainingDataset(source=ArraySource(arrays={"sigma": sigma, "y": y}), shuffle=False),
            task=NUTS(num_warmup=NUTS_WARMUP, num_samples=NUTS_SAMPLES, num_chains=NUTS_CHAINS),
            backend="numpyro-mcmc",
            max_steps=total,
            steps_per_call=chunk,
            log_every_n_steps=chunk,
            callbacks=(Checkpoint(every_n_steps=chunk),) if checkpoint else (),
            progress=False,
            seed=0,
            name="nuts",
        )
        c0, t0 = time.process_time(), time.perf_counter()
        with run_settings(run_dir=run_dir, store=False), contextlib.redirect_stdout(io.StringIO()):
            model, _ = loop.run()  # the posterior report is printed (and formatted) all the same
        seconds = time.perf_counter() - t0
        cpu[key].append(time.process_time() - c0)
        draws.setdefault(key, dict(model.posterior.draws))
        shutil.rmtree(run_dir, ignore_errors=True)
        return seconds

    print(
        f"\n## chunked NUTS: eight schools, {NUTS_CHAINS} chains, {NUTS_WARMUP} + {NUTS_SAMPLES}, {rounds} rounds",
        flush=True,
    )
    base = Contender("NumPyro MCMC.run (vectorized)", bare)
    chunked = Contender(
        f"TrainingLoop.run, chunks of {NUTS_CHUNK}, Checkpoint({NUTS_CHUNK})",
        functools.partial(ours, "chunked", NUTS_CHUNK, True),
    )
    whole = Contender("TrainingLoop.run, one chunk, no checkpoint", functools.partial(ours, "whole", total, False))
    try:
        with persistent_compilation_cache():
            run_interleaved([base, chunked, whole], rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = draws.get("bare")
    for key, c in (("chunked", chunked), ("whole", whole)):
        got = draws.get(key)
        if c.error is None and (ref is None or got is None or any(not np.array_equal(ref[k], got[k]) for k in ref)):
            c.error = "the draws differ from MCMC.run's"
    rows = []
    for key, c in (("chunked", chunked), ("whole", whole)):
        err = base.error or c.error
        pairs = [1.10 * b / o for b, o in zip(base.samples, c.samples, strict=False) if o > 0]
        spread = [round(o / b, 3) for b, o in zip(base.samples, c.samples, strict=False) if b > 0]
        # The warm-up's run is the first entry of each CPU list: paired from the second on, like the samples.
        cpu_ratios = sorted(round(o / b, 3) for b, o in zip(cpu["bare"][1:], cpu[key][1:], strict=False) if b > 0)
        note = (
            f"seconds per whole run; ratio = 1.10 x MCMC.run / pipekit, paired per round; pipekit / MCMC.run per "
            f"round: wall {sorted(spread)}, CPU seconds {cpu_ratios}; both trace and lower afresh, XLA's compile "
            "from the persistent cache for both"
        )
        rows.append(
            Row(
                section="12 chunked, checkpointed NUTS vs MCMC.run (s)",
                size="eight schools",
                baseline=base.name,
                contender=c.name,
                baseline_us=median(base.samples),
                contender_us=median(c.samples),
                ratio=None if err or not pairs else statistics.median(pairs),
                target=1.0,
                note=f"error: {err}" if err else note,
                baseline_samples=[round(v, 3) for v in base.samples],
                contender_samples=[round(v, 3) for v in c.samples],
            )
        )
    return rows


def bench_job(rounds: int) -> Row:
    """A `startup.JOB_STEPS`-step job of the small MLP, whole fresh processes: the hand script against the Python
    API with its defaults (artifact store, metrics file); ratio = 1.10 x hand / pipekit, paired per round."""
    import startup

    print(f"\n## a {startup.JOB_STEPS}-step job: whole processes, small MLP, {rounds} interleaved rounds", flush=True)
    measured = startup.measure(rounds, ("hand_job", "api_job"))
    print(startup.report(measured), flush=True)
    hand, c = measured["hand_job"], measured["api_job"]
    err = hand.error or c.error
    base, ours = [s.process_s for s in hand.samples], [s.process_s for s in c.samples]
    pairs = [1.10 * b / o for b, o in zip(base, ours, strict=False) if o > 0]
    cpu = [o.cpu_s / h.cpu_s for h, o in zip(hand.samples, c.samples, strict=False) if h.cpu_s > 0]
    cpu_note = f"; CPU seconds {statistics.median(cpu):.2f}x the hand script's" if cpu else ""
    return Row(
        section=f"11 a {startup.JOB_STEPS}-step job, whole process (s)",
        size="small",
        baseline="hand-written script",
        contender="pipekit Python API (store on)",
        baseline_us=hand.median("process_s"),
        contender_us=c.median("process_s"),
        ratio=None if err or not pairs else statistics.median(pairs),
        target=1.0,
        note=f"error: {err}" if err else f"seconds; ratio = 1.10 x hand / pipekit, paired per round{cpu_note}",
        baseline_samples=[round(v, 3) for v in base],
        contender_samples=[round(v, 3) for v in ours],
    )


def keras_available() -> str | None:
    try:
        import keras  # noqa: F401
    except ImportError:
        return "keras is not installed (pip install 'pipekit-train[keras]')"
    return None


def lightning_available() -> str | None:
    try:
        import pytorch_lightning  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return "torch or pytorch-lightning is not installed (pip install 'pipekit-train[lightning]')"
    return None


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[Row]) -> str:
    lines = [
        "| comparison | model | baseline | µs/step | pipekit contender | µs/step | ratio | target | result |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.section} | {r.size} | {r.baseline} | {fmt(r.baseline_us, '.1f')} | {r.contender} | "
            f"{fmt(r.contender_us, '.1f')} | {fmt(r.ratio, '.3f')} | ≥{r.target:g} | {r.verdict}{note} |"
        )
    return "\n".join(lines)


def _git(*args: str) -> str | None:
    """Read-only git queries, for the record of what was measured."""
    import subprocess

    try:
        out = subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "equinox": eqx.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "pipekit_train": str(Path(pipekit_train.__file__).parent),
        "git_head": _git("rev-parse", "HEAD"),
        "src_changes": _git("status", "--porcelain", "--", "src"),
    }
    try:
        import keras

        info["keras"] = keras.__version__
    except ImportError:
        info["keras"] = None
    return info


GROUPS = ("steps", "data", "startup", "extend", "nuts", "flax", "observe", "transformer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer steps and rounds (~1 minute)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds per comparison (default 5; 2 quick)")
    parser.add_argument("--sizes", default="small,medium,compute-bound", help="comma-separated model sizes to run")
    parser.add_argument(
        "--startup-rounds", type=int, default=None, help="rounds of fresh processes for time to first step (default 3)"
    )
    parser.add_argument("--out", default=str(HERE), help="directory for results.json and results.md")
    parser.add_argument(
        "--only",
        action="append",
        choices=GROUPS,
        help="run only this group of rows (repeatable; default every group): steps (rows 0-8 by size), data, "
        "startup, extend, nuts, flax (row 13 by size), observe (row 14 by size), transformer (rows 15, 15b, "
        "benchmarks/sequences.py)",
    )
    args = parser.parse_args(argv)
    groups = set(args.only or GROUPS)
    rounds = args.rounds or (2 if args.quick else 5)
    wanted = set(args.sizes.split(","))
    sizes = [quick_size(s) if args.quick else s for s in SIZES if s.name in wanted]
    started = time.perf_counter()
    load_before = os.getloadavg()
    x, y = make_data()
    keras_ok = keras_available()
    rows: list[Row] = []
    root = tempfile.mkdtemp(prefix="pipekit-bench-")
    try:
        for size in sizes if "steps" in groups else ():
            rows += bench_size(size, x, y, rounds, root, keras_ok)
        if "data" in groups:  # cheap: more rounds, less noise
            rows += bench_data(x, y, 3 * rounds, 2_000 if args.quick else 20_000)
        startup_rounds = args.startup_rounds if args.startup_rounds is not None else (1 if args.quick else 3)
        if startup_rounds > 0 and "startup" in groups:
            rows += bench_startup(startup_rounds)
        if "extend" in groups:
            rows += bench_extend(rounds, args.quick)
        if "nuts" in groups:
            rows += bench_nuts(rounds)
        for size in sizes if "flax" in groups else ():
            rows += bench_flax(size, x, y, rounds, root)
        for size in sizes if "observe" in groups else ():
            rows += bench_observe(size, x, y, rounds, root)
        if "transformer" in groups:
            from sequences import bench_transformer

            rows += bench_transformer(rounds, args.quick, root, Contender, row, run_interleaved)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started
    table = markdown(rows)
    header = (
        f"pipekit-train benchmarks ({'quick' if args.quick else 'full'}; {rounds} interleaved rounds; "
        f"median µs per optimizer step; ratio = baseline µs / pipekit µs, paired per round; "
        f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; {elapsed:.0f} s)"
    )
    print("\n" + header + "\n\n" + table, flush=True)
    misses = [r for r in rows if r.verdict == "MISS"]
    print(
        f"\n{len(rows) - len(misses)} of {len(rows)} comparisons meet their target; "
        f"{len(misses)} miss; {sum(r.verdict == 'N/A' for r in rows)} not measured."
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "mode": "quick" if args.quick else "full",
        "rounds": rounds,
        "seconds": round(elapsed, 1),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "environment": environment(),
        "sizes": [s.__dict__ for s in sizes],
        "rows": [{**r.__dict__, "verdict": r.verdict} for r in rows],
        "argv": sys.argv[1:],
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
