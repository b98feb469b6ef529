"""What the engine drives and what it hands back: the `StepBackend` protocol (a backend's step methods), the
`StageHooks` the checkpoint and resume machinery implements, the plain `EngineSnapshot` hooks read, the
`AdapterResult` of a stage, and the divergence errors. The contract an adapter author implements against is this
module plus `pipekit_train.backends.Backend` (``adapters/README.md``)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..backends._contract import StepBackend

__all__ = [
    "AdapterResult",
    "EngineSnapshot",
    "HookCall",
    "NonFiniteLossError",
    "NonFiniteWeightsError",
    "StageHooks",
    "first_nonfinite",
    "now_iso",
]


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite. The message names the stage, step and epoch."""


class NonFiniteWeightsError(FloatingPointError):
    """The weights hold NaN or infinity; nothing was saved or registered with them. The message names the array."""


def first_nonfinite(tree: Any) -> str | None:
    """The path of the first floating-point array of `tree` (a pytree or a flat mapping) holding NaN or infinity."""
    import jax

    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        host = np.asarray(leaf)
        if host.dtype.kind in "fc" and not np.isfinite(host).all():  # the paths only now: a save checks each time
            return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
    return None


@dataclass
class EngineSnapshot:
    """What the engine knows after a chunk, as plain data: what checkpoint hooks save with the arrays.

    Attributes:
        step: Optimizer steps taken.
        epoch: The epoch of `step`.
        pending: The steps not yet logged, ``[[step, {metric: value}], ...]`` as host floats, already checked to be
            finite (a checkpoint never holds weights past a non-finite loss).
        last_train: The last logged window's means (``loss``, ``lr``, ...).
        last_eval: The last validation metrics (``validate/...``).
        evaluated_at: The step `last_eval` was computed at, or ``None``.
        callback_states: Each callback's state, by its `callback_keys` key (its type and how many callbacks of that
            type come before it), so adding a callback of another type does not move any other's state.
    """

    step: int
    epoch: int
    pending: list[list[Any]]
    last_train: dict[str, float]
    last_eval: dict[str, float]
    evaluated_at: int | None
    callback_states: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class HookCall:
    """What the engine hands its hooks after a chunk and at the end, never the engine itself.

    Attributes:
        step: The steps taken so far.
        backend: The stage's `StepBackend` (its state to save, a best checkpoint to load back).
        snapshot: The engine's state as plain data (`EngineSnapshot`), taken when a checkpoint is written (it reads
            the pending step losses to the host and checks them).
        written: Tell the engine (and so the callbacks' ``on_checkpoint``) that a checkpoint of that step was written.
        may_wait: A save due now may be finished after the next chunk is dispatched: the backend dispatches its
            chunks through JAX (its loss is a JAX array: the call may return before the device is done), the
            stage goes on (not its last step, no stop asked for), and no callback hears of saves, phases or
            records (`on_checkpoint`, `on_phase_start`, `on_phase`, `on_log`), where `ctx.model` would already be
            the next chunk's.
            The hook then takes the state now and returns the rest of the save.
        restored: Tell the engine that `restore_best` loaded the checkpoint of a step, with that checkpoint's
            metadata: the stage's final metrics become that step's.
    """

    step: int
    backend: StepBackend
    snapshot: Callable[[], EngineSnapshot]
    written: Callable[[int], None]
    may_wait: bool = False
    restored: Callable[[int, Mapping[str, Any]], None] = lambda step, meta: None


class StageHooks(Protocol):
    """What the engine calls on checkpoint, resume and signal hooks (`pipekit_train.checkpoint` supplies them)."""

    parent_ids: tuple[str, ...]
    restored_meta: Mapping[str, Any] | None
    #: Where the stage's checkpoints are (a resumed run says so), or ``None``.
    directory: Any
    #: After `restore`: a line saying an elastic resume continued on another topology, or ``None``.
    topology_note: str | None
    #: After `restore`: the reason of a callback's stop (early stopping) that the resumed checkpoint was written at,
    #: else ``None``. The engine ends the stage there at once, as it had.
    resumed_stop: str | None

    def restore(self, backend: StepBackend) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]] | None]:
        """Before the first step: load a warm start and/or the checkpoint to resume; ``(step, data, callbacks)``."""

    def boundaries(self) -> list[int]:
        """Step multiples a fused chunk must not cross (the checkpoint cadence)."""

    def idle_after(self, step: int) -> bool:
        """Whether `after_chunk` after `step` steps would do nothing (no checkpoint due, no signal, no other process
        to agree with): the engine then does not call it."""

    def after_chunk(self, call: HookCall, data_state: dict[str, Any]) -> Callable[[], None] | None:
        """After every dispatch that `idle_after` does not rule out: save when the cadence says so.

        With ``call.may_wait``, a hook may take the state's snapshot now and return the rest of the save; the
        engine calls it right after dispatching the next chunk, before anything else of that chunk (and at the
        stage's end or failure, if no next chunk comes), so the device does not idle while the host saves."""

    def stop_requested(self) -> str | None:
        """A signal's name when SIGINT/SIGTERM asked the stage to stop."""

    def at_end(self, call: HookCall, data_state: dict[str, Any], stop_reason: str | None) -> None:
        """After the last step: a final save, waiting for background writes, `restore_best`.

        `stop_reason` is the signal's name when a signal stopped the stage (it resumes from this save: no
        `restore_best` then)."""

    def close(self) -> None:
        """Release what the hooks hold (signal handlers, writers), also after an error."""


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass
class AdapterResult:
    """What an adapter's ``run`` returns to `TrainingLoop`."""

    model: Any
    opt_state: Any
    step: int
    epoch: int
    metrics: dict[str, float]
    backend_info: dict[str, Any]
    artifact_fields: dict[str, Any] = field(default_factory=dict)
    started_at: str = ""
    ended_at: str = ""
    status: str = "completed"
    stop_reason: str | None = None
    rng: Any = None
    #: `restore_best`: the restored step and the last step's metrics (`TrainingArtifact.restored`), else ``None``.
    restored: dict[str, Any] | None = None
