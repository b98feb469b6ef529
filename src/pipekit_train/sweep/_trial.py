"""One trial: the sweep's pipeline with a trial's values set, the key it is matched by on a restart, and its run.

A trial runs as an ordinary run with ``resume: auto`` in ``trials/<key>`` of the sweep's run directory
(`run_trial`); what it ended as is read back from the artifacts its stages wrote there (`outcome`), by the driver
or, for a trial a worker trained, by the executor that waited for it (`_executors`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import pipekit
from pipekit import ConfigError, Operator

from .._jsonio import read_json
from .._signals import phase
from ._journal import Journal
from ._sweep import ACTIVE_PRUNER, Sweep, SweepPruning

_PRUNED = "stopped: pruned by the sweep"


def _parts(path: str) -> list[str]:
    return [p for p in path.replace("[", ".").replace("]", "").split(".") if p]


def apply_params(pipeline: Operator, params: Mapping[str, Any], where: str) -> Operator:
    """`pipeline` with each ``{field path: value}`` of `params` set as ``--set`` sets it (type-checked; an unknown
    path is refused with the closest ones); errors name `where` (``Sweep.grid``) instead of ``--set``."""
    try:
        edited: Operator = pipekit.apply_overrides(pipeline, [(_parts(path), value) for path, value in params.items()])
        return edited
    except ConfigError as e:
        message = str(e).replace("--set ", f"{where}.")
        shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
        raise ConfigError(f"{message} (trial {shown})") from None


def trial_key(op: Operator) -> str:
    """The key a trial is matched by on a restart: the hash of its configuration and of its training data."""
    from ..stage.preflight import training_stages

    config = pipekit.dumps(op, strict=False)
    data = [loop.dataset.content_hash() for loop in training_stages(op)]
    return hashlib.sha256((config + "\n" + json.dumps(data)).encode()).hexdigest()[:16]


def _entry(number: int, key: str, params: dict[str, Any], trial_dir: str) -> dict[str, Any]:
    return {
        "number": number,
        "key": key,
        "params": params,
        "state": "running",
        "objective": None,
        "artifact_ids": [],
        "run_dir": trial_dir,
    }


def run_trial(
    sweep: Sweep,
    op: Operator,
    key: str,
    number: int,
    params: dict[str, Any],
    run_dir: str,
    journal: Journal,
    store: str | bool | None,
    pruner: Any,
    settle: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run one trial as an ordinary run with ``resume: auto`` in ``trials/<key>``; its journal entry.

    `pruner` is the trial's pruner (`ACTIVE_PRUNER`; ``None``: no pruning); `settle` is called with the trial's
    outcome before the journal records it (Optuna is told first: `_optuna`).
    """
    from ..stage.driver import run_pipeline
    from ..stage.record import TrainingInterrupted
    from ..stage.settings import RunSettings

    phase("trial-begun")  # (tests: a signal or a kill before the journal says the trial runs)
    trial_dir = os.path.join(run_dir, "trials", key)
    entry = _entry(number, key, params, trial_dir)
    journal.set(entry)
    if pruner is not None:
        op = _with_pruning(op, sweep.metric)
    record = {"name": sweep.name, "trial": number, "params": params, "key": key}
    token = ACTIVE_PRUNER.set(pruner)
    try:
        settings = RunSettings(
            run_dir=trial_dir,
            store=False if store is False else (store if isinstance(store, str) else None),
            # a trial begun before continues (its checkpoint, or its finished stages as they are); a new one starts
            resume="auto" if os.path.exists(os.path.join(trial_dir, "run.json")) else "never",
            pipeline=op,
            sweep=record,
        )
        run_pipeline(op, settings)  # a TrainingLoop or a Sequential (pre-flight checked)
        phase("trial-trained")  # (tests: a kill after the training, before its outcome is recorded)
    except TrainingInterrupted:
        raise  # SIGINT / SIGTERM: the trial stays `running` and resumes from its checkpoint next time
    except Exception as e:
        entry = {**entry, "state": "failed", "error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
        entry["artifact_ids"] = [a["artifact_id"] for a in trial_artifacts(trial_dir)]
    else:
        entry = {**entry, **outcome(trial_dir, sweep.metric)}
    finally:
        ACTIVE_PRUNER.reset(token)
    if settle is not None:
        settle(entry)
    journal.set(entry)
    return entry


def _with_pruning(op: Operator, metric: str) -> Operator:
    """`op` with a `SweepPruning` callback on its last training stage (the one the objective is read from)."""
    from pipekit import Sequential

    from ..stage.loop import TrainingLoop

    if isinstance(op, TrainingLoop):
        return op.replace(callbacks=(*op.callbacks, SweepPruning(metric=metric)))
    if isinstance(op, Sequential):
        stages = list(op.stages)
        last = max(i for i, s in enumerate(stages) if isinstance(s, TrainingLoop))
        stages[last] = _with_pruning(stages[last], metric)
        return op.replace(stages=tuple(stages))
    return op


def trial_artifacts(trial_dir: str) -> list[dict[str, Any]]:
    """The artifacts a trial's stages wrote (``artifact.json``), in the order they ran."""
    records = [
        read_json(p, what="a stage's artifact") for p in glob.glob(os.path.join(trial_dir, "*", "artifact.json"))
    ]
    return sorted(records, key=lambda a: (a.get("started_at") or "", a["artifact_id"]))


def outcome(trial_dir: str, metric: str) -> dict[str, Any]:
    """What a trial's run directory says of it: ``state`` (completed, or pruned), ``objective``, ``artifact_ids``."""
    artifacts = trial_artifacts(trial_dir)
    objective = None
    for a in artifacts:
        value = a.get("final_metrics", {}).get(metric)
        if value is not None:
            objective = float(value)
    pruned = any(str(a.get("status", "")).startswith(_PRUNED) for a in artifacts)
    return {
        "state": "pruned" if pruned else "completed",
        "objective": objective,
        "artifact_ids": [a["artifact_id"] for a in artifacts],
    }
