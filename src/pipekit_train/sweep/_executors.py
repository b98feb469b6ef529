"""Running a sweep's trials in parallel: worker processes (``workers: N``) or Ray tasks (``executor: {type: ray}``).

A worker trains its trial as `run_trial` does but records nothing; the driver records the artifacts its stages
wrote and the trial's outcome in the journal (one writer of each). Which Ray a sweep uses is `ray_address`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pipekit
from pipekit import ConfigError, Operator

from ._journal import Journal
from ._sweep import RayExecutor, Sweep
from ._trial import _entry, outcome, trial_artifacts


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
