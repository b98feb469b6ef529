"""Choose the finetuning recipe of the digits demo by validation accuracy (never by test), over 3 seeds each.

Usage: python examples/digits/select_recipe.py [RUN_DIR]

Pretrains once with the demo's pretrain stage (the denoising autoencoder; or reuses RUN_DIR's finished pretrain
stage), then finetunes every candidate recipe and trains
every from-scratch candidate with seeds 0, 1, 2, and prints validation and test accuracy as mean ± sd. The demo
(`make demo`) runs the candidate with the best mean validation accuracy of each side; docs/recipes.md records the
table this script printed. Takes a few minutes on two cores.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pipekit
from pipekit_train import TrainingLoop, run_settings
from pipekit_train.optim import SAM, ParamGroup

HERE = Path(__file__).parent
SEEDS = (0, 1, 2)


def finetune_candidates(demo: TrainingLoop) -> dict[str, TrainingLoop]:
    """Candidates built from the demo's finetune stage with its recipe taken out (lr 1e-3, no parameter groups),
    so that each label says the whole recipe whatever the demo file uses now."""
    cfg = {**demo.optimizer_config, "lr": 0.001}
    base = demo.replace(optimizer_config=cfg, param_groups=())
    enc = "encoder.*"
    return {
        "lr 1e-3 everywhere": base,
        "encoder lr x0.1": base.replace(param_groups=(ParamGroup(pattern=enc, lr_scale=0.1),)),
        "encoder lr x0.3": base.replace(param_groups=(ParamGroup(pattern=enc, lr_scale=0.3),)),
        "lr 3e-3, encoder x0.1": base.replace(
            optimizer_config={**cfg, "lr": 0.003}, param_groups=(ParamGroup(pattern=enc, lr_scale=0.1),)
        ),
        "L2-SP 1.0": base.replace(param_groups=(ParamGroup(pattern=enc, l2sp=1.0),)),
        "L2-SP 10": base.replace(param_groups=(ParamGroup(pattern=enc, l2sp=10.0),)),
        "encoder frozen": base.replace(param_groups=(ParamGroup(pattern=enc, frozen=True),)),
        "encoder frozen until 300": base.replace(param_groups=(ParamGroup(pattern=enc, frozen=True, unfreeze_at=300),)),
        "lr 3e-3, L2-SP 10": base.replace(
            optimizer_config={**cfg, "lr": 0.003}, param_groups=(ParamGroup(pattern=enc, l2sp=10.0),)
        ),
        "lr 3e-3, frozen until 300": base.replace(
            optimizer_config={**cfg, "lr": 0.003},
            param_groups=(ParamGroup(pattern=enc, frozen=True, unfreeze_at=300),),
        ),
        "L2-SP 100": base.replace(param_groups=(ParamGroup(pattern=enc, l2sp=100.0),)),
        "SAM 0.05": base.replace(gradient=SAM(rho=0.05)),
        "lr 3e-3, frozen until 300, encoder x0.3": base.replace(
            optimizer_config={**cfg, "lr": 0.003},
            param_groups=(ParamGroup(pattern=enc, frozen=True, unfreeze_at=300, lr_scale=0.3),),
        ),
        "lr 3e-3, frozen until 300, encoder x0.1": base.replace(
            optimizer_config={**cfg, "lr": 0.003},
            param_groups=(ParamGroup(pattern=enc, frozen=True, unfreeze_at=300, lr_scale=0.1),),
        ),
    }


def scratch_candidates(demo: TrainingLoop) -> dict[str, TrainingLoop]:
    cfg = {**demo.optimizer_config, "lr": 0.001}
    base = demo.replace(optimizer_config=cfg)
    return {
        "lr 1e-3": base,
        "lr 3e-3": base.replace(optimizer_config={**cfg, "lr": 0.003}),
        "lr 1e-2": base.replace(optimizer_config={**cfg, "lr": 0.01}),
        "SAM 0.05": base.replace(gradient=SAM(rho=0.05)),
    }


def _fmt(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):5.1f} ± {100 * statistics.stdev(values):3.1f}"


def main(argv: list[str]) -> int:
    run_dir = argv[0] if argv else "runs/select-recipe"
    pipe = pipekit.load(HERE / "pretrain_finetune.yaml")
    pretrain, finetune = pipe.stages
    scratch = pipekit.load(HERE / "from_scratch.yaml")
    with run_settings(run_dir=run_dir, store=False, resume="auto"):
        _, state = pretrain.replace(progress=False)._apply(None, None)
        rows = []
        for side, candidates, incoming in (
            ("pretrained", finetune_candidates(finetune), state),
            ("scratch", scratch_candidates(scratch), None),
        ):
            for i, (label, loop) in enumerate(candidates.items()):
                val, test = [], []
                for seed in SEEDS:
                    stage = loop.replace(seed=seed, name=f"{side}_{i}_seed{seed}", callbacks=(), progress=False)
                    result, _ = stage._apply(None, incoming)
                    metrics = result.artifact.final_metrics
                    val.append(metrics["validate/accuracy"])
                    test.append(metrics["test/accuracy"])
                rows.append((side, label, val, test))
                print(f"{side:<11} {label:<40} val {_fmt(val)}  test {_fmt(test)}", flush=True)
    for side in ("pretrained", "scratch"):
        # Ties (equal mean validation accuracy) go to the smaller spread, then to the later, more conservative row.
        ranked = [
            (round(statistics.mean(r[2]), 6), -round(statistics.stdev(r[2]), 6), i)
            for i, r in enumerate(rows)
            if r[0] == side
        ]
        best = rows[max(ranked)[2]]
        print(f"chosen by validation for {side}: {best[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
