"""Warm starts: a stage that begins from the weights alone of another stage's checkpoint (`TrainingLoop.init_from`:
its best, latest or a given step, or the average of several), grafted leaf by leaf onto this model's weights; the
optimizer state, the step and the data position start fresh."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from .._trees import path_name
from ..checkpoint._checkpointer import Checkpointer
from ..checkpoint._errors import CheckpointError, CheckpointMismatchError


def warm_start(spec: str, backend: Any) -> str | None:
    """Load only the weights of `spec`, `TrainingLoop.init_from`
    (``DIR[@best|@latest|@STEP|@average(last=N)|@average(best=N)]``), into `backend`; return the artifact id of the
    stage that wrote them, when it finished and recorded one (the new stage's parent)."""
    path, _, which = spec.partition("@")
    directory = Path(path)
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    if not (directory / "manifest.json").exists():
        raise CheckpointError(
            f"TrainingLoop.init_from {spec!r}: {directory} is not a checkpoint directory (no manifest.json); "
            "give a stage directory or its checkpoints/ folder, optionally with @best, @latest, @STEP or "
            "@average(last=N)"
        )
    averaged = re.fullmatch(r"average\((last|best)=(\d+)\)", which)
    if averaged is not None:  # DIR@average(last=3): the uniform mean of those checkpoints' weights
        from ..checkpoint._average import average_checkpoints
        from ..checkpoint._selectors import Average, Best, Last

        count = int(averaged.group(2))
        selector = Last(n=count) if averaged.group(1) == "last" else Best(k=count)
        raw = average_checkpoints(directory, Average(selector=selector), None)
    elif which and not which.isdigit() and which not in ("best", "latest"):
        raise CheckpointError(
            f"TrainingLoop.init_from {spec!r}: {which!r} is not a checkpoint choice; write DIR, DIR@best, "
            "DIR@latest, DIR@STEP, DIR@average(last=N) or DIR@average(best=N)"
        )
    else:
        source = Checkpointer(directory, async_save=False)
        try:
            choice: int | str = (
                int(which) if which.isdigit() else (which or ("best" if source.best_step() else "latest"))
            )
            raw, _, _ = source.restore(choice, None)
        finally:
            source.close()
    weights = backend.weights_tree()
    backend.load_weights_tree(
        {part: _graft(tree, raw.get(part, {}), f"{spec}: {part}") for part, tree in weights.items()}
    )
    return _source_artifact(directory)


def _graft(template: Any, raw: Any, where: str) -> Any:
    """`template` with every array leaf replaced by the leaf at the same path of the restored `raw` tree."""
    import jax

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves_with_path:
        node = raw
        for part in path_name(path).split("/"):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise CheckpointMismatchError(
                    f"init_from {where}: the checkpoint has no weights at {path_name(path)!r}; the architectures differ"
                )
        value = np.asarray(node)
        if value.shape != tuple(leaf.shape):
            raise CheckpointMismatchError(
                f"init_from {where}: weights {path_name(path)!r} have shape {value.shape} in the checkpoint but "
                f"{tuple(leaf.shape)} in this model"
            )
        out.append(np.asarray(value, dtype=leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _source_artifact(directory: Path) -> str | None:
    """The artifact id of the stage that wrote `directory`, when it finished and recorded one."""
    for candidate in (directory / "artifact.json", directory.parent / "artifact.json"):
        if candidate.exists():
            try:
                return str(json.loads(candidate.read_text())["artifact_id"])
            except (ValueError, KeyError):
                return None
    return None
