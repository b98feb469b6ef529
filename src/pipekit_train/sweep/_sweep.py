"""The `Sweep` operator: a pipeline, the fields to vary (a grid or distributions), the objective and the executor.

Only the shape of the configuration is checked here (no file is read, nothing is imported); `_plan.preflight`
checks the trials' pipelines before any trial runs.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Mapping
from typing import Any, Literal

from pipekit import ConfigError, Operator, field, suggestion

from ..callbacks._base import Callback, TrainContext

#: The distributions of ``sampler: random`` and ``sampler: optuna``, each ``{kind: arguments}``.
DISTRIBUTIONS = ("uniform", "log_uniform", "int", "choice")
SAMPLERS = ("grid", "random", "optuna")


class LocalExecutor(Operator, name="local"):
    """Where a sweep's trials run: on this machine (``executor: {type: local, workers: N}``).

    Attributes:
        workers: ``1``: one trial after another in the driver's process (compiled steps are reused across trials).
            ``N > 1`` (grid and random sweeps): up to N trials at once, each in a spawned worker process; the
            driver alone writes the journal and records the artifacts in the store.
    """

    workers: int = 1

    def validate(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"local.workers must be >= 1, got {self.workers}")


class RayExecutor(Operator, name="ray"):
    """Where a sweep's trials run: as Ray tasks (``executor: {type: ray, address: auto, resources_per_trial: {CPU:
    1}}``; the ``ray`` extra). Grid and random sweeps.

    Attributes:
        address: The Ray cluster: ``auto`` (the one this process is connected to; else the one ``$RAY_ADDRESS`` or
            ``ray start`` names, if it answers; else a private local instance, started for the sweep and stopped
            after it) or ``HOST:PORT`` (refused in one line when nothing answers there). `_executors.ray_address`.
        resources_per_trial: What each trial's task asks of Ray (``{CPU: 1}``, ``{GPU: 1}``, custom resources).
    """

    address: str = "auto"
    resources_per_trial: dict[str, float] = field(default_factory=lambda: {"CPU": 1})

    def validate(self) -> None:
        if not self.address:
            raise ConfigError("ray.address must be 'auto' or HOST:PORT, got ''")
        bad = [k for k, v in self.resources_per_trial.items() if not isinstance(v, (int, float)) or v < 0]
        if bad:
            raise ConfigError(f"ray.resources_per_trial.{bad[0]} must be a number >= 0")


class Sweep(Operator):
    """Train `pipeline` once per trial, each trial with some of its fields set, and rank the trials by `objective`.

    Attributes:
        name: The sweep's name: recorded in every trial's artifacts (``artifacts query --sweep NAME``).
        pipeline: The pipeline (a `TrainingLoop` or a `Sequential` of stages), inline, or the path of its YAML file
            (relative to the sweep's file when loaded from one, else to the working directory).
        grid: ``sampler: grid``: ``{field path: [values]}``; every combination is a trial. Field paths are written
            as ``--set`` writes them: ``optimizer_config.lr``, ``seed``, ``stages.1.max_steps``.
        space: ``sampler: random`` / ``optuna``: ``{field path: distribution}``, a distribution one of
            ``{uniform: [a, b]}``, ``{log_uniform: [a, b]}``, ``{int: [a, b]}`` (both ends included) or
            ``{choice: [v1, v2, ...]}``.
        sampler: ``grid``, ``random`` (seeded: trial ``i`` draws the same values on every run) or ``optuna``
            (Optuna's TPE; its study lives in ``optuna.sqlite`` in the sweep's run directory, so it resumes).
        trials: How many trials ``random`` and ``optuna`` run.
        seed: The sampler's seed.
        objective: ``{metric: NAME, mode: min|max}``: the final metric that ranks trials (of the last stage that
            logs it).
        prune: ``sampler: optuna``: stop a trial whose ``objective.metric`` at a validation is worse than Optuna's
            median pruner allows (``{warmup_steps: N, startup_trials: N}``); ``None``: no pruning.
        executor: ``{type: local, workers: 1}``: trials run one after another in this process (trials that differ
            only in numbers the step traces reuse its compiled program). ``workers: N`` (grid and random): up to N
            trials at once, each in a worker process (spawned); the driver alone writes the journal and the store.
    """

    name: str = "sweep"
    pipeline: Any = None
    grid: dict[str, list[Any]] | None = None
    space: dict[str, dict[str, Any]] | None = None
    sampler: Literal["grid", "random", "optuna"] = "grid"
    trials: int | None = None
    seed: int = 0
    objective: dict[str, str] = field(default_factory=lambda: {"metric": "validate/loss", "mode": "min"})
    prune: dict[str, int] | None = None
    executor: LocalExecutor | RayExecutor = field(default_factory=lambda: LocalExecutor())

    @classmethod
    def example(cls) -> Sweep:
        return cls(
            name="grid4",
            pipeline="pipeline.yaml",
            grid={"optimizer_config.lr": [0.003, 0.03], "seed": [0, 1]},
            objective={"metric": "validate/loss", "mode": "min"},
        )

    def validate(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ConfigError(f"Sweep.name must be letters, digits, '-', '_' or '.', got {self.name!r}")
        if self.pipeline is None or not isinstance(self.pipeline, (str, Operator)):
            raise ConfigError(
                f"Sweep.pipeline must be a pipeline (type: TrainingLoop / Sequential) or the path of its YAML file, "
                f"got {self.pipeline!r}"
            )
        if self.sampler == "grid":
            if not self.grid:
                raise ConfigError("Sweep.grid: sampler 'grid' needs {field path: [values, ...]}, got nothing")
            for path, values in self.grid.items():
                if not isinstance(values, list) or not values:
                    raise ConfigError(f"Sweep.grid.{path}: expected a non-empty list of values, got {values!r}")
            if self.space:
                raise ConfigError("Sweep.space is for sampler 'random' or 'optuna'; sampler 'grid' takes grid")
        else:
            if not self.space:
                raise ConfigError(
                    f"Sweep.space: sampler {self.sampler!r} needs {{field path: distribution}}, e.g. "
                    "{optimizer_config.lr: {log_uniform: [1e-4, 1e-1]}}"
                )
            if self.grid:
                raise ConfigError(f"Sweep.grid is for sampler 'grid'; sampler {self.sampler!r} takes space")
            if self.trials is None or self.trials < 1:
                raise ConfigError(f"Sweep.trials: sampler {self.sampler!r} needs trials >= 1, got {self.trials!r}")
            for path, dist in self.space.items():
                check_distribution(path, dist)
        metric, mode = self.objective.get("metric"), self.objective.get("mode", "min")
        unknown = sorted(set(self.objective) - {"metric", "mode"})
        if unknown:
            raise ConfigError(
                f"Sweep.objective: unknown key {unknown[0]!r}{suggestion(unknown[0], ['metric', 'mode'])}; "
                "expected {metric: NAME, mode: min|max}"
            )
        if not isinstance(metric, str) or "/" not in metric:
            raise ConfigError(f"Sweep.objective.metric must name a logged metric like 'validate/loss', got {metric!r}")
        if mode not in ("min", "max"):
            raise ConfigError(f"Sweep.objective.mode must be 'min' or 'max', got {mode!r}")
        if self.prune is not None:
            if self.sampler != "optuna":
                raise ConfigError(f"Sweep.prune works with sampler 'optuna' (Optuna's pruner), got {self.sampler!r}")
            bad = sorted(set(self.prune) - {"warmup_steps", "startup_trials"})
            if bad:
                raise ConfigError(
                    f"Sweep.prune: unknown key {bad[0]!r}"
                    f"{suggestion(bad[0], ['warmup_steps', 'startup_trials'])}; allowed: warmup_steps, startup_trials"
                )
            if not metric.startswith("validate/"):
                raise ConfigError(
                    f"Sweep.prune: trials are pruned at validations, so objective.metric must be a validate/ "
                    f"metric, got {metric!r}"
                )
        if self.parallel and self.sampler == "optuna":
            raise ConfigError(
                "Sweep.executor: sampler 'optuna' asks for one trial at a time here (executor: {type: local, "
                f"workers: 1}}); got {self.executor!r}"
            )

    @property
    def parallel(self) -> bool:
        """Whether trials run outside the driver's process (several workers, or Ray)."""
        return isinstance(self.executor, RayExecutor) or self.executor.workers > 1

    @property
    def mode(self) -> str:
        return self.objective.get("mode", "min")

    @property
    def metric(self) -> str:
        return self.objective["metric"]

    def run(self) -> Any:
        """Run every trial (in ``runs/sweeps/<name>``); the `SweepResult`."""
        from ._driver import run_sweep

        return run_sweep(self)


def check_distribution(path: str, dist: Any) -> None:
    """Refuse a distribution that is not one of `DISTRIBUTIONS` with arguments that fit it (one line)."""
    where = f"Sweep.space.{path}"
    if not isinstance(dist, Mapping) or len(dist) != 1:
        raise ConfigError(
            f"{where}: a distribution is one of {{uniform: [a, b]}}, {{log_uniform: [a, b]}}, {{int: [a, b]}}, "
            f"{{choice: [...]}}; got {dist!r}"
        )
    ((kind, args),) = dist.items()
    if kind not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {kind!r}{suggestion(kind, DISTRIBUTIONS)}")
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}: choice takes a non-empty list of values, got {args!r}")
        return
    numbers = isinstance(args, list) and len(args) == 2
    numbers = numbers and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    if not numbers or not args[0] < args[1]:
        raise ConfigError(f"{where}: {kind} takes [low, high] with low < high, got {args!r}")
    if kind == "int" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}: int takes two integers [low, high], got {args!r}")
    if kind == "log_uniform" and args[0] <= 0:
        raise ConfigError(f"{where}: log_uniform needs 0 < low, got {args!r}")
    if not all(math.isfinite(a) for a in args):
        raise ConfigError(f"{where}: {kind} bounds must be finite, got {args!r}")


#: The pruner of the trial running in this thread (``None`` outside one): ``report(step, value) -> prune?``.
ACTIVE_PRUNER: contextvars.ContextVar[Any] = contextvars.ContextVar("pipekit_sweep_pruner", default=None)


class SweepPruning(Callback):
    """Reports `metric` at each validation to the sweep's pruner and stops the stage when the pruner says so.

    A sweep with ``prune:`` adds it to the last training stage of each trial. Outside a sweep's trial it does
    nothing, so a recorded trial's pipeline reproduces as an ordinary run. Not part of the resume fingerprint.
    A trial resumed from the checkpoint its pruning stop wrote (the driver was killed before the stage ended)
    stops again at once, at the same step with the same status, as any stage a callback stopped does.

    Args:
        metric: The validation metric reported to the pruner at each validation.
    """

    metric: str = "validate/loss"

    def fingerprint(self) -> None:
        return None

    def on_eval_end(self, ctx: TrainContext, metrics: Mapping[str, float]) -> None:
        pruner = ACTIVE_PRUNER.get()
        if pruner is None or self.metric not in metrics:
            return
        if pruner.report(int(ctx.step), float(metrics[self.metric])):
            ctx.request_stop(self._reason(ctx.step, float(metrics[self.metric])))

    def _reason(self, step: int, value: float) -> str:
        return f"pruned by the sweep at step {step}: {self.metric}={value:.6g}"
