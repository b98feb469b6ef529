"""The adapter contract: what a backend is to the training core (``adapters/README.md`` says the same in prose).

A backend is **one object**, named by its entry point in the ``pipekit_train.backends`` group (or handed to
`register_backend`). The stage runner calls it in this order, each once per stage:

1. `Backend.check` in pre-flight (``validate`` runs exactly this, for every stage before any trains): every rule
   of this backend that needs no weights and no compiling (data keys and shapes against the model and the loss,
   what the backend refuses, a hand-off from the previous stage it cannot take).
2. `Backend.build` when the stage starts from fresh weights (or a `Transfer` needs a fresh model to fill in): the
   one place a model is initialised. Where the stage starts from (fresh, carried over, converted from another
   backend, transferred) is decided by the core (`pipekit_train.stage.start`), never by the adapter.
3. `Backend.start`: the one call that hands the stage to the backend. It returns the `StepBackend` the engine
   drives (its step methods are documented on `pipekit_train.engine._protocol.StepBackend`).

`capabilities` says what the backend honours; pre-flight refuses a stage that asks for anything else, naming the
capability and the backends that have it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..engine._protocol import StepBackend
    from ..stage.loop import TrainerCarryState, TrainingLoop
    from ._model import ModelOp

__all__ = ["CAPABILITIES", "CONTRACT", "Backend", "LazyBackend"]

#: Every capability a backend may list, and what it means (the text is what pre-flight's refusals and
#: ``adapters/README.md`` say).
CAPABILITIES: dict[str, str] = {
    "weights": "trains weights that start fresh, carry over to the next stage or convert between backends",
    "transfer": "assembles a stage's model from the previous one by paths (TrainingLoop.transfer)",
    "init_from": "warm-starts from a kept checkpoint's weights (TrainingLoop.init_from)",
    "gradient": "a gradient rule such as SAM (TrainingLoop.gradient)",
    "param_groups": "parameter groups (TrainingLoop.param_groups)",
    "diagnostics": "in-step diagnostics (TrainingLoop.diagnostics)",
    "carry": "takes the previous stage's optimizer state or EMA weights (TrainingLoop.carry)",
    "schedules": "schedules on loss and callback values",
    "mesh": "data parallel over a device mesh (TrainingLoop.mesh)",
    "shard_params": "parameters sharded over the mesh (mesh.shard_params)",
    "precision": "a compute dtype other than float32 (TrainingLoop.precision)",
    "processes": "several jax.distributed processes",
    "lr_find": "the learning-rate finder (pipekit-train lr-find)",
    "export": "jax.export of the trained model (pipekit-train export)",
    "schedule_segment": "restarts its learning-rate schedule for an extension (extend --new-segment)",
}

#: The names a backend object has: what `register_backend` checks and ``adapters/README.md`` documents
#: (tests/adapters/test_contract.py compares the three).
CONTRACT = ("name", "requires", "extra", "capabilities", "check", "build", "start", "info")


@runtime_checkable
class Backend(Protocol):
    """A backend, as the training core sees it.

    Attributes:
        name: The name `TrainingLoop.backend` uses (``"equinox"``).
        requires: The import names of the packages it needs (``("equinox", "optax")``): a missing one is one clear
            error naming `extra` before anything runs.
        extra: The pipekit-train extra that installs them (``"keras"``), or ``None``.
        capabilities: What it honours, from `CAPABILITIES`.
    """

    name: str
    requires: tuple[str, ...]
    extra: str | None
    capabilities: frozenset[str]

    def check(self, loop: TrainingLoop, incoming: TrainerCarryState | None, stage: str) -> None:
        """Pre-flight rules of this backend that need no weights and no compiling; raise `pipekit.ConfigError` or
        `pipekit.ShapeError` naming the stage, the field and the value. `incoming` is what the previous stage will
        hand over (its model unbound or untrained during ``validate``): a backend without the ``weights``
        capability, which takes its starting point from it in `start`, refuses a hand-off it cannot take here."""
        ...

    def build(self, loop: TrainingLoop) -> ModelOp:
        """`loop.model_op` bound to freshly initialised weights (from ``loop.seed``). Called at most once a stage."""
        ...

    def start(self, loop: TrainingLoop, model: ModelOp, incoming: TrainerCarryState | None) -> StepBackend:
        """The stage's `StepBackend`, holding `model`'s weights (the model the core chose) and this backend's own
        state. `incoming` is the previous stage's carry-state (``None`` for a first stage): a backend with the
        ``carry`` capability reads `TrainingLoop.carry` from it, a sampler its initial point."""
        ...

    def info(self) -> dict[str, Any]:
        """The framework and its versions, for the artifact's ``backend_info`` (``{"backend": name, ...}``)."""
        ...


def missing_members(backend: Any) -> list[str]:
    """The members of `CONTRACT` that `backend` lacks (callables for the methods)."""
    missing = []
    for member in CONTRACT:
        if not hasattr(backend, member) or (
            member in ("check", "build", "start", "info") and not callable(getattr(backend, member))
        ):
            missing.append(member)
    return missing


class LazyBackend:
    """A backend object whose methods live in a module imported on first use, so that registering the backend
    (reading a pipeline file, listing backends) never imports its framework.

    Subclass it with the four attributes and `impl`, the dotted name of a module with the functions
    ``check(loop, incoming, stage)``, ``build(loop)``, ``start(loop, model, incoming)``, ``info()`` and, with the
    ``transfer`` capability, ``transfer(spec, previous, fresh)``; each method below calls the one of its name.
    """

    name: str = ""
    requires: tuple[str, ...] = ()
    extra: str | None = None
    capabilities: frozenset[str] = frozenset()
    impl: str = ""

    def _impl(self) -> Any:
        import importlib

        return importlib.import_module(self.impl)

    def check(self, loop: TrainingLoop, incoming: TrainerCarryState | None, stage: str) -> None:
        self._impl().check(loop, incoming, stage)

    def build(self, loop: TrainingLoop) -> ModelOp:
        model: ModelOp = self._impl().build(loop)
        return model

    def transfer(self, spec: Any, previous: ModelOp, fresh: ModelOp) -> ModelOp:
        """`fresh` with the sub-trees `spec` (a `Transfer`) names copied from `previous` (``transfer`` capability)."""
        model: ModelOp = self._impl().transfer(spec, previous, fresh)
        return model

    def start(self, loop: TrainingLoop, model: ModelOp, incoming: TrainerCarryState | None) -> StepBackend:
        step_backend: StepBackend = self._impl().start(loop, model, incoming)
        return step_backend

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = self._impl().info()
        return out

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"
