"""Print the demo's comparison: pretrained-then-finetuned classifier vs the same classifier from scratch, 3 seeds.

Usage: python examples/digits/compare.py RUN_DIR SCRATCH_RUN_DIR [--seeds N]

Seed 0 of each side is what `make demo` just trained with ``pipekit-train run`` (RUN_DIR, SCRATCH_RUN_DIR). The
other seeds are trained here, in this process, into the same run directories: the finetune stages start from
RUN_DIR's finished pretrain stage (``resume: auto`` finds it; it is not trained again). Each side's recipe was
chosen by validation accuracy with examples/digits/select_recipe.py, and the pretrain stage's denoising pretext
with examples/digits/select_pretext.py (docs/recipes.md); the test column is printed as it comes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).parent


def _final(run_dir: Path, stage: str) -> dict[str, float]:
    path = run_dir / stage / "artifact.json"
    if not path.exists():
        sys.exit(f"compare.py: {path} not found; run the demo pipelines first (make demo)")
    metrics: dict[str, float] = json.loads(path.read_text())["final_metrics"]
    return metrics


def _more_seeds(run_dir: Path, scratch_dir: Path, seeds: range) -> tuple[list[dict], list[dict]]:
    """Final metrics of the finetune and scratch stages for `seeds`, trained in this process."""
    import pipekit
    from pipekit_train import run_settings

    # resume="auto" finds the finished pretrain stage; for the new seed stages there is nothing to resume, as meant.
    warnings.filterwarnings("ignore", message="resume='auto': nothing to resume")
    pretrain, finetune = pipekit.load(HERE / "pretrain_finetune.yaml").stages
    scratch = pipekit.load(HERE / "from_scratch.yaml")
    tuned, plain = [], []
    with run_settings(run_dir=str(run_dir), store=False, resume="auto"):
        _, pretrained = pretrain.replace(progress=False)._apply(None, None)  # finished: read back, not trained
        for seed in seeds:
            stage = finetune.replace(seed=seed, name=f"finetune_seed{seed}", callbacks=(), progress=False)
            tuned.append(stage._apply(None, pretrained)[0].artifact.final_metrics)
    with run_settings(run_dir=str(scratch_dir), store=False, resume="auto"):
        for seed in seeds:
            stage = scratch.replace(seed=seed, name=f"scratch_seed{seed}", callbacks=(), progress=False)
            plain.append(stage.run().artifact.final_metrics)
    return tuned, plain


def _ms(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):5.1f} ± {100 * sd:3.1f}"


def verdict(pretrained: list[float], scratch: list[float]) -> str:
    """One line: does pretraining help on these numbers, beyond the seed-to-seed spread (2 standard errors)?"""
    diff = statistics.mean(pretrained) - statistics.mean(scratch)
    if len(pretrained) < 2 or len(scratch) < 2:
        return f"pretrained - scratch = {100 * diff:+.1f} points on test (one seed each: no spread to judge by)"
    se = math.sqrt(statistics.variance(pretrained) / len(pretrained) + statistics.variance(scratch) / len(scratch))
    margin = f"{100 * diff:+.1f} points on test, 2 standard errors = {200 * se:.1f}"
    if diff > 2 * se:
        return f"pretraining helps here: {margin}"
    if diff < -2 * se:
        return f"pretraining hurts here: {margin}"
    return f"no clear difference on test: {margin} (pretraining does not measurably help on these seeds)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("scratch_dir", type=Path)
    parser.add_argument("--seeds", type=int, default=1, help="seeds per side (seed 0 is the CLI run's)")
    args = parser.parse_args(argv)
    tuned = [_final(args.run_dir, "finetune")]
    plain = [_final(args.scratch_dir, "scratch")]
    if args.seeds > 1:
        more_tuned, more_plain = _more_seeds(args.run_dir, args.scratch_dir, range(1, args.seeds))
        tuned += more_tuned
        plain += more_plain
    print(
        f"\nDigits, 10% of the training labels: does unsupervised pretraining help? ({args.seeds} seed(s), mean ± sd)"
    )
    print(f"{'classifier':<34} {'val acc':>12} {'test acc':>12}")
    for label, runs in (("pretrained encoder + finetune", tuned), ("from scratch", plain)):
        val = [m["validate/accuracy"] for m in runs]
        test = [m["test/accuracy"] for m in runs]
        print(f"{label:<34} {_ms(val):>12} {_ms(test):>12}")
    print(verdict([m["test/accuracy"] for m in tuned], [m["test/accuracy"] for m in plain]))
    print(
        "each side's recipe and the pretext task were chosen by validation accuracy (examples/digits/select_recipe.py, "
        "select_pretext.py, docs/recipes.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
