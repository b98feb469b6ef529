"""Checked by ``make lint`` (mypy --strict), not run: the README's five lines type-check as users write them."""

import pipekit
from pipekit_train import (
    MSE,
    CrossEntropy,
    EquinoxModel,
    NpzSource,
    TrainingArtifact,
    TrainingDataset,
    TrainingLoop,
    Transfer,
)

pretrain = TrainingLoop(
    model_op=EquinoxModel(factory="autoencoder", kwargs={"in_size": 64, "latent_size": 8}),
    dataset=TrainingDataset(source=NpzSource(path="data/train.npz")),
    loss=MSE(),
    target_key="x",
    max_steps=100,
    name="pretrain",
)
finetune = TrainingLoop(
    model_op=EquinoxModel(factory="classifier", kwargs={"in_size": 64, "latent_size": 8, "num_classes": 10}),
    dataset=TrainingDataset(source=NpzSource(path="data/train.npz")),
    loss=CrossEntropy(),
    transfer=Transfer(paths={"encoder": "encoder"}),
    max_steps=100,
    name="finetune",
)
full = pipekit.Sequential([pretrain, finetune])
loaded: pipekit.Operator = pipekit.load("examples/digits/pretrain_finetune.yaml")


def provenance(artifact: TrainingArtifact) -> str:
    return f"{artifact.artifact_id}: {artifact.dataset_hash}"
