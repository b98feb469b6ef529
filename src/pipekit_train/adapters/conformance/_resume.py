"""The conformance checks on checkpoints: a SIGTERM and a resume end bitwise where an uninterrupted run ends,
``restore_best`` returns the best checkpoint's weights, and ``keep`` selectors leave the checkpoints they name (a
warm start from the latest one starts from the final weights).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._problem import _capabilities, _problem, _read_json, _run


def check_resumes_exactly(backend: str, tmp: Path) -> None:
    """A run stopped by SIGTERM between two evaluations (step 15 of 30: evaluations and checkpoints at 10, 20,
    30) and resumed ends bitwise where an uninterrupted run ends: the weights, every callback's saved state and
    the logged history. With the ``weights`` capability the stage also has `ReduceLROnPlateau` and
    `EarlyStopping`, which act on the evaluations (the warm-up cosine schedule of every check runs under them)."""
    import signal

    from pipekit_train import Callback, Checkpoint, TrainingInterrupted
    from pipekit_train.callbacks import EarlyStopping, ReduceLROnPlateau
    from pipekit_train.checkpoint import Checkpointer, Last

    class TermAt15(Callback, register=False):
        """SIGTERM after the chunk that reaches step 15, when armed: the loop finishes it, checkpoints, stops."""

        needs_every_step = False  # it only observes: the chunks stay fused (they end at 15, a logging step)
        armed = False

        def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
            if TermAt15.armed and ctx.step == 15:
                TermAt15.armed = False
                os.kill(os.getpid(), signal.SIGTERM)

        def fingerprint(self) -> None:
            return None  # it interrupts the run; it does not change what is trained

    callbacks: list[Any] = [Checkpoint(every_n_steps=10, keep=(Last(n=1),), async_save=False), TermAt15()]
    loop = _problem(backend)
    if "weights" in _capabilities(backend) and loop.val_dataset is not None:
        callbacks += [ReduceLROnPlateau(patience=0, factor=0.5, threshold=0.5), EarlyStopping(patience=10)]
    loop = loop.replace(callbacks=tuple(callbacks))
    full, _ = _run(loop, tmp / "full")
    TermAt15.armed = True
    try:
        _run(loop, tmp / "part")
    except TrainingInterrupted as stop:
        assert stop.reason == "SIGTERM" and stop.artifact.status == "stopped: SIGTERM", (
            f"{backend}: the stopped run reports {stop.reason!r} with status {stop.artifact.status!r}"
        )
    else:
        raise AssertionError(f"{backend}: SIGTERM at step 15 did not stop the run")
    finally:
        TermAt15.armed = False
    from pipekit_train import run_settings

    with run_settings(run_dir=str(tmp / "part"), store=False, resume="auto"):
        resumed, _ = loop.run()
    assert resumed.weights_hash() == full.weights_hash(), (
        f"{backend}: the weights resumed from step 15 ({resumed.weights_hash()}) differ from an uninterrupted "
        f"run's ({full.weights_hash()})"
    )

    def final_callbacks(run: str) -> Any:
        with Checkpointer(tmp / run / "stage0" / "checkpoints", async_save=False) as ckpt:
            return ckpt.restore("latest")[2].get("callbacks")

    want, got = final_callbacks("full"), final_callbacks("part")
    assert got == want, f"{backend}: the callbacks' saved state after the resume is {got}, uninterrupted {want}"
    from ...cli._check_resume_compare import history_difference

    differs = history_difference(tmp / "full", tmp / "part")
    assert differs is None, f"{backend}: the logged history after a SIGTERM at step 15 and a resume {differs}"


def check_restores_the_best_checkpoint(backend: str, tmp: Path) -> None:
    """With the ``weights`` capability and validation: ``restore_best`` returns the weights of the best checkpoint
    (here the one of step 10: ``mode: max`` on ``validate/loss`` makes the worst loss the best), and the artifact
    records that step's validation metrics and names the step (`TrainingArtifact.restored`)."""
    if "weights" not in _capabilities(backend):
        return
    from pipekit_train import Callback, Checkpoint
    from pipekit_train.checkpoint import Best, Last

    seen: dict[int, tuple[str, dict[str, float]]] = {}

    class RecordEvals(Callback, register=False):
        def on_eval_end(self, ctx: Any, metrics: Mapping[str, float]) -> None:
            seen[ctx.step] = (ctx.model.weights_hash(), dict(metrics))

    ckpt = Checkpoint(every_n_steps=10, keep=(Best(k=1), Last(n=1)), monitor="validate/loss", mode="max")
    loop = _problem(backend, restore_best=True, callbacks=(ckpt, RecordEvals()))
    if loop.val_dataset is None:
        return
    model, artifact = _run(loop, tmp / "best")
    best = max(seen, key=lambda step: (seen[step][1]["validate/loss"], -step))
    assert best != 30, f"{backend}: the validation loss rose over training ({seen}); the check needs it to fall"
    assert model.weights_hash() == seen[best][0] == artifact.trained_model_hash, (
        f"{backend}: restore_best returned weights {model.weights_hash()}, the artifact says "
        f"{artifact.trained_model_hash}, the best checkpoint (step {best}) held {seen[best][0]}"
    )
    recorded = {k: v for k, v in artifact.final_metrics.items() if k.startswith("validate/")}
    assert recorded == seen[best][1], (
        f"{backend}: the artifact records {recorded} as the validation metrics of the returned model, but the best "
        f"step {best} evaluated to {seen[best][1]}"
    )
    restored = artifact.restored or {}
    assert restored.get("step") == best and restored.get("last_step") == 30, (
        f"{backend}: the artifact's restored record is {artifact.restored}, not step {best} of 30"
    )


def check_keeps_checkpoints_by_selectors(backend: str, tmp: Path) -> None:
    """``keep=(Last(n=2),)`` keeps the last two checkpoints; the latest holds the final weights (``init_from``)."""
    from pipekit_train import Callback, Checkpoint
    from pipekit_train.checkpoint import Last

    model, _ = _run(_problem(backend, callbacks=(Checkpoint(every_n_steps=5, keep=(Last(n=2),)),)), tmp / "keep")
    directory = tmp / "keep" / "stage0" / "checkpoints"
    on_disk = sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())
    listed = [entry["step"] for entry in _read_json(directory / "manifest.json")["entries"]]
    assert on_disk == [25, 30], f"{backend}: saving every 5 of 30 steps keeping Last(n=2) left steps {on_disk} on disk"
    assert listed == [25, 30], f"{backend}: manifest.json lists steps {listed}, not [25, 30]"
    if "init_from" not in _capabilities(backend):
        return

    starts: list[str] = []

    class RecordStart(Callback, register=False):
        def on_train_start(self, ctx: Any) -> None:
            starts.append(ctx.model.weights_hash())

    warm = _problem(backend, max_steps=1, init_from=f"{directory}@latest", callbacks=(RecordStart(),))
    if warm.optimizer_config.get("warmup_steps"):  # one step: no room for the warm-up
        warm = warm.replace(optimizer_config={**warm.optimizer_config, "warmup_steps": 0})
    _run(warm, tmp / "warm")
    assert starts == [model.weights_hash()], (
        f"{backend}: a warm start from the checkpoint of step 30 starts from weights {starts}, not the final "
        f"weights {model.weights_hash()} (weights_tree / load_weights_tree)"
    )
