"""Averaging the weights of several checkpoints into one (`average_checkpoints`, `write_average`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._checkpointer import Checkpointer
from ._errors import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from ._layout import _check_step, _uncommitted_reason
from ._manifest import _load_entries, _step
from ._selectors import Average, Best, Last, ManifestEntry, Mode, Selector


# Averaging ---------------------------------------------------------------------------------------------------
def _selection(directory: Path) -> tuple[dict[int, ManifestEntry], str | None, Mode]:
    header, entries = _load_entries(directory)
    committed = {s: e for s, e in entries.items() if _uncommitted_reason(directory / str(s)) is None}
    monitor = header.get("monitor")
    mode = header.get("mode")
    if monitor is None:
        scored = sorted((e for e in committed.values() if e.score is not None), key=_step)
        monitor, mode = (scored[-1].metric, scored[-1].mode) if scored else (None, "min")
    return committed, monitor, mode or "min"


def _pick(directory: Path, steps: Sequence[int] | Average | Selector) -> tuple[list[int], dict[int, ManifestEntry]]:
    committed, monitor, mode = _selection(directory)
    if isinstance(steps, (Average, Selector)):
        selector = steps.selector if isinstance(steps, Average) else steps
        own = [e for e in committed.values() if e.metric == monitor and e.mode == mode]
        picked = sorted(selector.select(sorted(own, key=_step), mode))
        if not picked:
            raise CheckpointNotFoundError(f"{steps!r} picks no checkpoint in {directory}; steps: {sorted(committed)}")
        wanted = selector.n if isinstance(selector, Last) else selector.k if isinstance(selector, Best) else None
        if wanted is not None and len(picked) < wanted:  # never average fewer than asked without saying so
            raise CheckpointNotFoundError(
                f"{selector!r} asks for {wanted} checkpoints but {directory} holds only {len(picked)} it can pick "
                f"(steps {', '.join(map(str, picked))}); ask for {len(picked)}, or keep more when training "
                "(Checkpoint keep=...)"
            )
        return picked, committed
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise CheckpointError(f"steps must be a list of steps or an Average, got {steps!r}")
    picked = sorted({_check_step("average_checkpoints", s) for s in steps})
    if not picked:
        raise CheckpointError("average_checkpoints: steps is empty; name at least one checkpoint")
    missing = [s for s in picked if _uncommitted_reason(directory / str(s)) is not None]
    if missing:
        raise CheckpointNotFoundError(
            f"average_checkpoints: step(s) {missing} are not committed checkpoints in {directory}; "
            f"committed steps: {sorted(committed)}"
        )
    return picked, committed


def average_checkpoints(
    directory: str | os.PathLike[str], steps: Sequence[int] | Average | Selector, abstract_state: Any = None
) -> Any:
    """The uniform mean of the checkpoints `steps` names, as a state tree.

    Floating-point leaves are averaged (accumulated in float64, returned in their own dtype); every other
    leaf (integer counters, PRNG keys) comes from the newest of the checkpoints. Each checkpoint is verified
    against its checksums while it is read.

    Args:
        directory: A checkpoint directory.
        steps: The steps to average, or an `Average` / selector resolved against the directory's manifest.
        abstract_state: As for `Checkpointer.restore`; ``None`` restores the trees as saved.
    """
    import jax

    from ._restore import _restore_step, is_committed

    directory = Path(directory).absolute()
    picked, committed = _pick(directory, steps)
    sums: list[np.ndarray | None] = []
    treedef = None
    newest: list[Any] = []
    for step in picked:
        entry = committed.get(step)
        state, _, _ = _restore_step(directory, step, abstract_state, entry.files if entry else None)
        leaves, this_def = jax.tree_util.tree_flatten(state)
        if treedef is None:
            treedef = this_def
            sums = [None] * len(leaves)
        elif this_def != treedef:
            raise CheckpointMismatchError(f"step {step} in {directory} holds another tree than step {picked[0]}")
        for i, leaf in enumerate(leaves):
            if _is_inexact(leaf.dtype):
                acc = np.asarray(leaf).astype(np.complex128 if np.iscomplexobj(leaf) else np.float64)
                so_far = sums[i]
                sums[i] = acc if so_far is None else so_far + acc
        newest = leaves
    out = []
    for total, leaf in zip(sums, newest):
        if total is None:
            out.append(leaf)
        else:
            mean = (total / len(picked)).astype(leaf.dtype)
            out.append(jax.device_put(mean, getattr(leaf, "sharding", None) if is_committed(leaf) else None))
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_inexact(dtype: Any) -> bool:
    import jax
    import jax.numpy as jnp

    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, np.inexact))


def write_average(
    src_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], steps: Sequence[int] | Average | Selector
) -> int:
    """Average checkpoints of `src_dir` and write the result as an ordinary checkpoint into `out_dir`.

    The new checkpoint takes the newest averaged step's number, epoch, stage and run id; its meta records
    ``{"averaged_from": [steps], "source": src_dir, "weight": "uniform"}`` and its data position is empty
    (averaged weights are a starting point, not a place to resume). `out_dir` must hold no checkpoint yet.

    Returns:
        The step written.
    """
    src, out = Path(src_dir).absolute(), Path(out_dir).absolute()
    if src.resolve() == out.resolve():
        raise CheckpointError(f"write_average: out_dir must differ from src_dir, both are {src}")
    picked, committed = _pick(src, steps)
    state = average_checkpoints(src, picked)
    _, monitor, mode = _selection(src)
    newest = committed.get(picked[-1]) or ManifestEntry(step=picked[-1])
    with Checkpointer(out, keep=(Last(n=1),), monitor=monitor, mode=mode, async_save=False) as writer:
        if writer.steps():
            raise CheckpointError(
                f"write_average: {out} already holds checkpoints {writer.steps()}; write into an empty directory"
            )
        meta = {
            "averaged_from": picked,
            "source": str(src),
            "weight": "uniform",
            "epoch": newest.epoch,
            "stage": newest.stage,
            "run_id": newest.run_id,
            "score": None,
            "stop_reason": None,
        }
        writer.save(picked[-1], state=state, data_iter={}, meta=meta)
    return picked[-1]
