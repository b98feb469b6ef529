"""Data parallel over the devices: the `TrainingLoop.mesh` setting, the device mesh and the shardings.

A stage trains on a one-axis device mesh named ``data``. The global batch (`TrainingLoop.batch_size`) is split
along that axis, one slice per device; parameters and optimizer state are replicated on every device, or, with
``shard_params: true``, split along ``data`` as well (FSDP style: each array's first axis that the device count
divides). XLA inserts the gradient all-reduce (or the all-gathers and reduce-scatters) itself: the step is one
`jax.jit` with explicit input and output shardings. With one device and no ``shard_params`` there is no mesh at
all: the step is the unsharded one, bit for bit (design/scale.md).

With several processes (`jax.distributed`, `pipekit_train.scale._distributed`) the ``data`` axis spans the devices of
every process, process by process; each process hands the step only its rows of the global batch (`MeshPlan.assemble`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipekit import ConfigError, suggestion

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh, NamedSharding

MESH_KEYS = ("devices", "shard_params")


def supports(loop: Any, setting: str) -> bool:
    """Whether the stage's backend honours `setting` (``"mesh"``, ``"precision"``): its `capabilities` list it
    (adapters/README.md). Any other backend trains on one device in float32 and refuses more."""
    return setting in loop.adapter().capabilities


def mesh_settings(mesh: Any, where: str = "TrainingLoop.mesh") -> tuple[int | None, bool]:
    """``(devices, shard_params)`` of a `mesh` mapping (``None`` devices: every local device); one-line errors."""
    if mesh is None:
        return None, False
    if not isinstance(mesh, dict):
        raise ConfigError(f"{where} must be a mapping like {{devices: all, shard_params: false}}, got {mesh!r}")
    for key in mesh:
        if key not in MESH_KEYS:
            raise ConfigError(
                f"{where} has no setting {key!r}{suggestion(str(key), MESH_KEYS)}; allowed: {', '.join(MESH_KEYS)}"
            )
    devices = mesh.get("devices", "all")
    if devices == "all" or devices is None:
        count = None
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        count = devices
    else:
        raise ConfigError(f"{where}.devices must be a positive int or 'all', got {devices!r}")
    shard = mesh.get("shard_params", False)
    if not isinstance(shard, bool):
        raise ConfigError(f"{where}.shard_params must be true or false, got {shard!r}")
    return count, shard


def device_count(loop: Any) -> int:
    """How many devices the stage trains on: `mesh.devices` (or every local device) of every process."""
    import jax

    return len(_local_devices(loop)) * int(jax.process_count())


def _local_devices(loop: Any) -> list[Any]:
    """This process's devices the stage trains on: the first `mesh.devices` local ones, or all of them."""
    import jax

    wanted, _ = mesh_settings(loop.mesh)
    available = jax.local_devices()
    if wanted is None:
        return list(available)
    if wanted > len(available):
        raise ConfigError(
            f"TrainingLoop.mesh.devices is {wanted} but this process has {len(available)} local device(s) "
            f"({jax.default_backend()}); use devices: all or at most {len(available)}"
        )
    return list(available[:wanted])


def _mesh_devices(loop: Any) -> tuple[Any, ...]:
    """The mesh's devices in process order: the first `mesh.devices` local devices of process 0, then of 1, ...

    With several processes (`jax.distributed`) the ``data`` axis spans every process's devices, so process `p`'s
    devices hold the `p`-th contiguous part of each global batch: the rows that process reads (`local_rows`).
    """
    import jax

    local = _local_devices(loop)
    if jax.process_count() == 1:
        return tuple(local)
    per_process = len(local)
    out: list[Any] = []
    for p in range(jax.process_count()):
        mine = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        out.extend(mine[:per_process])
    return tuple(out)


@dataclass(frozen=True)
class MeshPlan:
    """The mesh of a stage and the shardings of its arrays (hashable: it keys the compiled steps)."""

    mesh: Mesh
    shard_params: bool

    @property
    def num_devices(self) -> int:
        return int(self.mesh.size)

    @property
    def replicated(self) -> NamedSharding:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec())  # type: ignore[no-untyped-call]

    def batch(self, stacked: bool) -> NamedSharding:
        """The batch's sharding: the records axis (axis 1 of a chunk of stacked batches) split along ``data``."""
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(None, "data") if stacked else PartitionSpec("data"))  # type: ignore[no-untyped-call]

    def leaf(self, shape: tuple[int, ...]) -> NamedSharding:
        """A parameter's (or optimizer-state array's) sharding: replicated, or split along its first axis that
        the device count divides when `shard_params` is set (arrays with no such axis stay replicated)."""
        from jax.sharding import NamedSharding, PartitionSpec

        if self.shard_params:
            n = self.num_devices
            for axis, size in enumerate(shape):
                if size >= n and size % n == 0:
                    spec = PartitionSpec(*([None] * axis), "data")  # type: ignore[no-untyped-call]
                    return NamedSharding(self.mesh, spec)
        return self.replicated

    def shardings(self, leaves: list[Any]) -> tuple[NamedSharding, ...]:
        return tuple(self.leaf(tuple(getattr(x, "shape", ()))) for x in leaves)

    @property
    def num_processes(self) -> int:
        return len({d.process_index for d in self.mesh.devices.flat})

    def assemble(self, batch: dict[str, Any], stacked: bool) -> dict[str, Any]:
        """The global batch as the compiled step takes it: as it is for one process (the call splits the NumPy
        arrays), else one global `jax.Array` per key made from this process's rows
        (`jax.make_array_from_process_local_data`)."""
        if self.num_processes == 1:
            return batch
        import jax

        sharding, axis = self.batch(stacked), 1 if stacked else 0
        out = {}
        for key, local in batch.items():
            shape = list(local.shape)
            shape[axis] *= self.num_processes
            out[key] = jax.make_array_from_process_local_data(sharding, local, tuple(shape))  # type: ignore[no-untyped-call]
        return out

    def put(self, leaves: list[Any]) -> list[jax.Array]:
        """`leaves` placed on the mesh with their shardings (fresh arrays when they move)."""
        import jax

        return [jax.device_put(x, s) for x, s in zip(leaves, self.shardings(leaves), strict=True)]


_PLANS: dict[tuple[Any, ...], MeshPlan] = {}


def mesh_plan(loop: Any) -> MeshPlan | None:
    """The stage's `MeshPlan`, or ``None`` for one device without parameter sharding (the unsharded step).

    Refuses a global batch the device count does not divide, naming both.
    """
    import numpy as np
    from jax.sharding import Mesh

    n = device_count(loop)
    _, shard = mesh_settings(loop.mesh)
    if n == 1 and not shard:
        return None
    value = loop.batch_size
    if value % n:
        raise ConfigError(
            f"TrainingLoop.batch_size is {value}, the global batch, which the stage's {n} devices cannot split "
            f"evenly; use a multiple of {n} (e.g. {value + (-value) % n}) or set mesh: {{devices: ...}}"
        )
    short = 0 if loop.dataset.drop_remainder else loop.dataset.num_records() % value
    if short % n:
        raise ConfigError(
            f"TrainingLoop.dataset keeps the short last batch of each epoch ({short} records, drop_remainder: "
            f"false), which the stage's {n} devices cannot split evenly; set drop_remainder: true on the dataset"
        )
    devices = _mesh_devices(loop)
    key = (devices, shard)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = MeshPlan(Mesh(np.array(devices), ("data",)), shard)
    return plan


def check_mesh(loop: Any) -> None:
    """Pre-flight: the mesh a stage asks for exists, its backend trains on one, and the batch splits evenly."""
    from ..backends._registry import able_to

    wanted, shard = mesh_settings(loop.mesh)
    if not supports(loop, "mesh"):
        if (wanted is not None and wanted > 1) or shard:
            raise ConfigError(
                f"TrainingLoop.mesh is {loop.mesh!r} but backend {loop.backend!r} trains on one device only "
                f"(data parallel: {able_to('mesh')}); remove mesh or set mesh: {{devices: 1}}"
            )
        return
    if shard and not supports(loop, "shard_params"):
        raise ConfigError(
            f"TrainingLoop.mesh.shard_params is true but backend {loop.backend!r} keeps its variables replicated "
            f"(parameter sharding: {able_to('shard_params')}); remove shard_params"
        )
    import jax

    processes = jax.process_count()
    if processes > 1 and not supports(loop, "processes"):
        raise ConfigError(
            f"this process is one of {processes} (jax.distributed is initialized) but backend {loop.backend!r} "
            f"trains in one process only (multi-process: {able_to('processes')}); run it without pipekit-train launch"
        )
    if processes > 1 and shard:
        raise ConfigError(
            f"TrainingLoop.mesh.shard_params is true but this run has {processes} processes; parameter sharding "
            "works within one process only: remove shard_params (design/scale.md)"
        )
    mesh_plan(loop)


def describe(loop: Any) -> dict[str, Any]:
    """The topology a stage trains on, for `backend_info` and the resume fingerprint.

    A backend without a mesh trains on one device; JAX is not imported for it (a backend may not use JAX at all).
    """
    import sys

    if not supports(loop, "mesh"):
        loaded = sys.modules.get("jax")
        processes = int(loaded.process_count()) if loaded is not None else 1
        return {"num_devices": 1, "num_processes": processes, "shard_params": False}
    import jax

    _, shard = mesh_settings(loop.mesh)
    return {"num_devices": device_count(loop), "num_processes": jax.process_count(), "shard_params": shard}


def used_devices(loop: Any) -> list[str] | None:
    """The devices the stage trains on, as ``str(device)`` in mesh order: the mesh's for a backend with one, else
    the first device. ``None`` when JAX is not loaded (a backend that does not use it says its own)."""
    import sys

    if not supports(loop, "mesh"):
        loaded = sys.modules.get("jax")
        return [str(loaded.devices()[0])] if loaded is not None else None
    return [str(d) for d in _mesh_devices(loop)]
