"""Forks: a new run that starts from a committed checkpoint of another run, under a changed configuration.

``pipekit-train run PIPELINE.yaml --fork RUN_DIR@STEP [--set ...]`` (or ``RUN_DIR/STAGE@STEP`` when the run has
several stages) starts the pipeline's first stage from the whole training state of that checkpoint: the weights,
the optimizer state (step count and schedule position), the data position and the callbacks' state, exactly as a
resume would, but in a new run directory and without the resume's "same configuration" rule, since changing it is
the point. What may change is what does not change the shape of that state (the learning rate, the schedule, the
number of steps, callbacks, the data); a model or optimizer whose state has another structure is refused.

`resolve_fork` checks the place before anything is compiled (the run and stage exist, the step is committed, else
the nearest committed steps); `restore_fork` (called by `CheckpointHooks.restore` for the first stage of a fork)
loads the state and fills `CheckpointHooks.fork` with the lineage edge the artifact records: ``{"run_dir",
"stage", "step", "parent_artifact", "config_diff"}``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from pathlib import Path
from typing import Any

from ..checkpoint._errors import CheckpointError, CheckpointMismatchError

__all__ = ["ForkPoint", "resolve_fork", "restore_fork"]

_SPEC = re.compile(r"^(?P<path>.+)@(?P<step>\d+)$")


@dataclasses.dataclass(frozen=True)
class ForkPoint:
    """A resolved ``--fork``: the parent run, its stage, the committed step and that stage's checkpoint folder."""

    run_dir: str
    stage: str
    step: int
    checkpoint_dir: str

    @property
    def spec(self) -> str:
        return f"{self.run_dir}/{self.stage}@{self.step}"


def _is_stage_dir(path: Path) -> bool:
    return any((path / name).exists() for name in ("checkpoints", "final.json", "metrics.jsonl"))


def _checkpoint_dir(run_dir: Path, stage: str) -> Path:
    """Where the stage's checkpoints are: ``checkpoints/`` in its folder, else the ``checkpoint_dir`` its recorded
    configuration set (`TrainingLoop.checkpoint_directory`; a relative one is relative to the current folder, as
    it was to the run's)."""
    default = run_dir / stage / "checkpoints"
    if default.is_dir():
        return default
    import yaml

    try:
        doc = yaml.safe_load(_parent_record(run_dir, stage)[1] or "null")
    except yaml.YAMLError:
        return default
    loops: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "TrainingLoop":
                loops.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    named = [loop for loop in loops if loop.get("name") == stage] or (loops if len(loops) == 1 else [])
    found = named[0].get("checkpoint_dir") if named else None
    return Path(found).absolute() if isinstance(found, str) and found else default


def _stages(run_dir: Path) -> list[str]:
    """The run's stages that have checkpoints (in their folder or their own `checkpoint_dir`)."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if _is_stage_dir(p) and _checkpoint_dir(run_dir, p.name).is_dir())


def resolve_fork(spec: str, first_stage: str | None, own_checkpoint_dir: str | None = None) -> ForkPoint:
    """`spec` (``RUN_DIR@STEP`` or ``RUN_DIR/STAGE@STEP``) as a `ForkPoint`, or one clear `CheckpointError`.

    Without ``/STAGE`` the parent stage is the one named like `first_stage` (the forking pipeline's first stage),
    else the run's only stage with checkpoints. The parent's checkpoints are in its stage folder, or in the
    ``checkpoint_dir`` its recorded configuration set. `own_checkpoint_dir` (the forking first stage's
    ``checkpoint_dir``) must not be that folder: the fork would write its steps among the parent's.
    """
    from ..checkpoint._checkpointer import Checkpointer

    match = _SPEC.match(spec)
    if match is None:
        raise CheckpointError(
            f"--fork {spec!r}: expected RUN_DIR@STEP or RUN_DIR/STAGE@STEP (a run directory and a committed step, "
            "e.g. runs/20260501T120000Z-1f2e3d4c@200)"
        )
    path, step = Path(match["path"]).absolute(), int(match["step"])
    if _is_stage_dir(path):
        run_dir, stage = path.parent, path.name
    elif path.is_dir():
        run_dir, found = path, _stages(path)
        if not found:
            raise CheckpointError(
                f"--fork {spec!r}: {path} holds no stage with checkpoints (no STAGE/checkpoints, nor a stage whose "
                "recorded checkpoint_dir exists)"
            )
        if first_stage in found:
            stage = first_stage
        elif len(found) == 1:
            stage = found[0]
        else:
            raise CheckpointError(
                f"--fork {spec!r}: run {path} has stages {', '.join(found)} and none is named like this pipeline's "
                f"first stage {first_stage!r}; name one: --fork {path}/{found[0]}@{step}"
            )
    else:
        raise CheckpointError(f"--fork {spec!r}: {path} is not a run directory nor a stage directory of one")
    directory = _checkpoint_dir(run_dir, stage)
    if not directory.is_dir():
        raise CheckpointError(
            f"--fork {spec!r}: stage {stage!r} of {run_dir} has no checkpoints ({directory} is missing)"
        )
    with Checkpointer(directory, async_save=False) as ckpt:
        steps = ckpt.steps()
    if step not in steps:
        near = sorted(steps, key=lambda s: (abs(s - step), s))[:3]
        listed = ", ".join(str(s) for s in sorted(near)) if near else "none"
        raise CheckpointError(
            f"--fork {spec!r}: stage {stage!r} of {run_dir} has no committed checkpoint at step {step}; the nearest "
            f"committed steps: {listed} (all: {len(steps)})"
        )
    if own_checkpoint_dir and Path(own_checkpoint_dir).absolute() == directory.absolute():
        raise CheckpointError(
            f"--fork {spec!r}: the fork's first stage would write its checkpoints into the parent's folder "
            f"{directory} (its checkpoint_dir), among the parent's steps; give the fork its own, e.g. "
            "--set checkpoint_dir=PATH (a stage in a Sequential: --set stages.0.checkpoint_dir=PATH), or leave it unset"
        )
    return ForkPoint(run_dir=str(run_dir), stage=stage, step=step, checkpoint_dir=str(directory))


def _parent_record(run_dir: str | Path, stage: str) -> tuple[str | None, str]:
    """(the parent stage's artifact id or ``None``, its recorded configuration YAML or ``""``)."""
    stage_dir = Path(run_dir) / stage
    try:
        art = json.loads((stage_dir / "artifact.json").read_text())
        return str(art["artifact_id"]), str(art.get("training_pipeline_yaml") or "")
    except (OSError, ValueError, KeyError):
        pass
    try:  # not finished (stopped, still running): the run's pipeline, as `run` wrote it when it began
        return None, str(json.loads((Path(run_dir) / "run.json").read_text()).get("pipeline_yaml") or "")
    except (OSError, ValueError):
        return None, ""


def config_diff(parent_yaml: str, fork_yaml: str) -> str:
    """The unified diff of the parent's recorded configuration against the fork's (``""`` when equal)."""
    return "".join(
        difflib.unified_diff(
            parent_yaml.splitlines(keepends=True), fork_yaml.splitlines(keepends=True), "parent", "fork", n=1
        )
    )


def restore_fork(
    hooks: Any, backend: Any, point: ForkPoint
) -> tuple[int, dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """Load the checkpoint `point` names into `backend` (the whole training state); return what
    `CheckpointHooks.restore` returns: (the step, the data position, the callbacks' state)."""
    import pipekit

    from ..checkpoint._checkpointer import Checkpointer
    from ..scale._distributed import local_data_state

    source = Checkpointer(Path(point.checkpoint_dir), async_save=False)
    try:
        try:
            state, data_iter, meta = source.restore(point.step, backend.state_tree())
        except CheckpointMismatchError as e:
            raise CheckpointMismatchError(
                f"--fork {point.spec}: the checkpoint's training state does not fit stage {hooks.info.stage!r} "
                f"({_first_mismatch(str(e))}); a fork may change the learning rate, schedule, steps, callbacks or "
                "data, not the model's structure or the optimizer's kind. To start a changed model from those "
                f"weights alone, use init_from: {point.checkpoint_dir}@{point.step}"
            ) from None
    finally:
        source.close()
    backend.load_state_tree(state)
    parent, parent_yaml = _parent_record(point.run_dir, point.stage)
    if parent:
        hooks.parent_ids = (parent,)
    hooks.fork = {
        "run_dir": point.run_dir,
        "stage": point.stage,
        "step": point.step,
        "parent_artifact": parent,
        "config_diff": config_diff(parent_yaml, pipekit.dumps(hooks.loop, strict=False)),
    }
    where = f"forking stage {hooks.info.stage!r} from {point.spec}"
    return int(meta["step"]), local_data_state(data_iter, where), dict(meta.get("callbacks", {}))


def _first_mismatch(text: str) -> str:
    """The first of the mismatches a restore lists (``shape of 'params/w': checkpoint (8, 4), abstract_state (16,
    4)``), and how many more."""
    text = " ".join(text.split())
    _, found, rest = text.partition("shape of ")
    if not found:
        return text
    items = rest.rstrip(")").split("; shape of ")
    more = f", and {len(items) - 1} more" if len(items) > 1 else ""
    return f"shape of {items[0]}{more}".replace("abstract_state", "this model")
