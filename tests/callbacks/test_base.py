"""`Callback`: a hook that assigns an attribute (``self.last = ...``) is the user's mistake, said in one line that
names the callback and where run-time state goes (`ctx.state_of(self)`), not an internal error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit import PipekitError
from pipekit_train import Callback
from pipekit_train.cli import main

MESSAGE = (
    "callback RememberLastStep assigned self.last, but a callback is frozen (its fields are its configuration): keep "
    "what changes during a run in its state, ctx.state_of(self)['last'] = ... (start it in initial_state(); "
    "checkpoints save it and a resume restores it)"
)


class RememberLastStep(Callback):
    """Keeps the last step the wrong way: on itself."""

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        self.last = ctx.step


def test_assigning_in_a_hook_names_the_callback_and_ctx_state_of():
    with pytest.raises(PipekitError) as info:
        RememberLastStep().last = 3  # type: ignore[attr-defined]
    assert str(info.value) == MESSAGE


def test_the_command_line_says_it_in_one_line_with_exit_code_2(tmp_path: Path, capsys, monkeypatch):
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x[:, :1])
    (tmp_path / "p.yaml").write_text(
        "pipekit: 1\n"
        "type: TrainingLoop\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 3, out_size: 1, width_size: 4, depth: 1}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\n"
        "loss: {type: MSE}\n"
        "max_steps: 2\n"
        "batch_size: 8\n"
        "progress: false\n"
        "callbacks: [{type: RememberLastStep}]\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["run", "p.yaml", "--run-dir", "run", "--no-store"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"pipekit-train: error: {MESSAGE}"]
