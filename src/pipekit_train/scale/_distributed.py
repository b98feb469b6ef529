"""Multi-process training with `jax.distributed`: start-up from the environment, and the few agreements it needs.

A multi-process run is N copies of the same ``pipekit-train run`` (one per host, or N on one host through
``pipekit-train launch``), each with its own local devices. `initialize_distributed` connects them once, before JAX
does any computation, from the environment:

==============================  ==========================================================================
``PIPEKIT_COORDINATOR``         ``host:port`` of process 0's coordination service (or JAX's own
                                ``JAX_COORDINATOR_ADDRESS``)
``PIPEKIT_NUM_PROCESSES``       how many processes take part
``PIPEKIT_PROCESS_ID``          this process's index, ``0 .. N-1``
``PIPEKIT_DISTRIBUTED=auto``    let JAX detect all three from the cluster (SLURM, Open MPI, Kubernetes, TPU)
``PIPEKIT_HEARTBEAT_TIMEOUT``   seconds without a heartbeat after which JAX's coordination service takes a
                                process for dead and stops the others (default: JAX's, 100)
==============================  ==========================================================================

Everything else is the same program on every process: the mesh spans every process's devices (`_mesh`), each
process gathers only its rows of each global batch (`local_rows`), and process 0 alone writes what the run shares
(run directory lock, metrics, progress, final weights, artifact, checkpoint manifest); the others wait for it at a
barrier (`barrier`). Decisions one process could make alone (stop on a signal) are agreed through JAX's
coordination service (`agree`), so every process stops after the same step. design/scale.md has the reasons.

With one process nothing here imports JAX or talks to anyone: every helper is a no-op.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from pipekit import ConfigError

COORDINATOR = "PIPEKIT_COORDINATOR"
NUM_PROCESSES = "PIPEKIT_NUM_PROCESSES"
PROCESS_ID = "PIPEKIT_PROCESS_ID"
DISTRIBUTED = "PIPEKIT_DISTRIBUTED"
HEARTBEAT = "PIPEKIT_HEARTBEAT_TIMEOUT"
ENV_VARS = (COORDINATOR, NUM_PROCESSES, PROCESS_ID, DISTRIBUTED, HEARTBEAT)

#: How long a process waits for the others at a barrier or an agreement (the slowest save or compile).
TIMEOUT_MS = 30 * 60 * 1000

_started = False
_rounds: dict[str, int] = {}


def _env_int(name: str, value: str, low: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if number < low:
        raise ConfigError(f"${name} must be an int of at least {low}, got {value!r}")
    return number


def settings_from_env(env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """``jax.distributed.initialize`` keyword arguments the environment asks for, or ``None`` for one process.

    One-line `ConfigError` for a bad or incomplete setting, naming the variable, the rule and the value.
    """
    env = dict(os.environ if env is None else env)
    mode = env.get(DISTRIBUTED, "").strip()
    if mode and mode not in ("auto", "off"):
        raise ConfigError(f"${DISTRIBUTED} must be 'auto' (detect the cluster) or 'off', got {mode!r}")
    if mode == "off":
        return None
    given = {k: env[k] for k in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if env.get(k, "").strip()}
    coordinator = given.get(COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS") or None
    if mode == "auto" or (not given and coordinator is not None):  # JAX's own variables: JAX fills in the rest
        out: dict[str, Any] = {}
    elif not given:
        return None
    else:
        missing = [k for k in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if k not in given]
        if COORDINATOR in missing and coordinator is not None:
            missing.remove(COORDINATOR)
        if missing:
            raise ConfigError(
                f"a multi-process run needs {', '.join('$' + k for k in (COORDINATOR, NUM_PROCESSES, PROCESS_ID))}; "
                f"{', '.join('$' + k for k in missing)} not set (set by `pipekit-train launch`, or set "
                f"${DISTRIBUTED}=auto to let JAX detect the cluster)"
            )
        out = {}
    if coordinator is not None:
        if ":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit():
            raise ConfigError(f"${COORDINATOR} must be host:port, got {coordinator!r}")
        out["coordinator_address"] = coordinator
    if NUM_PROCESSES in given:
        out["num_processes"] = _env_int(NUM_PROCESSES, given[NUM_PROCESSES], 1)
    if PROCESS_ID in given:
        out["process_id"] = _env_int(PROCESS_ID, given[PROCESS_ID], 0)
        count = out.get("num_processes")
        if count is not None and out["process_id"] >= count:
            raise ConfigError(f"${PROCESS_ID} must be below ${NUM_PROCESSES} ({count}), got {out['process_id']}")
    if out.get("num_processes") == 1 and mode != "auto":
        return None
    if env.get(HEARTBEAT, "").strip():  # a process killed outside `launch`: how soon the survivors give up
        out["heartbeat_timeout_seconds"] = _env_int(HEARTBEAT, env[HEARTBEAT], 1)
    return out


def initialize_distributed() -> bool:
    """Connect this process to the others when the environment names a multi-process run; once per process.

    Must run before JAX computes anything (JAX fixes its devices then). On CPU, cross-process collectives go
    through gloo. Returns whether this process is one of several.
    """
    global _started
    if _started:
        return process_count() > 1
    kwargs = settings_from_env()
    if kwargs is None:
        return False
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            "the environment names a multi-process run ($PIPEKIT_NUM_PROCESSES / $PIPEKIT_COORDINATOR) but JAX "
            "already computed in this process; call pipekit_train.initialize_distributed() before anything else "
            "uses JAX (the CLI does it first thing)"
        )
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(getattr(jax.config, "jax_platforms", "") or "")
    if not platforms or "cpu" in platforms:  # CPU devices all-reduce across processes through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    jax.distributed.initialize(**kwargs)
    _started = True
    return process_count() > 1


def process_count() -> int:
    """How many processes train together (1 unless `jax.distributed` is initialized); never imports JAX."""
    jax = sys.modules.get("jax")
    return int(jax.process_count()) if jax is not None else 1


def process_index() -> int:
    """This process's index (0 for a single process); never imports JAX."""
    jax = sys.modules.get("jax")
    return int(jax.process_index()) if jax is not None else 0


def is_primary() -> bool:
    """Whether this process writes what the processes share (process 0, or the only process)."""
    return process_index() == 0


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:  # pragma: no cover - process_count() > 1 means it is there
        raise RuntimeError("jax.distributed is not initialized")
    return client


def _round(name: str) -> str:
    """A fresh key for the next use of `name`: every process makes the same calls in the same order."""
    count = _rounds.get(name, 0)
    _rounds[name] = count + 1
    return f"pipekit/{name}/{count}"


def barrier(name: str) -> None:
    """Wait until every process gets here (a no-op for one process)."""
    if process_count() == 1:
        return
    _client().wait_at_barrier(_round("barrier/" + name), TIMEOUT_MS)


def allgather(name: str, value: Any) -> list[Any]:
    """Every process's JSON-able `value`, by process index (``[value]`` for one process).

    Host-side, through the coordination service's key-value store: it does not wait for the devices.
    """
    count = process_count()
    if count == 1:
        return [value]
    client, key, me = _client(), _round("gather/" + name), process_index()
    client.key_value_set(f"{key}/{me}", json.dumps(value))
    out = [json.loads(client.blocking_key_value_get(f"{key}/{p}", TIMEOUT_MS)) for p in range(count)]
    # Every process has read every value once the next barrier passes; drop them so the store stays small.
    client.wait_at_barrier(key + "/read", TIMEOUT_MS)
    with contextlib.suppress(Exception):
        client.key_value_delete(f"{key}/{me}")
    return out


def agree(name: str, value: str | None) -> str | None:
    """The first non-``None`` `value` of any process (by process index): one decision for all of them."""
    if process_count() == 1:
        return value
    return next((v for v in allgather(name, value) if v is not None), None)


@contextlib.contextmanager
def primary_holds(name: str, make: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Process 0 enters ``make()`` (the run directory lock) for the block; the others wait until it holds it.

    A process 0 that is refused (another run holds the lock) tells the others, which fail with its message
    instead of waiting; a single process simply enters ``make()``.
    """
    if process_count() == 1:
        with make():
            yield
        return
    client, key = _client(), _round("holds/" + name)
    if not is_primary():
        word = json.loads(client.blocking_key_value_get(key, TIMEOUT_MS))
        if word is not None:
            raise RuntimeError(f"process 0 of {process_count()} stopped: {word}")
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(make())
        except BaseException as e:
            client.key_value_set(key, json.dumps(f"{type(e).__name__}: {e}"))
            raise
        client.key_value_set(key, json.dumps(None))
        yield


def local_rows() -> tuple[int, int] | None:
    """``(process index, process count)`` when this process reads only its part of each global batch."""
    n = process_count()
    return (process_index(), n) if n > 1 else None


def gather_data_state(state: dict[str, Any]) -> dict[str, Any]:
    """The data position a checkpoint holds: this process's own, or every process's keyed by index."""
    if process_count() == 1:
        return state
    return {"num_processes": process_count(), "by_process": allgather("data_state", state)}


def local_data_state(saved: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """This process's data position out of what `gather_data_state` saved (either topology).

    The position of a global batch is the same on every process (each reads its rows of the same batch), so a
    checkpoint of another process count resumes from the common position; positions that differ (a dataset of
    another kind) are refused, naming both topologies.
    """
    if saved is None or "by_process" not in saved:
        return saved
    positions = saved["by_process"]
    count = process_count()
    if len(positions) == count:
        return dict(positions[process_index()])
    if all(p == positions[0] for p in positions):
        return dict(positions[0])
    raise ConfigError(
        f"{where}: the checkpoint was written by {len(positions)} processes, each at its own data position, and "
        f"this run has {count}; resume with {len(positions)} processes (pipekit-train launch --num-processes "
        f"{len(positions)})"
    )
