"""The learning-rate finder: an exponential sweep of the learning rate over a copy of one training stage.

`lr_find` steps the stage's own compiled train step (the backend's `StepBackend`, the same model, loss, data,
optimizer, parameter groups, mesh and precision) with the learning rate growing geometrically from `min_lr` to
`max_lr`, one optimizer step per rate, and stops early when the smoothed loss exceeds `divergence` times the best
one or stops being finite. The rate is set each step through the run-time learning-rate multiplier that
`ReduceLROnPlateau` uses (`StepBackend.set_lr_scale`) on a constant schedule of 1.0, so the step compiles once.

Nothing is recorded: no run directory, no checkpoint, no artifact. A later stage of a pipeline starts from what
the stages before it hand on: read from a finished run (`from_run`), or trained first in a temporary directory.

The suggestion is the rate where the smoothed loss falls fastest (the steepest descent against ``log(lr)``,
before the minimum); when the curve has no clear descent it falls back to a tenth of the rate at the minimum, and
`LRFindResult.method` says which.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipekit import ConfigError, Operator, suggestion

__all__ = ["LRFindResult", "lr_find", "select_stage"]

_SCHEDULE_KEYS = ("schedule", "warmup_steps", "decay_steps", "end_lr", "decay_rate")


@dataclass(frozen=True)
class LRFindResult:
    """What `lr_find` measured.

    Attributes:
        stage: The stage swept.
        lrs: The learning rate of each step taken.
        losses: The training loss of each step (the batch's loss before that step's update).
        smoothed: The exponentially smoothed loss (bias-corrected, like Adam's moments).
        suggestion: The suggested learning rate.
        method: ``"steepest"`` (where the smoothed loss falls fastest) or ``"min/10"`` (a tenth of the rate at the
            lowest smoothed loss, when there is no clear descent).
        stop_reason: Why the sweep ended: ``"reached max_lr"``, or the step where the loss diverged.
        notes: What the sweep changed in the stage's configuration to run (gradual unfreezing, earlier stages).
    """

    stage: str
    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    suggestion: float
    method: Literal["steepest", "min/10"]
    stop_reason: str
    notes: tuple[str, ...] = ()

    def table(self, rows: int = 20) -> str:
        """A table of about `rows` evenly spaced steps of the sweep, the suggestion's row marked."""
        n = len(self.lrs)
        picked = sorted(set(np.linspace(0, n - 1, min(rows, n)).round().astype(int).tolist()))
        skip = max(1, n // 10)
        best = skip + int(np.argmin(self.smoothed[skip:])) if n > skip else int(np.argmin(self.smoothed))
        mark = int(np.argmin(np.abs(np.log(np.asarray(self.lrs)) - math.log(self.suggestion))))
        picked = sorted({*picked, best, mark} & set(range(n)))
        lines = [f"{'step':>5} {'lr':>10} {'loss':>11} {'smoothed':>11}"]
        for i in picked:
            note = "  <- suggested" if i == mark else ("  <- lowest" if i == best else "")
            lines.append(f"{i:>5} {self.lrs[i]:>10.3g} {self.losses[i]:>11.5g} {self.smoothed[i]:>11.5g}{note}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Draw the loss against the learning rate (log axis) into `path` (PNG); needs the ``plot`` extra."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise ConfigError(
                "lr-find --plot needs matplotlib: pip install 'pipekit-train[plot]' (the table above has the "
                "same numbers)"
            ) from None
        fig = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(self.lrs, self.losses, color="0.7", linewidth=1, label="loss")
        ax.plot(self.lrs, self.smoothed, color="C0", linewidth=2, label="smoothed")
        ax.axvline(
            self.suggestion, color="C3", linestyle="--", label=f"suggested {self.suggestion:.3g} ({self.method})"
        )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        # From the lowest loss seen to a little above where the curve starts: the divergence leaves the frame.
        low = min(min(self.losses), min(self.smoothed))
        high = max(self.smoothed[: max(1, len(self.smoothed) // 10)])
        span = max(high - low, 1e-12)
        ax.set_ylim(low - 0.05 * span, high + 0.3 * span)
        ax.set_title(f"lr-find: stage {self.stage!r}")
        ax.legend()
        fig.tight_layout()
        out = os.fspath(path)
        fig.savefig(out, format="png", dpi=100)
        return out


def _training_stages(op: Operator) -> list[Any]:
    from ..stage.preflight import training_stages

    return training_stages(op)


def select_stage(op: Operator, stage: int | str | None) -> tuple[int, list[Any]]:
    """The index of the training stage `stage` names (its position or its name) among `op`'s, and them all."""
    loops = _training_stages(op)
    if not loops:
        raise ConfigError(f"lr-find needs a TrainingLoop, but the pipeline has none ({type(op).__name__})")
    names = [loop.name or f"stage{i}" for i, loop in enumerate(loops)]
    listing = ", ".join(f"{i}: {n}" for i, n in enumerate(names))
    if stage is None:
        return 0, loops
    if isinstance(stage, str) and stage.lstrip("-").isdigit():
        stage = int(stage)
    if isinstance(stage, int):
        if not 0 <= stage < len(loops):
            raise ConfigError(
                f"--stage {stage} is out of range: the pipeline has {len(loops)} training stage(s) ({listing})"
            )
        return stage, loops
    if stage not in names:
        raise ConfigError(
            f"--stage {stage!r}: no training stage has that name{suggestion(stage, names)}; stages: {listing}"
        )
    return names.index(stage), loops


def _sweep_copy(loop: Any, steps: int) -> tuple[Any, list[str]]:
    """The stage as the sweep runs it: a constant learning rate of 1.0 (the multiplier sets the rate), `steps`
    steps, no callbacks, no `carry` or `init_from`, and groups that unfreeze later training from the start."""
    from ..optim._recipes import ParamGroup

    notes = []
    config = {k: v for k, v in loop.optimizer_config.items() if k not in _SCHEDULE_KEYS}
    config.update(lr=1.0, schedule="constant")
    groups: list[ParamGroup] = []
    for group in loop.param_groups:
        if group.unfreeze_at is not None:
            notes.append(
                f"param group {group.label!r} unfreezes at step {group.unfreeze_at} in the stage; it trains from the "
                "sweep's first step"
            )
            group = group.replace(frozen=False, unfreeze_at=None)
        groups.append(group)
    copy = loop.replace(
        optimizer_config=config,
        max_steps=steps,
        callbacks=(),
        param_groups=tuple(groups),
        steps_per_call=1,
        init_from=None,
        restore_best=False,
        resume="never",
        progress=False,
        carry=None,
    )
    if loop.carry:
        notes.append(
            f"carry {loop.carry} is not applied: the sweep starts from the model the previous stage returned, with "
            "a fresh optimizer"
        )
    if loop.init_from:
        notes.append(f"init_from {loop.init_from!r} is not read: the sweep starts from the stage's own start")
    return copy, notes


def _incoming(loops: list[Any], index: int, from_run: str | None) -> tuple[Any, list[str]]:
    """The carry-state stage `index` starts from: None for the first; else read from `from_run`'s finished
    stages, or made by training the earlier stages in a temporary directory (recording nothing)."""
    if index == 0:
        return None, []
    from .._jsonio import read_json
    from ..stage.driver import run_stage
    from ..stage.loop import RunInfo
    from ..stage.recorded import finished_stage
    from ..stage.settings import RunSettings

    names = [loop.name or f"stage{i}" for i, loop in enumerate(loops)]
    if from_run is None:
        with tempfile.TemporaryDirectory(prefix="pipekit-lr-find-") as tmp:
            settings, state = RunSettings(run_dir=tmp, store=False), None
            for loop in loops[:index]:
                _, state = run_stage(loop.replace(progress=False), state, settings)
        return state, [f"trained the earlier stage(s) {', '.join(names[:index])} first, in a temporary directory"]
    if not os.path.isdir(from_run):
        raise ConfigError(f"--from-run {from_run}: no such run directory")
    state = None
    meta = os.path.join(from_run, "run.json")
    run_id = str(read_json(meta, what="the run's metadata").get("run_id", "")) if os.path.exists(meta) else ""
    settings = RunSettings(run_dir=from_run, store=False)
    for i, loop in enumerate(loops[:index]):
        info = RunInfo(
            run_id=run_id,
            run_dir=from_run,
            stage=names[i],
            stage_index=i,
            stage_dir=os.path.join(from_run, names[i]),
        )
        done = finished_stage(info, loop, settings)
        if done is None:
            raise ConfigError(
                f"--from-run {from_run}: stage {names[i]!r} has not finished there with this configuration (no "
                f"{os.path.join(info.stage_dir, 'final.json')}, or the stage changed since); finish the run, or "
                "leave out --from-run to train the earlier stages in a temporary directory"
            )
        state = done[1]
    return state, [f"the earlier stage(s) {', '.join(names[:index])} come from {from_run}"]


def suggest(lrs: Sequence[float], smoothed: Sequence[float]) -> tuple[float, Literal["steepest", "min/10"]]:
    """The steepest descent of `smoothed` against ``log(lr)`` inside its real descent, or a tenth of the rate at
    the minimum when there are too few points before it or the loss never falls.

    The first tenth of the sweep is left out (the smoothed loss there is about one batch's loss). The curve is
    smoothed once more, by a centred moving mean over a tenth of the sweep (centred, so the descent does not shift
    to larger rates as it does under the running mean), which a small, noisy stage needs: on its own the running
    mean leaves wiggles whose slope beats the real descent's. The real descent starts where that curve has fallen a
    quarter of the way from its starting level to its minimum; a dip of the plateau before it is not a descent.
    """
    values = np.asarray(smoothed, dtype=np.float64)
    logs = np.log(np.asarray(lrs, dtype=np.float64))
    n = len(values)
    skip = max(1, n // 10)  # the first steps: the smoothing's start-up, as noisy as one batch
    half = max(1, n // 20)
    centred = values.copy()
    for i in range(skip, n):
        centred[i] = values[max(skip, i - half) : i + half + 1].mean()
    lowest = skip + int(np.argmin(centred[skip:])) if n > skip else int(np.argmin(values))
    if lowest - skip >= 3:
        start = float(centred[skip])
        drop = start - float(centred[lowest])
        fallen = np.flatnonzero(centred[skip : lowest + 1] <= start - 0.25 * drop)
        if drop > 0 and fallen.size:
            first = max(skip, skip + int(fallen[0]) - half)
            grad = np.gradient(centred[first : lowest + 1], logs[first : lowest + 1])
            i = first + int(np.argmin(grad))
            if grad[i - first] < 0:
                return float(lrs[i]), "steepest"
    return float(lrs[lowest]) / 10, "min/10"


def lr_find(
    pipeline: Operator,
    stage: int | str | None = None,
    *,
    min_lr: float = 1e-6,
    max_lr: float = 1.0,
    steps: int = 100,
    divergence: float = 4.0,
    beta: float = 0.9,
    from_run: str | None = None,
) -> LRFindResult:
    """Sweep the learning rate of one training stage of `pipeline` (a `TrainingLoop` or a `Sequential`).

    Args:
        pipeline: The pipeline, as loaded from its file.
        stage: Which training stage: its position among the training stages or its name; null: the first.
        min_lr: The first step's learning rate (> 0).
        max_lr: The last step's learning rate (> `min_lr`); step ``i`` uses
            ``min_lr * (max_lr / min_lr) ** (i / (steps - 1))``.
        steps: Steps of the sweep (>= 10).
        divergence: Stop once the smoothed loss exceeds this many times the lowest one (> 1).
        beta: The smoothing of the loss (in [0, 1)).
        from_run: A run directory where the stages before `stage` finished: the stage starts from what they
            handed on. Null: those stages are trained first, in a temporary directory.

    Returns:
        An `LRFindResult`: the curve, the suggestion and how it was chosen.
    """
    if not (math.isfinite(min_lr) and min_lr > 0):
        raise ConfigError(f"lr-find: --min-lr must be a number > 0, got {min_lr}")
    if not (math.isfinite(max_lr) and max_lr > min_lr):
        raise ConfigError(f"lr-find: --max-lr must be a number > --min-lr ({min_lr}), got {max_lr}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 10:
        raise ConfigError(f"lr-find: --steps must be an int >= 10 (points of the curve), got {steps!r}")
    if not divergence > 1:
        raise ConfigError(f"lr-find: divergence must be > 1 (times the lowest loss), got {divergence}")
    if not 0 <= beta < 1:
        raise ConfigError(f"lr-find: beta must be in [0, 1), got {beta}")
    index, loops = select_stage(pipeline, stage)
    loop = loops[index]
    name = loop.name or f"stage{index}"
    if "lr_find" not in loop.adapter().capabilities:
        from ..backends._registry import able_to

        raise ConfigError(
            f"lr-find: stage {name!r} trains on backend {loop.backend!r}, which cannot be stepped by hand at a set "
            "learning rate (its capabilities do not list lr_find); lr-find supports " + able_to("lr_find")
        )
    copy, notes = _sweep_copy(loop, steps)
    incoming, more = _incoming(loops, index, from_run)
    from ..stage.driver import start_stage
    from ..stage.preflight import check

    _, _, backend = start_stage(check(copy, incoming, name), incoming)  # as a run starts it: the same pre-flight
    iterator = copy.dataset.iterator(copy.batch_size, copy.seed)
    factor = (max_lr / min_lr) ** (1 / (steps - 1))
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    avg = 0.0
    stop = "reached max_lr"
    try:
        for step in range(steps):
            lr = min_lr * factor**step
            backend.set_lr_scale(lr)
            loss = float(np.asarray(backend.train([next(iterator)], step)["loss"]))
            if not math.isfinite(loss):
                stop = f"the loss became {loss} at step {step} (lr {lr:.3g})"
                break
            avg = beta * avg + (1 - beta) * loss
            lrs.append(lr)
            losses.append(loss)
            smoothed.append(avg / (1 - beta ** (step + 1)))
            if step > 0 and smoothed[-1] > divergence * min(smoothed):
                stop = f"diverged at step {step} (lr {lr:.3g}): the smoothed loss passed {divergence:g}x its lowest"
                break
    finally:
        iterator.close()
    if len(lrs) < 2:
        raise ConfigError(
            f"lr-find: stage {name!r}: {stop}, before a curve could be drawn; lower --min-lr (now {min_lr:g})"
        )
    lr, method = suggest(lrs, smoothed)
    return LRFindResult(
        stage=name,
        lrs=tuple(lrs),
        losses=tuple(losses),
        smoothed=tuple(smoothed),
        suggestion=lr,
        method=method,
        stop_reason=stop,
        notes=tuple(notes + more),
    )
