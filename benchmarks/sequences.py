"""Row 15 of ``benchmarks/run.py`` (``--only transformer``): tokens per second of a ``transformer`` stage against a
hand-written Equinox + optax loop of the same model, paired in one run.

The model: ``transformer`` with ``vocab_size`` 259, ``d_model`` 128, 4 heads, 2 layers, records of 128 tokens,
batch 32, AdamW, `NextTokenCrossEntropy`. The stage is `TrainingLoop.run()` with its defaults (``steps_per_call:
auto``) on an `ArraySource` of random byte tokens, timed by the run-difference method (a short and a long run, so
the fixed costs of a run cancel); the hand loop is ``jax.jit`` with donation over pre-batched device arrays, the same
model built from the same key, one step per call. Reported as µs per step (the ratio is paired per round) and
tokens per second in the note, with the model's FLOPs per token (``6 * parameters`` for the matrices plus the
attention's ``12 * layers * T * d_model``, the usual estimate) and the fraction of the machine's measured peak: the
best of a few ``float32`` matrix products of 2048 x 2048 under ``jax.jit`` (``2 n^3`` FLOPs each), measured in the
same run, so "fraction of peak" is against what XLA reaches on this machine's cores, not a vendor's figure.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipekit_train import EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.data import ArraySource
from pipekit_train.losses import NextTokenCrossEntropy

KWARGS = {"vocab_size": 259, "d_model": 128, "num_heads": 4, "num_layers": 2, "max_len": 128}
SEQ, BATCH, RECORDS = 128, 32, 2048
LR = 1e-3


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(RECORDS, SEQ), dtype=np.int32)


def flops_per_token(params: int) -> float:
    return 6.0 * params + 12.0 * KWARGS["num_layers"] * SEQ * KWARGS["d_model"]


def peak_flops(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` jitted ``float32`` ``n x n`` matrix products (``2 n^3`` FLOPs each)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(matmul(a, a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(a, a))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


class StageRuns:
    """`TrainingLoop.run()` of the transformer stage; each run in a fresh run directory."""

    def __init__(self, x: np.ndarray, root: str, short: int, long: int, lora: dict[str, Any] | None = None) -> None:
        self.dataset = TrainingDataset(source=ArraySource(arrays={"x": x}))
        self.root, self.lengths, self.count, self.last = root, (short, long), 0, ""
        self.optimizer_config: dict[str, Any] = {"name": "adamw", "lr": LR, **({"lora": lora} if lora else {})}

    def run(self, steps: int) -> None:
        self.count += 1
        run_dir = os.path.join(self.root, f"run{self.count:04d}")
        loop = TrainingLoop(
            model_op=EquinoxModel(factory="transformer", kwargs=KWARGS),
            dataset=self.dataset,
            loss=NextTokenCrossEntropy(),
            target_key="x",
            optimizer_config=self.optimizer_config,
            max_steps=steps,
            batch_size=BATCH,
            log_every_n_steps=100,
            progress=False,
        )
        with run_settings(store=False, run_dir=run_dir):
            model, _ = loop.run()
        jax.block_until_ready(model.module)
        shutil.rmtree(self.last, ignore_errors=True)
        self.last = run_dir

    def setup(self) -> None:
        for steps in self.lengths:
            self.run(steps)

    def measure(self) -> float:
        short, long = self.lengths
        t0 = time.perf_counter()
        self.run(short)
        t1 = time.perf_counter()
        self.run(long)
        t2 = time.perf_counter()
        return ((t2 - t1) - (t1 - t0)) / (long - short) * 1e6


class HandLoop:
    """``jax.jit`` with donation: the loss on ``vmap(model)``, AdamW, pre-batched device arrays."""

    def __init__(self, x: np.ndarray, steps: int) -> None:
        model = EquinoxModel(factory="transformer", kwargs=KWARGS).build(0)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        self.optimizer = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
        self.params = jax.tree.map(jnp.copy, params)
        self.opt_state = self.optimizer.init(self.params)
        self.steps = steps
        loss = NextTokenCrossEntropy()

        def step(params: Any, opt_state: Any, xb: jax.Array) -> tuple[Any, Any, jax.Array]:
            def loss_fn(p: Any) -> jax.Array:
                return loss(jax.vmap(eqx.combine(p, static))(xb), xb)[0]

            value, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self.fn = jax.jit(step, donate_argnums=(0, 1))
        self.batches = [jnp.asarray(x[i : i + BATCH]) for i in range(0, RECORDS - BATCH + 1, BATCH)]

    def setup(self) -> None:
        return None

    def measure(self) -> float:
        params, opt_state = self.params, self.opt_state
        t0 = time.perf_counter()
        for i in range(self.steps):
            params, opt_state, value = self.fn(params, opt_state, self.batches[i % len(self.batches)])
        jax.block_until_ready((params, value))
        elapsed = time.perf_counter() - t0
        self.params, self.opt_state = params, opt_state
        return elapsed / self.steps * 1e6


def bench_transformer(
    rounds: int, quick: bool, root: str, contender_cls: Any, row: Any, run_interleaved: Any
) -> list[Any]:
    """Row 15: the stage against the hand loop, interleaved round by round (`run.py`'s `Contender`, `row` and
    `run_interleaved`)."""
    short, long = (2, 6) if quick else (4, 16)
    x = tokens()
    stage = StageRuns(x, os.path.join(root, "transformer"), short, long)
    hand = HandLoop(x, long - short)
    base = contender_cls("hand jax.jit + optax", hand.measure, hand.setup)
    cont = contender_cls("pipekit transformer stage", stage.measure, stage.setup)
    print(f"\n## transformer: d_model 128, 2 layers, seq {SEQ}, batch {BATCH}, steps {short}/{long}", flush=True)
    run_interleaved([base, cont], rounds)
    params = (
        EquinoxModel(factory="transformer", kwargs=KWARGS)
        .bind(EquinoxModel(factory="transformer", kwargs=KWARGS).build(0))
        .num_params()
    )
    peak = peak_flops()
    note = (
        f"{params:,} parameters, ~{flops_per_token(params) / 1e6:.1f} MFLOP/token; "
        f"peak {peak / 1e9:.0f} GFLOP/s (float32 matmul)"
    )
    for name, c in (("hand", base), ("stage", cont)):
        if c.samples:
            us = float(np.median(c.samples))
            tokens_per_s = BATCH * SEQ / us * 1e6
            fraction = tokens_per_s * flops_per_token(params) / peak
            note += f"; {name} {tokens_per_s:,.0f} tokens/s, {fraction:.0%} of peak"
    rows = [row("15 transformer stage vs hand loop (tokens/s)", "seq128-d128", base, cont, note)]
    # 15b: LoRA (rank 8 on the default targets, the attention and MLP projections) against full training of the
    # same stage: a LoRA step skips the frozen weights' gradients and optimizer update.
    lora = StageRuns(x, os.path.join(root, "transformer-lora"), short, long, lora={"rank": 8})
    full = contender_cls("pipekit stage, full training", stage.measure, stage.setup)
    c_lora = contender_cls("pipekit stage, LoRA rank 8", lora.measure, lora.setup)
    print(f"\n## transformer with LoRA: rank 8, steps {short}/{long}", flush=True)
    run_interleaved([full, c_lora], rounds)
    rows.append(row("15b transformer LoRA vs full training", "seq128-d128", full, c_lora, "µs per step"))
    return rows
