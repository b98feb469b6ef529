# ruff: noqa: E501  (the expected error lines are whole lines, as a user sees them)
"""Absurd sizes are refused by ``validate``, one line each naming the field, the value and the bound.

A model whose weights cannot fit in memory is sized from the architecture's abstract shapes (nothing allocated);
step counts and batch sizes past what the compiled step counts in (int32) and any int past 64 bits are refused
when the file is read, before JAX starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import Checkpoint, EarlyStopping
from pipekit_train.backends._shared import check_model_size, memory_limit
from pipekit_train.cli import main

PIPE = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 20
  batch_size: 8
"""

#: (name, text replaced, replacement, what the one line must hold).
CASES = [
    (
        "width",
        "width_size: 8",
        "width_size: 1000000000000",
        r"^pipekit-train: error: wide\.yaml: stage 'fit': EquinoxModel\(.*'width_size': 1000000000000.*\) has "
        r"6,000,000,000,001 parameters \(22,351\.7 GiB of weights alone; .*\) but the (machine's|container's) memory",
    ),
    (
        "steps64",
        "max_steps: 20",
        f"max_steps: {2**63}",
        r"^pipekit-train: error: steps64\.yaml:10:14: TrainingLoop\.max_steps must be an int that fits in 64 bits "
        rf"\(-9223372036854775808 to 9223372036854775807\), got {2**63}$",
    ),
    (
        "steps",
        "max_steps: 20",
        f"max_steps: {2**63 - 1}",
        r"^pipekit-train: error: steps\.yaml:10:14: TrainingLoop\.max_steps must be at most 2147483647 \(2\*\*31 - 1: .*\), "
        rf"got {2**63 - 1}$",
    ),
    (
        "batch",
        "batch_size: 8",
        f"batch_size: {2**40}",
        rf"^pipekit-train: error: batch\.yaml:11:15: TrainingLoop\.batch_size must be at most 2147483647 .*, got {2**40}$",
    ),
    (
        "every",
        "max_steps: 20",
        f"max_steps: 20\n  callbacks: [{{type: Checkpoint, every_n_steps: {2**64}}}]",
        rf"^pipekit-train: error: every\.yaml:11:49: Checkpoint\.every_n_steps must be an int that fits in 64 bits .*got {2**64}$",
    ),
]


@pytest.mark.parametrize(("name", "old", "new", "line"), CASES, ids=[c[0] for c in CASES])
def test_validate_refuses_an_absurd_size_in_one_line(
    name: str, old: str, new: str, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x[:, :1])
    path = tmp_path / ("wide.yaml" if name == "width" else f"{name}.yaml")
    path.write_text(PIPE.replace(old, new))
    assert main(["validate", path.name]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert re.search(line, err), err

    (tmp_path / "ok.yaml").write_text(PIPE)  # the same file with sane sizes is fine
    assert main(["validate", "ok.yaml"]) == 0


def test_int_fields_everywhere_are_bounded_to_64_bits_when_built_in_python():
    with pytest.raises(ConfigError, match=r"EarlyStopping\.patience must be an int that fits in 64 bits"):
        EarlyStopping(patience=2**64)
    assert Checkpoint(every_n_steps=2**63 - 1).every_n_steps == 2**63 - 1  # the bound itself is accepted


def test_the_memory_bound_refuses_only_what_cannot_fit():
    limit, where = memory_limit() or (0, "")
    assert limit > 2**20 and "memory" in where  # this machine's memory (or its container's limit) was read
    check_model_size(10**6, limit, "fit", "M")  # exactly the memory there is: not refused
    with pytest.raises(
        ConfigError, match=r"^stage 'fit': 'M' has 1,000 parameters \(1\.0 GiB .* device's memory is 0\.5"
    ):
        check_model_size(1000, 2**30, "fit", "M", device_bytes=2**29)
