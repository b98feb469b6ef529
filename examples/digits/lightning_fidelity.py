"""Fidelity of the ``lightning`` backend against a plain Lightning ``Trainer.fit``: the same recipe on digits, 3 seeds.

Both sides train the same torch model (``TorchModel(factory="classifier", ...)``: encoder 64 → 256 → 32, head
32 → 10, the same initial weights for a seed) on the full digits training split, 1000 steps of batch 32 with AdamW
(lr 1e-3, weight decay 1e-4 on weights only, warm-up cosine over 50 steps), and report the test accuracy:

- **lightning backend**: ``TrainingLoop(backend="lightning")``, with `CrossEntropy` (pipekit's step loop).
- **Trainer.fit**: the `build_lightning_module` of the same model and loss (``torch.optim.AdamW`` with the same
  param groups and a per-step ``LambdaLR`` of the same schedule) fitted by ``pytorch_lightning.Trainer`` over a
  shuffled ``DataLoader`` (reshuffled each epoch) for the same number of steps.

The target (issue 10) is a mean test accuracy within 0.5 points of ``Trainer.fit``'s. Run it (a few minutes on two
cores)::

    JAX_PLATFORMS=cpu .venv/bin/python examples/digits/lightning_fidelity.py [--seeds 0 1 2] [--steps 1000]

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

import numpy as np

from pipekit_train import TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.lightning import TorchModel, build_lightning_module
from pipekit_train.data import RegisteredSource
from pipekit_train.losses import CrossEntropy

MODEL = TorchModel(factory="classifier", kwargs={"in_size": 64, "num_classes": 10, "latent_size": 32, "hidden": [256]})
OPTIMIZER = {"name": "adamw", "lr": 0.001, "weight_decay": 0.0001, "schedule": "warmup_cosine", "warmup_steps": 50}
BATCH = 32


def _digits(split: str) -> dict[str, np.ndarray]:
    return RegisteredSource(name="digits", kwargs={"split": split}).load()


def lightning_backend(seed: int, steps: int, root: str) -> tuple[float, float]:
    """Test accuracy and seconds of ``TrainingLoop(backend="lightning")``."""
    loop = TrainingLoop(
        backend="lightning",
        model_op=MODEL,
        dataset=TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "train"})),
        test_dataset=TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "test"})),
        loss=CrossEntropy(),
        optimizer_config=OPTIMIZER,
        max_steps=steps,
        batch_size=BATCH,
        log_every_n_steps=100,
        seed=seed,
        progress=False,
    )
    started = time.perf_counter()
    with run_settings(run_dir=os.path.join(root, f"backend-{seed}"), store=False):
        _, artifact = loop.run()
    return artifact.final_metrics["test/accuracy"], time.perf_counter() - started


def trainer_fit(seed: int, steps: int) -> tuple[float, float]:
    """Test accuracy and seconds of a plain ``Trainer.fit`` with the same model, optimizer, data and step count."""
    import pytorch_lightning as pl
    import torch

    train, test = _digits("train"), _digits("test")
    torch.manual_seed(seed)
    module = build_lightning_module(CrossEntropy(), MODEL, OPTIMIZER, max_steps=steps, seed=seed)
    data = torch.utils.data.TensorDataset(torch.from_numpy(train["x"]), torch.from_numpy(train["y"]))
    loader = torch.utils.data.DataLoader(
        data, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
    )
    trainer = pl.Trainer(
        max_steps=steps,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    started = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - started
    module.eval()
    with torch.no_grad():
        logits = module(torch.from_numpy(test["x"])).numpy()
    return float(np.mean(np.argmax(logits, axis=-1) == test["y"])), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lightning-fidelity-") as root:
        for seed in args.seeds:
            backend_acc, backend_s = lightning_backend(seed, args.steps, root)
            fit_acc, fit_s = trainer_fit(seed, args.steps)
            rows.append((seed, backend_acc, fit_acc, backend_s, fit_s))
            print(
                f"seed {seed}: lightning backend {100 * backend_acc:.2f}%  Trainer.fit {100 * fit_acc:.2f}%", flush=True
            )
    mean_backend = statistics.mean(r[1] for r in rows)
    mean_fit = statistics.mean(r[2] for r in rows)
    diff = 100 * (mean_backend - mean_fit)
    print("\n| seed | lightning backend test acc | Trainer.fit test acc | backend s | fit s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for seed, b, f, bs, fs in rows:
        print(f"| {seed} | {100 * b:.2f}% | {100 * f:.2f}% | {bs:.1f} | {fs:.1f} |")
    print(f"| mean | {100 * mean_backend:.2f}% | {100 * mean_fit:.2f}% | | |")
    verdict = "PASS" if abs(diff) <= 0.5 else "MISS"
    print(f"\nbackend - fit: {diff:+.2f} points (target: within 0.5) -> {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
