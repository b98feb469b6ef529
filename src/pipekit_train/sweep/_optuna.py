"""``sampler: optuna``: Optuna's TPE asks for each trial's values, its median pruner stops bad trials at validations.

The study lives in Optuna's RDB storage on ``optuna.sqlite`` in the sweep's run directory (study name: the sweep's
name), so a restarted driver loads it: trials the journal holds as running are resumed under their own Optuna trial
(the same number and parameters), a trial Optuna holds as running that the journal never recorded (the driver died
between asking and recording it) is told failed, and a finished trial whose result Optuna missed is told it.
Optuna is imported only here (the ``sweep`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from pipekit import ConfigError, Operator

from ._driver import Journal, apply_params, run_trial, trial_key
from ._sweep import Sweep

_FINISHED = ("completed", "pruned", "failed")


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "Sweep.sampler 'optuna' needs Optuna: pip install 'pipekit-train[sweep]' (or choose sampler: random)"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def study_of(sweep: Sweep, run_dir: str) -> Any:
    """The sweep's Optuna study in ``RUN_DIR/optuna.sqlite``, created or loaded."""
    optuna = _optuna()
    storage = "sqlite:///" + os.path.abspath(os.path.join(run_dir, "optuna.sqlite"))
    prune = sweep.prune
    if prune is None:
        pruner = optuna.pruners.NopPruner()
    else:
        pruner = optuna.pruners.MedianPruner(
            n_startup_trials=int(prune.get("startup_trials", 2)), n_warmup_steps=int(prune.get("warmup_steps", 0))
        )
    return optuna.create_study(
        study_name=sweep.name,
        storage=storage,
        sampler=optuna.samplers.TPESampler(seed=sweep.seed, n_startup_trials=min(4, sweep.trials or 4)),
        pruner=pruner,
        direction="minimize" if sweep.mode == "min" else "maximize",
        load_if_exists=True,
    )


def suggest(trial: Any, space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The trial's values for `space`, asked of Optuna (each field path is an Optuna parameter name)."""
    out: dict[str, Any] = {}
    for path, dist in space.items():
        ((kind, args),) = dist.items()
        if kind == "uniform":
            out[path] = trial.suggest_float(path, args[0], args[1])
        elif kind == "log_uniform":
            out[path] = trial.suggest_float(path, args[0], args[1], log=True)
        elif kind == "int":
            out[path] = trial.suggest_int(path, args[0], args[1])
        else:
            out[path] = trial.suggest_categorical(path, args)
    return out


def _tell(study: Any, number: int, entry: Mapping[str, Any]) -> None:
    from optuna.trial import TrialState

    if entry["state"] == "completed" and entry["objective"] is not None:
        study.tell(number, entry["objective"], skip_if_finished=True)
    elif entry["state"] == "pruned":
        study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
    else:
        study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


def run_optuna(
    sweep: Sweep,
    pipeline: Operator,
    run_dir: str,
    journal: Journal,
    store: str | bool | None,
    on_trial: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Run the sweep's trials with Optuna until `Sweep.trials` have finished (completed, pruned or failed)."""
    optuna = _optuna()
    from optuna.trial import TrialState

    study = study_of(sweep, run_dir)
    assert sweep.space is not None and sweep.trials is not None
    by_number = {t["number"]: t for t in journal.trials.values()}
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        entry = by_number.get(frozen.number)
        if entry is None:  # asked, never recorded: nothing ran under it
            study.tell(frozen.number, state=TrialState.FAIL)
        elif entry["state"] in _FINISHED:  # recorded, not told
            _tell(study, frozen.number, entry)

    def one(trial: Any, params: dict[str, Any]) -> None:
        op = apply_params(pipeline, params, "Sweep.space")

        def report(step: int, value: float) -> bool:
            trial.report(value, step)
            return bool(trial.should_prune())

        entry = run_trial(sweep, op, trial_key(op), trial.number, params, run_dir, journal, store, report)
        _tell(study, trial.number, entry)
        if on_trial is not None:
            on_trial(entry)

    frozen_by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for entry in sorted(journal.trials.values(), key=lambda t: t["number"]):
        if entry["state"] == "running":  # the driver stopped during it: continue it under its own Optuna trial
            frozen = frozen_by_number[entry["number"]]
            one(optuna.trial.Trial(study, frozen._trial_id), dict(entry["params"]))
    while sum(t["state"] in _FINISHED for t in journal.trials.values()) < sweep.trials:
        trial = study.ask()
        one(trial, suggest(trial, sweep.space))
