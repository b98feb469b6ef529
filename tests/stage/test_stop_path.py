"""A signal's stop, resumed, is bitwise the uninterrupted run: weights, callback state, kept checkpoints, history.

A stage with validation and stateful callbacks (`ReduceLROnPlateau`, `EarlyStopping`, `EMA`, `Best` retention and
`restore_best`) is stopped by a real SIGTERM between two evaluations and right after one, and resumed with
``resume="auto"``. The continuation must make the uninterrupted run's decisions: the same learning-rate reductions
at the same steps, the same early-stopping counters, the same checkpoints kept and ranked, the same logged records
(the records the stop shows are marked ``interrupted`` and dropped by the history), the same returned weights and
the same recorded metrics. Equinox, and Lightning (torch: a backend that is not JAX-native).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from pipekit_train import (
    ArraySource,
    Callback,
    Checkpoint,
    CrossEntropy,
    TrainingDataset,
    TrainingInterrupted,
    TrainingLoop,
    run_settings,
)
from pipekit_train.callbacks import EMA, EarlyStopping, ReduceLROnPlateau
from pipekit_train.checkpoint import Best, Last
from pipekit_train.tracking import history

pytestmark = pytest.mark.xdist_group("stop-path")

_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(192, 6)).astype(np.float32)
_Y = (_X[:, :3].sum(axis=1) > 0).astype(np.int32) + (_X[:, 3] > 0.5).astype(np.int32)


def _data(lo: int, hi: int) -> TrainingDataset:
    return TrainingDataset(source=ArraySource(arrays={"x": _X[lo:hi], "y": _Y[lo:hi]}))


class TermAt(Callback, register=False):
    """Sends this process SIGTERM after the chunk that reaches `at` (when armed): a real signal, handled by the
    stage's own handlers. It only observes steps, so it keeps the chunks fused (`needs_every_step = False`)."""

    needs_every_step = False
    at: ClassVar[list[int]] = [0]

    def fingerprint(self) -> None:
        return None

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if self.at[0] and ctx.step == self.at[0]:
            self.at[0] = 0
            os.kill(os.getpid(), signal.SIGTERM)


# The stateful built-in callbacks, each alone and all together; patience and factors small enough to act in 48 steps.
PLATEAU = ReduceLROnPlateau(patience=0, factor=0.5, threshold=0.05)
EARLY = EarlyStopping(patience=3, min_delta=0.02)
CALLBACKS = {
    "plateau": (PLATEAU,),
    "early-stopping": (EARLY,),
    "ema": (EMA(decay=0.9),),
    "all": (PLATEAU, EARLY, EMA(decay=0.9)),
}
MLP = {"in_size": 6, "out_size": 3, "width_size": 16, "depth": 1}
MODELS = ("equinox", "lightning")


def _model(backend: str) -> Any:
    if backend == "equinox":
        from pipekit_train import EquinoxModel

        return EquinoxModel(factory="mlp", kwargs=MLP)
    from pipekit_train.adapters.lightning import TorchModel

    return TorchModel(factory="mlp", kwargs=MLP)


def _loop(backend: str, callbacks: tuple[Callback, ...]) -> TrainingLoop:
    return TrainingLoop(
        backend=backend,
        model_op=_model(backend),
        dataset=_data(0, 128),
        val_dataset=_data(128, 192),
        loss=CrossEntropy(),
        optimizer_config={"name": "sgd", "lr": 0.3, "momentum": 0.9},
        max_steps=48,
        batch_size=16,
        log_every_n_steps=2,
        eval_every_n_steps=6,
        seed=5,
        progress=False,
        restore_best=True,
        callbacks=(
            *callbacks,
            Checkpoint(every_n_steps=12, keep=(Best(k=5), Last(n=1)), async_save=False),
            TermAt(),
        ),
    )


def _run(loop: TrainingLoop, run_dir: Path, resume: str = "never") -> Any:
    with run_settings(run_dir=str(run_dir), store=str(run_dir / "store.sqlite"), resume=resume):
        return loop.run()


def _outcome(run_dir: Path) -> dict[str, Any]:
    """What must be bitwise: the logged history (not timings), the events, the kept checkpoints with their scores
    and the callbacks' state in the last one, the artifact's metrics and restored step."""
    stage = run_dir / "stage0"
    records = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    events = [{k: v for k, v in r.items() if k != "time"} for r in records if r.get("type") == "event"]
    hist = {c: s for c, s in history(str(stage))[str(stage)]["stage0"].items() if c != "time"}
    manifest = json.loads((stage / "checkpoints" / "manifest.json").read_text())
    kept = [(e["step"], e["score"], e.get("resume_point", False)) for e in manifest["entries"]]
    last = max(e["step"] for e in manifest["entries"])
    record = json.loads((stage / "checkpoints" / str(last) / "meta.json").read_text())
    artifact = json.loads((stage / "artifact.json").read_text())
    metrics = {k: v for k, v in artifact["final_metrics"].items() if not k.startswith("time/")}
    restored = artifact.get("restored")
    if restored is not None:
        restored = {**restored, "last_metrics": {k: v for k, v in restored["last_metrics"].items() if "time/" not in k}}
    return {
        "history": hist,
        "events": events,
        "kept": kept,
        "callbacks": record["user"]["callbacks"],
        "status": artifact["status"],
        "metrics": metrics,
        "restored": restored,
        "weights": artifact["trained_model_hash"],
    }


_REFERENCES: dict[tuple[str, str], dict[str, Any]] = {}


def _reference(backend: str, callbacks: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run of `backend` with `callbacks`, once per test process."""
    key = (backend, callbacks)
    if key not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp(f"ref-{backend}-{callbacks}")
        _run(_loop(backend, CALLBACKS[callbacks]), run_dir)
        _REFERENCES[key] = _outcome(run_dir)
    return _REFERENCES[key]


@pytest.mark.parametrize("backend", MODELS)
@pytest.mark.parametrize("callbacks", sorted(CALLBACKS))
@pytest.mark.parametrize(
    "kill_at", [8, 6, 12], ids=["between-evaluations", "right-after-an-evaluation", "at-a-checkpoint-step"]
)
def test_a_sigterm_then_resume_is_bitwise_the_uninterrupted_run(
    backend, callbacks, kill_at, tmp_path, tmp_path_factory
):
    reference = _reference(backend, callbacks, tmp_path_factory)
    loop = _loop(backend, CALLBACKS[callbacks])
    TermAt.at[0] = kill_at
    with pytest.raises(TrainingInterrupted) as stopped:
        _run(loop, tmp_path / "run")
    assert stopped.value.reason == "SIGTERM" and stopped.value.artifact.status == "stopped: SIGTERM"
    # The stop shows where it was: the partial window's means and a validation pass at the stop step (unless one
    # ran there), marked interrupted.
    records = [json.loads(line) for line in (tmp_path / "run" / "stage0" / "metrics.jsonl").read_text().splitlines()]
    shown = [(r["context"], r["step"]) for r in records if r.get("interrupted")]
    assert ("validate", kill_at) in shown if kill_at % 6 else ("validate", kill_at) not in shown
    _run(loop, tmp_path / "run", resume="auto")
    resumed = _outcome(tmp_path / "run")
    for part in reference:
        assert resumed[part] == reference[part], f"{part} differs after a SIGTERM at step {kill_at}"


def test_the_callbacks_act_in_the_reference_run(tmp_path_factory):
    """The scenario means something: in 48 steps the plateau lowers the rate, early stopping counts bad passes,
    and restore_best returns a step that is not the last."""
    ref = _reference("equinox", "all", tmp_path_factory)
    assert [e["event"] for e in ref["events"]].count("reduce_lr") >= 1
    early = next(v for k, v in ref["callbacks"].items() if k.startswith("EarlyStopping"))
    assert early["best_step"] is not None
    assert ref["restored"]["step"] != ref["restored"]["last_step"] or ref["status"] != "completed"


def test_a_signal_in_the_last_chunk_lets_the_stage_finish_and_be_recorded(tmp_path, tmp_path_factory):
    """A SIGTERM as the stage reaches max_steps stops nothing of it: the stage is recorded as completed (its
    final.json, its artifact), the pipeline stops after it, and a resume takes the finished stage as it is."""
    reference = _reference("equinox", "all", tmp_path_factory)
    loop = _loop("equinox", CALLBACKS["all"])
    TermAt.at[0] = 48
    with pytest.raises(TrainingInterrupted) as stopped:
        _run(loop, tmp_path / "run")
    assert stopped.value.artifact.status == "completed"
    assert (tmp_path / "run" / "stage0" / "final.json").exists()
    assert _outcome(tmp_path / "run") == reference
    _, state = _run(loop, tmp_path / "run", resume="auto")  # nothing left to train: the recorded stage
    assert state.artifact_id == stopped.value.artifact.artifact_id


def test_a_stage_a_callback_stopped_and_killed_before_it_was_recorded_ends_there_again(tmp_path):
    """Early stopping ended the stage at step s and wrote its stop checkpoint; a kill came before the artifact and
    final.json. The resumed run ends at s with the same status and weights: it does not train on past the stop."""
    loop = _loop("equinox", (EarlyStopping(patience=1, min_delta=0.5),))
    model, artifact = _run(loop, tmp_path / "ref")
    assert artifact.status.startswith("stopped: early stopping"), artifact.status
    stopped_at = artifact.backend_info["steps"]
    assert stopped_at < 48
    cut = tmp_path / "cut"
    _run(loop, cut)
    for name in ("final.json", "artifact.json"):  # what the kill left unwritten
        (cut / "stage0" / name).unlink()
    (cut / "store.sqlite").unlink()
    resumed, again = _run(loop, cut, resume="auto")
    assert (again.status, again.backend_info["steps"]) == (artifact.status, stopped_at)
    assert resumed.weights_hash() == model.weights_hash()


class IntAt(TermAt, register=False):
    """`TermAt`, with SIGINT."""

    at: ClassVar[list[int]] = [0]

    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if self.at[0] and ctx.step == self.at[0]:
            self.at[0] = 0
            os.kill(os.getpid(), signal.SIGINT)


def test_an_inherited_ignored_sigint_stays_ignored_while_training(tmp_path, tmp_path_factory):
    """A background job of a shell runs with SIGINT ignored: training does not take it over, so a Ctrl+C meant
    for the shell's foreground job does not stop it."""
    reference = _reference("equinox", "ema", tmp_path_factory)
    loop = _loop("equinox", CALLBACKS["ema"])
    loop = loop.replace(callbacks=(*loop.callbacks, IntAt()))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        IntAt.at[0] = 8
        _run(loop, tmp_path / "run")
        assert IntAt.at[0] == 0  # it was sent
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # and is still ignored after the stage
    finally:
        signal.signal(signal.SIGINT, previous)
        IntAt.at[0] = 0
    outcome = _outcome(tmp_path / "run")
    outcome["callbacks"].pop("IntAt:0")
    assert outcome == reference
