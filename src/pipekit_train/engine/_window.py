"""The logging window: the step metrics between two logging points, kept on the device as the steps return them and
read to the host once per log interval (one transfer for the window, not one per step), then written as the
window's train and time records (`LogWindow`, the engine's records: every one goes to the writer and the
callbacks' `on_log`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..callbacks._base import Callback, TrainContext
from ..tracking._progress import PhaseClock, Progress
from ..tracking._writers import MetricWriter

if TYPE_CHECKING:
    from ..backends._contract import StepBackend


class _Fetched:
    """A fused chunk's stacked metrics, read to the host once by whoever reads first: a callback's `on_step_end`
    (`_HostStepMetrics`) or the log window's record (`_hosts`), which then reads nothing more."""

    __slots__ = ("host", "stacked")

    def __init__(self, stacked: Mapping[str, Any]) -> None:
        self.stacked = stacked
        self.host: Mapping[str, Any] | None = None

    def get(self) -> Mapping[str, Any]:
        if self.host is None:
            self.host = to_host(self.stacked)
        return self.host


class _LazyStepMetrics(Mapping[str, Any]):
    """One step's metrics out of a chunk's stacked metrics; slices only what a callback reads."""

    def __init__(self, stacked: Mapping[str, Any], index: int | None, fetched: _Fetched | None = None) -> None:
        self._stacked = stacked
        self._index = index
        self._fetched = fetched

    def __getitem__(self, key: str) -> Any:
        value = self._stacked[key]
        return value if self._index is None else value[self._index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stacked)

    def __len__(self) -> int:
        return len(self._stacked)


class _HostStepMetrics(Mapping[str, Any]):
    """What `on_step_end` gets for one step of a fused chunk: that step's values on the host (NumPy scalars), the
    chunk read once at the first read of any of them (`_Fetched`), so a callback that reads every step's loss
    costs one transfer per chunk, shared with the log window, and no wait per step."""

    __slots__ = ("_fetched", "_index")

    def __init__(self, fetched: _Fetched, index: int | None) -> None:
        self._fetched = fetched
        self._index = index  # None: a call of one step, whose values are not stacked

    def __getitem__(self, key: str) -> Any:
        value = self._fetched.get()[key]
        return value if self._index is None else value[self._index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetched.stacked)

    def __len__(self) -> int:
        return len(self._fetched.stacked)


def to_host(tree: Any) -> Any:
    """`tree` with its JAX arrays as NumPy arrays: `jax.device_get`, but on the CPU one plain read per array.

    `jax.device_get` starts an asynchronous copy of every array before reading any, which overlaps transfers
    from an accelerator; on the CPU there is nothing to overlap and the extra call per array made the log window
    of a one-step-per-call loop (a hundred steps of small metrics) cost ~20 µs a step (`make bench` row 1).
    """
    import jax

    if jax.default_backend() != "cpu":
        return jax.device_get(tree)
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def _hosts(window: list[tuple[int, Mapping[str, Any]]]) -> dict[int, Mapping[str, Any]]:
    """The host values of every chunk in `window`, by ``id`` of its stacked metrics: those a callback already read
    (`_Fetched`) as they are, the others in one transfer."""
    chunks: dict[int, Mapping[str, Any]] = {}
    fetched: dict[int, _Fetched] = {}
    for _, m in window:
        if isinstance(m, _LazyStepMetrics):
            chunks.setdefault(id(m._stacked), m._stacked)
            if m._fetched is not None:
                fetched.setdefault(id(m._stacked), m._fetched)
    host = {k: f.host for k, f in fetched.items() if f.host is not None}
    missing = [k for k in chunks if k not in host]
    if missing:
        for k, values in zip(missing, to_host([chunks[k] for k in missing]), strict=True):
            host[k] = values
            if k in fetched:
                fetched[k].host = values
    return host


def _on_host(window: list[tuple[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Each step's metrics in `window` as host values: one transfer per chunk, then slices on the host.

    Slicing a chunk's stacked device arrays step by step (``dict(m)``) dispatches one gather per step and metric:
    with ``steps_per_call=10`` that was 44% of the loop's time on a small MLP.
    """
    host = _hosts(window)
    return [
        dict(_LazyStepMetrics(host[id(m._stacked)], m._index)) if isinstance(m, _LazyStepMetrics) else dict(m)
        for _, m in window
    ]


def _columns(window: list[tuple[int, Mapping[str, Any]]]) -> dict[str, np.ndarray] | None:
    """The window's per-step scalar metrics as one host array per name (in step order), or ``None`` when an entry
    is not a slice of a chunk's scalars (a restored window, a metric with more than one value per step).

    One transfer per chunk and one concatenation per metric: at 100 fused steps per log window, building a dict
    per step and checking each step's loss on its own cost more host time than the chunk's dispatch.
    """
    segments: list[tuple[Mapping[str, Any], int | None, int]] = []  # (stacked, first index or None, count)
    for _, m in window:
        if not isinstance(m, _LazyStepMetrics):
            return None
        last = segments[-1] if segments else None
        if last is not None and last[0] is m._stacked and last[1] is not None and m._index == last[1] + last[2]:
            segments[-1] = (last[0], last[1], last[2] + 1)
        else:
            segments.append((m._stacked, m._index, 1))
    host = _hosts(window)
    keys = list(host[id(segments[0][0])])
    if all(first is None for _, first, _ in segments):  # one-step calls: a scalar per chunk, stacked per name
        rows = [host[id(stacked)] for stacked, _, _ in segments]
        if any(r.keys() != rows[0].keys() for r in rows):
            return None
        columns = {k: np.asarray([r[k] for r in rows]) for k in keys}
        return columns if all(c.ndim == 1 for c in columns.values()) else None
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for stacked, first, count in segments:
        values = host[id(stacked)]
        if list(values) != keys:
            return None
        for k in keys:
            v = np.asarray(values[k])
            if first is None:
                if v.ndim != 0:
                    return None
                parts[k].append(v.reshape(1))
            else:
                if v.ndim != 1:
                    return None
                parts[k].append(v[first : first + count])
    return {k: np.concatenate(p) for k, p in parts.items()}


class LogWindow:
    """The engine's records: the window's train and time records at each log step, possibly a dispatch later
    (`_deferrable`), and every record sent to the writer and the callbacks (a part of `Engine`)."""

    loop: Any
    backend: StepBackend
    writer: MetricWriter
    callbacks: tuple[Callback, ...]
    ctx: TrainContext
    clock: PhaseClock
    progress: Progress | None
    step: int
    window: list[tuple[int, Mapping[str, Any]]]
    last_train: dict[str, Any]
    _deferred: tuple[list[tuple[int, Mapping[str, Any]]], float] | None
    _showing_stop: bool
    _pending: Any

    if TYPE_CHECKING:

        def epoch_of(self, step: int) -> int: ...

        def _deliver_pending(self) -> None: ...

        def _check_finite(self, step: int, loss: Any) -> None: ...

    def _emit(self, record: dict[str, Any]) -> None:
        """Send one record to the writer and to every callback's `on_log`: all of them see the same values.

        The metrics a signal's stop shows after its checkpoint (`_stop_for_resume`) are marked ``interrupted``:
        the history drops them once the resumed run logs on, and writers that cannot take a point back
        (TensorBoard, MLflow) leave them out."""
        if self._pending is not None:  # the steps before this record are reported before it (`_step_ends`)
            self._deliver_pending()
        if self._showing_stop and record.get("type") == "metrics":
            record = {**record, "interrupted": True}
        self.writer.write(record)
        for cb in self.callbacks:
            cb.on_log(self.ctx, record)

    def _deferrable(self) -> bool:
        """Whether this log step's record may be written after the next chunk is dispatched.

        Waiting for the chunk's metrics at every log step leaves the device idle while the host writes records
        and dispatches the next chunk; with one chunk per log window (`auto`) that was the loop's largest cost
        over a hand-written scan. Only where nothing else happens at this step: no evaluation, epoch end,
        last step or stop, and no callback reading records (`on_log`), so every record is written with the same
        values and in the same order, only a chunk later. A checkpoint at this step writes the record first
        (`snapshot`), whether it is saved now or after the next dispatch (`_finish_save`).
        """
        loop, step = self.loop, self.step
        if step >= loop.max_steps or self.ctx.stop_reason is not None:
            return False
        if loop.val_dataset is not None and step % loop.eval_every_n_steps == 0:
            return False
        if loop.steps_per_epoch and step % loop.steps_per_epoch == 0:
            return False
        return all(type(cb).on_log is Callback.on_log for cb in self.callbacks)

    def _flush_deferred(self) -> None:
        assert self._deferred is not None
        window, lr = self._deferred
        self._deferred = None
        self._flush(window, lr)

    def _flush_window(self, keep: bool = False) -> None:
        """Write the pending records; with `keep` (a signal's stop) the window's record is marked ``interrupted``
        and the window stays pending, for the checkpoint."""
        if self._deferred is not None:
            self._flush_deferred()
        if not self.window:
            return
        window = self.window
        if not keep:
            self.window = []
        self._flush(window, None)

    def _flush(self, window: list[tuple[int, Mapping[str, Any]]], lr: float | None) -> None:
        """Write the train (and time) record of `window`; `lr`: the learning rate at its last step, if known."""
        steps = [s for s, _ in window]
        step = steps[-1]
        columns = _columns(window)
        record: dict[str, float] = {}
        if columns is not None:  # one array per metric: the same values and means, without a dict per step
            losses = np.asarray(columns["loss"], dtype=np.float64)
            if not np.isfinite(losses).all():
                i = int(np.flatnonzero(~np.isfinite(losses))[0])
                self._check_finite(steps[i], losses[i])
            for key, column in columns.items():  # in float64: a window restored from a checkpoint (Python floats)
                record[key] = float(np.mean(np.asarray(column, dtype=np.float64)))  # gives the same mean
        else:
            values = _on_host(window)
            for s, v in zip(steps, values):
                self._check_finite(s, v["loss"])
            for key in values[0]:
                record[key] = float(np.mean(np.asarray([v[key] for v in values], dtype=np.float64)))
        record["lr"] = lr if lr is not None else self.backend.learning_rate(step)
        self.last_train = record
        epoch = self.epoch_of(step)
        self._emit({"type": "metrics", "context": "time", "step": step, "epoch": epoch, **self.clock.summary()})
        self._emit({"type": "metrics", "context": "train", "step": step, "epoch": epoch, **record})
        if self.progress is not None:
            self.progress.logged(step, epoch, record.get("loss"))
