"""What a sweep will run, checked before any trial runs: each trial's values (the grid's combinations, the random
sampler's draws) and the pre-flight of every trial (a search: each end of its ranges) and of the objective's metric.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipekit import ConfigError, Operator, suggestion

from ._sweep import Sweep
from ._trial import apply_params


# Sampling ---------------------------------------------------------------------------------------------------
def grid_params(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the last path varying fastest."""
    paths = list(grid)
    return [dict(zip(paths, values, strict=True)) for values in itertools.product(*(grid[p] for p in paths))]


def random_params(space: Mapping[str, Mapping[str, Any]], seed: int, number: int) -> dict[str, Any]:
    """Trial `number`'s values: drawn from a generator seeded by ``(seed, number)``, the same on every run."""
    import numpy as np

    rng = np.random.default_rng([seed, number])
    out: dict[str, Any] = {}
    for path, dist in space.items():
        ((kind, args),) = dist.items()
        if kind == "uniform":
            out[path] = float(rng.uniform(args[0], args[1]))
        elif kind == "log_uniform":
            out[path] = float(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
        elif kind == "int":
            out[path] = int(rng.integers(args[0], args[1], endpoint=True))
        else:
            out[path] = args[int(rng.integers(len(args)))]
    return out


def _extremes(space: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For pre-flight of a search: every path at each end of its range (each choice), the others at their low."""
    low = {p: next(iter(d.values()))[0] for p, d in space.items()}
    out = [low]
    for path, dist in space.items():
        for value in next(iter(dist.values()))[1:]:
            out.append({**low, path: value})
    return out


# Pre-flight -------------------------------------------------------------------------------------------------
def logged_metrics(op: Operator) -> dict[str, str]:
    """The final metrics the training stages of `op` log, by name, each with the stage that logs it last."""
    from ..stage.preflight import training_stages

    out: dict[str, str] = {}
    for index, loop in enumerate(training_stages(op)):
        stage = loop.name or f"stage{index}"
        names = ["loss", *_metric_names(loop.metrics)]
        out["train/loss"] = stage
        for context, ds in (("validate", loop.val_dataset), ("test", loop.test_dataset)):
            if ds is not None:
                out.update({f"{context}/{n}": stage for n in names})
    return out


def _metric_names(metrics: Sequence[Any]) -> list[str]:
    names: list[str] = []
    for m in metrics:
        try:
            names += list(m.compute(m.init()))
        except Exception:  # a metric that cannot compute an empty state: its names are not known before training
            names.append(type(m).__name__.lower())
    return names


def preflight(sweep: Sweep, pipeline: Operator) -> list[dict[str, Any]]:
    """Check every trial this sweep will run (a search: each range's ends) before any runs; the grid's or random
    sampler's parameters, in trial order (``[]`` for Optuna, which asks as it goes). One `ConfigError` line each."""
    from ..stage.preflight import check_without_jax, training_stages

    if not training_stages(pipeline):
        raise ConfigError(f"Sweep.pipeline: {type(pipeline).__name__} has no training stage (TrainingLoop) to sweep")
    if sweep.sampler == "grid":
        assert sweep.grid is not None
        planned, checked, where = grid_params(sweep.grid), None, "Sweep.grid"
    else:
        assert sweep.space is not None and sweep.trials is not None
        checked, where = _extremes(sweep.space), "Sweep.space"
        planned = (
            []
            if sweep.sampler == "optuna"
            else [random_params(sweep.space, sweep.seed, i) for i in range(sweep.trials)]
        )
    for params in checked if checked is not None else planned:
        op = apply_params(pipeline, params, where)
        for index, loop in enumerate(training_stages(op)):
            check_without_jax(loop, loop.name or f"stage{index}")
    logged = logged_metrics(pipeline)
    if sweep.metric not in logged:
        raise ConfigError(
            f"Sweep.objective.metric: no stage logs {sweep.metric!r}{suggestion(sweep.metric, logged)}; "
            f"logged: {', '.join(sorted(logged))}"
        )
    return planned
