"""Conformance checks every backend adapter must pass (run: ``python -m pipekit_train.adapters.conformance NAME``).

Each check builds a tiny regression problem, runs the adapter through `TrainingLoop` exactly as users do, and
raises `AssertionError` with a readable message when the adapter breaks the contract in ``adapters/README.md``.
`tests/test_adapter_contract.py` runs every check over every implemented backend, so a new adapter is covered the
moment it is added to ``_IMPLEMENTED_BACKENDS``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np


def _problem(backend: str, **overrides: Any) -> Any:
    from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    fields: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": y})),
        val_dataset=TrainingDataset(source=ArraySource(arrays={"x": x[:32], "y": y[:32]}), shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=30,
        batch_size=16,
        eval_every_n_steps=10,
        log_every_n_steps=10,
        backend=backend,
        progress=False,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def _run(loop: Any, run_dir: Path) -> tuple[Any, Any]:
    from pipekit_train import run_settings

    with run_settings(run_dir=str(run_dir), store=False):
        return loop.run()  # type: ignore[no-any-return]


def check_returns_a_trained_model(backend: str, tmp: Path) -> None:
    """``run`` returns a bound model operator of the loop's architecture, and the loss went down."""
    loop = _problem(backend)
    model, artifact = _run(loop, tmp / "a")
    assert model == loop.model_op, f"{backend}: the returned model is {model!r}, not the loop's architecture"
    assert model.module is not None, f"{backend}: the returned model is not bound to weights"
    assert model(np.zeros((2, 4), np.float32)).shape == (2, 1)
    records = [json.loads(line) for line in (tmp / "a" / "stage0" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r.get("type") == "metrics" and r.get("context") == "train"]
    assert len(train) == 3 and train[-1] < train[0], f"{backend}: training losses {train} did not go down"
    assert artifact.backend == backend and artifact.backend_info.get("steps") == 30


def check_is_deterministic(backend: str, tmp: Path) -> None:
    """The same loop and seed give bitwise the same weights; another seed gives others."""
    a, _ = _run(_problem(backend), tmp / "d1")
    b, _ = _run(_problem(backend), tmp / "d2")
    c, _ = _run(_problem(backend, seed=1), tmp / "d3")
    assert a.weights_hash() == b.weights_hash(), f"{backend}: two runs with one seed differ"
    assert a.weights_hash() != c.weights_hash(), f"{backend}: the seed does not change the weights"


def check_calls_callbacks_in_order(backend: str, tmp: Path) -> None:
    """Hooks run in the documented order, once per step / evaluation, with the step counter right."""
    from pipekit_train import Callback

    events: list[tuple[str, int]] = []

    class Record(Callback, register=False):
        def on_train_start(self, ctx: Any) -> None:
            events.append(("start", ctx.step))

        def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
            events.append(("step", ctx.step))

        def on_eval_end(self, ctx: Any, metrics: Mapping[str, float]) -> None:
            assert "validate/loss" in metrics, f"{backend}: on_eval_end got {sorted(metrics)}"
            events.append(("eval", ctx.step))

        def on_train_end(self, ctx: Any) -> None:
            events.append(("end", ctx.step))

    _run(_problem(backend, callbacks=(Record(),)), tmp / "cb")
    steps = [s for e, s in events if e == "step"]
    assert events[0] == ("start", 0) and events[-1] == ("end", 30), f"{backend}: events {events[:2]}..{events[-2:]}"
    assert steps == list(range(1, 31)), f"{backend}: on_step_end saw steps {steps}"
    assert [s for e, s in events if e == "eval"] == [10, 20, 30]


def check_resumes_exactly(backend: str, tmp: Path) -> None:
    """A run stopped by SIGTERM at step 20 and resumed gives bitwise the weights of an uninterrupted run."""
    import os
    import signal

    from pipekit_train import Callback, Checkpoint, Last, TrainingInterrupted, run_settings

    class TermAt20(Callback, register=False):
        def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
            if ctx.step == 20:
                os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: finish the step, checkpoint, stop

    ckpt = Checkpoint(every_n_steps=10, keep=(Last(n=1),), async_save=False)
    full, _ = _run(_problem(backend, callbacks=(ckpt,)), tmp / "full")
    try:
        _run(_problem(backend, callbacks=(ckpt, TermAt20())), tmp / "part")
    except TrainingInterrupted as stop:
        assert stop.reason == "SIGTERM" and stop.artifact.status == "stopped: SIGTERM"
    else:
        raise AssertionError(f"{backend}: SIGTERM did not stop the run")
    with run_settings(run_dir=str(tmp / "part"), store=False, resume="auto"):
        resumed, _ = _problem(backend, callbacks=(ckpt,)).run()
    assert resumed.weights_hash() == full.weights_hash(), f"{backend}: resumed weights differ from uninterrupted"


CHECKS: dict[str, Callable[[str, Path], None]] = {
    "returns_a_trained_model": check_returns_a_trained_model,
    "is_deterministic": check_is_deterministic,
    "calls_callbacks_in_order": check_calls_callbacks_in_order,
    "resumes_exactly": check_resumes_exactly,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pipekit_train.adapters.conformance BACKEND", file=sys.stderr)
        return 2
    failed = 0
    for name, check in CHECKS.items():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                check(argv[0], Path(tmp))
            except AssertionError as e:
                failed += 1
                print(f"FAIL {name}: {e}")
            else:
                print(f"ok   {name}")
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
