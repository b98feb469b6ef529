"""The progress display: plain lines off a terminal (or under CI), the rich bar on a pseudo-terminal, the clock."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from pipekit_train import MSE, ArraySource, EarlyStopping, EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.engine._protocol import NonFiniteLossError
from pipekit_train.tracking._progress import PhaseClock, Progress, plain_output

ROOT = Path(__file__).resolve().parents[1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_say_resume_eval_eta_and_end(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    out = io.StringIO()
    progress = Progress("fit", 100, start=40, stream=out, batch_size=8)
    progress.resumed(40, "runs/a/fit/checkpoints")
    progress.compiled(2.5)
    progress.compiled(0.01)  # later small compiles are counted, not announced
    progress.update(50, 5, None, 2.0)  # 2 s per step, 50 steps left
    progress.logged(50, 5, 0.25)  # the train record of step 50: its line
    progress.evaluated(50, 5, {"validate/loss": 0.5, "validate/accuracy": 0.875})
    progress.update(60, 6, None, 2.0)
    progress.logged(60, 6, 0.125)
    progress.close("stopped: early stopping: no improvement", {"train/loss": 0.125, "time/step_s": 2.0})
    lines = out.getvalue().splitlines()
    assert lines[0] == "fit: resumed at step 40 from runs/a/fit/checkpoints"
    assert lines[1] == "fit: compiled in 2.50 s (not counted in steps/s)"
    assert re.fullmatch(
        r"fit: step 50/100 epoch 5 \| loss 0\.25 \| 0\.5 steps/s \| 4 ex/s \| elapsed \d:\d\d:\d\d ETA 0:01:40",
        lines[2],
    )
    assert lines[3] == "fit: step 50 epoch 5 | validate loss 0.5 accuracy 0.875"
    assert "| val loss 0.5 accuracy 0.875 |" in lines[4] and lines[4].endswith("ETA 0:01:20")
    assert re.fullmatch(
        r"fit: stopped early at step 60/100 after \d:\d\d:\d\d: early stopping: no improvement", lines[5]
    )
    assert lines[6:] == ["  train/loss   0.125", "  time/step_s  2"]


def test_a_compile_or_an_evaluation_is_seen_as_it_starts(monkeypatch):
    """Off a terminal a line says a long silence is a compile or an evaluation; on one, the bar says the phase."""
    monkeypatch.delenv("CI", raising=False)
    out = io.StringIO()
    progress = Progress("fit", 100, stream=out)
    progress.phase_started("compiling", 0, 0)
    progress.compiled(41.0)
    progress.phase_started("compiling", 90, 9)  # a later chunk length: quiet, like its compile
    progress.phase_started("evaluating", 50, 5)
    progress.evaluated(50, 5, {"validate/loss": 0.5})
    progress.phase_started("checkpointing", 50, 5)  # saves are frequent (and usually short): no line
    progress.phase_started("stepping", 50, 5)
    assert out.getvalue().splitlines() == [
        "fit: step 0 | compiling",
        "fit: compiled in 41.00 s (not counted in steps/s)",
        "fit: step 50 epoch 5 | evaluating",
        "fit: step 50 epoch 5 | validate loss 0.5",
    ]
    bar = Progress("fit", 100, stream=_Terminal())
    try:
        bar.update(50, 5, None, None)
        assert bar._fields()["info"] == "epoch 5"
        bar.phase_started("evaluating", 50, 5)
        assert bar._fields()["info"] == "epoch 5 | [evaluating]"
    finally:
        bar.close()


def test_interrupted_and_disabled():
    out = io.StringIO()
    progress = Progress("fit", 10, stream=out)
    progress.update(3, 0, None, None)
    progress.close("stopped: SIGTERM")
    assert out.getvalue().splitlines()[-1].startswith("fit: interrupted by SIGTERM at step 3/10")
    quiet = io.StringIO()
    off = Progress("fit", 10, enabled=False, stream=quiet)
    off.resumed(3, None)
    off.update(10, 0, 0.1, 0.1)
    off.close("completed", {"train/loss": 0.1})
    assert quiet.getvalue() == ""


def test_ci_or_a_pipe_means_plain_lines(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert plain_output(io.StringIO()) and not plain_output(_Terminal())
    monkeypatch.setenv("CI", "true")
    assert plain_output(_Terminal())
    monkeypatch.setenv("CI", "false")
    assert not plain_output(_Terminal())


def test_phase_clock_keeps_compiling_out_of_steps_per_second():
    clock = PhaseClock()
    clock.compile_s = 3.0
    clock.chunk(1, 3.2, 0.2, compiled=True)
    clock.chunk(10, 1.0, 0.1, compiled=False)
    clock.chunk(10, 3.0, 0.1, compiled=False)
    assert clock.step_s() == pytest.approx(0.2)  # 20 steps in 4 s; the compiling chunk is not averaged in
    summary = clock.summary()
    assert summary["compile_s"] == 3.0 and summary["step_s"] == pytest.approx(0.2)
    assert summary["data_wait_frac"] == pytest.approx(0.4 / 7.2)
    assert (clock.span_steps, clock.span_s) == (20, pytest.approx(4.0))
    for _ in range(12):
        clock.chunk(1, 1.0, 0.0, compiled=False)  # the displayed rate forgets chunks older than about 10 s
    assert clock.recent_step_s() == pytest.approx(1.0)


def _data(n: int = 64) -> TrainingDataset:
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": x.sum(axis=1, keepdims=True)}))


MODEL = EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 5, "depth": 1})


def test_a_real_run_prints_evaluations_the_early_stop_and_a_final_table(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    data = _data()
    loop = TrainingLoop(
        model_op=MODEL,
        dataset=data,
        val_dataset=data.replace(shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 1e-9},  # nothing improves: EarlyStopping stops after 2 passes
        max_steps=40,
        batch_size=16,
        eval_every_n_steps=4,
        log_every_n_steps=4,
        callbacks=(EarlyStopping(patience=2),),
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    err = capsys.readouterr().err.splitlines()
    evals = [line for line in err if "| validate loss" in line]
    assert [line.split(" |")[0] for line in evals] == [
        "stage0: step 4 epoch 1",
        "stage0: step 8 epoch 2",
        "stage0: step 12 epoch 3",
    ]
    stop = next(line for line in err if "stopped early" in line)
    assert stop.startswith("stage0: stopped early at step 12/40") and "early stopping: validate/loss" in stop
    assert any(line.startswith("  time/compile_s ") for line in err)
    assert err[-1].startswith("  time/")


def test_a_non_finite_loss_gets_its_own_line(capsys, tmp_path: Path):
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": 100 * x[:, :1]}))
    loop = TrainingLoop(
        model_op=MODEL,
        dataset=data,
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 1e38},
        max_steps=4,
        batch_size=8,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False), pytest.raises(NonFiniteLossError):
        loop.run()
    err = capsys.readouterr().err
    assert "stage0: stopped on a non-finite loss: stage 'stage0': the training loss became nan at step 2" in err


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from pipekit_train import (MSE, ArraySource, Callback, Checkpoint, EquinoxModel, TrainingDataset,
                               TrainingInterrupted, TrainingLoop, run_settings)

    class Chatty(Callback, register=False):
        def fingerprint(self):
            return None
        def on_step_end(self, ctx, metrics):
            if ctx.step == 5:
                print("hello from a callback")
            if ctx.step == 30:
                os.kill(os.getpid(), signal.SIGTERM)  # the stage stops after a committed checkpoint

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": x.sum(axis=1, keepdims=True)}))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=data, val_dataset=data.replace(shuffle=False), loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01}, max_steps=60, batch_size=16, log_every_n_steps=5,
        eval_every_n_steps=20, callbacks=(Checkpoint(every_n_steps=10), Chatty()))
    with run_settings(run_dir=sys.argv[1], store=False):
        try:
            loop.run()
        except TrainingInterrupted:
            pass
    with run_settings(run_dir=sys.argv[1], store=False, resume="auto"):
        loop.run()
    """
)


@pytest.mark.slow
def test_on_a_pseudo_terminal_the_bar_has_an_eta_and_says_where_it_resumed(tmp_path: Path):
    pty = pytest.importorskip("pty")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(JAX_PLATFORMS="cpu", COLUMNS="160", TERM="xterm", PYTHONPATH=str(ROOT / "src"))
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    raw = b""
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                raw += chunk
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace"))  # drop colours and cursor moves
    assert proc.returncode == 0, text[-3000:]
    # Each terminal line as it was left: what follows the last carriage return (the bar redraws over itself).
    lines = [line.rstrip("\r").split("\r")[-1] for line in text.split("\n")]
    bars = [line for line in lines + text.split("\r") if "stage0 " in line and "/60" in line]
    assert bars and all(re.search(r"ETA (\d+:\d\d:\d\d|-:--:--)", bar) for bar in bars)
    assert any(re.search(r"ETA \d+:\d\d:\d\d", bar) and "steps/s" in bar for bar in bars)
    assert "hello from a callback" in lines  # a callback's print() is a line of its own, not glued to the bar
    assert any(line.startswith("stage0: interrupted by SIGTERM at step 30/60") for line in lines)
    assert f"stage0: resumed at step 30 from {tmp_path / 'run' / 'stage0' / 'checkpoints'}" in lines
    assert any(line.startswith("stage0: completed at step 60/60") for line in lines)
    assert any("time/compile_s" in line for line in lines)  # the final table


def test_model_summary_counts_each_top_level_submodule_and_goes_into_the_artifact(capsys, tmp_path: Path):
    import json

    import jax

    from pipekit_train.provenance import ArtifactStore, TrainingArtifact
    from pipekit_train.tracking._progress import model_summary

    op = EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 5, "depth": 1})
    summary = model_summary(op.bind(op.build(jax.random.key(0))).weights())
    assert summary["submodules"] == [
        {"name": "layers[0]", "params": 3 * 5 + 5, "bytes": 4 * 20},
        {"name": "layers[1]", "params": 5 + 1, "bytes": 4 * 6},
    ]
    assert (summary["total_params"], summary["total_bytes"]) == (26, 104)

    loop = TrainingLoop(model_op=op, dataset=_data(), loss=MSE(), max_steps=2, batch_size=16)
    with run_settings(run_dir=str(tmp_path / "run"), store=str(tmp_path / "store.sqlite")):
        _, artifact = loop.run()
    assert artifact.model_summary == summary
    err = capsys.readouterr().err.splitlines()
    assert "stage0: model: 26 parameters, 104 B" in err and any(line.split()[:2] == ["layers[0]", "20"] for line in err)
    with ArtifactStore(str(tmp_path / "store.sqlite")) as store:
        assert store.get(artifact.artifact_id).model_summary == summary
    # An older record has no model_summary: it reads back, and writes out, as the same JSON text (same digest).
    old = artifact.replace(model_summary=None)
    assert "model_summary" not in old.to_dict()
    assert TrainingArtifact.from_json(old.to_json()).to_json() == old.to_json()
    assert json.loads(artifact.to_json())["model_summary"] == summary


def test_a_plain_line_shows_the_loss_of_its_own_step_without_another_host_sync(capsys, tmp_path: Path, monkeypatch):
    """The line of step 200 once showed step 100's loss (the record of a log step is written a chunk later), and
    the first line none. Each line now carries its step's train/loss; the display reads nothing more from the
    device (the same number of `jax.device_get` calls with and without it)."""
    import jax

    from pipekit_train.tracking._writers import read_jsonl

    monkeypatch.delenv("CI", raising=False)
    calls = {"n": 0}
    real = jax.device_get

    def counting(x):
        calls["n"] += 1
        return real(x)

    monkeypatch.setattr(jax, "device_get", counting)
    data = _data()
    counts = {}
    for progress in (False, True):
        loop = TrainingLoop(
            model_op=MODEL,
            dataset=data,
            loss=MSE(),
            optimizer_config={"name": "sgd", "lr": 0.01},
            max_steps=40,
            batch_size=16,
            log_every_n_steps=4,
            progress=progress,
        )
        calls["n"] = 0
        capsys.readouterr()
        with run_settings(run_dir=str(tmp_path / f"run{progress}"), store=False):
            loop.run()
        counts[progress] = calls["n"]
    lines = [line for line in capsys.readouterr().err.splitlines() if re.match(r"stage0: step \d+/40 ", line)]
    logged = {
        r["step"]: r["loss"]
        for r in read_jsonl(tmp_path / "runTrue" / "stage0" / "metrics.jsonl")
        if r["type"] == "metrics" and r["context"] == "train"
    }
    shown = [
        (int(m.group(1)), float(m.group(2)))
        for m in (re.search(r"step (\d+)/40 .*\| loss (\S+) ", line) for line in lines)
    ]
    assert [s for s, _ in shown] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert all(value == float(f"{logged[s]:.4g}") for s, value in shown)
    assert counts[True] == counts[False]


def test_at_80_columns_the_bar_keeps_the_step_counter_once_validation_metrics_appear(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    out = _Terminal()
    progress = Progress("finetune", 1000, stream=out, batch_size=32)
    progress.update(200, 3, 0.125, 0.01)
    progress.evaluated(200, 3, {"validate/loss": 0.5123, "validate/accuracy": 0.8751, "validate/f1_macro": 0.81})
    progress.update(300, 4, 0.1, 0.01)
    progress.close()  # the bar's last drawing is its state at the end
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    bars = [line for line in text.replace("\r", "\n").split("\n") if line.startswith("finetune ")]
    last = bars[-1]
    assert len(last) <= 80 and " 300/1000 epoch 4 | loss 0.1 | val " in last, last
    assert re.search(r"\d:\d\d:\d\d ETA 0:00:07$", last), last


def test_while_evaluating_the_bar_shows_the_step_of_the_loss_it_shows(tmp_path: Path, monkeypatch):
    """At a step that logs and evaluates, the record (with its loss) is written before the evaluation and the bar's
    step moved only after it: the bar showed step 5 beside step 10's loss while evaluating. What the display holds
    each time a phase begins is recorded by a spy, and compared with the records written."""
    from pipekit_train.tracking._writers import read_jsonl

    seen: list[tuple[str, int, float | None]] = []

    class Spy(Progress):
        def phase_started(self, phase: str, step: int, epoch: int) -> None:
            seen.append((phase, self.step, self.loss))
            super().phase_started(phase, step, epoch)

    monkeypatch.setattr("pipekit_train.engine._loop.Progress", Spy)
    monkeypatch.delenv("CI", raising=False)
    data = _data()
    loop = TrainingLoop(
        model_op=MODEL,
        dataset=data,
        val_dataset=data.replace(shuffle=False),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.01},
        max_steps=20,
        batch_size=16,
        log_every_n_steps=5,
        eval_every_n_steps=10,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    loss = {
        r["step"]: r["loss"]
        for r in read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
        if r["type"] == "metrics" and r["context"] == "train"
    }
    assert [(step, shown) for phase, step, shown in seen if phase == "evaluating"] == [(10, loss[10]), (20, loss[20])]
