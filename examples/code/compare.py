"""Print the code demo's comparison: full finetuning vs LoRA vs the same classifier from scratch, over seeds.

Usage: python examples/code/compare.py RUN_DIR [--seeds N] [--set stages.1.max_steps=60 ...]

RUN_DIR is a run of examples/code/pretrain_finetune.yaml; its pretrain stage is read back when it has finished
(``resume: auto``) and trained first, from the same file, when it has not. For each seed this process then trains
three arms of the file's finetune stage into RUN_DIR (stages ``full_seed{s}``, ``lora_seed{s}``,
``scratch_seed{s}``; a finished one is read back, so a rerun costs little):

- **full**: the finetune stage as written: the pretrained ``embed`` and ``blocks`` (``Transfer``), a new head, every
  weight trained.
- **lora**: the same stage with ``optimizer_config.lora`` (rank 8, alpha 8) on the transformer's attention and MLP
  projections and on ``head``: only the adapters train. The new head is a frozen random matrix, so it gets adapters
  too: with 8 classes, a rank-8 ``B A`` on it can be any 8 x d_model matrix. Its bias stays frozen.
- **scratch**: the same classifier from its random initialisation, no transfer: the same data, steps, batch,
  optimizer, learning rate and schedule as the finetune stage. That recipe was written for finetuning and not tuned
  for either side; no arm's recipe was chosen by these numbers.

``--set`` changes the pipeline as ``pipekit-train run --set`` does (the same paths); a shortened run says so in the
table's title. The verdict compares means against two standard errors of their difference, from the seeds' spread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
YAML = HERE / "pretrain_finetune.yaml"
ARMS = ("full", "lora", "scratch")
LABELS = {
    "full": "pretrained trunk, full finetune",
    "lora": "pretrained trunk, LoRA",
    "scratch": "from scratch (no transfer)",
}
LORA = {"rank": 8, "alpha": 8.0, "targets": ["*.attention.*_proj", "*.mlp.up", "*.mlp.down", "head"]}


@dataclass
class Arm:
    """One arm's runs: final metrics per seed, trainable and total parameters, and each run's own seconds."""

    name: str
    metrics: list[dict[str, float]] = field(default_factory=list)
    trainable: int | None = None
    params: int | None = None
    seconds: list[float] = field(default_factory=list)

    def values(self, key: str) -> list[float]:
        return [m[key] for m in self.metrics if key in m]


def _load(sets: Sequence[str]) -> Any:
    import pipekit

    op = pipekit.load(YAML)
    return pipekit.apply_overrides(op, [pipekit.parse_override(text) for text in sets]) if sets else op


def run_arms(run_dir: Path, seeds: int, sets: Sequence[str] = ()) -> tuple[dict[str, Arm], bool]:
    """Train (or read back) the pretrain stage and every arm for seeds ``0..seeds-1``; ``(arms, has_test)``."""
    from pipekit_train import run_settings

    # resume="auto" reads back a finished stage; for a new arm there is nothing to resume, as meant.
    warnings.filterwarnings("ignore", message="resume='auto': nothing to resume")
    pretrain, finetune = _load(sets).stages
    arms = {name: Arm(name) for name in ARMS}
    lora_config = {**finetune.optimizer_config, "lora": LORA}
    with run_settings(run_dir=str(run_dir), store=False, resume="auto"):
        _, pretrained = pretrain.replace(progress=False)._apply(None, None)
        for seed in range(seeds):
            for name in ARMS:
                stage = finetune.replace(seed=seed, name=f"{name}_seed{seed}", callbacks=(), progress=False)
                if name == "scratch":
                    result = stage.replace(transfer=None).run()
                else:
                    if name == "lora":
                        stage = stage.replace(optimizer_config=lora_config)
                    result = stage._apply(None, pretrained)[0]
                arm = arms[name]
                artifact = result.artifact
                arm.metrics.append(dict(artifact.final_metrics))
                # the stage's own clock (compile, steps and evaluations), so a read-back arm reports its training
                arm.seconds.append(float(artifact.final_metrics.get("time/elapsed_s", math.nan)))
                info = artifact.backend_info or {}
                arm.trainable, arm.params = info.get("trainable_params"), info.get("num_params")
    return arms, finetune.test_dataset is not None


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):5.1f} ± {100 * sd:4.1f}"


def _margin(a: list[float], b: list[float]) -> tuple[float, float | None]:
    """Difference of means and two standard errors of it (None with fewer than 2 seeds a side)."""
    diff = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, None
    return diff, 2 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def _judged(a: list[float], b: list[float], label: str, phrases: tuple[str, str, str]) -> str:
    """One sentence on ``mean(a) - mean(b)`` (`label`): the first of `phrases` when it exceeds two standard errors,
    the second when it falls below minus two, else the third; with one seed a side, only the difference."""
    diff, two_se = _margin(a, b)
    if two_se is None:
        return f"{label} = {100 * diff:+.1f} points (one seed: no spread to judge by)"
    phrase = phrases[0] if diff > two_se else phrases[1] if diff < -two_se else phrases[2]
    return f"{phrase}: {label} = {100 * diff:+.1f} points, 2 standard errors = {100 * two_se:.1f}"


def verdict(arms: dict[str, Arm], key: str) -> str:
    """Two sentences from the numbers: does pretraining help (full vs scratch), does LoRA match full finetuning?"""
    full, lora, scratch = (arms[n].values(key) for n in ARMS)
    first = _judged(
        full,
        scratch,
        "full finetune - scratch",
        ("pretraining helps here", "pretraining hurts here", "pretraining does not measurably help here"),
    )
    second = _judged(
        lora,
        full,
        "LoRA - full",
        (
            "LoRA beats full finetuning",
            "LoRA falls short of full finetuning",
            "LoRA and full finetuning are within the seeds' spread",
        ),
    )
    return f"verdict ({key.split('/')[0]} accuracy): {first}; {second}"


def table(arms: dict[str, Arm], has_test: bool, seeds: int, sets: Sequence[str] = ()) -> str:
    """The comparison as text: one row per arm, then the verdict line."""
    lines = [
        f"Code demo: which of 8 stdlib packages a snippet comes from ({seeds} seed(s), mean ± sd)",
        *([f"SHORTENED, not the example as written: {' '.join(sets)}"] if sets else []),
        f"{'classifier':<34} {'val acc':>13} {'test acc':>13} {'trainable':>10} {'s per run':>10}",
    ]
    for name in ARMS:
        arm = arms[name]
        test = _ms(arm.values("test/accuracy")) if has_test else "-"
        trainable = f"{arm.trainable:,}" if arm.trainable is not None else "?"
        seconds = f"{statistics.mean(arm.seconds):.0f}" if arm.seconds else "-"
        lines.append(
            f"{LABELS[name]:<34} {_ms(arm.values('validate/accuracy')):>13} {test:>13} {trainable:>10} {seconds:>10}"
        )
    params = arms["full"].params
    lines.append(f"the classifier has {params:,} parameters; chance is 12.5%" if params else "chance is 12.5%")
    lines.append(verdict(arms, "test/accuracy" if has_test else "validate/accuracy"))
    lines.append(
        "same data, steps, batch, optimizer and schedule for every arm (the YAML's finetune recipe, tuned for none); "
        "LoRA: rank 8 on the attention and MLP projections and the head"
    )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (0, 1, ...)")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="as pipekit-train run --set")
    args = parser.parse_args(list(argv))
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    arms, has_test = run_arms(args.run_dir, args.seeds, args.set)
    print(table(arms, has_test, args.seeds, args.set))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
