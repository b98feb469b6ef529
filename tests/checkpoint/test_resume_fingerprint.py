"""What a resume compares: everything that changes the result, nothing that doesn't; --force-resume; callback state
follows the callback, not its position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import (
    MAE,
    MSE,
    SAM,
    ArraySource,
    Callback,
    Checkpoint,
    CheckpointMismatchError,
    EarlyStopping,
    EquinoxModel,
    Last,
    NullWriter,
    ParamGroup,
    PipekitTrainWarning,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)

pytestmark = pytest.mark.xdist_group("resume-fingerprint")  # one worker: its module fixtures are built once

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)


class StopAt(Callback, register=False):
    """Stops the first run at `step` (a graceful stop writes a checkpoint), like an interruption would."""

    step: int = 10

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        if ctx.step == self.step:
            ctx.request_stop("test")

    def fingerprint(self) -> None:
        return None


def _loop(**overrides: Any) -> TrainingLoop:
    fields: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1]})),
        val_dataset=TrainingDataset(source=ArraySource(arrays={"x": X[:16], "y": X[:16, :1]}), shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=20,
        batch_size=8,
        eval_every_n_steps=5,
        log_every_n_steps=5,
        progress=False,
        name="s",
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


CKPT = Checkpoint(every_n_steps=5, keep=(Last(n=1),), async_save=False)


def _interrupted(run_dir: Path, **overrides: Any) -> None:
    callbacks = (CKPT, StopAt(), *overrides.pop("callbacks", ()))
    with run_settings(run_dir=str(run_dir), store=False):
        _loop(callbacks=callbacks, **overrides).run()


def _resume(run_dir: Path, force: bool = False, **overrides: Any) -> Any:
    callbacks = (CKPT, *overrides.pop("callbacks", ()))
    with run_settings(run_dir=str(run_dir), store=False, resume="auto", force_resume=force):
        return _loop(callbacks=callbacks, **overrides).run()


def test_defaults_written_out_and_log_cadence_do_not_refuse_a_resume(tmp_path: Path):
    _interrupted(tmp_path / "r")
    _resume(tmp_path / "r", optimizer_config={"name": "adam", "lr": 0.01, "eps": 1e-8}, log_every_n_steps=10)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"dataset": TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1]}), shuffle=False)}, "shuffle"),
        ({"eval_every_n_steps": 10}, "eval_every_n_steps"),
        ({"val_dataset": None}, "val_dataset_hash"),
        ({"callbacks": (EarlyStopping(monitor="validate/loss", patience=3),)}, "EarlyStopping"),
    ],
    ids=["shuffle", "eval-cadence", "validation-data", "callbacks"],
)
def test_what_changes_the_result_refuses_a_resume(tmp_path: Path, change: dict[str, Any], key: str):
    _interrupted(tmp_path / "r")
    with pytest.raises(CheckpointMismatchError, match=rf"(?s)configuration changed.*{key}.*--force-resume"):
        _resume(tmp_path / "r", **change)


def test_force_resume_continues_and_warns(tmp_path: Path):
    _interrupted(tmp_path / "r")
    with pytest.warns(PipekitTrainWarning, match=r"--force-resume: stage 's' continues from step 10"):
        _, artifact = _resume(tmp_path / "r", force=True, eval_every_n_steps=10)
    assert artifact.backend_info["steps"] == 20


def test_callback_state_follows_the_callback_not_its_position(tmp_path: Path):
    stopper = EarlyStopping(monitor="validate/loss", patience=100)
    _interrupted(tmp_path / "r", callbacks=(stopper,))

    seen: dict[str, Any] = {}

    class Peek(Callback):
        order: int = -10  # sorts before EarlyStopping: it would have taken its slot by position

        def on_train_start(self, ctx: Any) -> None:
            seen.update(ctx.state_of(stopper))

        def fingerprint(self) -> None:
            return None

    _resume(tmp_path / "r", callbacks=(Peek(), stopper))
    assert seen.get("best") is not None, f"EarlyStopping's restored state is {seen}"


def _l1(predicted: Any, target: Any) -> Any:
    import jax.numpy as jnp

    return jnp.mean(jnp.abs(predicted - target))


def _l1_copy(predicted: Any, target: Any) -> Any:
    import jax.numpy as jnp

    return jnp.mean(jnp.abs(predicted - target))


def test_a_loss_given_as_a_function_is_compared_by_its_name(tmp_path: Path):
    """A function has no YAML form: the fingerprint holds its module and qualified name (docs/checkpoints.md)."""
    _interrupted(tmp_path / "r", loss=_l1)
    with pytest.raises(
        CheckpointMismatchError, match=r"(?s)configuration changed.*-.*\._l1 \(Python object.*\+.*\._l1_copy \(Python"
    ):
        _resume(tmp_path / "r", loss=_l1_copy)
    _, artifact = _resume(tmp_path / "r", loss=_l1)
    assert artifact.backend_info["steps"] == 20


# Every field, one at a time ------------------------------------------------------------------------------------
# What each TrainingLoop field does to a resume (docs/reliability.md lists the same): a change to a REFUSED field is
# refused with a diff naming it; a change to a HARMLESS one resumes and ends bitwise where an uninterrupted run with
# the changed configuration ends. A new field must be added to one of the two.


def _source(**arrays: Any) -> TrainingDataset:
    return TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1], **arrays}))


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "model_op": (
        {"model_op": EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 5, "depth": 1})},
        "width_size",
    ),
    "dataset": ({"dataset": _source(z=X[:, :1])}, "dataset_hash"),
    "dataset.drop_remainder": (
        {"dataset": TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1]}), drop_remainder=False)},
        "dataset_drop_remainder",
    ),
    "loss": ({"loss": MSE(reduction="sum")}, "reduction"),
    "optimizer_config": ({"optimizer_config": {"name": "adam", "lr": 0.02}}, "lr"),
    "max_steps": ({"max_steps": 30}, "max_steps"),
    "batch_size": ({"batch_size": 16}, "batch_size"),
    "seed": ({"seed": 1}, "seed"),
    "accum": ({"accum": 2}, "accum"),
    "grad_clip_norm": ({"grad_clip_norm": 1.0}, "grad_clip_norm"),
    "steps_per_call": ({"steps_per_call": 5}, "steps_per_call"),
    "steps_per_epoch": ({"steps_per_epoch": 4}, "steps_per_epoch"),
    "target_key": (
        {
            "dataset": _source(z=X[:, :1] * 3),
            "val_dataset": TrainingDataset(
                source=ArraySource(arrays={"x": X[:16], "y": X[:16, :1], "z": X[:16, :1] * 3}), shuffle=False
            ),
            "target_key": "z",
        },
        "target_key",
    ),
    "eval_batch_size": ({"eval_batch_size": 4}, "eval_batch_size"),
    "gradient": ({"gradient": SAM(rho=0.05)}, "gradient"),
    "param_groups": ({"param_groups": (ParamGroup(pattern="*.bias", lr_scale=0.5),)}, "param_groups"),
    "precision": ({"precision": {"compute": "bfloat16"}}, "precision"),
}
# Covered by the tests above: dataset.shuffle, val_dataset, eval_every_n_steps, callbacks.
REFUSED_ABOVE = ("val_dataset", "eval_every_n_steps", "callbacks")
# Not tried here (each needs a second model or device layout); in the fingerprint all the same. Of `mesh`, only
# `shard_params` is refused: another device or process count is an elastic resume (tests/scale/test_elastic.py).
REFUSED_UNTRIED = ("task", "transfer", "input_key", "mesh")

HARMLESS: dict[str, dict[str, Any]] = {
    "log_every_n_steps": {"log_every_n_steps": 3},
    "progress": {"progress": True},
    "test_dataset": {"test_dataset": TrainingDataset(source=ArraySource(arrays={"x": X[:8], "y": X[:8, :1]}))},
    "diagnostics": {"diagnostics": True},
    "stop_on_nonfinite": {"stop_on_nonfinite": False},
    "metric_writer": {"metric_writer": NullWriter()},
    "restore_best": {"restore_best": True},  # acts after the last step: resumed or not, the same best checkpoint
    "metrics": {"metrics": (MAE(),)},  # more numbers at each evaluation; a callback monitoring one is fingerprinted
    "resume": {"resume": "auto"},
}
# How and where a run is recorded, not what it computes; `init_from` is read only by a fresh start (a resume
# continues its own checkpoint), and so is `carry`; `preset` is a name: the fields it fills are compared by their
# resolved values.
HARMLESS_BY_NATURE = ("name", "checkpoint_dir", "backend", "init_from", "carry", "preset")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("interrupted") / "r"
    _interrupted(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    with run_settings(run_dir=str(tmp_path_factory.mktemp("whole") / "r"), store=False):
        _, artifact = _loop(callbacks=(CKPT,)).run()
    return str(artifact.trained_model_hash)


def test_every_training_loop_field_is_classified_for_resume():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainingLoop)}
    classified = {
        *REFUSED,
        *REFUSED_ABOVE,
        *REFUSED_UNTRIED,
        *HARMLESS,
        *HARMLESS_BY_NATURE,
    }
    classified = {name.split(".")[0] for name in classified}
    assert fields - classified == set(), "classify the new TrainingLoop field(s) here and in docs/reliability.md"


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_changing_a_field_that_changes_the_result_is_refused_with_a_diff(interrupted: Path, tmp_path: Path, field: str):
    import shutil

    change, key = REFUSED[field]
    run_dir = tmp_path / "r"
    shutil.copytree(interrupted, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    with pytest.raises(CheckpointMismatchError, match=rf"(?s)configuration changed.*{key}.*--force-resume"):
        _resume(run_dir, **change)


@pytest.mark.parametrize("field", sorted(HARMLESS))
def test_changing_a_harmless_field_resumes_bitwise(
    interrupted: Path, uninterrupted_hash: str, tmp_path: Path, field: str
):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(interrupted, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    _, artifact = _resume(run_dir, **HARMLESS[field])
    expected = uninterrupted_hash
    if field != "resume":  # the uninterrupted run with the changed value (resume: "auto" there has nothing to resume)
        with run_settings(run_dir=str(tmp_path / "whole"), store=False):
            expected = _loop(callbacks=(CKPT,), **HARMLESS[field]).run()[1].trained_model_hash
    assert artifact.trained_model_hash == expected


# A finished stage -----------------------------------------------------------------------------------------------
def _finished(tmp_path: Path, **overrides: Any) -> tuple[Path, dict[str, bytes]]:
    """A stage (data in a file, so its YAML loads again) that ran to the end in ``tmp_path/r``, and its run files."""
    from pipekit_train import NpzSource

    np.savez(tmp_path / "data.npz", x=X, y=X[:, :1])
    data = TrainingDataset(source=NpzSource(path=str(tmp_path / "data.npz")))
    loop = _loop(dataset=data, val_dataset=None, **overrides)
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        loop.run()
    stage = tmp_path / "r" / "s"
    return stage, {name: (stage / name).read_bytes() for name in ("final.json", "metrics.jsonl", "artifact.json")}


def _resume_finished(tmp_path: Path, force: bool = False, **overrides: Any) -> Any:
    from pipekit_train import NpzSource

    data = TrainingDataset(source=NpzSource(path=str(tmp_path / "data.npz")))
    loop = _loop(dataset=data, val_dataset=None, **overrides)
    with run_settings(run_dir=str(tmp_path / "r"), store=False, resume="auto", force_resume=force):
        return loop.run()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["no-checkpoint", "checkpointed"])
def test_a_finished_stage_whose_configuration_changed_is_refused_with_the_diff(tmp_path: Path, checkpointed: bool):
    """With or without a Checkpoint, never trained again: the fingerprint of its record (or of its last
    checkpoint) against this run's, as diff."""
    callbacks = (CKPT,) if checkpointed else ()
    stage, before = _finished(tmp_path, callbacks=callbacks)
    with pytest.raises(CheckpointMismatchError) as info:
        _resume_finished(tmp_path, callbacks=callbacks, optimizer_config={"name": "adam", "lr": 0.02})
    text = str(info.value)
    if checkpointed:
        assert "the configuration changed since that checkpoint was written" in text and "--force-resume" in text
    else:
        assert f"refusing to resume stage 's': it finished at step 20 in {stage} under another configuration" in text
        assert "--- finished stage\n+++ this run" in text and f"delete {stage} to train the stage again" in text
    assert '-  "lr": 0.01,' in text and '+  "lr": 0.02,' in text, text
    assert {name: (stage / name).read_bytes() for name in before} == before  # nothing trained, nothing rewritten


def test_a_finished_stage_whose_change_alters_nothing_it_computed_is_taken_as_it_is(tmp_path: Path):
    stage, before = _finished(tmp_path)
    _, artifact = _resume_finished(tmp_path, log_every_n_steps=10, progress=False)
    assert {name: (stage / name).read_bytes() for name in before} == before
    assert artifact.backend_info["steps"] == 20


def test_force_resume_continues_a_changed_finished_stage_from_its_last_checkpoint(tmp_path: Path):
    _finished(tmp_path, callbacks=(CKPT,))
    with pytest.warns(PipekitTrainWarning, match=r"--force-resume: stage 's' continues from step 20"):
        _, artifact = _resume_finished(tmp_path, force=True, callbacks=(CKPT,), max_steps=30)
    assert artifact.backend_info["steps"] == 30
