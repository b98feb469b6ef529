"""``pipekit-train history``: the table, JSON, a PNG of two real runs' curves, and its errors; no JAX imported."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.cli._common import run_commands
from pipekit_train.cli._history import add_history_commands
from pipekit_train.tracking._history import history

pytestmark = pytest.mark.xdist_group("cli-history")  # one worker (--dist loadgroup): the module fixture is built once

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cli(*argv: str) -> int:
    return run_commands(add_history_commands, list(argv))


def _dataset(seed: int) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": x.sum(axis=1, keepdims=True)}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two 20-step runs of a tiny MLP with validation every 10 steps."""
    root = tmp_path_factory.mktemp("history-cli")
    out = []
    for name, lr in (("fast", 0.02), ("slow", 0.002)):
        loop = TrainingLoop(
            model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
            dataset=_dataset(0),
            val_dataset=_dataset(1).replace(shuffle=False),
            loss=MSE(),
            optimizer_config={"name": "adam", "lr": lr},
            max_steps=20,
            batch_size=16,
            log_every_n_steps=5,
            eval_every_n_steps=10,
            progress=False,
        )
        with run_settings(run_dir=str(root / name), store=False):
            loop.run()
        out.append(str(root / name))
    return out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"  # the first chunk: length (4 bytes), type, then width and height
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_table(runs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("history", *runs) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STAGE", "METRIC", "POINTS", "LAST", "BEST"]
    hist = history(runs)
    for run in runs:
        last = hist[run]["stage0"]["validate"]["loss"]["values"][-1]
        best = min(hist[run]["stage0"]["validate"]["loss"]["values"])
        row = next(line for line in lines if line.startswith(run) and "validate/loss" in line)
        assert row.split() == [run, "stage0", "validate/loss", "2", f"{last:.4g}", "@20", f"{best:.4g}", "@20"]


def test_metric_filter_and_json(runs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("history", *runs, "--metric", "validate/loss") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("validate/loss" in line for line in lines[1:])
    assert _cli("history", *runs, "--metric", "train/loss,validate/loss", "--json") == 0
    assert json.loads(capsys.readouterr().out) == history(runs, ["train/loss", "validate/loss"])


def test_png_of_two_runs(runs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots" / "curves.png"
    assert _cli("history", *runs, "--png", str(out)) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    width, height = _png_size(out)
    assert 200 < width < 5000 and 200 < height < 5000
    # one panel (loss) is narrower than two (loss and lr)
    assert _cli("history", *runs, "--metric", "loss", "--png", str(tmp_path / "loss.png")) == 0
    assert _png_size(tmp_path / "loss.png")[0] < width


def test_unknown_metric_is_a_one_line_did_you_mean(runs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("history", *runs, "--metric", "validate/los") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("pipekit-train history: error: no run logged a metric 'validate/los'")
    assert "(did you mean 'validate/loss'?)" in err


def test_png_without_matplotlib_names_the_extra(
    runs: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of these now raises ImportError
    assert _cli("history", runs[0], "--png", str(tmp_path / "x.png")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'pipekit-train[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def test_errors_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("history", str(tmp_path / "nope")) == 2
    assert capsys.readouterr().err == f"pipekit-train history: error: {tmp_path / 'nope'}: no such run directory\n"
    assert _cli("history") == 2  # argparse: RUN_DIR is required


def test_cli_with_png_does_not_import_jax(runs: list[str], tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "from pipekit_train.cli._history import main\n"
        f"rc = main(['history', *{runs!r}, '--png', {str(tmp_path / 'p.png')!r}])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'equinox'))\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rc": 0, "heavy": []}
    assert _png_size(tmp_path / "p.png")[0] > 200
