"""The window of step metrics between two logging points: kept on the device as the steps return them, read to
the host once per log interval (one transfer for the window, not one per step)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


class _LazyStepMetrics(Mapping[str, Any]):
    """One step's metrics out of a chunk's stacked metrics; slices only what a callback reads."""

    def __init__(self, stacked: Mapping[str, Any], index: int | None) -> None:
        self._stacked = stacked
        self._index = index

    def __getitem__(self, key: str) -> Any:
        value = self._stacked[key]
        return value if self._index is None else value[self._index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stacked)

    def __len__(self) -> int:
        return len(self._stacked)


def _on_host(window: list[tuple[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Each step's metrics in `window` as host values: one transfer per chunk, then slices on the host.

    Slicing a chunk's stacked device arrays step by step (``dict(m)``) dispatches one gather per step and metric:
    with ``steps_per_call=10`` that was 44% of the loop's time on a small MLP.
    """
    import jax

    chunks: dict[int, Mapping[str, Any]] = {}
    for _, m in window:
        if isinstance(m, _LazyStepMetrics):
            chunks.setdefault(id(m._stacked), m._stacked)
    host = dict(zip(chunks, jax.device_get(list(chunks.values())), strict=True))
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
    import jax

    segments: list[tuple[Mapping[str, Any], int | None, int]] = []  # (stacked, first index or None, count)
    for _, m in window:
        if not isinstance(m, _LazyStepMetrics):
            return None
        last = segments[-1] if segments else None
        if last is not None and last[0] is m._stacked and last[1] is not None and m._index == last[1] + last[2]:
            segments[-1] = (last[0], last[1], last[2] + 1)
        else:
            segments.append((m._stacked, m._index, 1))
    chunks: dict[int, Mapping[str, Any]] = {}
    for stacked, _, _ in segments:
        chunks.setdefault(id(stacked), stacked)
    host = dict(zip(chunks, jax.device_get(list(chunks.values())), strict=True))
    keys = list(host[id(segments[0][0])])
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
