"""Elastic resume: continuing a checkpoint on another number of devices or processes, and recording that it did.

The global batch (`TrainingLoop.batch_size`) and the data position (``{"epoch", "batch"}`` of the next global
batch) do not depend on the topology: one process on one device draws exactly the batches that N processes draw
together (each reads its contiguous part of every global batch, `scale._distributed.local_rows`). So a checkpoint
resumes on another device or process count as long as the new count splits the global batch: the same batches in
the same order, the same per-step PRNG keys, only the gradient all-reduce adds its partial sums in another order
(the weights agree within float rounding, not bit for bit).

Where it lives:

- every checkpoint's meta holds ``topology`` (``{"num_devices", "num_processes"}`` it was written on) and
  ``topology_changes`` (every change so far: ``{"step", "from", "to"}``); older checkpoints have neither and their
  topology is read from the resume fingerprint's ``mesh`` (`saved_topology`);
- the resume compares the fingerprints without the topology (`without_topology`); a change of topology alone is
  accepted and appended to the history, which the stage's artifact records as
  ``backend_info["topology_changes"]`` (``pipekit-train artifacts show`` prints it);
- a new device count that does not split the global batch is refused before pre-flight, in one line naming the
  batch, both counts and the nearest counts that would work (`check_resume_topology`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._errors import CheckpointMismatchError

__all__ = [
    "check_resume_topology",
    "fitting_counts",
    "history_text",
    "saved_topology",
    "topology_now",
    "topology_text",
    "without_topology",
]


def topology_now(loop: Any) -> dict[str, int]:
    """``{"num_devices", "num_processes"}`` this stage trains on."""
    from ..scale._mesh import describe

    topology = describe(loop)
    return {"num_devices": int(topology["num_devices"]), "num_processes": int(topology["num_processes"])}


def saved_topology(meta: dict[str, Any]) -> dict[str, int]:
    """The topology a checkpoint was written on: its meta's ``topology``, or (a checkpoint written before elastic
    resume) the fingerprint's ``mesh``, where one device of one process is left out."""
    recorded = meta.get("topology")
    if isinstance(recorded, dict):
        return {"num_devices": int(recorded["num_devices"]), "num_processes": int(recorded["num_processes"])}
    mesh = (meta.get("fingerprint") or {}).get("mesh") or {}
    return {"num_devices": int(mesh.get("num_devices", 1)), "num_processes": int(mesh.get("num_processes", 1))}


def without_topology(fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """A resume fingerprint without the device and process counts: what must still be equal for an elastic resume.

    ``mesh.shard_params`` stays (it is configuration, not topology)."""
    out = dict(fingerprint or {})
    mesh = out.pop("mesh", None)
    if isinstance(mesh, dict) and mesh.get("shard_params"):
        out["mesh"] = {"shard_params": True}
    return out


def topology_text(topology: dict[str, int]) -> str:
    """``4 devices (2 processes)``."""
    devices, processes = topology["num_devices"], topology["num_processes"]
    return f"{devices} device{'s' * (devices != 1)} ({processes} process{'es' * (processes != 1)})"


def history_text(changes: list[dict[str, Any]]) -> str:
    """``4 devices (1 process) -> step 4: 2 devices (1 process) -> step 8: 1 device (1 process)``."""
    if not changes:
        return "-"
    parts = [topology_text(changes[0]["from"])]
    for change in changes:
        parts.append(f"step {change['step']}: {topology_text(change['to'])}")
    return " -> ".join(parts)


def fitting_counts(batch_size: int, short: int = 0, processes: int = 1) -> list[int]:
    """The device counts that split a global batch of `batch_size` (and the short last batch of `short` records,
    when the data keeps it) evenly, among multiples of `processes` (each process has the same number)."""
    return [n for n in range(processes, batch_size + 1, processes) if batch_size % n == 0 and short % n == 0]


def _nearest(counts: list[int], n: int) -> list[int]:
    below = [c for c in counts if c < n]
    above = [c for c in counts if c > n]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def refusal(loop: Any, stage: str, where: str, step: int, then: dict[str, int], now: dict[str, int]) -> str | None:
    """The one-line refusal of an elastic resume whose new device count does not split the global batch, or
    ``None`` when it does."""
    batch, n = int(loop.batch_size), now["num_devices"]
    short = 0 if loop.dataset.drop_remainder else loop.dataset.num_records() % batch
    if batch % n == 0 and short % n == 0:
        return None
    counts = fitting_counts(batch, short, now["num_processes"])
    nearest = " or ".join(str(c) for c in _nearest(counts, n))
    rule = f"the global batch of {batch} records (TrainingLoop.batch_size)"
    if short:
        rule += f" with its short last batch of {short} records"
    return (
        f"cannot resume stage {stage!r} from step {step} in {where} on {topology_text(now)}: the checkpoint was "
        f"written on {topology_text(then)} and {rule} does not split evenly over {n} devices; resume on {nearest} "
        f"devices (any of {', '.join(map(str, counts))}), e.g. XLA_FLAGS=--xla_force_host_platform_device_count=N "
        "on CPU or mesh: {devices: N}"
    )


def check_resume_topology(loop: Any, stage_dir: str, stage: str) -> None:
    """Before pre-flight (whose batch check would say only "use another batch_size", which a resume cannot): refuse
    in one line a resume whose latest checkpoint was written on another topology that the new device count cannot
    continue. Nothing to resume, or the same topology: nothing to say."""
    from ._layout import _uncommitted_reason
    from ._manifest import _read_record_json

    if loop.checkpoint_settings is None:
        return
    directory = Path(loop.checkpoint_directory(stage_dir))
    if not directory.is_dir():
        return
    steps = sorted((int(c.name) for c in directory.iterdir() if c.name.isdigit()), reverse=True)
    for step in steps:  # the newest committed one: what the resume will take
        step_dir = directory / str(step)
        if _uncommitted_reason(step_dir) is not None:
            continue
        try:
            meta = _read_record_json(step_dir).get("user") or {}
        except Exception:  # a damaged record: the resume itself reports it with the whole story
            return
        then, now = saved_topology(meta), topology_now(loop)
        if then != now:
            message = refusal(loop, stage, str(directory), step, then, now)
            if message is not None:
                raise CheckpointMismatchError(message)
        return
