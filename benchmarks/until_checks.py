"""What `until` checks cost next to sampling: eight schools, NUTS, 4 vectorized chains, a check every 250 draws.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/until_checks.py [--max-draws 5000] [--check-every 250]
        [--check-growth 0.25]

The criterion is unreachable (``ess_bulk_min`` above the draws), so the stage runs its whole budget and checks at
every check point (`pipekit_train.adapters.bayes.check_after`: every ``check_every``, then spaced by
``check_growth`` times the draws so far; each check costs more as the draws accumulate: the worst case, a run that
converges late). The checks run on the host between chunks (`SamplerControls.until_reached`); their seconds are
the artifact's ``backend_info["until"]["check_s"]`` (the diagnostics only: the wait for the chunk's draws is
sampling), the sampling seconds are the stage's stepping time (``time/elapsed_s`` less compile, checkpoint and
check time). Prints one JSON line; the acceptance bar is checks <= 5% of sampling.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-draws", type=int, default=5000)
    parser.add_argument("--check-every", type=int, default=250)
    parser.add_argument("--check-growth", type=float, default=0.25)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument(
        "--model",
        choices=("eight_schools", "logistic_regression"),
        default="eight_schools",
        help="eight schools (10 scalars, 8 data points: about the cheapest iteration there is) or a logistic "
        "regression of 2,000 x 8 (9 scalars)",
    )
    args = parser.parse_args()

    from pipekit_train import ArraySource, TrainingDataset, TrainingLoop, run_settings
    from pipekit_train.adapters.numpyro import NUTS, NumpyroModel

    if args.model == "eight_schools":
        sigma = np.array([15, 10, 16, 11, 9, 11, 10, 18], np.float32)
        arrays = {"y": np.array([28, 8, -3, 7, -1, 1, 18, 12], np.float32), "sigma": sigma}
    else:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(2000, 8)).astype(np.float32)
        arrays = {"x": x, "y": (rng.random(2000) < 1 / (1 + np.exp(-(x @ rng.normal(size=8))))).astype(np.float32)}
    until = {
        "ess_bulk_min": 10 * 4 * args.max_draws,
        "check_every": args.check_every,
        "check_growth": args.check_growth,
        "max_draws": args.max_draws,
    }
    loop = TrainingLoop(
        model_op=NumpyroModel(model=args.model),
        dataset=TrainingDataset(source=ArraySource(arrays=arrays)),
        task=NUTS(num_warmup=args.warmup, num_chains=4, until=until),
        backend="numpyro-mcmc",
        batch_size=len(arrays["y"]),
        max_steps=args.warmup + args.max_draws,
        steps_per_call=args.check_every,
        log_every_n_steps=args.check_every,
        progress=False,
        name="nuts",
    )
    with tempfile.TemporaryDirectory() as tmp, run_settings(run_dir=tmp, store=False):
        _, artifact = loop.run()
    info = artifact.backend_info["until"]
    m = artifact.final_metrics
    check_s = float(info["check_s"])
    sampling_s = m["time/elapsed_s"] - m["time/compile_s"] - m["time/checkpoint_s"] - check_s
    print(
        json.dumps(
            {
                "model": args.model,
                "draws_per_chain": info["draws"],
                "checks": info["checks"],
                "check_s": round(check_s, 4),
                "sampling_s": round(sampling_s, 4),
                "check_fraction": round(check_s / sampling_s, 4),
                "ms_per_check": round(1e3 * check_s / max(1, info["checks"]), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
