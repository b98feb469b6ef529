"""Presets (`pipekit_train.stage.presets`): named fields that fill what a stage leaves unset, never what it sets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    MSE,
    ArraySource,
    ArtifactStore,
    CrossEntropy,
    EquinoxModel,
    ParamGroup,
    TrainingDataset,
    TrainingLoop,
    preset_fields,
    register_preset,
    registered_presets,
    run_settings,
)

REPO = Path(__file__).resolve().parents[2]
MLP = EquinoxModel(factory="mlp", kwargs={"in_size": 8, "out_size": 3, "width_size": 4, "depth": 1})

HEAD = """pipekit: 1
type: TrainingLoop
model_op: {type: EquinoxModel, factory: classifier, kwargs: {in_size: 64, num_classes: 10}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data/train.npz}}
loss: {type: CrossEntropy}
"""


def _data() -> TrainingDataset:
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :3].argmax(1).astype(np.int32)}))


def test_the_built_in_presets_hold_what_the_docs_say():
    assert set(registered_presets()) >= {"finetune-small", "pretrain-autoencoder", "linear-probe"}
    small = preset_fields("finetune-small")
    assert small["param_groups"] == (ParamGroup(pattern="encoder.*", l2sp=10.0, name="encoder"),)
    assert small["optimizer_config"]["lr"] == 3e-3 and small["max_steps"] == 1000
    assert preset_fields("pretrain-autoencoder")["loss"] == MSE()
    assert preset_fields("pretrain-autoencoder")["target_key"] == "x"
    assert preset_fields("linear-probe")["param_groups"][0].frozen
    docs = (REPO / "docs" / "recipes.md").read_text()
    for name in ("finetune-small", "pretrain-autoencoder", "linear-probe"):
        assert f"| `{name}` |" in docs, name  # a row of the presets table


def test_a_preset_fills_unset_fields_and_never_overrides_a_set_one():
    # max_steps and batch_size are set, max_steps to its default: the preset's 1000 and 32 must not win.
    loop = pipekit.loads(HEAD + "preset: finetune-small\nmax_steps: 10000\nbatch_size: 64\n")
    small = preset_fields("finetune-small")
    assert (loop.max_steps, loop.batch_size) == (10000, 64)
    assert loop.optimizer_config == small["optimizer_config"]
    assert loop.param_groups == small["param_groups"]
    assert loop.log_every_n_steps == small["log_every_n_steps"]
    assert loop.loss == CrossEntropy()  # not in the preset: the file's
    same = TrainingLoop(
        model_op=loop.model_op,
        dataset=loop.dataset,
        loss=CrossEntropy(),
        preset="finetune-small",
        max_steps=10000,
        batch_size=64,
    )
    assert same == loop


def test_dumps_keeps_the_preset_and_only_the_fields_the_file_set():
    text = HEAD + "max_steps: 10000\nbatch_size: 64\npreset: finetune-small\n"
    loop = pipekit.loads(text)
    dumped = pipekit.dumps(loop)
    top = list(yaml.safe_load(dumped))
    assert top == ["pipekit", "type", "model_op", "dataset", "loss", "max_steps", "batch_size", "preset"]
    assert pipekit.dumps(pipekit.loads(dumped)) == dumped
    assert pipekit.loads(dumped) == loop
    # A field set to the preset's own value needs no line: loading fills the same value.
    assert pipekit.dumps(loop.replace(log_every_n_steps=100)) == dumped
    changed = pipekit.dumps(loop.replace(log_every_n_steps=7))
    assert "log_every_n_steps: 7" in changed and pipekit.loads(changed).log_every_n_steps == 7


def test_replace_with_another_preset_refills_the_fields_the_old_one_filled():
    loop = pipekit.loads(HEAD + "preset: finetune-small\nmax_steps: 300\n")
    probe = loop.replace(preset="linear-probe")
    assert probe.param_groups == preset_fields("linear-probe")["param_groups"]
    assert probe.max_steps == 300  # the file's, kept
    assert probe == pipekit.loads(HEAD + "preset: linear-probe\nmax_steps: 300\n")
    plain = loop.replace(preset=None)
    assert plain.param_groups == () and plain.max_steps == 300


def test_an_unknown_preset_is_one_line_with_the_nearest_name_at_its_line():
    with pytest.raises(ConfigError) as info:
        pipekit.loads(HEAD + "preset: finetune-smal\n")
    message = str(info.value)
    assert message.startswith("<string>:6:9: TrainingLoop.preset 'finetune-smal' is not a registered preset")
    assert "(did you mean 'finetune-small'?)" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"TrainingLoop.preset 'nope' is not a registered preset; registered presets"):
        TrainingLoop(model_op=MLP, dataset=_data(), loss=MSE(), preset="nope")


def test_register_preset_checks_names_fields_and_values():
    register_preset("test-short", {"max_steps": 7, "optimizer_config": {"name": "sgd", "lr": 0.1}})
    register_preset("test-short", {"max_steps": 7, "optimizer_config": {"name": "sgd", "lr": 0.1}})  # same: no-op
    assert preset_fields("test-short")["max_steps"] == 7
    with pytest.raises(ConfigError, match=r"preset 'test-short' is already registered with other fields"):
        register_preset("test-short", {"max_steps": 8})
    with pytest.raises(ConfigError, match=r"TrainingLoop has no field 'max_step' \(did you mean 'max_steps'\?\)"):
        register_preset("test-bad", {"max_step": 7})
    with pytest.raises(ConfigError, match=r"a preset cannot set 'model_op'"):
        register_preset("test-bad", {"model_op": MLP})
    with pytest.raises(ConfigError, match=r"preset 'test-bad': TrainingLoop.batch_size must be int, got 'big'"):
        register_preset("test-bad", {"batch_size": "big"})
    with pytest.raises(ConfigError, match=r"name must be letters, digits, '-' or '_'"):
        register_preset("has space", {})
    assert "test-bad" not in registered_presets()


def test_the_artifact_records_the_preset_and_the_fields_it_filled(tmp_path):
    register_preset(
        "test-tiny",
        {"max_steps": 3, "batch_size": 16, "log_every_n_steps": 1, "optimizer_config": {"name": "sgd", "lr": 0.1}},
    )
    loop = TrainingLoop(
        model_op=MLP,
        dataset=_data(),
        loss=CrossEntropy(),
        preset="test-tiny",
        batch_size=32,
        progress=False,
    )
    store = str(tmp_path / "store.db")
    with run_settings(run_dir=str(tmp_path / "run"), store=store):
        _, artifact = loop.run()
    expected = {
        "name": "test-tiny",
        "fields": {"max_steps": 3, "log_every_n_steps": 1, "optimizer_config": {"name": "sgd", "lr": 0.1}},
    }
    assert artifact.preset == expected  # batch_size was the stage's own, not the preset's
    assert "preset: test-tiny" in artifact.training_pipeline_yaml and "max_steps" not in artifact.training_pipeline_yaml
    on_disk = json.loads((tmp_path / "run" / "stage0" / "artifact.json").read_text())
    assert on_disk["preset"] == expected
    assert type(artifact).from_dict(on_disk) == artifact
    assert ArtifactStore(store).get(artifact.artifact_id).preset == expected  # through the store and its digest


def test_the_presets_example_loads_and_keeps_its_short_form(monkeypatch):
    monkeypatch.chdir(REPO)
    pipeline = pipekit.load(REPO / "examples" / "recipes" / "presets.yaml")
    pretrain, finetune = pipeline.stages
    assert (pretrain.preset, pretrain.max_steps, pretrain.target_key) == ("pretrain-autoencoder", 1500, "x")
    assert finetune.param_groups == preset_fields("finetune-small")["param_groups"] and finetune.max_steps == 500
    dumped = pipekit.dumps(pipeline)
    assert "l2sp" not in dumped and dumped.count("preset:") == 2
    assert pipekit.loads(dumped) == pipeline


@pytest.mark.parametrize(
    "name,factory",
    [("pretrain-autoencoder", "autoencoder"), ("finetune-small", "classifier"), ("linear-probe", "classifier")],
)
def test_each_built_in_preset_passes_pre_flight_on_the_model_it_is_for(name, factory):
    from pipekit_train.stage.preflight import check_pipeline

    x = np.random.default_rng(0).uniform(size=(128, 64)).astype(np.float32)
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": (x[:, 0] * 10).astype(np.int32)}))
    kwargs = {"in_size": 64, "latent_size": 8} | ({"num_classes": 10} if factory == "classifier" else {})
    fields = {"loss": CrossEntropy()} if factory == "classifier" else {}
    loop = TrainingLoop(model_op=EquinoxModel(factory=factory, kwargs=kwargs), dataset=data, preset=name, **fields)
    assert check_pipeline(loop).startswith("1 training stage")
