"""The backend contract as types: `Backend` (what a backend is to the training core) and `StepBackend` (what the
engine drives during a stage). ``adapters/README.md`` lists the same members in prose, and
``tests/adapters/test_contract.py`` checks the two against each other.

A backend is **one object**, an instance of a `Backend` subclass, named by its entry point in the
``pipekit_train.backends`` group (or handed to `register_backend`). The stage runner calls it in this order, each
once per stage:

1. `Backend.check` in pre-flight (``validate`` runs exactly this, for every stage before any trains): every rule
   of this backend that needs no weights and no compiling (data keys and shapes against the model and the loss,
   what the backend refuses, a hand-off from the previous stage it cannot take).
2. `Backend.build` when the stage starts from fresh weights (or a `Transfer` needs a fresh model to fill in): the
   one place a model is initialised. Where the stage starts from (fresh, carried over, converted from another
   backend, transferred) is decided by the core (`pipekit_train.stage`), never by the backend; with the ``transfer``
   capability the core asks `Backend.transfer` to fill the fresh model in.
3. `Backend.start`: the one call that hands the stage to the backend. It returns the `StepBackend` the engine
   drives.

Like Lightning's ``Strategy``, every member the core calls is a method of these classes: the required ones are
abstract, the optional ones have a documented default, so the core calls methods and never probes an object for
what it has. `capabilities` says which settings a backend honours; pre-flight refuses a stage that asks for
anything else, naming the capability and the backends that have it.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._model import ModelOp, Transfer

__all__ = ["CAPABILITIES", "CONTRACT", "STEP_CONTRACT", "Backend", "LazyBackend", "StepBackend"]

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
    "ema": "an exponential moving average of the weights (the EMA callback)",
    "mesh": "data parallel over a device mesh (TrainingLoop.mesh)",
    "shard_params": "parameters sharded over the mesh (mesh.shard_params)",
    "precision": "a compute dtype other than float32 (TrainingLoop.precision)",
    "processes": "several jax.distributed processes",
    "lr_find": "the learning-rate finder (pipekit-train lr-find)",
    "export": "jax.export of the trained model (pipekit-train export)",
    "schedule_segment": "restarts its learning-rate schedule for an extension (extend --new-segment)",
    "lora": "trains low-rank adapters on a frozen model (optimizer_config.lora)",
}


class Backend(abc.ABC):
    """A backend, as the training core sees it. Subclass it, set the four attributes, implement the three abstract
    methods (and `transfer` with the ``transfer`` capability); the rest have defaults.

    Attributes:
        name: The name `TrainingLoop.backend` uses (``"equinox"``).
        requires: The import names of the packages it needs (``("equinox", "optax")``): a missing one is one clear
            error, before anything runs, naming how to install it.
        extra: The pipekit-train extra that installs them (``"keras"``), for a backend that ships with
            pipekit-train; ``None`` for any other (the error then says ``pip install <package>`` of `requires`).
        capabilities: What it honours, from `CAPABILITIES`.
        samples: Whether its stages draw from a distribution (a sampler: one step is one iteration of every chain)
            rather than train: the data reaches it whole, so `TrainingLoop.batch_size` is unused (never checked
            against the data), and the stage's progress, log lines and summary speak of draws, not of epochs,
            losses and parameters. Default ``False``.
    """

    name: str = ""
    requires: tuple[str, ...] = ()
    extra: str | None = None
    capabilities: frozenset[str] = frozenset()
    samples: bool = False

    @abc.abstractmethod
    def check(self, loop: Any, incoming: Any, stage: str) -> None:
        """Pre-flight rules of this backend that need no weights and no compiling; raise `pipekit.ConfigError` or
        `pipekit.ShapeError` naming the stage, the field and the value. `incoming` is what the previous stage will
        hand over (its model unbound or untrained during ``validate``): a backend without the ``weights``
        capability, which takes its starting point from it in `start`, refuses a hand-off it cannot take here."""

    @abc.abstractmethod
    def build(self, loop: Any) -> ModelOp:
        """`loop.model_op` bound to freshly initialised weights (from ``loop.seed``). Called at most once a stage."""

    @abc.abstractmethod
    def start(self, loop: Any, model: ModelOp, incoming: Any) -> StepBackend:
        """The stage's `StepBackend`, holding `model`'s weights (the model the core chose) and this backend's own
        state. `incoming` is the previous stage's `TrainerCarryState` (``None`` for a first stage): a backend with
        the ``carry`` capability reads its ``carried`` state (the previous stage's final optimizer state and EMA
        weights, read by the core), a sampler its initial point."""

    def info(self) -> dict[str, Any]:
        """The framework and its versions, for the artifact's ``backend_info``. Default: ``{"backend": name}``."""
        return {"backend": self.name}

    def transfer(self, spec: Transfer, previous: ModelOp, fresh: ModelOp) -> ModelOp:
        """With the ``transfer`` capability: `fresh` with the sub-trees `spec` names copied from `previous` (all
        bound models of this backend). The core calls it only for a backend that lists the capability."""
        raise NotImplementedError(f"backend {self.name!r} lists the 'transfer' capability but has no transfer method")

    def extended_fields(self, loop: Any, steps: int) -> dict[str, Any] | None:
        """For ``pipekit-train extend``: the `TrainingLoop` fields, besides ``max_steps``, that a stage `steps`
        steps longer than `loop` changes, for a backend whose stage length lives in another field too (a sampler
        kernel's ``num_samples``); raise `pipekit.ConfigError` when no longer stage continues this one exactly.
        Default ``None``: a trained stage, whose learning-rate schedule the core checks."""
        return None

    # What the conformance kit (and `TrainingLoop.example`) build with ----------------------------------------
    def example_model(self, in_size: int, out_size: int) -> ModelOp | None:
        """A small model of ``in_size -> out_size`` (the model the conformance kit trains). Default: ``None``, no
        example (the kit then refuses the backend, naming this method)."""
        return None

    def example_fields(self) -> dict[str, Any]:
        """`TrainingLoop` fields of the kit's problem for a backend that does not train it with `MSE` and SGD (a
        sampler's kernel as ``task``, an ELBO as ``loss``). Default: none."""
        return {}

    def example_transfer(self) -> dict[str, str]:
        """With the ``transfer`` capability: the `Transfer.paths` of `example_model` the kit copies (some of its
        parts, not all). Default: none (the kit then refuses a backend listing the capability)."""
        return {}

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"


class LazyBackend(Backend):
    """A backend whose methods live in a module imported on first use, so that registering the backend (reading a
    pipeline file, listing backends) never imports its framework.

    Subclass it with the four attributes and `impl`, the dotted name of a module with the functions
    ``check(loop, incoming, stage)``, ``build(loop)``, ``start(loop, model, incoming)``, ``info()`` and, with the
    ``transfer`` capability, ``transfer(spec, previous, fresh)``; each method below calls the one of its name.
    """

    impl: str = ""

    def _impl(self) -> Any:
        import importlib

        return importlib.import_module(self.impl)

    def check(self, loop: Any, incoming: Any, stage: str) -> None:
        self._impl().check(loop, incoming, stage)

    def build(self, loop: Any) -> ModelOp:
        model: ModelOp = self._impl().build(loop)
        return model

    def transfer(self, spec: Transfer, previous: ModelOp, fresh: ModelOp) -> ModelOp:
        model: ModelOp = self._impl().transfer(spec, previous, fresh)
        return model

    def start(self, loop: Any, model: ModelOp, incoming: Any) -> StepBackend:
        step_backend: StepBackend = self._impl().start(loop, model, incoming)
        return step_backend

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = self._impl().info()
        return out


class StepBackend(abc.ABC):
    """One stage's training state on a backend's framework: what the engine drives.

    `Backend.start` returns one. The backend-neutral engine owns the schedule (logging, validation, checkpoint
    cadence, epochs, ``steps_per_call`` chunking), callbacks, metric writers, divergence checks, progress, graceful
    stops, warm starts, `restore_best` and exact resume; a step backend runs steps and holds the state. The
    abstract methods are required; every other method has a default that is right for a backend that does not
    need it. Rules that keep resume exact: derive per-step randomness from ``(seed, step)``, never from a counter
    outside `state_tree`; take batches only from the engine; never hand the user's own arrays to a call that
    donates or mutates them.
    """

    # Required: stepping, evaluating, the model, the learning rate, the state a checkpoint holds -----------------
    @abc.abstractmethod
    def train(self, batches: list[dict[str, Any]], step: int) -> Mapping[str, Any]:
        """Run ``len(batches)`` optimizer steps starting at absolute step `step`; metrics (``loss`` at least) with a
        leading axis when several steps ran."""

    @abc.abstractmethod
    def evaluate(self, batch: dict[str, Any]) -> Mapping[str, Any]:
        """Metrics of one batch in inference mode, no gradients."""

    @abc.abstractmethod
    def bound_model(self) -> ModelOp:
        """The model operator bound to the current weights (a sampler: to its draws)."""

    @abc.abstractmethod
    def set_model(self, model_op: ModelOp) -> None:
        """Replace the current weights (same structure)."""

    @abc.abstractmethod
    def get_lr_scale(self) -> float:
        """The run-time learning-rate multiplier (1.0 unless `ReduceLROnPlateau` lowered it)."""

    @abc.abstractmethod
    def set_lr_scale(self, value: float) -> None:
        """Set the run-time learning-rate multiplier; it is part of `state_tree`, so it survives a resume."""

    @abc.abstractmethod
    def learning_rate(self, step: int) -> float:
        """The learning rate at `step` (the schedule times the multiplier), for logging."""

    @abc.abstractmethod
    def state_tree(self) -> Mapping[str, Any]:
        """Every array a checkpoint needs to continue exactly (weights, optimizer state, ...), a dict of pytrees."""

    @abc.abstractmethod
    def load_state_tree(self, tree: Mapping[str, Any]) -> None:
        """The inverse of `state_tree` (the tree comes back with the same structure, as arrays)."""

    @abc.abstractmethod
    def weights_tree(self) -> Mapping[str, Any]:
        """The model's weights alone: what a warm start (`TrainingLoop.init_from`) copies from a checkpoint. Its keys
        are keys of `state_tree`, with the same structure underneath."""

    @abc.abstractmethod
    def load_weights_tree(self, tree: Mapping[str, Any]) -> None:
        """Replace the weights only (the inverse of `weights_tree`); the optimizer state stays."""

    # How the engine drives it ----------------------------------------------------------------------------------
    def fuses_steps(self) -> bool:
        """Whether several steps in one call pay (``steps_per_call: auto`` fuses them). Default ``True``; a backend
        that steps in Python anyway (torch) says ``False``: one step per call."""
        return True

    def resident_data(self) -> bool:
        """Whether it takes device-resident batches through `train_window` (a small in-memory training set lives on
        the device; docs/performance.md). Default ``False``."""
        return False

    def train_window(self, window: Any, n: int, step: int) -> Mapping[str, Any]:
        """`train` for device-resident data (with `resident_data`): `window` (a `pipekit_train.data.DeviceWindow`)
        is sliced inside the compiled call (``window.take(i)``, or ``window.stacked(n)`` for a chunk). Only called
        when `resident_data` says so."""
        raise NotImplementedError(f"{type(self).__name__} takes no device-resident data (resident_data is False)")

    def running(self) -> contextlib.AbstractContextManager[None]:
        """A context the engine runs the stage inside (torch's deterministic mode, thread settings). Default:
        nothing."""
        return contextlib.nullcontext()

    def engine_loop(self, loop: Any) -> Any:
        """The `TrainingLoop` the engine drives when it differs from the stage's (a sampler caps ``batch_size`` at
        the number of records: it takes no batches). Default: `loop` itself."""
        return loop

    # What the stage records --------------------------------------------------------------------------------------
    def optimizer_state(self) -> Any:
        """The final optimizer state, handed to the next stage's user code as `TrainerCarryState.opt_state`.
        Default ``None``."""
        return None

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this run besides `Backend.info` (parameter counts, a
        sampler's kernel). Default: nothing."""
        return {}

    def trainable_params(self) -> int | None:
        """How many of the model's parameters the optimizer trains, when not all of them (LoRA's adapters, frozen
        parameter groups): the model summary at the start of the stage shows it beside the total. Default ``None``:
        all of them."""
        return None

    def final_metrics(self, stage: str, stage_dir: str) -> dict[str, float]:
        """Metrics added when the stage completes (a sampler's posterior diagnostics). Default: none."""
        return {}

    # Continuing a finished stage (``pipekit-train extend``) ------------------------------------------------------
    def extend_from(self, restore: Callable[[Any], Mapping[str, Any]], previous: Any) -> None:
        """Start an extension of the finished stage `previous` (its `TrainingLoop`) from its final checkpoint.
        ``restore(like)`` reads that checkpoint's state into a tree shaped as `like` (``None``: as it was saved).
        Default: the whole state, shaped as now (``load_state_tree(restore(state_tree()))``); a sampler whose draw
        buffer grows with the stage reads it as saved and grows it."""
        self.load_state_tree(restore(self.state_tree()))

    def schedule_segment(self, start: int, restart: bool) -> None:
        """With the ``schedule_segment`` capability (``extend --new-segment``): the learning-rate schedule counts
        from `start`; with `restart`, the optimizer state's schedule count is set back to 0. The core calls it only
        for a backend that lists the capability."""
        raise NotImplementedError(f"{type(self).__name__} cannot start a new schedule segment")

    # Stopping early, and boundaries of its own: the sampler extension (``until``) --------------------------------
    def chunk_periods(self) -> list[int]:
        """Step periods a fused chunk must not cross, besides the engine's own (log, evaluation, checkpoint,
        epoch). Default: none."""
        return []

    def next_boundary(self, step: int) -> int | None:
        """The next step after `step` a chunk must end at, for boundaries not at multiples of a period (a sampler's
        convergence checks after its warm-up). Default ``None``: none."""
        return None

    def until_reached(self, step: int) -> bool:
        """Asked before every chunk (after a resume too): ``True`` ends the stage as completed before ``max_steps``.
        It must be a function of the state at `step`, so a resumed run decides the same. Default ``False``."""
        return False

    def progress_chains(self, step: int) -> str | None:
        """Text for the progress line (a sampler's chains: each one's phase and divergences), read without waiting
        for the device. Default ``None``: nothing."""
        return None


def _members(cls: type) -> tuple[str, ...]:
    return tuple(
        name for name in cls.__dict__ if not name.startswith("_") and name not in ("impl",)
    )  # in definition order


#: The members of `Backend` the core reads (``adapters/README.md`` lists them; tests/adapters/test_contract.py).
CONTRACT: tuple[str, ...] = _members(Backend)
#: The members of `StepBackend` the engine and the stage call, required and optional.
STEP_CONTRACT: tuple[str, ...] = _members(StepBackend)
