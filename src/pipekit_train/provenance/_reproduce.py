"""`reproduce`: rebuild the pipeline that made an artifact and run it again, refusing if the data changed."""

from __future__ import annotations

from typing import Any

import pipekit
from pipekit import ConfigError, Sequential
from pipekit._yaml import IN_MEMORY_KEY


def pipeline_of(artifact_id: str, store: Any) -> tuple[Sequential, list[Any]]:
    """The `Sequential` of the recorded stages that lead to `artifact_id` (ancestors first), and their artifacts.

    Follows the first parent of each stage (the stage before it in its pipeline, or its warm-start source).
    """
    target = store.get(artifact_id)
    chain = [target]
    while chain[0].parent_ids:
        chain.insert(0, store.get(chain[0].parent_ids[0]))
    stages = []
    for art in chain:
        if IN_MEMORY_KEY in art.training_pipeline_yaml:
            raise ConfigError(
                f"artifact {art.artifact_id[:12]} (stage {art.stage!r}) was trained on in-memory arrays, which "
                "were not recorded; only pipelines whose data come from files or registered datasets can be "
                "reproduced"
            )
        stages.append(pipekit.loads(art.training_pipeline_yaml, source=f"artifact {art.artifact_id[:12]}"))
    return Sequential(stages), chain


def check_data_unchanged(pipeline: Sequential, chain: list[Any]) -> None:
    """Refuse when a stage's dataset no longer hashes to what was recorded."""
    for loop, art in zip(pipeline.stages, chain):
        now = loop.dataset.content_hash()  # type: ignore[attr-defined]
        if now != art.dataset_hash:
            raise ConfigError(
                f"cannot reproduce artifact {chain[-1].artifact_id[:12]}: the training data of stage {art.stage!r} "
                f"changed (recorded {art.dataset_hash}, now {now})"
            )
