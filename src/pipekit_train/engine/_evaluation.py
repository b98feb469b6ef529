"""Evaluation: the validation pass at the eval cadence (and at a stop), the stage's final metrics (those of the
model it returns, after `restore_best` the restored step's), the test split, and `evaluate`, one ordered pass of a
split through the backend's eval step and the loop's whole-split metrics."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..callbacks._base import Callback, TrainContext
from ..tracking._progress import CompileWatch, PhaseClock, Progress

if TYPE_CHECKING:
    from ..backends._contract import StepBackend


class Evaluation:
    """The engine's validation and test passes and its final metrics (a part of `Engine`)."""

    loop: Any
    backend: StepBackend
    callbacks: tuple[Callback, ...]
    ctx: TrainContext
    clock: PhaseClock
    progress: Progress | None
    step: int
    last_train: dict[str, Any]
    eval_metrics: dict[str, Any]
    evaluated_at: int | None
    _restored: tuple[int, Mapping[str, Any]] | None
    _restored_record: dict[str, Any] | None

    if TYPE_CHECKING:

        def _emit(self, record: dict[str, Any]) -> None: ...

        def _phase_start(self, phase: str) -> None: ...

        def _phase(self, phase: str, duration_s: float) -> None: ...

    def _evaluate(self, observe: bool = True) -> dict[str, float]:
        """A validation pass at this step: a record, the progress line and (with `observe`) the callbacks'
        `on_eval_end`; without `observe` nothing the run goes on from changes (a stop's display)."""
        loop = self.loop
        self._phase_start("evaluating")
        t0, compiles = time.perf_counter(), CompileWatch.count
        metrics = evaluate(self.backend, loop.val_dataset, loop.eval_batch_size or loop.batch_size, loop)
        seconds = time.perf_counter() - t0
        self.clock.eval_s += seconds
        self.clock.eval_compiles += CompileWatch.count - compiles
        self._phase("evaluating", seconds)
        prefixed = {f"validate/{k}": v for k, v in metrics.items()}
        self.eval_metrics = dict(prefixed)
        self.evaluated_at = self.step
        self.ctx.last_eval = prefixed
        self._emit({"type": "metrics", "context": "validate", "step": self.step, "epoch": self.ctx.epoch, **metrics})
        if self.progress is not None:
            self.progress.evaluated(self.step, self.ctx.epoch, prefixed)
        if observe:
            for cb in self.callbacks:
                cb.on_eval_end(self.ctx, prefixed)
        return prefixed

    def final_metrics(self) -> dict[str, float]:
        """The stage's metrics for its artifact and the next stage: those of the model it returns.

        After `restore_best`, the restored step's: its validation metrics (recorded with its checkpoint, or
        computed now when that checkpoint was scored without a validation pass there) and the train window
        logged last before it; the last step's go to the artifact's ``restored`` record with the step.
        The test split is evaluated on the returned model.
        """
        out = {f"train/{k}": v for k, v in self.last_train.items()}
        out.update(self.eval_metrics)
        loop = self.loop
        if self._restored is not None:
            out = self._restored_metrics(out)
        if loop.test_dataset is not None:
            self._phase_start("evaluating")
            t0 = time.perf_counter()
            metrics = evaluate(self.backend, loop.test_dataset, loop.eval_batch_size or loop.batch_size, loop)
            seconds = time.perf_counter() - t0
            self.clock.eval_s += seconds
            self._phase("evaluating", seconds)
            self._emit({"type": "metrics", "context": "test", "step": self.step, "epoch": self.ctx.epoch, **metrics})
            out.update({f"test/{k}": v for k, v in metrics.items()})
        return out

    def _restored_metrics(self, last: dict[str, float]) -> dict[str, float]:
        """The final metrics of the step `restore_best` loaded (see `final_metrics`); records which step it was."""
        assert self._restored is not None
        step, meta = self._restored
        out = {f"train/{k}": float(v) for k, v in dict(meta.get("last_train") or {}).items()}
        last_eval = {k: v for k, v in dict(meta.get("last_eval") or {}).items() if not k.startswith("_")}
        evaluated_at = meta.get("evaluated_at", dict(meta.get("last_eval") or {}).get("_step"))
        if last_eval and evaluated_at is not None and int(evaluated_at) == step:
            out.update({k: float(v) for k, v in last_eval.items()})
        elif self.loop.val_dataset is not None:  # scored on a train metric: evaluate the restored weights now
            loop = self.loop
            metrics = evaluate(self.backend, loop.val_dataset, loop.eval_batch_size or loop.batch_size, loop)
            out.update({f"validate/{k}": v for k, v in metrics.items()})
        self._restored_record = {
            "from": "best",
            "step": step,
            "epoch": meta.get("epoch"),
            "monitor": self.loop.checkpoint_settings.monitor if self.loop.checkpoint_settings is not None else None,
            "score": meta.get("score"),
            "last_step": self.step,
            "last_metrics": {k: float(v) for k, v in last.items()},
        }
        return out


def evaluate(backend: StepBackend, dataset: Any, batch_size: int, loop: Any = None) -> dict[str, float]:
    """Record-weighted means of the backend's eval metrics over one ordered pass of `dataset`, then the loop's
    whole-split `metrics` (`pipekit_train.Metric`), which replace a same-named mean.

    Nothing is read back to the host before the pass ends.
    """
    import jax

    from ..data._standardize import invert, statistics_of
    from ..tracking._metrics import compute_metrics, init_states, update_states

    wanted = tuple(getattr(loop, "metrics", ()) or ())
    model = backend.bound_model() if wanted else None
    states = init_states(wanted)
    totals: dict[str, float] = {}
    count = 0
    results = []
    # A standardized target: the whole-split metrics compare predictions and targets in the data's units.
    stats = statistics_of(dataset.transforms) if wanted else {}
    for batch in dataset.epoch_batches(batch_size):
        size = len(next(iter(batch.values())))
        results.append((size, backend.evaluate(batch)))
        if model is not None:
            y = loop.target_key
            predicted, target = invert(stats, y, model(batch[loop.input_key])), invert(stats, y, batch[y])
            states = update_states(wanted, states, predicted, target)
    for size, metrics in jax.device_get(results):
        count += size
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * size
    out = {k: v / max(count, 1) for k, v in totals.items()}
    if wanted:
        out.update(compute_metrics(wanted, states))
    return out
