"""Running a `Sweep`: pre-flight every trial, run each as an ordinary resumable run, keep a journal of the trials.

The sweep's run directory holds ``sweep.json`` (the journal, rewritten atomically after every change of a trial's
state; one entry per trial number), ``trials/<key>/`` (one ordinary run directory per trial, named by the trial's
key) and, for ``sampler: optuna``, ``optuna.sqlite`` (Optuna's RDB storage). A trial's key is the hash of its
configuration (the pipeline's YAML after its parameters are set) and of its training data
(`TrainingDataset.content_hash` of every training stage): a restarted sweep skips a trial the journal holds as
finished under the same key, and runs any other with ``resume: auto`` in its own directory, so a half-trained trial
continues bitwise from its last checkpoint and a finished one is taken as it is (never trained or recorded twice).
Only the driver writes the journal; each trial's artifacts go to the store as any run's do.

This module runs a sweep; its parts: `_plan` (each trial's values and the pre-flight), `_trial` (one trial: its
values set, its key, its run and outcome), `_journal` (``sweep.json``), `_executors` (worker processes and Ray)
and `_report` (`SweepResult`, `sweep_status`, the table).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pipekit
from pipekit import ConfigError, Operator

from ._executors import _run_in_workers
from ._journal import Journal, default_run_dir
from ._plan import preflight
from ._report import SweepResult, sweep_status
from ._sweep import Sweep
from ._trial import apply_params, run_trial, trial_key


def load_sweep(path: str) -> Sweep:
    """The `Sweep` in the YAML file `path`, its ``pipeline:`` file (relative to `path`) loaded."""

    op = pipekit.load(path)
    if not isinstance(op, Sweep):
        raise ConfigError(f"{path}: expected a sweep (type: Sweep), got type: {type(op).__name__}")
    if isinstance(op.pipeline, str):
        op = op.replace(
            pipeline=_load_pipeline(os.path.join(os.path.dirname(os.path.abspath(path)), op.pipeline), path)
        )
    return op


def _load_pipeline(file: str, sweep_file: str) -> Operator:
    if not os.path.isfile(file):
        raise ConfigError(f"{sweep_file}: pipeline: no such file {file}")
    return pipekit.load(file)


def run_sweep(
    sweep: Sweep,
    run_dir: str | None = None,
    *,
    store: str | bool | None = None,
    on_trial: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Run every trial of `sweep` not finished yet in `run_dir` (default ``runs/sweeps/<name>``); its result.

    Args:
        sweep: The sweep; its ``pipeline`` an operator (`load_sweep` loads a file's).
        run_dir: The sweep's directory; a second run with the same one continues it (see the module docstring).
        store: The artifact store (``None``: the default; ``False``: record nothing).
        on_trial: Called with each trial's entry when it ends (the CLI prints a line).
    """
    from .._lock import run_dir_lock

    pipeline = sweep.pipeline
    if isinstance(pipeline, str):
        pipeline = _load_pipeline(pipeline, "Sweep.pipeline")
    planned = preflight(sweep, pipeline)
    run_dir = run_dir or default_run_dir(sweep)
    os.makedirs(run_dir, exist_ok=True)
    with run_dir_lock(run_dir):
        journal = Journal(run_dir, sweep)
        if sweep.sampler == "optuna":
            from ._optuna import run_optuna

            run_optuna(sweep, pipeline, run_dir, journal, store, on_trial)
        else:
            todo = []
            for number, params in enumerate(planned):
                op = apply_params(pipeline, params, "Sweep.grid" if sweep.sampler == "grid" else "Sweep.space")
                key = trial_key(op)
                done = journal.trials.get(number)
                # A failed trial runs again; so does one whose configuration or data changed (another key).
                if done is None or done["key"] != key or done["state"] not in ("completed", "pruned"):
                    todo.append((number, params, op, key))
            if sweep.parallel:
                _run_in_workers(sweep, todo, run_dir, journal, store, on_trial)
            for number, params, op, key in todo if not sweep.parallel else ():
                entry = run_trial(sweep, op, key, number, params, run_dir, journal, store, None)
                if on_trial is not None:
                    on_trial(entry)
    return sweep_status(sweep, run_dir)
