"""Fidelity of the ``keras`` backend against plain Keras ``model.fit``: the same recipe on digits, 3 seeds.

Both sides train the same Keras model (``KerasModel(factory="classifier", ...)``: encoder 64 → 256 → 32, head
32 → 10) on the full digits training split, 1000 steps of batch 32 with AdamW (lr 1e-3, weight decay 1e-4 on
kernels only, warm-up cosine over 50 steps, the optimizer built by `build_keras_optimizer` from the same
``optimizer_config``), and report the test accuracy:

- **keras backend**: ``TrainingLoop(backend="keras")``, with `CrossEntropy`.
- **model.fit**: ``model.compile(optimizer, SparseCategoricalCrossentropy(from_logits=True))`` then ``fit`` over
  the same number of steps (each epoch reshuffled), ``steps_per_execution=1``.

The target (issue 10) is a mean test accuracy within 0.5 points of ``model.fit``'s. Run it (about 2-4 minutes on
two cores)::

    JAX_PLATFORMS=cpu .venv/bin/python examples/digits/keras_fidelity.py [--seeds 0 1 2] [--steps 1000]

It prints a Markdown table (the figures in ``docs/backends.md`` come from it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np

from pipekit_train import TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.keras import KerasModel, build_keras_optimizer
from pipekit_train.data import RegisteredSource
from pipekit_train.losses import CrossEntropy

MODEL = KerasModel(factory="classifier", kwargs={"in_size": 64, "num_classes": 10, "latent_size": 32, "hidden": [256]})
OPTIMIZER = {"name": "adamw", "lr": 0.001, "weight_decay": 0.0001, "schedule": "warmup_cosine", "warmup_steps": 50}
BATCH = 32


def _digits(split: str) -> dict[str, np.ndarray]:
    return RegisteredSource(name="digits", kwargs={"split": split}).load()


def keras_backend(seed: int, steps: int, root: str) -> tuple[float, float]:
    """Test accuracy and seconds of ``TrainingLoop(backend="keras")``."""
    loop = TrainingLoop(
        backend="keras",
        model_op=MODEL,
        dataset=TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "train"})),
        test_dataset=TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "test"})),
        loss=CrossEntropy(),
        optimizer_config=OPTIMIZER,
        max_steps=steps,
        batch_size=BATCH,
        log_every_n_steps=100,
        steps_per_call=1,
        seed=seed,
        progress=False,
    )
    started = time.perf_counter()
    with run_settings(run_dir=os.path.join(root, f"backend-{seed}"), store=False):
        _, artifact = loop.run()
    return artifact.final_metrics["test/accuracy"], time.perf_counter() - started


def keras_fit(seed: int, steps: int) -> tuple[float, float]:
    """Test accuracy and seconds of plain ``model.fit`` with the same model, optimizer, data and step count."""
    import keras

    train, test = _digits("train"), _digits("test")
    keras.utils.set_random_seed(seed)
    model = MODEL.new_keras_model()
    optimizer = build_keras_optimizer(OPTIMIZER, max_steps=steps)  # decay_biases: false -> excludes "bias"
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=1,
    )
    rng = np.random.default_rng(seed)
    n = len(train["x"])
    order = np.concatenate([rng.permutation(n) for _ in range(-(-steps * BATCH // n))])[: steps * BATCH]
    started = time.perf_counter()
    model.fit(train["x"][order], train["y"][order], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    seconds = time.perf_counter() - started
    logits = model.predict(test["x"], batch_size=256, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == test["y"])), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="keras-fidelity-") as root:
        for seed in args.seeds:
            backend_acc, backend_s = keras_backend(seed, args.steps, root)
            fit_acc, fit_s = keras_fit(seed, args.steps)
            rows.append((seed, backend_acc, fit_acc, backend_s, fit_s))
            print(f"seed {seed}: keras backend {100 * backend_acc:.2f}%  model.fit {100 * fit_acc:.2f}%", flush=True)
    mean_backend = statistics.mean(r[1] for r in rows)
    mean_fit = statistics.mean(r[2] for r in rows)
    diff = 100 * (mean_backend - mean_fit)
    print("\n| seed | keras backend test acc | model.fit test acc | backend s | fit s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for seed, b, f, bs, fs in rows:
        print(f"| {seed} | {100 * b:.2f}% | {100 * f:.2f}% | {bs:.1f} | {fs:.1f} |")
    print(f"| mean | {100 * mean_backend:.2f}% | {100 * mean_fit:.2f}% | | |")
    verdict = "PASS" if abs(diff) <= 0.5 else "MISS"
    print(f"\nbackend - fit: {diff:+.2f} points (target: within 0.5) -> {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
