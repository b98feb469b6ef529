"""``--set PATH=VALUE``: values go through the file loader's rules and limits, and can set operators and lists."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit import parse_override as _parse_override
from pipekit_train.cli._main import _load_pipeline

TINY = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  val_dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: false}
  loss: {type: CrossEntropy}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 20
  batch_size: 8
"""


@pytest.fixture
def pipe(tmp_path: Path) -> str:
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text(TINY)
    return str(tmp_path / "pipe.yaml")


def test_set_an_operator_a_list_of_operators_and_a_list_item(pipe: str):
    op = _load_pipeline(
        pipe,
        [
            "stages.0.loss={type: MSE}",
            "stages.0.callbacks=[{type: EarlyStopping, monitor: validate/loss}]",
            "stages.0.callbacks.0.patience=3",
            "stages[0].callbacks[1]={type: ReduceLROnPlateau}",  # the list's length appends
            "stages.0.optimizer_config.lr=1e-3",
        ],
    )
    loop = op.stages[0]
    assert type(loop.loss).__name__ == "MSE"
    assert [type(c).__name__ for c in loop.callbacks] == ["EarlyStopping", "ReduceLROnPlateau"]
    assert isinstance(loop.callbacks, tuple)
    assert loop.callbacks[0].patience == 3 and loop.callbacks[0].monitor == "validate/loss"
    assert loop.optimizer_config["lr"] == 0.001


@pytest.mark.parametrize(
    "override,message",
    [
        ("stages.0.max_steps=abc", r"--set stages\.0\.max_steps: TrainingLoop\.max_steps must be"),
        ("stages.0.loss={type: Nope}", r"--set stages\.0\.loss:1:\d+: unknown operator type 'Nope'"),
        ("stages.0.loss={type: EarlyStopping}", r"--set stages\.0\.loss: TrainingLoop\.loss must be"),
        ("stages.0.callbacks=[{type: EarlyStopping, patience: 0}]", r"--set stages\.0\.callbacks.*patience"),
        ("stages.0.callbacks.5={type: EarlyStopping}", r"--set stages\.0\.callbacks\.5: expected a list index"),
        ("stages.0.task=&a [*a]", r"--set stages\.0\.task:1:\d+: document nests deeper than"),
        ("stages.0.task=!!set {a, b}", r"tag 'tag:yaml.org,2002:set' is not allowed"),
        ("stages.0.task=!!binary aGVsbG8=", r"tag 'tag:yaml.org,2002:binary' is not allowed"),
        ("stages.0.optimizer_config={<<: {name: sgd}, lr: 0.1}", r"merge keys"),
        ("stages.0.seed=!!python/object/apply:os.system [echo pwned]", r"is not allowed"),
    ],
    ids=[
        "wrong-type",
        "unknown-operator",
        "operator-of-the-wrong-kind",
        "invalid-item",
        "index-out-of-range",
        "recursive-alias",
        "set-tag",
        "binary-tag",
        "merge-key",
        "python-tag",
    ],
)
def test_bad_values_are_refused_with_the_set_path(pipe: str, override: str, message: str):
    with pytest.raises(ConfigError, match=message):
        _load_pipeline(pipe, [override])


def test_an_alias_bomb_through_set_is_refused_quickly():
    levels = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="more than 100000 nodes"):
        _parse_override("stages.0.task={" + ", ".join(levels) + "}")
    assert time.perf_counter() - start < 5


def test_an_empty_value_is_the_empty_string_and_a_path_is_required():
    assert _parse_override("a.b=") == (["a", "b"], "")
    with pytest.raises(ConfigError, match="PATH=VALUE"):
        _parse_override("nothing")


def test_the_cli_prints_one_line_for_a_refused_value(pipe: str):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli", "validate", pipe, "--set", "stages.0.task=&a [*a]"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipekit-train: error: --set stages.0.task:1:"), out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipekit_train.cli",
            "run",
            pipe,
            "--set",
            "stages.0.loss={type: MSE}",
            "--print-config",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "loss:\n    type: MSE" in out.stdout


KERAS_MODEL = "stages.0.model_op={type: KerasModel, factory: mlp, kwargs: {in_size: 4, out_size: 1}}"


@pytest.mark.parametrize("explicit", [False, True], ids=["backend-follows-model", "backend-in-file"])
@pytest.mark.parametrize("model_first", [True, False], ids=["model-first", "backend-first"])
def test_overrides_are_checked_together_so_a_backend_can_be_switched(pipe: str, explicit: bool, model_first: bool):
    if explicit:  # the file names its backend: each --set alone contradicts the other field
        Path(pipe).write_text(TINY.replace("  loss: {type: CrossEntropy}", "  loss: {type: MSE}\n  backend: equinox"))
    sets = [KERAS_MODEL, "stages.0.backend=keras"]
    loop = _load_pipeline(pipe, sets if model_first else sets[::-1]).stages[0]
    assert (type(loop.model_op).__name__, loop.backend) == ("KerasModel", "keras")


def test_overrides_that_do_not_fit_together_are_refused_once_naming_them(pipe: str):
    with pytest.raises(ConfigError, match=r"^--set stages\.0\.backend, --set stages\.0\.max_steps: .*backend 'keras'"):
        _load_pipeline(pipe, ["stages.0.backend=keras", "stages.0.max_steps=5"])
    # a field's own type is still refused at its own --set, before the fields are checked together
    with pytest.raises(ConfigError, match=r"^--set stages\.0\.max_steps: TrainingLoop\.max_steps must be"):
        _load_pipeline(pipe, ["stages.0.backend=keras", "stages.0.max_steps=abc"])
