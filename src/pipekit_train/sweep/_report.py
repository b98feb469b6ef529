"""What a sweep's trials are: `SweepResult`, the table `sweep_status` reads back from the journal (and an Optuna
sweep's study), the best trial, and the table ``sweep --status`` prints.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ._journal import Journal, default_run_dir
from ._plan import grid_params, random_params
from ._sweep import Sweep


@dataclasses.dataclass
class SweepResult:
    """What `run_sweep` and `sweep_status` return: the trials in order of their number and the best one.

    Attributes:
        trials: One dict per trial: ``number``, ``key``, ``params``, ``state`` (one of `STATES`), ``objective``
            (a float, or ``None`` before it finished), ``artifact_ids`` (its stages' artifacts, in stage order),
            ``run_dir`` and, for a failed trial, ``error``.
        best: The finished trial with the best objective (``None`` when none finished).
        run_dir: The sweep's run directory.
    """

    trials: list[dict[str, Any]]
    best: dict[str, Any] | None
    run_dir: str

    def to_json(self) -> dict[str, Any]:
        """``{"trials": [{"params", "state", "objective", "artifact_ids"}], "best": {...}}`` (`--status --json`)."""

        def public(t: Mapping[str, Any]) -> dict[str, Any]:
            keys = ("params", "state", "objective", "artifact_ids")
            return {k: t[k] for k in keys}

        return {"trials": [public(t) for t in self.trials], "best": public(self.best) if self.best else None}


def sweep_status(sweep: Sweep, run_dir: str | None = None) -> SweepResult:
    """The table of `sweep`'s trials in `run_dir` as its journal holds it; planned trials not begun are ``pending``.

    A ``running`` trial is one that is running now, or whose driver stopped (running the sweep again resumes it).
    An Optuna sweep adds the trials its study holds that the journal does not (asked by a driver that stopped
    before recording them: ``running``, with the values asked so far); it and the study say the same of every trial.
    """
    run_dir = run_dir or default_run_dir(sweep)
    journal = Journal(run_dir, sweep)
    trials = sorted(journal.trials.values(), key=lambda t: t["number"])
    if sweep.sampler == "optuna" and os.path.exists(os.path.join(run_dir, "optuna.sqlite")):
        from ._optuna import study_trials

        trials = study_trials(sweep, run_dir, journal.trials) or trials
    numbers = {t["number"] for t in trials}
    if sweep.sampler == "grid":
        assert sweep.grid is not None
        planned = list(enumerate(grid_params(sweep.grid)))
    elif sweep.sampler == "random":
        assert sweep.space is not None and sweep.trials is not None
        planned = [(i, random_params(sweep.space, sweep.seed, i)) for i in range(sweep.trials)]
    else:
        planned = [(i, {}) for i in range(sweep.trials or 0)]
    for number, params in planned:
        if number not in numbers:
            trials.append(
                {
                    "number": number,
                    "key": None,
                    "params": params,
                    "state": "pending",
                    "objective": None,
                    "artifact_ids": [],
                    "run_dir": None,
                }
            )
    trials.sort(key=lambda t: t["number"])
    return SweepResult(trials=trials, best=best_trial(trials, sweep.mode), run_dir=run_dir)


def best_trial(trials: Sequence[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The completed trial with the lowest (``mode: min``) or highest objective; ties go to the lower number."""
    done = [
        t
        for t in trials
        if t["state"] == "completed" and t["objective"] is not None and t["objective"] == t["objective"]
    ]
    if not done:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(done, key=lambda t: (sign * t["objective"], t["number"]))


def format_table(result: SweepResult, metric: str) -> str:
    """The table ``sweep --status`` prints: one line per trial, then the best."""
    paths = list(dict.fromkeys(p for t in result.trials for p in t["params"]))
    width = {p: max(len(p), 10) for p in paths}
    wide = max(len(metric), 10)
    header = f"{'trial':>5}  " + "  ".join(f"{p:>{width[p]}}" for p in paths)
    header += f"  {'state':<9}  {metric:>{wide}}  artifacts"
    lines = [header, "-" * len(header)]
    for t in result.trials:
        cells = "  ".join(f"{_cell(t['params'].get(p)):>{width[p]}}" for p in paths)
        objective = "-" if t["objective"] is None else f"{t['objective']:.6g}"
        ids = ",".join(a[:12] for a in t["artifact_ids"]) or "-"
        lines.append(f"{t['number']:>5}  {cells}  {t['state']:<9}  {objective:>{wide}}  {ids}")
    if result.best is not None:
        b = result.best
        shown = ", ".join(f"{k}={_cell(v)}" for k, v in b["params"].items())
        lines.append(f"\nbest: trial {b['number']} ({shown}): {metric} = {b['objective']:.6g}")
    else:
        lines.append("\nbest: none finished yet")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
