"""Extending a finished stage: N more training steps, MCMC draws (``numpyro-mcmc``, ``blackjax``) or SVI steps.

`extend` reads the stage's recorded configuration (``artifact.json``) and its final checkpoint, and runs the same
stage planned ``N`` steps longer as a new stage of the run, ``<stage>-extend<k>`` (its own folder, ``final.json``,
artifact and weights; the extended stage's files are left as they are). The new stage starts from everything the
final checkpoint holds (weights and optimizer state, or the sampler state and the draws so far; the data position;
the callbacks), so its result is bitwise the result of a stage planned ``N`` steps longer from the start, where
that longer stage would have computed the same steps: a sampler's keys depend on the draw's index alone; a
learning-rate schedule whose horizon is ``max_steps`` (``decay_steps`` left to default) would not, and is refused
unless ``new_segment`` restarts it over the new steps (recorded). ``docs/bayesian.md`` and
``docs/checkpoints.md`` have the user's side.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

import pipekit
from pipekit import ConfigError, suggestion

from .loop import TrainerCarryState, TrainingLoop, TrainingResult

__all__ = ["Extension", "extend", "extended_loop"]

_SUFFIX = re.compile(r"-extend\d+$")


@dataclass(frozen=True)
class Extension:
    """A finished stage that the stage being run continues (what the checkpoint hooks restore and the artifact
    records).

    Attributes:
        loop: The finished stage's `TrainingLoop`, as recorded.
        stage: Its name.
        directory: Its checkpoint directory.
        step: Its final step (the checkpoint the extension starts from).
        artifact_id: Its artifact (the extension's parent).
        steps: How many steps the extension adds.
        new_segment: The learning-rate schedule restarts at `step` over the new steps (not exact, recorded).
    """

    loop: TrainingLoop
    stage: str
    directory: str
    step: int
    artifact_id: str
    steps: int
    new_segment: bool = False

    def record(self) -> dict[str, Any]:
        """What the extension's artifact records (``artifact.user["extension"]``)."""
        return {
            "stage": self.stage,
            "artifact_id": self.artifact_id,
            "from_step": self.step,
            "steps": self.steps,
            "exact": not self.new_segment,
            "new_segment": self.new_segment,
        }


def _schedule_refusal(loop: TrainingLoop, stage: str, steps: int) -> str | None:
    """Why the stage's learning-rate schedule would not continue as a longer stage's (``None``: it would)."""
    from ..optim._config import resolve_optimizer_config

    cfg = resolve_optimizer_config(loop.optimizer_config)
    kind = cfg["schedule"]
    if kind == "constant" or cfg.get("decay_steps") is not None:
        return None  # the numbers do not depend on max_steps: step t has the same rate in the longer stage
    end = loop.max_steps
    return (
        f"refusing to extend stage {stage!r} exactly: its {kind} schedule's decay_steps defaults to max_steps, so "
        f"it ended at step {end} (where the stage ended) and a stage planned for {end + steps} steps would have had "
        "another learning rate at every step; continue anyway as a new schedule segment with --new-segment "
        "(extend(..., new_segment=True), recorded), or set optimizer_config.decay_steps in a new run"
    )


def extended_loop(loop: TrainingLoop, steps: int, *, name: str, new_segment: bool = False) -> TrainingLoop:
    """`loop` planned `steps` steps longer, named `name`: ``max_steps`` and a sampler kernel's ``num_samples``
    grow; with `new_segment` a schedule with a horizon (``decay_steps``) gets the new steps as its horizon.

    Raises `pipekit.ConfigError` (one line) when the longer stage would not continue this one exactly: a thinned
    sampler extended by a number of draws that is not a multiple of ``thinning``, a schedule whose horizon is
    ``max_steps`` (unless `new_segment`).
    """
    stage = loop.name or "stage"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(
            f"extend: steps must be an int >= 1 (how many steps to add to stage {stage!r}), got {steps!r}"
        )
    # Its own checkpoints, in its own folder: a `checkpoint_dir` of the stage would mix the two stages' steps.
    changes: dict[str, Any] = {"max_steps": loop.max_steps + steps, "name": name, "checkpoint_dir": None}
    sampled = loop.adapter().extended_fields(loop, steps)
    if sampled is not None:
        changes.update(sampled)
    else:
        refusal = _schedule_refusal(loop, stage, steps)
        if refusal is not None and not new_segment:
            raise ConfigError(refusal)
        if new_segment and refusal is not None:
            changes["optimizer_config"] = {**loop.optimizer_config, "decay_steps": steps}
    return loop.replace(**changes)


def _finished(run_dir: str, stage: str) -> tuple[dict[str, Any], Any]:
    """The finished stage's ``final.json`` fields and its artifact; one line naming what is missing otherwise."""
    from .._jsonio import read_json
    from ..provenance._artifact import TrainingArtifact
    from .record import FINAL_FILE, read_final

    stage_dir = os.path.join(run_dir, stage)
    if not os.path.exists(os.path.join(stage_dir, FINAL_FILE)):
        finished = (
            sorted(
                e.name for e in os.scandir(run_dir) if e.is_dir() and os.path.exists(os.path.join(e.path, FINAL_FILE))
            )
            if os.path.isdir(run_dir)
            else []
        )
        raise ConfigError(
            f"extend: {run_dir} has no finished stage {stage!r} (no {os.path.join(stage_dir, FINAL_FILE)})"
            f"{suggestion(stage, finished)}; finished stages: {', '.join(finished) or 'none'}"
        )
    redo = f"run stage {stage!r} again in a new run"
    final = read_final(os.path.join(stage_dir, FINAL_FILE), stage, redo)
    record = read_json(
        os.path.join(stage_dir, "artifact.json"), what=f"stage {stage!r}'s artifact", required=("artifact_id",),
        remedy=redo,
    )  # fmt: skip
    return final, TrainingArtifact.from_dict(record)


def _lora_base(run_dir: str, loop: TrainingLoop, artifact: Any) -> Any:
    """For a LoRA stage (`optimizer_config.lora`), the model it started from, whose weights its checkpoints do not
    hold (only the adapters and that model's digest): the final model of its parent stage in this run (LoRA has no
    `init_from`, so the one parent is the previous stage). ``None`` otherwise, or when the stage started fresh."""
    from .._jsonio import read_json
    from ..provenance._model_registry import load_model
    from .record import FINAL_FILE, absolute_model_uri

    if loop.optimizer_config.get("lora") is None or not artifact.parent_ids:
        return None
    for entry in os.scandir(run_dir):
        path = os.path.join(entry.path, "artifact.json")
        if not (entry.is_dir() and os.path.exists(path)):
            continue
        if read_json(path, what="an artifact").get("artifact_id") == artifact.parent_ids[0]:
            final = read_json(os.path.join(entry.path, FINAL_FILE), what=f"stage {entry.name!r}'s final.json")
            return load_model(absolute_model_uri(final["model_uri"], run_dir))
    raise ConfigError(
        f"extend: the LoRA stage {artifact.stage!r} started from the model of artifact {artifact.parent_ids[0]}, "
        f"which is not a finished stage of {run_dir}; its checkpoints hold the adapters, not that model"
    )


def _next_name(run_dir: str, stage: str) -> str:
    """``<stage>-extend<k>``: the first k whose folder holds no finished stage (an unfinished one is continued)."""
    from .record import FINAL_FILE

    base = _SUFFIX.sub("", stage)
    k = 1
    while os.path.exists(os.path.join(run_dir, f"{base}-extend{k}", FINAL_FILE)):
        k += 1
    return f"{base}-extend{k}"


def extend(
    run_dir: str,
    stage: str,
    steps: int,
    *,
    new_segment: bool = False,
    store: str | Literal[False] | None = None,
    loop: TrainingLoop | None = None,
    imports: tuple[dict[str, Any], ...] = (),
) -> TrainingResult:
    """Continue the finished stage `stage` of the run in `run_dir` for `steps` more steps.

    The extension is a new stage of the run, ``<stage>-extend<k>`` (k counts extensions of that stage; extending
    an extension continues it), whose artifact's parent is the extended stage's, whose weights (or posterior) are
    in the run's registry, and whose ``final.json`` is its own; the extended stage's files are not touched. It
    starts from the stage's final checkpoint (a `Checkpoint` callback with ``save_on_end``, the default, keeps
    it), so the result is bitwise that of the stage planned `steps` longer: training steps, SVI steps, or MCMC
    iterations (``numpyro-mcmc``, ``blackjax``: ``num_samples`` grows by `steps`, and the draws are the longer
    stage's, the first ones those already drawn). An extension stopped midway (SIGINT, SIGKILL) is continued by
    calling `extend` again with the same `steps`.

    Args:
        run_dir: The run directory.
        stage: The finished stage's name (its folder in `run_dir`).
        steps: How many steps to add (a multiple of the kernel's ``thinning`` for a sampler).
        new_segment: A learning-rate schedule whose horizon is ``max_steps`` (``decay_steps`` not set) cannot
            continue as the longer stage's would and is refused; with `new_segment` it restarts at the stage's
            end over the new steps (``decay_steps: steps``, its count from 0), recorded in the artifact
            (``user["extension"]["exact"]`` is false).
        store: The artifact store (`RunSettings.store`: a path, ``None`` for the default, ``False`` for
            none).
        loop: The stage's `TrainingLoop` when its recorded YAML cannot be read back (a Python-only task); the
            checkpoint's fingerprint must match it.
        imports: The user modules imported for it (recorded in the artifact, as ``--import`` is).

    Returns:
        The extension's `TrainingResult` (model and artifact).

    Raises:
        pipekit.ConfigError: no such finished stage, no checkpoint of its final step, a stage that stopped early,
            `steps` below 1 or not a multiple of ``thinning``, a schedule that cannot continue exactly.
    """
    from ..checkpoint._checkpointer import Checkpointer
    from .driver import run_stage
    from .settings import RunSettings

    final, artifact = _finished(run_dir, stage)
    if artifact.status != "completed":
        raise ConfigError(
            f"extend: stage {stage!r} did not complete (status {artifact.status!r} at step {final['step']}); only a "
            "completed stage continues as a longer one would"
        )
    if loop is None:
        try:
            recorded = pipekit.loads(artifact.training_pipeline_yaml)
        except pipekit.PipekitError as e:
            raise ConfigError(
                f"extend: stage {stage!r}'s recorded configuration cannot be read back ({e}); pass its TrainingLoop "
                "as extend(..., loop=...)"
            ) from None
        if not isinstance(recorded, TrainingLoop):
            raise ConfigError(
                f"extend: stage {stage!r} was not recorded as a TrainingLoop, got {type(recorded).__name__}"
            )
        loop = recorded
    if new_segment and "schedule_segment" not in loop.adapter().capabilities:
        from ..backends import backends_with

        raise ConfigError(
            f"extend: backend {loop.adapter().name!r} of stage {stage!r} cannot restart its learning-rate schedule "
            "(it does not list the schedule_segment capability), so new_segment is refused; backends that can: "
            f"{', '.join(backends_with('schedule_segment')) or 'none installed'}"
        )
    step = int(final["step"])
    stage_dir = os.path.join(run_dir, stage)
    directory = loop.checkpoint_directory(stage_dir)
    held: list[int] = []
    if loop.checkpoint_settings is not None and os.path.isdir(directory):
        with Checkpointer(directory, async_save=False) as ckpt:
            held = ckpt.steps()
    if step not in held:
        why = (
            f"its checkpoints in {directory} hold steps {held}"
            if loop.checkpoint_settings is not None
            else "it has no Checkpoint callback"
        )
        raise ConfigError(
            f"extend: stage {stage!r} has no checkpoint of its final step {step} ({why}); extend continues from "
            "that checkpoint: run the stage with a Checkpoint callback (save_on_end: true, the default)"
        )
    name = _next_name(run_dir, stage)
    longer = extended_loop(loop.replace(name=stage), steps, name=name, new_segment=new_segment)
    extension = Extension(loop, stage, directory, step, artifact.artifact_id, steps, new_segment)
    incoming = TrainerCarryState(
        model=_lora_base(run_dir, loop, artifact),
        run_id=artifact.run_id,
        run_dir=run_dir,
        stage_index=0,
        artifact_id=artifact.artifact_id,
    )
    settings = RunSettings(run_dir=run_dir, resume="auto", imports=imports, extension=extension)
    if store is not None:
        settings = replace(settings, store=store)
    result, _ = run_stage(longer, incoming, settings)
    return result
