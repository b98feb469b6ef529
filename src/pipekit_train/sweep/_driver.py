"""Running a `Sweep`: pre-flight every trial, run each as an ordinary resumable run, keep a journal of the trials.

The sweep's run directory holds ``sweep.json`` (the journal, rewritten atomically after every change of a trial's
state; one entry per trial number), ``trials/<key>/`` (one ordinary run directory per trial, named by the trial's
key) and, for ``sampler: optuna``, ``optuna.sqlite`` (Optuna's RDB storage). A trial's key is the hash of its
configuration (the pipeline's YAML after its parameters are set) and of its training data
(`TrainingDataset.content_hash` of every training stage): a restarted sweep skips a trial the journal holds as
finished under the same key, and runs any other with ``resume: auto`` in its own directory, so a half-trained trial
continues bitwise from its last checkpoint and a finished one is taken as it is (never trained or recorded twice).
Only the driver writes the journal; each trial's artifacts go to the store as any run's do.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pipekit
from pipekit import ConfigError, Operator, suggestion

from .._jsonio import read_json, write_json
from .._signals import phase
from ._sweep import ACTIVE_PRUNER, RayExecutor, Sweep, SweepPruning

JOURNAL = "sweep.json"
STATES = ("completed", "running", "pending", "failed", "pruned")
_PRUNED = "stopped: pruned by the sweep"


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


# The journal -------------------------------------------------------------------------------------------------
class Journal:
    """``sweep.json``: the trials by number, rewritten atomically on every change (one writer: the driver).

    One entry per trial number: two trials with the same values (a search over choices or integers may ask for the
    same ones again) are two entries with one key, and share that key's run directory (the second takes the
    first's result as it is).
    """

    def __init__(self, run_dir: str, sweep: Sweep) -> None:
        self.path = os.path.join(run_dir, JOURNAL)
        self.trials: dict[int, dict[str, Any]] = {}  # by number
        if os.path.exists(self.path):
            data = read_json(self.path, what="the sweep's journal", required=("sweep", "trials"))
            if data["sweep"] != sweep.name:
                raise ConfigError(
                    f"{self.path}: this run directory holds sweep {data['sweep']!r}, not {sweep.name!r}; "
                    "choose another --run-dir"
                )
            self.trials = {int(t["number"]): t for t in data["trials"]}
        self.sweep = sweep

    def save(self) -> None:
        trials = sorted(self.trials.values(), key=lambda t: t["number"])
        write_json(self.path, {"sweep": self.sweep.name, "sampler": self.sweep.sampler, "trials": trials})

    def set(self, entry: dict[str, Any]) -> None:
        self.trials[entry["number"]] = entry
        self.save()


def default_run_dir(sweep: Sweep) -> str:
    return os.path.join("runs", "sweeps", sweep.name)


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


def _run_in_workers(
    sweep: Sweep,
    todo: Sequence[tuple[int, dict[str, Any], Operator, str]],
    run_dir: str,
    journal: Journal,
    store: str | bool | None,
    on_trial: Callable[[dict[str, Any]], None] | None,
) -> None:
    """The trials in worker processes (``workers: N``, spawned) or Ray tasks. A worker trains its trial as
    `run_trial` does but records nothing (``store=False``); the driver then records the artifacts its stages wrote
    (``artifact.json`` in the shared run directory) in the store, and the trial's outcome in the journal: one writer
    of each."""
    from ..provenance._artifact import TrainingArtifact
    from ..provenance._store import ArtifactStore

    pool = _RayPool(sweep.executor) if isinstance(sweep.executor, RayExecutor) else _ProcessPool(sweep.executor.workers)
    with pool:
        handles = {}
        for number, params, op, key in todo:
            trial_dir = os.path.join(run_dir, "trials", key)
            entry = _entry(number, key, params, trial_dir)
            journal.set(entry)
            record = {"name": sweep.name, "trial": number, "params": params, "key": key}
            resume = "auto" if os.path.exists(os.path.join(trial_dir, "run.json")) else "never"
            handles[pool.submit(pipekit.dumps(op, strict=False), os.path.abspath(trial_dir), resume, record)] = entry
        for handle, error in pool.finished(list(handles)):
            entry = handles[handle]
            if error is None and store is not False:
                with ArtifactStore(store if isinstance(store, str) else None) as db:
                    for a in trial_artifacts(entry["run_dir"]):
                        db.record(TrainingArtifact.from_dict(a))
            if error is not None:
                entry = {**entry, "state": "failed", "error": str(error).splitlines()[0][:500]}
                entry["artifact_ids"] = [a["artifact_id"] for a in trial_artifacts(entry["run_dir"])]
            else:
                entry = {**entry, **outcome(entry["run_dir"], sweep.metric)}
            journal.set(entry)
            if on_trial is not None:
                on_trial(entry)


class _ProcessPool:
    """``workers: N``: a `ProcessPoolExecutor` with the ``spawn`` start method (JAX does not survive ``fork``)."""

    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))

    def __enter__(self) -> _ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, *args: Any) -> Any:
        return self.pool.submit(_worker_trial, *args)

    def finished(self, handles: list[Any]) -> Any:
        from concurrent.futures import as_completed

        for future in as_completed(handles):
            crashed = future.exception()  # the worker process died (its trial stays resumable)
            yield future, (f"{type(crashed).__name__}: {crashed}" if crashed is not None else future.result())


class _RayPool:
    """``executor: {type: ray}``: each trial a Ray task asking for `RayExecutor.resources_per_trial`.

    Uses the Ray this process is connected to; else connects as `ray_address` says (a private local instance when
    no cluster answers) and disconnects when the sweep ends (a local instance it started ends then).
    """

    def __init__(self, executor: RayExecutor) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("Sweep.executor 'ray' needs Ray: pip install 'pipekit-train[ray]'") from None
        self.ray: Any = ray  # typed as Any: the `ray` extra may be missing where this is type-checked
        self.connected = False
        if not ray.is_initialized():
            address = ray_address(executor.address)
            local: dict[str, Any] = {"include_dashboard": False} if address == "local" else {}
            self.ray.init(address=address, log_to_driver=False, **local)
            self.connected = True
        resources = dict(executor.resources_per_trial)
        options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 1), "num_gpus": resources.pop("GPU", 0)}
        if resources:
            options["resources"] = resources
        self.task = self.ray.remote(**options, max_retries=0)(_worker_trial)

    def __enter__(self) -> _RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.connected:  # connected for this sweep: disconnected (a local instance it started ends)
            self.ray.shutdown()

    def submit(self, *args: Any) -> Any:
        return self.task.remote(*args)

    def finished(self, handles: list[Any]) -> Any:
        pending = list(handles)
        while pending:
            (done,), pending = self.ray.wait(pending, num_returns=1)
            try:
                yield done, self.ray.get(done)
            except Exception as e:  # the task or its worker died
                yield done, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def ray_address(address: str) -> str:
    """What ``ray.init(address=...)`` is given for `RayExecutor.address`.

    ``HOST:PORT`` as it is, once something answers there (else one line, before Ray retries for minutes).
    ``auto``: ``$RAY_ADDRESS`` the same way; else the cluster ``ray start`` recorded (Ray's
    ``ray_current_cluster`` file under ``$RAY_TMPDIR``, ``$TMPDIR`` or ``/tmp``, then ``ray/``) when it answers;
    else ``"local"``: a private instance on this machine. A file left by a cluster that has stopped is not followed
    (``ray.init(address="auto")`` would wait for it), and a cluster another process started without ``ray
    start`` is not joined (Ray's ``auto`` joins any it finds running on the machine).
    """
    if address != "auto":
        _must_answer(address, f"Sweep.executor.address {address}")
        return address
    named = os.environ.get("RAY_ADDRESS", "").strip()
    if named and named not in ("auto", "local"):
        _must_answer(named, f"$RAY_ADDRESS={named}")
        return named
    if named == "local":
        return "local"
    try:
        with open(_ray_address_file()) as f:
            recorded = f.read().strip()
    except OSError:
        return "local"
    return recorded if recorded and _answers(recorded) is None else "local"


def _ray_address_file() -> str:
    """Where ``ray start`` records its cluster's address (Ray's own rule, `ray._common.utils.get_ray_address_file`)."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    return os.path.join(base or "/tmp", "ray", "ray_current_cluster")


def _answers(address: str) -> str | None:
    """``None`` when something accepts a connection at ``HOST:PORT`` (a ``ray://`` client address is taken as it
    is); else why not."""
    import socket

    if "://" in address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"not HOST:PORT: {address!r}"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _must_answer(address: str, what: str) -> None:
    why = _answers(address)
    if why is not None:
        raise ConfigError(f"{what}: no Ray cluster answers there ({why}); start one (ray start --head) or use 'auto'")


def _worker_trial(yaml_text: str, trial_dir: str, resume: str, record: dict[str, Any]) -> str | None:
    """In a worker process: train one trial (recording nothing in the store); ``None``, or its error in one line."""
    from ..stage.driver import run_pipeline
    from ..stage.settings import RunSettings

    try:
        op = pipekit.loads(yaml_text)
        settings = RunSettings(run_dir=trial_dir, store=False, resume=resume, pipeline=op, sweep=record)  # type: ignore[arg-type]
        run_pipeline(op, settings)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


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
