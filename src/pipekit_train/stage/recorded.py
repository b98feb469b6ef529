"""A stage that already finished in the run directory: taken as it is (`finished_stage`, under ``resume: auto``),
run again only when its configuration changed and it has a checkpoint to continue (`changed_since_finished`), and
its lost ``final.json`` taken back from the artifact recorded for it, or refused (`take_back`).

A stage is finished once its artifact is recorded and ``final.json`` marks it (`stage.record.finish`). A crash cannot
lose ``final.json`` after the artifact exists (it is written first), but a deleted or damaged file can. Training the
stage again would record a second finished artifact for the same run and stage; `take_back` instead finds the one
recorded (``artifact.json`` beside it, else the store: same run, stage and configuration) and

- restores ``final.json`` from it, with a warning of one line, when its model is in the run's registry (verified
  against its address) and the latest committed checkpoint is the stage's last step, of this run;
- otherwise refuses in one line naming the artifact and what to do.

When nothing finished is recorded (a run killed before its end, or stopped by a signal), the stage resumes from its
checkpoints as always.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import TYPE_CHECKING, Any

import pipekit

from .._jsonio import DamagedFileError, read_json, write_json
from .._warnings import PipekitTrainWarning
from ..scale._distributed import barrier, is_primary
from .carry import handoff
from .loop import RunInfo, TrainerCarryState, TrainingLoop, TrainingResult
from .record import FINAL_FILE, absolute_model_uri, read_final, record_in_store, write_final
from .settings import RunSettings

if TYPE_CHECKING:
    from ..provenance._artifact import TrainingArtifact

__all__ = ["changed_since_finished", "finished_stage", "take_back"]

#: Statuses of a stage that did not finish: it resumes from its checkpoints and records a new artifact at its end.
_UNFINISHED = ("failed", "stopped: SIGINT", "stopped: SIGTERM")


def take_back(info: RunInfo, loop: TrainingLoop, damaged: DamagedFileError | None, settings: RunSettings) -> bool:
    """Restore the stage's lost ``final.json`` from its recorded artifact (see the module docstring).

    Args:
        info: The stage's run and folder.
        loop: The stage as it is configured now.
        damaged: The error reading ``final.json`` gave, or ``None`` when the file is missing.
        settings: The run's settings (the store to look in).

    Returns:
        ``True`` when ``final.json`` was restored, ``False`` when no finished artifact of this stage is recorded
        (the stage trains, resuming from its checkpoints).

    Raises:
        DamagedFileError: an artifact is recorded but cannot be taken back, naming it and what to do; or `damaged`
            itself when nothing is recorded.
    """
    path = os.path.join(info.stage_dir, FINAL_FILE)
    yaml_text = pipekit.dumps(loop, strict=False)
    artifact, where = _recorded(info, yaml_text, settings)
    if artifact is None:
        if damaged is not None:
            raise damaged
        return False
    lost = "is missing" if damaged is None else "is damaged"
    step = artifact.backend_info.get("steps")
    problem, model_uri, epoch = _check(info, loop, artifact, step)
    if problem is not None:
        raise DamagedFileError(
            f"{path} {lost}, but stage {info.stage!r} was recorded as finished: artifact {artifact.artifact_id} "
            f"({where}, step {step}); {problem}, so it cannot be taken back and training it again would record it "
            f"twice. Restore {FINAL_FILE} from a backup, or train the stage in a new run directory (--run-dir)",
            path=path,
        )
    assert model_uri is not None and isinstance(step, int)
    if is_primary():  # several processes: process 0 writes what the run keeps
        if damaged is not None and os.path.exists(path):  # kept, not overwritten: nothing written is lost
            os.replace(path, f"{path}.damaged-{int(time.time())}")
        artifact_path = os.path.join(info.stage_dir, "artifact.json")
        if _read_artifact(artifact_path) != artifact:  # the store's copy: the stage's own record, written again
            write_json(artifact_path, artifact.to_dict())
        write_final(info, step, epoch, artifact.artifact_id, model_uri)
    barrier("final-restored")  # several processes: the others read it once process 0 has written it
    warnings.warn(
        f"stage {info.stage!r}: {path} {lost}; restored it from artifact {artifact.artifact_id} ({where}: its "
        f"model is in the run's registry and its last step {step} is the latest checkpoint) instead of training "
        "the stage again",
        PipekitTrainWarning,
        stacklevel=4,
    )
    return True


def _finished(artifact: TrainingArtifact | None, info: RunInfo, yaml_text: str) -> bool:
    return (
        artifact is not None
        and artifact.run_id == info.run_id
        and artifact.stage == info.stage
        and artifact.status not in _UNFINISHED
        and artifact.training_pipeline_yaml == yaml_text
    )


def _read_artifact(path: str) -> TrainingArtifact | None:
    """The artifact in `path`, or ``None`` when it is missing or damaged (the store may still know it)."""
    from ..provenance._artifact import TrainingArtifact

    if not os.path.exists(path):
        return None
    try:
        return TrainingArtifact.from_dict(read_json(path, what="the stage's artifact", required=("artifact_id",)))
    except (pipekit.PipekitError, KeyError, TypeError, ValueError):
        return None


def _recorded(info: RunInfo, yaml_text: str, settings: RunSettings) -> tuple[TrainingArtifact | None, str]:
    """The finished artifact recorded for this run, stage and configuration, and where it was found."""
    from ..provenance._artifact import pipeline_hash
    from ..provenance._store import ArtifactStore

    path = os.path.join(info.stage_dir, "artifact.json")
    artifact = _read_artifact(path)
    if _finished(artifact, info, yaml_text):
        return artifact, path
    if settings.store is False:
        return None, ""
    store = ArtifactStore(settings.store or None)
    if not os.path.exists(store.path):
        return None, ""
    with store:
        found = store.query(run_id=info.run_id, stage=info.stage, pipeline_hash=pipeline_hash(yaml_text))
    finished = [a for a in found if _finished(a, info, yaml_text)]  # newest first
    return (finished[0], f"the store {store.path}") if finished else (None, "")


def _check(
    info: RunInfo, loop: TrainingLoop, artifact: TrainingArtifact, step: Any
) -> tuple[str | None, str | None, int]:
    """(why the artifact cannot be taken back or ``None``, the model's URI in the run's registry, the epoch)."""
    from ..checkpoint import Checkpointer
    from ..provenance._model_registry import LocalModelRegistry, ModelRegistryError

    registry = LocalModelRegistry(os.path.abspath(os.path.join(info.run_dir, "models")))
    uri = f"pipekit-model:{artifact.trained_model_hash}"
    try:
        registry.load(uri)  # verified against its address
    except ModelRegistryError as e:
        return f"its model is not in the run's registry ({e})", None, 0
    if loop.checkpoint_settings is None:
        return "the stage keeps no checkpoints to check its last step against", None, 0
    directory = loop.checkpoint_directory(info.stage_dir)
    checkpointer = Checkpointer(directory, async_save=False)
    try:
        entries = checkpointer.manifest()
    finally:
        checkpointer.close()
    latest = entries[-1] if entries else None
    if latest is None or latest.step != step or latest.run_id not in (None, info.run_id):
        seen = f"step {latest.step}" if latest is not None else "none"
        return f"the latest committed checkpoint in {directory} is {seen}, not its last step {step}", None, 0
    return None, registry.locator(uri), int(latest.epoch or 0)


def finished_stage(
    info: RunInfo, loop: TrainingLoop, settings: RunSettings
) -> tuple[TrainingResult, TrainerCarryState] | None:
    """A stage that already finished in this run directory: its model and artifact, without training again."""
    from ..provenance._artifact import TrainingArtifact

    path = os.path.join(info.stage_dir, FINAL_FILE)
    redo = f"delete {info.stage_dir} to train stage {info.stage!r} again"
    exists, damaged = os.path.exists(path), None
    if exists:
        try:
            final = read_final(path, info.stage, redo)
        except DamagedFileError as e:
            damaged = e
    barrier("final-read")  # several processes: each has read final.json before process 0 may restore it
    # A lost final.json (deleted or damaged) of a stage whose artifact is recorded: restored from that artifact, or
    # refused; never trained and recorded a second time.
    if not exists or damaged is not None:
        if not take_back(info, loop, damaged, settings):
            return None
        final = read_final(path, info.stage, redo)
    record = read_json(
        os.path.join(info.stage_dir, "artifact.json"),
        what=f"stage {info.stage!r}'s artifact",
        required=("artifact_id",),
        remedy=redo,
    )
    try:
        artifact = TrainingArtifact.from_dict(record)
    except (KeyError, TypeError, ValueError) as e:
        raise DamagedFileError(
            f"{os.path.join(info.stage_dir, 'artifact.json')}: stage {info.stage!r}'s artifact is damaged ({e}); "
            f"{redo}",
            path=os.path.join(info.stage_dir, "artifact.json"),
        ) from None
    if final["artifact_id"] != artifact.artifact_id:
        raise DamagedFileError(
            f"{path}: stage {info.stage!r}'s record of its final weights names artifact {final['artifact_id']!r} "
            f"but {os.path.join(info.stage_dir, 'artifact.json')} is artifact {artifact.artifact_id!r}; {redo}",
            path=path,
        )
    from ..provenance._model_registry import load_model

    model = load_model(absolute_model_uri(final["model_uri"], info.run_dir))
    changed = model != loop.model_op or artifact.training_pipeline_yaml != pipekit.dumps(loop, strict=False)
    if changed and changed_since_finished(info, loop, artifact, int(final["step"]), settings):
        return None  # resume its last checkpoint, whose fingerprint refuses a changed configuration
    record_in_store(artifact, settings, info)  # a no-op when it is there; the crash window after final.json
    state = TrainerCarryState(
        model=model,
        step=int(final["step"]),
        epoch=int(final.get("epoch", 0)),
        metrics=artifact.final_metrics,
        run_id=info.run_id,
        run_dir=info.run_dir,
        stage_index=info.stage_index + 1,
        artifact_id=artifact.artifact_id,
        **handoff(loop, info.stage_dir),
    )
    return TrainingResult(model, artifact), state


def changed_since_finished(info: RunInfo, loop: TrainingLoop, artifact: Any, step: int, settings: RunSettings) -> bool:
    """A finished stage whose YAML changed since: ``True`` to run it, which resumes its last checkpoint (and that
    checkpoint's fingerprint refuses a changed configuration with its diff, or ``--force-resume`` continues it).
    Without a checkpoint to resume, ``False`` (take it as it is) when nothing that changes its result changed (the
    same fingerprint), else refused with the fingerprint's diff: it is never trained again from scratch."""
    from ..checkpoint._errors import CheckpointMismatchError
    from ..engine._fingerprint import _diff, fingerprint

    directory = loop.checkpoint_directory(info.stage_dir)
    if loop.checkpoint_settings is not None and os.path.isdir(directory) and any(os.scandir(directory)):
        return True
    try:
        then = pipekit.loads(artifact.training_pipeline_yaml)
        saved, now = {**fingerprint(then), "dataset_hash": artifact.dataset_hash}, fingerprint(loop)
        diff = _diff(saved, now, then="finished stage") if saved != now else ""
    except pipekit.PipekitError:  # its file names a type not registered now: compare the files themselves
        import difflib

        old, new = artifact.training_pipeline_yaml.splitlines(), pipekit.dumps(loop, strict=False).splitlines()
        diff = "\n".join(difflib.unified_diff(old, new, "finished stage", "this run", lineterm="", n=1))
    if not diff:
        return False
    raise CheckpointMismatchError(
        f"refusing to resume stage {info.stage!r}: it finished at step {step} in {info.stage_dir} under another "
        f"configuration and has no checkpoint to continue from:\n{diff}\nResume with the original configuration, "
        f"delete {info.stage_dir} to train the stage again, or start a new run in another --run-dir"
    )
