"""The example pipelines load, round-trip through YAML and pass `validate` (training them is `make demo`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipekit
from pipekit_train.stage.preflight import check_pipeline

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_round_trips_and_validates(path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(Path(__file__).parent.parent)  # examples name their data relative to the repository root
    op = pipekit.load(path)
    assert pipekit.loads(pipekit.dumps(op)) == op
    assert "training stage" in check_pipeline(op)


def test_demo_pipeline_threads_pretrain_into_finetune():
    op = pipekit.load(Path(__file__).parent.parent / "examples/digits/pretrain_finetune.yaml")
    pretrain, finetune = op.stages
    assert finetune.transfer.paths == {"encoder": "encoder"}
    assert finetune.dataset.source.kwargs["label_fraction"] == 0.1
    # A denoising autoencoder: noisy images in `x`, the clean ones in `x_clean` as the target (docs/recipes.md).
    assert pretrain.target_key == "x_clean" and type(pretrain.dataset.transforms[0]).__name__ == "GaussianNoise"
