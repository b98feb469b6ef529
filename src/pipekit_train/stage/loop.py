"""`TrainerCarryState` and `TrainingLoop`: the training stage of a pipeline and what it hands the next stage."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import pipekit
from pipekit import CarryState, ConfigError, StatefulOperator, field

from ..backends._model import ModelOp, Transfer
from ..backends._registry import check_backend_name, get_backend
from ..backends._shared import stage_name as stage_name
from ..callbacks._base import Callback
from ..data._dataset import TrainingDataset
from ..losses._function import as_loss
from ..losses._loss import Loss
from ..optim._recipes import GradientRule, ParamGroup
from ..tracking._metrics import Metric
from ..tracking._writers import MetricWriter
from .presets import fill_from_preset

if TYPE_CHECKING:
    from ..backends._contract import Backend


class TrainerCarryState(CarryState):
    """Carry-state for `TrainingLoop`: what one stage hands the next.

    Attributes:
        model: The model operator, bound to its current weights.
        opt_state: The optimizer state the stage ended with, for user code in this process (an optax state for
            Equinox). Every stage starts its own optimizer fresh, and a resumed run that skips a finished stage
            does not restore it (``None`` then).
        step: Optimizer steps taken by the stage that produced this state.
        epoch: ``step // steps_per_epoch`` (without it, ``step //`` the training set's batches per epoch).
        metrics: Final metric snapshot of that stage (host floats).
        rng: The stage's PRNG seed material (``jax.random.key_data`` as a list, or ``None``).
        run_id: The run this state belongs to; later stages of a `Sequential` share it.
        run_dir: Directory of the run's files.
        stage_index: How many training stages have run before the next one.
        artifact_id: The artifact recorded for the stage that produced this state (the next stage's parent).
        checkpoint_dir: Where that stage's checkpoints are (``None`` without a `Checkpoint` callback): what the
            next stage's `TrainingLoop.carry` reads its final optimizer state and EMA weights from.
        has_ema: Whether that stage kept EMA weights (an `EMA` callback).
        carried: For a next stage with `TrainingLoop.carry`: that stage's final checkpoint as saved (``params``,
            ``opt_state``, maybe ``ema``), read by the core just before `Backend.start`; else ``None``. Not
            written by `to_dict` (the checkpoint is where it lives).
    """

    def __init__(
        self,
        model: ModelOp | None = None,
        opt_state: Any = None,
        step: int = 0,
        epoch: int = 0,
        metrics: dict[str, float] | None = None,
        rng: Any = None,
        run_id: str | None = None,
        run_dir: str | None = None,
        stage_index: int = 0,
        artifact_id: str | None = None,
        checkpoint_dir: str | None = None,
        has_ema: bool = False,
        carried: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.opt_state = opt_state
        self.step = step
        self.epoch = epoch
        self.metrics = metrics or {}
        self.rng = rng
        self.run_id = run_id
        self.run_dir = run_dir
        self.stage_index = stage_index
        self.artifact_id = artifact_id
        self.checkpoint_dir = checkpoint_dir
        self.has_ema = has_ema
        self.carried = carried

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the model as its YAML, optimizer state and weights left to checkpoints."""
        data = super().to_dict()
        data["model"] = pipekit.dumps(self.model) if self.model is not None else None
        data["opt_state"] = None
        data["carried"] = None
        return data

    @classmethod
    def from_dict(cls, data: Any) -> TrainerCarryState:
        data = dict(data)
        if isinstance(data.get("model"), str):
            data["model"] = pipekit.loads(data["model"])
        return super().from_dict(data)  # type: ignore[return-value]


class TrainingResult(NamedTuple):
    """What `TrainingLoop.run()` (and a `Sequential` ending in one) returns: ``model, artifact = result``."""

    model: ModelOp
    artifact: Any


@dataclass
class RunInfo:
    """Where and how a stage runs; shared by the stages of one pipeline run."""

    run_id: str
    run_dir: str
    stage: str
    stage_index: int
    parent_ids: tuple[str, ...] = ()
    stage_dir: str = ""


#: The largest step count or batch size a `TrainingLoop` accepts: JAX (without x64) and optax count steps in int32.
MAX_COUNT = 2**31 - 1
_OPTIONAL_COUNTS = ("steps_per_epoch", "eval_batch_size")
_COUNTS = (
    "max_steps",
    "batch_size",
    "eval_every_n_steps",
    "log_every_n_steps",
    "accum",
    "steps_per_call",
    *_OPTIONAL_COUNTS,
)


class TrainingLoop(StatefulOperator):
    """Train `model_op` on `dataset`, producing a trained model operator and an artifact.

    Every field is documented in ``docs/yaml.md``. The stage runs on the backend adapter named by `backend` (any
    name registered in the ``pipekit_train.backends`` entry-point group or with `register_backend`).

    Attributes:
        model_op: The architecture: a model operator of the stage's backend (`EquinoxModel`, `KerasModel`,
            `NumpyroModel`, ...).
        dataset: The training data, a `TrainingDataset` (docs/datasets.md).
        val_dataset: Evaluated every `eval_every_n_steps` steps and at the end, logged under `validate`.
        loss: A `Loss` operator (`MSE`, `CrossEntropy`, `Composite`, your own subclass) or, from Python, any
            callable ``loss(predicted, target)`` (wrapped in a `LossFunction`, which has no YAML form); set `loss`
            or `task`, not both.
        task: A backend-native objective instead of `loss`: a sampler kernel (`NUTS`, `HMC`, `MALA`; in YAML too)
            or an Equinox `TrainTask` (Python only).
        optimizer_config: The optimizer, its schedule and their settings (design/optimizers.md).
        max_steps: Optimizer steps (iterations, for samplers) the stage runs.
        steps_per_epoch: How many steps make an epoch (for `epoch` in records and `on_epoch_end`); null: `epoch`
            counts passes over the training set (its batches per epoch) and `on_epoch_end` is not called.
        batch_size: Records per step: the global batch, split over the stage's devices (docs/scale.md); unused by
            samplers, which take the data whole (docs/bayesian.md).
        backend: The backend that trains the stage: any installed or registered name
            (`pipekit_train.available_backends()`); null: the model operator's own backend.
        callbacks: `Checkpoint`, `EarlyStopping`, `ReduceLROnPlateau`, `EMA`, trackers, your own.
        metric_writer: Where records go; null writes `metrics.jsonl` in the stage directory (a `JsonLinesWriter`);
            or `ConsoleWriter`, `TensorBoardWriter`, a `MultiWriter` of several.
        eval_every_n_steps: Validation cadence.
        log_every_n_steps: How many steps one train record averages.
        checkpoint_dir: Where the `Checkpoint` callback writes; null: `<stage dir>/checkpoints`.
        seed: The stage's randomness: initial weights, data order, per-step keys.
        name: The stage name: the run directory's sub-folder, the artifact's stage; null: `stage<i>`.
        input_key: Which batch entry is the model input.
        target_key: Which batch entry is the loss target.
        test_dataset: Evaluated once at the end, logged under `test`.
        eval_batch_size: Batch size of validation and test passes; null: `batch_size`.
        metrics: Whole-split metrics (`Accuracy`, `PrecisionRecallF1`, `MAE`, your own `Metric`) computed at every
            validation and at the test pass, next to the loss (docs/metrics.md).
        transfer: How weights from the previous stage enter this stage's model (below).
        carry: What else to take from the previous stage: ``{optimizer_state: true}`` continues its optimizer
            state, ``{weights: ema}`` starts from its EMA weights (``params``: its raw parameters; ``returned``,
            the default: the model it returned). Read from its final checkpoint (docs/recipes.md).
        accum: Gradient accumulation: one optimizer update every `accum` steps (`optax.MultiSteps`).
        grad_clip_norm: Clip gradients to this global norm.
        steps_per_call: `auto`: fuse every step between two boundaries (log, eval, checkpoint, epoch end, a
            callback that needs the host every step) into one compiled call (`lax.scan`), up to a cap; an int:
            at most this many steps per call. Callbacks still see every step (docs/performance.md).
        stop_on_nonfinite: Stop with an error naming the step when the loss or the weights become NaN or infinite.
        progress: A progress bar on a terminal, plain lines in logs or when `CI` is set (docs/metrics.md).
        resume: `auto`: continue the run in the run directory exactly (see checkpoints.md).
        init_from: Start from another run's checkpoint weights (weights only).
        restore_best: Return the best checkpoint's weights instead of the last ones.
        mesh: Data parallel: ``{devices: N or all, shard_params: false}``; null: every local device, parameters
            replicated (docs/scale.md).
        precision: Mixed precision: ``{compute: bfloat16, params: float32}``; null: float32 throughout
            (docs/scale.md).
        gradient: A gradient rule: `SAM` (``{type: SAM, rho: 0.05, adaptive: false}``); null: the plain gradient
            (docs/recipes.md).
        param_groups: Parameters chosen by path pattern (`ParamGroup`: ``encoder.*``, ``*.bias``), each with its own
            learning-rate scale, weight decay, L2-SP or freezing (docs/recipes.md).
        diagnostics: Log gradient norm, parameter norm and update/parameter ratio, globally and per group,
            computed in the step (docs/recipes.md).
        preset: A named set of fields (``finetune-small``, ``pretrain-autoencoder``, ``linear-probe``, or one
            added with `register_preset`) that fills every field the stage does not set; never overrides a set one
            (docs/recipes.md).
    """

    model_op: ModelOp
    dataset: TrainingDataset
    val_dataset: TrainingDataset | None = None
    loss: Loss | None = None
    task: Any = None
    optimizer_config: dict[str, Any] = field(default_factory=lambda: {"name": "adamw", "lr": 3e-4})
    max_steps: int = 10_000
    steps_per_epoch: int | None = None
    batch_size: int = 32
    backend: str | None = None
    callbacks: tuple[Callback, ...] = ()
    metric_writer: MetricWriter | None = None
    eval_every_n_steps: int = 500
    log_every_n_steps: int = 100
    checkpoint_dir: str | None = None
    seed: int = 0
    name: str | None = None
    input_key: str = "x"
    target_key: str = "y"
    test_dataset: TrainingDataset | None = None
    eval_batch_size: int | None = None
    metrics: tuple[Metric, ...] = ()
    transfer: Transfer | None = None
    carry: dict[str, Any] | None = None
    accum: int = 1
    grad_clip_norm: float | None = None
    steps_per_call: int | Literal["auto"] = "auto"
    stop_on_nonfinite: bool = True
    progress: bool = True
    resume: Literal["never", "auto"] = "never"
    init_from: str | None = None
    restore_best: bool = False
    mesh: dict[str, Any] | None = None
    precision: dict[str, Any] | None = None
    gradient: GradientRule | None = None
    param_groups: tuple[ParamGroup, ...] = ()
    diagnostics: bool = False
    preset: str | None = None

    def validate(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if value is None or value == "auto":
                continue
            also = " or auto" if name == "steps_per_call" else " or null" if name in _OPTIONAL_COUNTS else ""
            if value <= 0:
                raise ConfigError(f"TrainingLoop.{name} must be a positive int{also}, got {value}")
            if value > MAX_COUNT:
                raise ConfigError(
                    f"TrainingLoop.{name} must be at most {MAX_COUNT} (2**31 - 1: steps and batch sizes are 32-bit "
                    f"ints in the compiled step and the optimizer's step count), got {value}"
                )
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ConfigError(f"TrainingLoop.grad_clip_norm must be positive or null, got {self.grad_clip_norm}")
        if self.loss is None and self.task is None:
            raise ConfigError("TrainingLoop needs a `loss` (or a backend-native `task`); both are null")
        if self.loss is not None and self.task is not None:
            raise ConfigError(
                f"TrainingLoop has both a loss ({self.loss!r}) and a task ({type(self.task).__name__}); a task "
                "computes its own loss: set one of them"
            )
        if self.name is not None and not self.name.replace("-", "_").isidentifier():
            raise ConfigError(f"TrainingLoop.name must be a simple name (letters, digits, _ or -), got {self.name!r}")
        if self.backend is None:  # the model operator's own backend (a frozen operator: set once, here)
            object.__setattr__(self, "backend", getattr(self.model_op, "backend", None) or None)
            if self.backend is None:
                raise ConfigError(
                    f"TrainingLoop.backend is null and the model operator {self.model_op!r} names no backend; set "
                    "backend: to an installed one (pipekit_train.available_backends())"
                )
        check_backend_name(self.backend)
        from ..backends._carry import carry_settings

        carry_settings(self.carry)
        from ..optim._config import resolve_optimizer_config

        resolve_optimizer_config(self.optimizer_config)  # keys, names and values now, with the file position
        from ..scale._mesh import mesh_settings
        from ..scale._precision import compute_dtype

        mesh_settings(self.mesh)
        compute_dtype(self.precision)
        for i, group in enumerate(self.param_groups):
            if group.unfreeze_at is not None and group.unfreeze_at >= self.max_steps:
                raise ConfigError(
                    f"TrainingLoop.param_groups[{i}].unfreeze_at ({group.unfreeze_at}) must be < max_steps "
                    f"({self.max_steps}): the group would never train"
                )
        model_backend = getattr(self.model_op, "backend", "")
        if model_backend and model_backend != self.backend:
            raise ConfigError(
                f"TrainingLoop.model_op is {self.model_op!r}, a model of backend {model_backend!r}, but "
                f"TrainingLoop.backend is {self.backend!r}; set backend: {model_backend} or choose a model of "
                f"backend {self.backend!r}"
            )

    @classmethod
    def fill_fields(cls, given: dict[str, Any]) -> dict[str, Any]:
        """`preset` fills every field the call (or the file) leaves out (`Operator.fill_fields`; docs/recipes.md);
        a `loss` given as a plain callable becomes a `LossFunction` (`as_loss`)."""
        if "loss" in given:
            given = {**given, "loss": as_loss(given["loss"], "TrainingLoop.loss")}
        return fill_from_preset(given)

    def non_default_fields(self) -> dict[str, Any]:
        """The fields a file must spell out: with a `preset`, those that differ from what the preset gives."""
        from .presets import explicit_fields

        fields = explicit_fields(self, super().non_default_fields())
        if fields.get("backend") == getattr(self.model_op, "backend", None):
            del fields["backend"]  # the default: the model operator's backend
        return fields

    def replace(self, **changes: Any) -> TrainingLoop:
        """A copy with some fields changed; a new `preset` fills again the fields the old one filled."""
        if "preset" in changes and changes["preset"] != self.preset:
            from .presets import replace_with_preset

            return replace_with_preset(self, changes)
        if (
            "model_op" in changes
            and "backend" not in changes
            and self.backend == getattr(self.model_op, "backend", None)
        ):
            changes = {**changes, "backend": None}  # it followed the model: it follows the new one
        return super().replace(**changes)

    @classmethod
    def example(cls) -> TrainingLoop:
        from ..data import NpzSource
        from ..losses._builtin import MSE

        return cls(
            model_op=_example_model(),
            dataset=TrainingDataset(source=NpzSource(path="data/train.npz")),
            loss=MSE(),
            optimizer_config={"name": "sgd", "lr": 0.1, "momentum": 0.9},
            max_steps=20,
            callbacks=(),
            name="pretrain",
        )

    # Settings given as callbacks (design/overview.md: why they stay callbacks) ------------------------------
    @property
    def ema_settings(self) -> Any:
        """The stage's `EMA` callback (its decay, warm-up, which weights evaluate and return), or ``None``."""
        from ..callbacks._controls import EMA

        return next((cb for cb in self.callbacks if isinstance(cb, EMA)), None)

    @property
    def checkpoint_settings(self) -> Any:
        """The stage's `Checkpoint` callback (cadence, retention, layout), or ``None``: no checkpoints."""
        from ..checkpoint._settings import Checkpoint

        return next((cb for cb in self.callbacks if isinstance(cb, Checkpoint)), None)

    def checkpoint_directory(self, stage_dir: str) -> str:
        """Where the stage's checkpoints are: `checkpoint_dir`, else ``checkpoints/`` in its stage folder."""
        return self.checkpoint_dir or os.path.join(stage_dir, "checkpoints")

    # Running -----------------------------------------------------------------------------------------------
    def adapter(self) -> Backend:
        """The backend object for `backend` (the contract: ``adapters/README.md``)."""
        return get_backend(str(self.backend))  # set by `validate` (null: the model operator's backend)

    def initial_state(self) -> TrainerCarryState | None:
        """``None``: a stage run first starts fresh; a later stage of a `Sequential` gets the previous stage's state."""
        return None

    def _apply(self, carrier: Any, state: TrainerCarryState | None) -> tuple[TrainingResult, TrainerCarryState]:
        from .driver import run_stage
        from .settings import current_settings

        return run_stage(self, state, current_settings())  # `run_settings`: the Python API's channel

    def run(self) -> TrainingResult:  # type: ignore[override]
        """Train from scratch (or resume), returning ``(trained_model_op, artifact)``."""
        return self._apply(None, self.initial_state())[0]


def _example_model() -> ModelOp:
    """The example model of the first installed backend (by name) that trains weights: the core names none."""
    from ..backends._registry import BackendError, available_backends

    for name in available_backends():
        try:
            backend = get_backend(name)
        except (BackendError, ImportError):
            continue
        model = backend.example_model(4, 1) if "weights" in backend.capabilities else None
        if model is not None:
            return model
    raise ConfigError("TrainingLoop.example: no installed backend trains weights and has an example_model")
