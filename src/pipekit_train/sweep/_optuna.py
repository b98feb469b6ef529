"""``sampler: optuna``: Optuna's TPE asks for each trial's values, its median pruner stops bad trials at validations.

The study lives in Optuna's RDB storage on ``optuna.sqlite`` in the sweep's run directory (study name: the sweep's
name). It is the truth of which trials there are, the values each was asked and how each ended; the journal
(``sweep.json``) holds the same trials under the same numbers with what the study does not (each trial's key, run
directory and artifacts). A trial's outcome is told to Optuna first and recorded in the journal after, so after a
kill at any moment the two differ at most by the one trial that was running, in one of two ways, and both
`sweep_status` and a restarted driver read that trial as the study has it (`trials_of`):

- a trial Optuna holds as running that the journal has not recorded (the driver stopped between asking and
  recording it) is ``running``, with the values it was asked so far; a restarted driver continues it under its own
  number with those values (a value not asked yet is asked then, as the first driver would have), like a trial the
  journal holds as running (the driver stopped during it), which resumes from its checkpoint;
- a trial Optuna was told of that the journal still holds as running (the driver stopped between the two) is
  read as it ended, from its run directory; a restarted driver records it.

What a trial is asked does not depend on how many drivers asked: each value is drawn by a TPE sampler seeded with
``(seed, trial number, field path)`` (`_sampler`) from the trials finished before it, so a sweep stopped at any
moment (SIGKILL included) and restarted asks the values an uninterrupted one asks, and ends with the same study
and table. A trial resumed from its checkpoint reports each validation to the pruner once. Optuna is imported only
here (the ``sweep`` extra).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from pipekit import ConfigError, Operator

from .._signals import phase
from ._journal import Journal
from ._sweep import Sweep
from ._trial import apply_params, outcome, run_trial, trial_key

_FINISHED = ("completed", "pruned", "failed")
#: A trial's state in the journal for each of Optuna's (``WAITING``: enqueued, not used here).
_STATES = {"RUNNING": "running", "WAITING": "running", "COMPLETE": "completed", "PRUNED": "pruned", "FAIL": "failed"}


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "Sweep.sampler 'optuna' needs Optuna: pip install 'pipekit-train[sweep]' (or choose sampler: random)"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _storage(run_dir: str) -> str:
    return "sqlite:///" + os.path.abspath(os.path.join(run_dir, "optuna.sqlite"))


def _sampler(sweep: Sweep, number: int, path: str) -> Any:
    """The TPE sampler that draws trial `number`'s value of `path`: seeded by ``(seed, number, path)``, so the draw
    depends only on those and on the trials finished before (never on what else this process drew)."""
    import numpy as np

    seed = np.random.SeedSequence([sweep.seed, number, zlib.crc32(path.encode())]).generate_state(1)[0]
    return _optuna().samplers.TPESampler(seed=int(seed), n_startup_trials=min(4, sweep.trials or 4))


def study_of(sweep: Sweep, run_dir: str) -> Any:
    """The sweep's Optuna study in ``RUN_DIR/optuna.sqlite``, created or loaded."""
    optuna = _optuna()
    prune = sweep.prune
    if prune is None:
        pruner = optuna.pruners.NopPruner()
    else:
        pruner = optuna.pruners.MedianPruner(
            n_startup_trials=int(prune.get("startup_trials", 2)), n_warmup_steps=int(prune.get("warmup_steps", 0))
        )
    return optuna.create_study(
        study_name=sweep.name,
        storage=_storage(run_dir),
        sampler=_sampler(sweep, 0, ""),  # replaced before each value is asked (`suggest`)
        pruner=pruner,
        direction="minimize" if sweep.mode == "min" else "maximize",
        load_if_exists=True,
    )


def suggest(trial: Any, sweep: Sweep) -> dict[str, Any]:
    """The trial's values for ``sweep.space``, asked of Optuna (each field path is an Optuna parameter name); a
    value the trial was asked already (before a restart) comes back as it was."""
    assert sweep.space is not None
    out: dict[str, Any] = {}
    for path, dist in sweep.space.items():
        trial.study.sampler = _sampler(sweep, trial.number, path)
        ((kind, args),) = dist.items()
        if kind == "uniform":
            out[path] = trial.suggest_float(path, args[0], args[1])
        elif kind == "log_uniform":
            out[path] = trial.suggest_float(path, args[0], args[1], log=True)
        elif kind == "int":
            out[path] = trial.suggest_int(path, args[0], args[1])
        else:
            out[path] = trial.suggest_categorical(path, args)
        phase("optuna-suggested")  # (tests: a kill between two values of one trial)
    return out


def _tell(trial: Any, entry: Mapping[str, Any]) -> None:
    """Tell Optuna how `trial` ended (a failed trial's error kept in its user attributes, for `trials_of`)."""
    from optuna.trial import TrialState

    if entry["state"] == "completed" and entry["objective"] is not None:
        trial.study.tell(trial.number, entry["objective"], skip_if_finished=True)
    elif entry["state"] == "pruned":
        trial.study.tell(trial.number, state=TrialState.PRUNED, skip_if_finished=True)
    else:
        trial.set_user_attr("error", entry.get("error") or "finished without a value of the objective")
        trial.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)


def trials_of(sweep: Sweep, study: Any, recorded: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every trial of `study` as a journal entry: the journal's (`recorded`, by number) where it says what the study
    says; a trial the journal has not recorded: ``running`` with the values asked so far; a trial the study finished
    that the journal holds as running: its outcome, read from its run directory (see the module docstring)."""
    out = []
    for frozen in study.get_trials(deepcopy=False):
        state = _STATES[frozen.state.name]
        entry = recorded.get(frozen.number)
        if entry is None:
            entry = {
                "number": frozen.number,
                "key": None,
                "params": dict(frozen.params),
                "state": "running",
                "objective": None,
                "artifact_ids": [],
                "run_dir": None,
            }
        elif state != "running" and entry["state"] == "running":  # told; the journal not written yet
            ended = outcome(entry["run_dir"], sweep.metric)
            if state == "failed":
                error = frozen.user_attrs.get("error", "failed")
                entry = {**entry, "state": "failed", "error": error, "artifact_ids": ended["artifact_ids"]}
            else:
                entry = {**entry, **ended, "state": state}
        out.append(entry)
    return out


def study_trials(sweep: Sweep, run_dir: str, recorded: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """`trials_of` the sweep's study in `run_dir` (``[]`` before the study was created): `sweep_status` reads the
    trials of an Optuna sweep through it."""
    optuna = _optuna()
    try:
        study = optuna.load_study(study_name=sweep.name, storage=_storage(run_dir))
    except KeyError:  # the study was never created (the driver stopped before)
        return []
    return trials_of(sweep, study, recorded)


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
    # The journal and the study made to agree (see the module docstring) before anything is asked.
    for entry in trials_of(sweep, study, journal.trials):
        if entry["state"] != "running" and journal.trials.get(entry["number"]) != entry:
            journal.set(entry)  # told, not recorded: recorded now
    unfinished = []
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        recorded = journal.trials.get(frozen.number)
        if recorded is not None and recorded["state"] in _FINISHED:  # not told (a sweep begun before this order)
            _tell(optuna.trial.Trial(study, frozen._trial_id), recorded)
        else:  # asked (recorded running, or not recorded yet): continued under its own number
            unfinished.append(frozen)

    def one(trial: Any, reported: dict[int, float]) -> None:
        params = suggest(trial, sweep)
        op = apply_params(pipeline, params, "Sweep.space")

        def settle(entry: dict[str, Any]) -> None:
            _tell(trial, entry)
            phase("optuna-told")  # (tests: a kill after Optuna was told, before the journal records it)

        pruner = _Pruner(trial, reported)  # (without `prune:`, Optuna's NopPruner: values recorded, never acted on)
        entry = run_trial(sweep, op, trial_key(op), trial.number, params, run_dir, journal, store, pruner, settle)
        phase("optuna-recorded")
        if on_trial is not None:
            on_trial(entry)

    for frozen in sorted(unfinished, key=lambda t: t.number):
        study = study_of(sweep, run_dir)  # a fresh study object: what it caches of the trials is read now
        one(optuna.trial.Trial(study, frozen._trial_id), dict(frozen.intermediate_values))
    while sum(t["state"] in _FINISHED for t in journal.trials.values()) < sweep.trials:
        trial = study.ask()
        phase("optuna-asked")  # (tests: a kill after Optuna made the trial, before any value is asked)
        one(trial, {})


class _Pruner:
    """The pruner of one trial (`_sweep.ACTIVE_PRUNER`): its validations reported to Optuna, each step once (a trial
    resumed from its checkpoint validates again what it had reported), and Optuna's median pruner asked."""

    def __init__(self, trial: Any, reported: dict[int, float]) -> None:
        self.trial = trial
        self.reported = reported  # step -> value, as the study holds them

    def report(self, step: int, value: float) -> bool:
        if step not in self.reported:
            self.trial.report(value, step)
            self.reported[step] = value
        return bool(self.trial.should_prune())
