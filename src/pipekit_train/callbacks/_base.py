"""Callbacks: user code that runs at documented points of a training run.

A callback is an operator: its fields are its configuration and it is written to YAML with the pipeline. What
changes during a run (counters, best scores) lives in ``ctx.state_of(self)``, a JSON-able dict that the loop keeps
for each callback and saves in every checkpoint, so a resumed run continues the callback exactly.

Hooks, in the order a run calls them:

- ``on_train_start(ctx)``: once, after the model, optimizer and data are ready (and after a resume).
- ``on_step_end(ctx, metrics)``: after every optimizer step. ``metrics`` maps names to scalars that may still be on
  the device; reading one (``float(metrics["loss"])``) waits for the step, so read only when you need to. Fused
  steps (``steps_per_call``) are reported one by one after their compiled call, as host values; see
  `Callback.needs_every_step` and `Callback.observes_only`.
- ``on_eval_end(ctx, metrics)``: after each validation pass, with host floats named ``validate/<metric>``.
- ``on_epoch_end(ctx)``: when ``step`` crosses a multiple of ``steps_per_epoch``.
- ``on_checkpoint(ctx, step)``: after a checkpoint of ``step`` was handed to the checkpointer.
- ``on_log(ctx, record)``: every record the loop sends to its metric writer (parameters, ``train`` / ``validate`` /
  ``test`` / ``time`` metrics, phases, the finish line), with the same names and values the writer gets.
- ``on_phase_start(ctx, phase)``: before a phase that may take long runs: ``compiling`` (before the first
  dispatch of each chunk length), ``evaluating``, ``checkpointing``; ``stepping`` when one of them did nothing.
- ``on_phase(ctx, phase, duration_s)``: when a phase ends: ``compiling``, ``stepping``, ``evaluating``,
  ``checkpointing``, then ``done`` or ``failed`` (with the stage's whole duration).
- ``on_train_end(ctx)``: once, when the run ends normally or by a requested stop.
- ``on_exception(ctx, exc)``: when the run fails; the exception is re-raised afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from pipekit import Operator


class RecordWriter(Protocol):
    """Where `TrainContext.writer` sends a record (a `pipekit_train.tracking.MetricWriter`)."""

    def write(self, record: dict[str, Any]) -> None: ...


class Callback(Operator, register=False):
    """Base class of callbacks. Subclasses are registered operators: give them fields, override hooks.

    Args:
        order: Where the callback runs among the others at each hook: lower runs earlier (EMA, -10, swaps the
            weights before the others see them).
    """

    #: Lower runs earlier. Callbacks that change what others see (EMA swapping weights) run first.
    order: int = 0

    #: Whether `on_step_end` needs the host after each single step (to stop the run at that step, or to read or
    #: replace the model as it is then): `TrainingLoop.steps_per_call: auto` then runs one step per compiled call.
    #: ``False`` keeps the steps fused: the callback is still called for every step, in order, at the end of the
    #: chunk, before anything else happens there (a stop it requests ends the stage at the chunk's end).
    #: ``None`` (the default) infers it with `observes_only` (docs/callbacks.md, "Every step, fused").
    needs_every_step: ClassVar[bool | None] = None

    #: Whether `on_step_end` only observes: it reads the metrics and the step, keeps its state, writes records,
    #: and never stops the run, raises, reads or replaces the model or changes the learning rate. ``True`` keeps
    #: the steps fused and lets the loop call it for a chunk's steps while the next chunk runs, with host values.
    #: ``None`` (the default) infers it from the source of `on_step_end` (``pipekit_train.callbacks._observing``);
    #: a callback that overrides it and is not shown to only observe needs every step.
    observes_only: ClassVar[bool | None] = None

    @classmethod
    def frozen_message(cls, name: str) -> str:
        """What a hook that assigns ``self.NAME = ...`` is told: a callback is configuration; what changes during
        a run is its state (`initial_state`, `TrainContext.state_of`), which checkpoints save and resumes restore."""
        owner = cls._pipekit_name or cls.__name__
        return (
            f"callback {owner} assigned self.{name}, but a callback is frozen (its fields are its configuration): "
            f"keep what changes during a run in its state, ctx.state_of(self)[{name!r}] = ... (start it in "
            "initial_state(); checkpoints save it and a resume restores it)"
        )

    def initial_state(self) -> dict[str, Any]:
        """The JSON-able run-time state this callback starts a run with."""
        return {}

    def fingerprint(self) -> Any:
        """What of this callback a resumed run must share with the checkpoint for the result to be exact.

        The default is the whole configuration. A callback that only observes (a tracker, a logger) returns
        ``None``, so changing it does not refuse a resume.
        """
        from pipekit._yaml import to_plain

        return to_plain(self, strict=False)

    def on_train_start(self, ctx: TrainContext) -> None:
        """Called once when training starts (or resumes)."""

    def on_step_end(self, ctx: TrainContext, metrics: Mapping[str, Any]) -> None:
        """Called after every optimizer step."""

    def on_eval_end(self, ctx: TrainContext, metrics: Mapping[str, float]) -> None:
        """Called after every validation pass."""

    def on_epoch_end(self, ctx: TrainContext) -> None:
        """Called at each epoch boundary."""

    def on_checkpoint(self, ctx: TrainContext, step: int) -> None:
        """Called after a checkpoint of `step` is written (or queued, when saving asynchronously)."""

    def on_log(self, ctx: TrainContext, record: Mapping[str, Any]) -> None:
        """Called with every record the loop writes (docs/metrics.md lists the names)."""

    def on_phase_start(self, ctx: TrainContext, phase: str) -> None:
        """Called when a phase that may take long starts, before it runs: ``compiling`` (before the first dispatch
        of each chunk length: JAX may have the program already, then ``stepping`` starts instead of a
        ``compiling`` end), ``evaluating``, ``checkpointing`` (a checkpoint retention does not keep: ``stepping``
        next). Every end of those three (`on_phase`) has its start before it."""

    def on_phase(self, ctx: TrainContext, phase: str, duration_s: float) -> None:
        """Called when a phase ends (``compiling``, ``stepping``, ``evaluating``, ``checkpointing``, ``done``,
        ``failed``), with its wall-clock duration in seconds."""

    def on_train_end(self, ctx: TrainContext) -> None:
        """Called once at the end of a run."""

    def on_exception(self, ctx: TrainContext, exc: BaseException) -> None:
        """Called when the run fails, before the exception propagates."""


#: The keys of `TrainContext.artifact_fields` that are fields of the artifact itself; any other goes to ``user``.
ARTIFACT_KEYS = ("tracker_run_id", "model_registry_uri", "trained_model_hash", "model_summary")


class ArtifactFields(dict[str, Any]):
    """`TrainContext.artifact_fields`: a dict whose values must be JSON data, checked when they are set.

    Example:
        >>> fields = ArtifactFields()
        >>> fields["dataset_version"] = "v3"
        >>> fields["scaler"] = object()
        Traceback (most recent call last):
        ...
        TypeError: ctx.artifact_fields['scaler'] must be JSON data (...) ..., got object: ...
    """

    def __setitem__(self, key: str, value: Any) -> None:
        import json

        if not isinstance(key, str) or not key:
            raise TypeError(f"ctx.artifact_fields keys must be non-empty strings, got {key!r}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"ctx.artifact_fields[{key!r}] must be JSON data (a dict with string keys, list, str, int, float, "
                f"bool or None) to go into the stage's artifact, got {type(value).__name__}: {e}"
            ) from None
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]  # every value is checked
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


class TrainContext:
    """What a callback sees of a running `TrainingLoop`. Built by the loop; callbacks do not construct it.

    Attributes:
        loop: The `TrainingLoop` operator being run.
        stage: The stage name (``"stage0"``, or the loop's `name`).
        run_id: Identifier of this run (stable across resumes).
        run_dir: Directory of this stage's files (metrics, checkpoints), or ``None``.
        step: Optimizer steps taken so far in this stage.
        epoch: ``step // steps_per_epoch``; without `steps_per_epoch`, ``step //`` the training set's batches per epoch.
        writer: The metric writer; ``ctx.writer.write({...})`` adds a record.
        artifact_fields: Values that callbacks contribute to the stage's artifact: the artifact's own fields
            (``tracker_run_id``, ``model_registry_uri``, ``trained_model_hash``, ``model_summary``), and any other
            key, which the artifact keeps in its ``user`` mapping. A value must be JSON data (checked when set).
        stop_reason: ``None`` while running; the reason once a stop was requested.
        last_eval: The metrics of the latest validation pass.
    """

    def __init__(
        self,
        *,
        loop: Any,
        stage: str,
        run_id: str,
        run_dir: str | None,
        writer: RecordWriter,
        callback_states: dict[str, dict[str, Any]],
        callbacks: tuple[Callback, ...],
        get_model: Any,
        set_model: Any = None,
        lr_scale: Any = None,
    ) -> None:
        self.loop = loop
        self.stage = stage
        self.run_id = run_id
        self.run_dir = run_dir
        self.writer = writer
        self.step = 0
        self.epoch = 0
        self.stop_reason: str | None = None
        self.last_eval: dict[str, float] = {}
        self.artifact_fields: dict[str, Any] = ArtifactFields()
        self._states = callback_states
        self._index = {id(cb): key for cb, key in zip(callbacks, callback_states)}
        self._get_model = get_model
        self._set_model = set_model
        self._lr_scale = lr_scale

    def state_of(self, callback: Callback) -> dict[str, Any]:
        """The mutable, checkpointed run-time state of `callback` (a JSON-able dict)."""
        return self._states[self._index[id(callback)]]

    @property
    def model(self) -> Any:
        """The model the stage would return if it ended now, bound to host copies of its weights: the weights
        being trained, or their moving average when an `EMA` callback has ``return_ema`` (the default). What
        `RegisterModel` stores and the artifact's ``trained_model_hash`` names at the end is this model."""
        return self._get_model()

    def set_model(self, model_op: Any) -> None:
        """Replace the weights being trained (used by weight-averaging callbacks); the structure must match."""
        if self._set_model is None:
            raise RuntimeError("this backend does not let callbacks replace the model")
        self._set_model(model_op)

    def request_stop(self, reason: str) -> None:
        """Ask the loop to stop after the current step; the first reason given is recorded."""
        if self.stop_reason is None:
            self.stop_reason = reason

    @property
    def lr_scale(self) -> float:
        """The multiplier applied to the learning rate schedule (1.0 unless a plateau callback lowered it)."""
        return float(self._lr_scale.get()) if self._lr_scale is not None else 1.0

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        if self._lr_scale is None:
            raise RuntimeError("this backend does not support changing the learning rate during a run")
        self._lr_scale.set(float(value))
