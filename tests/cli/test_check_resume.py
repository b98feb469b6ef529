"""``pipekit-train check-resume``: real training processes, killed by real signals (SIGKILL inside a checkpoint
write, SIGTERM in the second stage of a `Sequential`) and resumed with ``--resume auto``, compared step by step with an
uninterrupted run. A pipeline that resumes exactly passes; one with a callback that keeps unsaved Python state that
changes training is refused, naming the callback and the step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.test_signals import STAGE as SIGNALS_STAGE

from pipekit_train.cli._main import main

pytestmark = pytest.mark.xdist_group("check-resume")

# The tiny two-layer MLP stage of tests/test_signals.py, with a step budget and a Checkpoint callback.
STAGE = SIGNALS_STAGE.replace("max_steps: 4", "max_steps: {steps}") + (
    "  callbacks: [{{type: Checkpoint, every_n_steps: {every}}}{extra}]\n"
)

# A callback that keeps a step counter as a plain Python attribute, not in `ctx.state_of(self)`: a resumed run starts
# it from 0, so it halves the learning rate at other steps than the uninterrupted run.
PLANTED = """\
from pipekit_train.callbacks import Callback


class CheckResumePlanted(Callback):
    every: int = 3
    needs_every_step = True

    def on_step_end(self, ctx, metrics):
        count = self.__dict__.get("count", 0) + 1
        object.__setattr__(self, "count", count)  # unsaved: the checkpoint does not hold it
        if count % self.every == 0:
            ctx.lr_scale = ctx.lr_scale * 0.5
"""


def _workspace(tmp_path: Path, *stages: str) -> None:
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text("pipekit: 1\ntype: Sequential\nstages:\n" + "".join(stages))


def _env(monkeypatch: pytest.MonkeyPatch, xla_cache_env: dict[str, str]) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for key, value in xla_cache_env.items():
        monkeypatch.setenv(key, value)


def test_a_pipeline_that_resumes_exactly_is_bitwise_at_every_kill_point(tmp_path, monkeypatch, capsys, xla_cache_env):
    _env(monkeypatch, xla_cache_env)
    _workspace(tmp_path, *(STAGE.format(name=name, steps=1000, every=2, extra="") for name in ("fit", "tune")))
    # --steps 8: every stage runs 8 steps (its max_steps of 1000 overridden as --set would).
    code = main(["check-resume", "pipe.yaml", "--kills", "2", "--steps", "8", "--work-dir", "w"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 stage(s) (fit: 8 steps, tune: 8 steps); 2 kill(s), 4 runs" in out
    lines = out.splitlines()
    kill1 = next(line for line in lines if line.strip().startswith("kill 1:"))
    kill2 = next(line for line in lines if line.strip().startswith("kill 2:"))
    # A SIGKILL inside the write of step 4 (step 2 committed): the resumed run continues from step 2.
    assert "SIGKILL during the checkpoint save of step 4 of stage 'fit', resumed at step 2 of 'fit': bitwise" in kill1
    # A SIGTERM in the second stage: it stops after a committed checkpoint and continues from it.
    assert "SIGTERM at step 2 of stage 'tune'" in kill2 and ": bitwise" in kill2
    assert "problem" not in out and "result: bitwise at all 2 kill points" in out
    # The kills happened in real processes, at their points: the traces say which process and step.
    traces = sorted(p.name for p in (tmp_path / "w").glob("trace-*.jsonl"))
    assert traces == ["trace-0.jsonl", "trace-1.jsonl", "trace-2.jsonl", "trace-reference.jsonl"]
    kills = [
        line for name in ("trace-0.jsonl", "trace-1.jsonl") for line in (tmp_path / "w" / name).read_text().splitlines()
    ]
    assert sum('"kill": "SIGKILL"' in line and '"during_save": true' in line for line in kills) == 1
    assert sum('"kill": "SIGTERM"' in line for line in kills) == 1


def test_a_callback_with_unsaved_state_is_named_with_the_step(tmp_path, monkeypatch, capsys, xla_cache_env):
    _env(monkeypatch, xla_cache_env)
    (tmp_path / "planted_cb.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))  # the training processes run in tmp_path: `-m` puts it on sys.path
    _workspace(tmp_path, STAGE.format(name="fit", steps=12, every=4, extra=", {type: CheckResumePlanted, every: 3}"))
    code = main(["check-resume", "pipe.yaml", "--import", "planted_cb", "--kills", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    kill = next(line for line in out.splitlines() if line.strip().startswith("kill 1:"))
    # Resumed at step 4 the counter restarts: the uninterrupted run halves the learning rate at step 6, this one
    # at step 7. The first differing state is the optimizer's learning-rate scale at step 6; the cause is named.
    assert "resumed at step 4 of 'fit': differs at stage 'fit' step 6: optimizer state" in kill
    assert "probable cause: callback 'CheckResumePlanted:0'" in kill
    assert "attribute(s) count differ from the uninterrupted run from step 5 on" in kill
    assert "result: NOT bitwise" in out


def test_a_pipeline_without_checkpoints_is_refused_before_running_anything(tmp_path, capsys):
    _workspace(tmp_path, SIGNALS_STAGE.format(name="fit"))
    assert main(["check-resume", "pipe.yaml", "--work-dir", "w"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no stage has a Checkpoint callback" in err[0] and "pipe.yaml" in err[0]
    assert not list((tmp_path / "w").glob("trace-*"))


def test_a_validating_stage_is_stopped_between_two_evaluations_and_its_history_compared(
    tmp_path, monkeypatch, capsys, xla_cache_env
):
    """With validation, the plan has a SIGTERM off the validation cadence (where a stop that evaluates, unlike the
    uninterrupted run, would show: a plateau's lower rate, an early-stopping count, an extra record), and the report
    compares the logged history of the whole chain with the uninterrupted run's."""
    _env(monkeypatch, xla_cache_env)
    stage = STAGE.format(
        name="fit",
        steps=24,
        every=8,
        extra=(
            ", {type: ReduceLROnPlateau, patience: 1, factor: 0.5, threshold: 0.5}, {type: EarlyStopping, patience: 50}"
        ),
    ).replace(
        "  callbacks:",
        "  val_dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: false}\n"
        "  eval_every_n_steps: 4\n  log_every_n_steps: 2\n  callbacks:",
    )
    _workspace(tmp_path, stage)
    code = main(["check-resume", "pipe.yaml", "--kills", "1", "--work-dir", "w"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1 asked, and a SIGTERM between two validation passes" in out
    term = next(line for line in out.splitlines() if "SIGTERM at step" in line)
    step = int(term.split("SIGTERM at step ")[1].split()[0])
    assert step > 4 and step % 4 != 0, term
    assert "logged history: bitwise" in out and "result: bitwise at all 2 kill points" in out
