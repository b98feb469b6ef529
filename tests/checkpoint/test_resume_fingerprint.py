"""What a resume compares: everything that changes the result, nothing that doesn't; --force-resume; callback state
follows the callback, not its position."""

from __future__ import annotations

import os
import signal
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
    TrainingInterrupted,
    TrainingLoop,
    run_settings,
)

pytestmark = pytest.mark.xdist_group("resume-fingerprint")  # one worker: its module fixtures are built once

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)


class StopAt(Callback, register=False):
    """Interrupts the first run at `step` with a real SIGTERM (a graceful stop writes a checkpoint to resume from).

    Not `ctx.request_stop`: a stage a callback stopped has ended, and a resume ends it there again."""

    step: int = 10

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        if ctx.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

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
    with run_settings(run_dir=str(run_dir), store=False), pytest.raises(TrainingInterrupted):
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


# The checkpoint cadence -------------------------------------------------------------------------------------------
# With fused steps, chunks end at checkpoint steps (engine/_chunks.py): a cadence is compared only where it shapes the
# chunks (`_fingerprint.cadence_shapes_chunks`), so a change that is accepted resumes into the uninterrupted run's
# chunks.


def _chunks(loop: Any, every: int | None) -> list[tuple[int, int]]:
    """``(first, last)`` of every chunk the engine cuts `loop`'s steps into, with checkpoints every `every` steps:
    the engine's own `_periods`, `chunk_plan` and `next_chunk`, on a stand-in holding what they read."""
    from types import SimpleNamespace

    from pipekit_train.engine._chunks import chunk_plan
    from pipekit_train.engine._loop import Engine

    class Cutter:
        _periods, _boundaries, next_chunk = Engine._periods, Engine._boundaries, Engine.next_chunk

    cutter = Cutter()
    backend = SimpleNamespace(chunk_periods=lambda: [], next_boundary=lambda step: None)  # the StepBackend defaults
    cutter.loop, cutter.backend, cutter.step = loop, backend, 0  # type: ignore[attr-defined]
    cutter.hooks = SimpleNamespace(boundaries=lambda: [every] if every else [])  # type: ignore[attr-defined]
    cutter.chunks = chunk_plan(loop, cutter._periods(), True, 1, ())  # type: ignore[attr-defined]
    out = []
    while cutter.step < loop.max_steps:  # type: ignore[attr-defined]
        n = cutter.next_chunk()
        out.append((cutter.step, cutter.step + n))  # type: ignore[attr-defined]
        cutter.step += n  # type: ignore[attr-defined]
    return out


def test_a_cadence_taken_as_shaping_no_chunk_never_does():
    """Over a grid of cadences, fusion settings and schedules: whenever `cadence_shapes_chunks` says a cadence
    shapes nothing, the engine cuts exactly the chunks it cuts with no checkpoint at all (the rule is safe); and it
    lets most cadences that are multiples of a boundary through (the rule is useful)."""
    from types import SimpleNamespace

    from pipekit_train.engine._fingerprint import cadence_shapes_chunks

    free = checked = 0
    for setting in ("auto", 2, 4, 6):
        for log, val, spe, max_steps in [(5, None, None, 40), (4, 6, None, 48), (10, None, 7, 70), (3, 9, 12, 36)]:
            loop = SimpleNamespace(
                steps_per_call=setting,
                log_every_n_steps=log,
                val_dataset=object() if val else None,
                eval_every_n_steps=val or 0,
                steps_per_epoch=spe,
                max_steps=max_steps,
            )
            plain = _chunks(loop, None)
            for every in range(1, 2 * max_steps + 1):
                checked += 1
                if not cadence_shapes_chunks(loop, every):
                    free += 1
                    assert _chunks(loop, every) == plain, (setting, log, val, spe, max_steps, every)
    assert checked == 4 * (80 + 96 + 140 + 72) and free > checked // 4


def _traced(monkeypatch: pytest.MonkeyPatch, trace: Path, loop: TrainingLoop) -> tuple[Any, list[dict[str, Any]]]:
    """`loop.run()` with the resume probe tracing every chunk into `trace`: its artifact and the chunks it ran."""
    import json

    monkeypatch.setenv("PIPEKIT_RESUME_PROBE", json.dumps({"trace": str(trace)}))
    try:
        _, artifact = loop.run()
    finally:
        monkeypatch.delenv("PIPEKIT_RESUME_PROBE")
    return artifact, [json.loads(line) for line in trace.read_text().splitlines()]


class StopAfterEval(Callback, register=False):
    """Interrupts the run (SIGTERM) after the evaluation of `step`: unlike `StopAt` (`on_step_end`), it lets the
    steps fuse."""

    step: int = 10

    def on_eval_end(self, ctx: Any, metrics: Any) -> None:
        if ctx.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def fingerprint(self) -> None:
        return None


def test_a_cadence_change_that_shapes_no_chunk_resumes_bitwise_into_the_same_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Fused (`auto`: chunks of 5 between the log, eval and checkpoint steps), stopped at step 10 with checkpoints
    every 5, resumed with checkpoints every 10: every chunk (its steps, and the digest of every state leaf, the data
    position and the callbacks' state after it) is the uninterrupted every-10 run's, and so are the weights."""
    import json

    every10 = Checkpoint(every_n_steps=10, keep=(Last(n=1),), async_save=False)
    with run_settings(run_dir=str(tmp_path / "r"), store=False), pytest.raises(TrainingInterrupted):
        _traced(monkeypatch, tmp_path / "a.jsonl", _loop(callbacks=(CKPT, StopAfterEval())))
    with run_settings(run_dir=str(tmp_path / "r"), store=False, resume="auto"):
        resumed, after = _traced(monkeypatch, tmp_path / "b.jsonl", _loop(callbacks=(every10,)))
    with run_settings(run_dir=str(tmp_path / "whole"), store=False):
        whole, chunks = _traced(monkeypatch, tmp_path / "c.jsonl", _loop(callbacks=(every10,)))
    before = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]

    def key(record: dict[str, Any]) -> tuple[Any, ...]:
        return record["first"], record["step"], json.dumps(record["state"], sort_keys=True), record["data"]

    assert [(r["first"], r["step"]) for r in chunks] == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert [key(r) for r in before] + [key(r) for r in after] == [key(r) for r in chunks]
    assert resumed.trained_model_hash == whole.trained_model_hash


def test_a_cadence_change_that_shapes_the_chunks_is_refused(interrupted: Path, tmp_path: Path):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(interrupted, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    every4 = Checkpoint(every_n_steps=4, keep=(Last(n=1),), async_save=False)  # cuts at 4, 8, 12, 16: not boundaries
    diff = r'- "checkpoint_every": "shapes no chunk \(a multiple of a boundary\)",\n\+ "checkpoint_every": 4,'
    with (
        pytest.raises(CheckpointMismatchError, match=rf"(?s)configuration changed.*{diff}"),
        run_settings(run_dir=str(run_dir), store=False, resume="auto"),
    ):
        _loop(callbacks=(every4,)).run()
