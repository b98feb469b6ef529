"""Does the ``transformer`` stage train as well as a hand-written loop? Validation perplexity at the same step count.

Issue 42 asks that the same transformer and data, trained by a hand-written Equinox + optax loop, reach the same
validation perplexity as the stage within 2% at the same step count. This script trains both on CPython's standard
library sources (every machine has them), then scores both on the same validation files:

- **the stage**: `TrainingLoop.run()` with a `TextSource` (byte tokenizer, records of `SEQ` tokens, files split
  80/20 by the source's seeded permutation), `NextTokenCrossEntropy`, AdamW, its own shuffling and model seed;
  its validation perplexity is the recorded `validate/perplexity` (the `Perplexity` metric).
- **the hand loop**: what a user writes without the library: the same Equinox model (the zoo's factory) from its
  own key, the training records read once into NumPy, shuffled each epoch by NumPy's generator, ``jax.jit`` of a
  hand-written next-token cross-entropy (``optax.softmax_cross_entropy_with_integer_labels``, padding masked) with
  ``optax.adamw``; its perplexity is computed by hand over the same validation records (``exp`` of the summed
  negative log-likelihood over counted tokens).

Different model seeds and data orders, on purpose: the comparison is of training quality, not of bits. Each side
runs with `--seeds` seeds; the verdict compares the mean perplexities (the spread over seeds is printed beside).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/perplexity.py            # 3 seeds, 300 steps: ~3 min on 2 cores
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/perplexity.py --quick    # 1 seed, 60 steps: a smoke run

Writes ``benchmarks/perplexity.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipekit_train import EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.data import TextSource
from pipekit_train.losses import NextTokenCrossEntropy
from pipekit_train.tracking import Perplexity

HERE = Path(__file__).resolve().parent
PACKAGES = ("json", "email", "logging", "http", "urllib")
PATHS = tuple(f"{{stdlib}}/{p}/*.py" for p in PACKAGES)
SEQ, BATCH, LR = 128, 16, 2e-3
KWARGS = {"vocab_size": 259, "d_model": 64, "num_heads": 4, "num_layers": 2, "max_len": SEQ}
PAD = 258
VAL_RECORDS = 256
TOLERANCE = 0.02


def source(split: str, **extra: Any) -> TextSource:
    return TextSource(paths=PATHS, seq_len=SEQ, split=split, fractions={"train": 0.8, "val": 0.2}, **extra)


def stage_perplexity(seed: int, steps: int, run_dir: str) -> float:
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="transformer", kwargs=KWARGS),
        dataset=TrainingDataset(source=source("train")),
        val_dataset=TrainingDataset(source=source("val", max_records=VAL_RECORDS)),
        loss=NextTokenCrossEntropy(),
        target_key="x",
        metrics=[Perplexity()],
        optimizer_config={"name": "adamw", "lr": LR, "weight_decay": 0.0},
        max_steps=steps,
        batch_size=BATCH,
        eval_every_n_steps=steps,
        log_every_n_steps=steps,
        seed=seed,
        progress=False,
    )
    with run_settings(store=False, run_dir=run_dir):
        _, artifact = loop.run()
    return float(artifact.final_metrics["validate/perplexity"])


def _nll_and_count(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed next-token negative log-likelihood and the number of counted (non-padding) targets."""
    targets = tokens[:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), targets)
    mask = targets != PAD
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


def hand_perplexity(seed: int, steps: int, train: np.ndarray, val: np.ndarray) -> float:
    """The loop a user writes by hand: build, shuffle, jit, step; then score the validation records."""
    model = EquinoxModel(factory="transformer", kwargs=KWARGS).build(jax.random.key(1000 + seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adamw(LR, weight_decay=0.0)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: jax.Array) -> tuple[Any, Any, jax.Array]:
        def loss_fn(p: Any) -> jax.Array:
            total, count = _nll_and_count(jax.vmap(eqx.combine(p, static))(batch), batch)
            return total / jnp.maximum(count, 1)

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < BATCH:
            order += list(rng.permutation(len(train)))
        idx, order = order[:BATCH], order[BATCH:]
        params, opt_state, _ = step(params, opt_state, jnp.asarray(train[idx]))

    @jax.jit
    def score(params: Any, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _nll_and_count(jax.vmap(eqx.combine(params, static))(batch), batch)

    total, count = 0.0, 0
    for i in range(0, len(val), BATCH):
        nll, n = score(params, jnp.asarray(val[i : i + BATCH]))
        total, count = total + float(nll), count + int(n)
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 60 steps")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per side (default 3; 1 quick)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 300; 60 quick)")
    parser.add_argument("--out", default=str(HERE), help="directory for perplexity.json")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or (60 if args.quick else 300)
    started, load_before = time.perf_counter(), os.getloadavg()
    train = np.asarray(source("train").load()["x"])
    val = np.asarray(source("val", max_records=VAL_RECORDS).load()["x"])
    print(f"train {train.shape[0]} records, val {val.shape[0]} records of {SEQ} tokens; {steps} steps, batch {BATCH}")
    stage, hand = [], []
    with tempfile.TemporaryDirectory(prefix="pipekit-perplexity-") as root:
        for seed in range(seeds):
            stage.append(stage_perplexity(seed, steps, os.path.join(root, f"stage{seed}")))
            hand.append(hand_perplexity(seed, steps, train, val))
            print(f"seed {seed}: stage {stage[-1]:.4f}, hand {hand[-1]:.4f}", flush=True)
    s_mean, h_mean = statistics.fmean(stage), statistics.fmean(hand)
    diff = s_mean / h_mean - 1.0
    verdict = "PASS" if abs(diff) <= TOLERANCE else "MISS"
    spread = (lambda v: f"{min(v):.3f}-{max(v):.3f}") if seeds > 1 else (lambda v: "-")
    table = (
        "| contender | validation perplexity (mean) | over seeds | relative to hand | target | result |\n"
        "| --- | ---: | --- | ---: | ---: | --- |\n"
        f"| hand eqx + optax loop | {h_mean:.4f} | {spread(hand)} | 1.000 | | |\n"
        f"| pipekit transformer stage | {s_mean:.4f} | {spread(stage)} | {1 + diff:.3f} | within ±2% | {verdict} |"
    )
    elapsed = time.perf_counter() - started
    print(
        f"\n{seeds} seed(s), {steps} steps, d_model {KWARGS['d_model']}, {KWARGS['num_layers']} layers, seq {SEQ}, "
        f"batch {BATCH}; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; {elapsed:.0f} s\n\n"
        + table
    )
    result = {
        "seeds": seeds,
        "steps": steps,
        "model": KWARGS,
        "seq_len": SEQ,
        "batch": BATCH,
        "lr": LR,
        "packages": PACKAGES,
        "stage": stage,
        "hand": hand,
        "relative": 1 + diff,
        "verdict": verdict,
        "seconds": round(elapsed, 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "perplexity.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
