"""What a resume compares: everything that changes the result, nothing that doesn't; --force-resume; callback state
follows the callback, not its position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    CheckpointMismatchError,
    EarlyStopping,
    EquinoxModel,
    Last,
    PipekitTrainWarning,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)

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
