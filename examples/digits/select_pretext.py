"""Choose the demo's pretext task (plain or denoising autoencoder) by validation accuracy, over 3 seeds each.

Usage: python examples/digits/select_pretext.py [RUN_DIR]

For every candidate pretext (the plain autoencoder of the demo, Gaussian input noise, masking) it pretrains the
autoencoder once, then finetunes the demo's classifier (its chosen recipe, examples/digits/pretrain_finetune.yaml)
with seeds 0, 1, 2 and prints validation and test accuracy as mean ± sd. The choice is by mean validation accuracy
only; the test column is printed as it comes. docs/recipes.md records the table this script printed.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import pipekit
from pipekit_train import TrainingLoop, run_settings
from pipekit_train.data import GaussianNoise, MaskInputs, Transform

HERE = Path(__file__).parent
SEEDS = (0, 1, 2)


def pretext_candidates() -> dict[str, tuple[Transform, ...]]:
    """Input corruptions of the pretrain stage; the autoencoder reconstructs the clean input `x_clean`."""
    return {
        "plain autoencoder": (),
        "gaussian noise 0.1": (GaussianNoise(key="x", std=0.1, clean_key="x_clean", clip=(0.0, 1.0)),),
        "gaussian noise 0.3": (GaussianNoise(key="x", std=0.3, clean_key="x_clean", clip=(0.0, 1.0)),),
        "masking 0.25": (MaskInputs(key="x", rate=0.25, clean_key="x_clean"),),
        "masking 0.5": (MaskInputs(key="x", rate=0.5, clean_key="x_clean"),),
        "gaussian noise 0.5": (GaussianNoise(key="x", std=0.5, clean_key="x_clean", clip=(0.0, 1.0)),),
        "gaussian noise 0.3, masking 0.25": (
            GaussianNoise(key="x", std=0.3, clean_key="x_clean", clip=(0.0, 1.0)),
            MaskInputs(key="x", rate=0.25),
        ),
    }


def with_pretext(pretrain: TrainingLoop, transforms: tuple[Transform, ...]) -> TrainingLoop:
    if not transforms:
        return pretrain
    assert pretrain.val_dataset is not None
    return pretrain.replace(
        dataset=pretrain.dataset.replace(transforms=transforms),
        val_dataset=pretrain.val_dataset.replace(transforms=transforms),
        target_key="x_clean",
    )


def _fmt(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):5.1f} ± {100 * statistics.stdev(values):3.1f}"


def main(argv: list[str]) -> int:
    run_dir = Path(argv[0] if argv else "runs/select-pretext")
    # resume="auto" reuses finished stages of an earlier call; for new stages there is nothing to resume, as meant.
    warnings.filterwarnings("ignore", message="resume='auto': nothing to resume")
    pretrain, finetune = pipekit.load(HERE / "pretrain_finetune.yaml").stages
    pretrain = pretrain.replace(dataset=pretrain.dataset.replace(transforms=()), target_key="x")
    if pretrain.val_dataset is not None:
        pretrain = pretrain.replace(val_dataset=pretrain.val_dataset.replace(transforms=()))
    rows = []
    for i, (label, transforms) in enumerate(pretext_candidates().items()):
        with run_settings(run_dir=str(run_dir / f"pretext{i}"), store=False, resume="auto"):
            stage = with_pretext(pretrain, transforms).replace(progress=False, callbacks=())
            _, state = stage._apply(None, None)
            val, test = [], []
            for seed in SEEDS:
                tuned = finetune.replace(seed=seed, name=f"finetune_seed{seed}", callbacks=(), progress=False)
                metrics = tuned._apply(None, state)[0].artifact.final_metrics
                val.append(metrics["validate/accuracy"])
                test.append(metrics["test/accuracy"])
        rows.append((label, val, test))
        print(f"{label:<24} val {_fmt(val)}  test {_fmt(test)}", flush=True)
    ranked = [(round(statistics.mean(v), 6), -round(statistics.stdev(v), 6), i) for i, (_, v, _) in enumerate(rows)]
    print(f"chosen by validation: {rows[max(ranked)[2]][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
