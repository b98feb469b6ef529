"""`observes_only`: which `on_step_end` hooks are shown, from their source, to only observe; and how a callback's
declarations and that inference decide how it hears of steps (`engine._chunks.step_hook`)."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from pipekit_train import EMA, Callback, Checkpoint, EarlyStopping, ReduceLROnPlateau
from pipekit_train.callbacks._observing import observes_only
from pipekit_train.engine._chunks import needs_every_step, step_hook

LOSSES: list[float] = []


# Hooks that only observe ---------------------------------------------------------------------------------------
def reads_the_loss(self, ctx, metrics):
    ctx.state_of(self)["sum"] += float(metrics["loss"])


def appends_and_prints(self, ctx, metrics):
    LOSSES.append(float(metrics["loss"]))
    if ctx.step % 10 == 0:
        print(f"step {ctx.step} (epoch {ctx.epoch}): {np.mean(LOSSES[-10:]):.4f}")


def writes_a_record(self, ctx, metrics):
    state = ctx.state_of(self)
    state.setdefault("seen", []).append(ctx.step)
    ctx.writer.write({"type": "metrics", "context": "mine", "step": ctx.step, "loss": metrics["loss"].item()})
    ctx.artifact_fields["last_step"] = ctx.step


# Hooks that act, or that the source cannot show to only observe -------------------------------------------------
def stops(self, ctx, metrics):
    if float(metrics["loss"]) < 0.1:
        ctx.request_stop("converged")


def reads_the_model(self, ctx, metrics):
    LOSSES.append(ctx.model)


def lowers_the_lr(self, ctx, metrics):
    ctx.lr_scale = 0.5


def signals(self, ctx, metrics):
    if ctx.step == 15:
        os.kill(os.getpid(), signal.SIGTERM)


def raises(self, ctx, metrics):
    if not np.isfinite(float(metrics["loss"])):
        raise RuntimeError("diverged")


def asserts(self, ctx, metrics):
    assert float(metrics["loss"]) > 0


def hands_ctx_on(self, ctx, metrics):
    LOSSES.append(ctx)


def calls_a_helper(self, ctx, metrics):
    self.record(ctx.step)


def sets_a_flag(self, ctx, metrics):
    Callback.flag = ctx.step


def declares_a_global(self, ctx, metrics):
    global LOSSES
    LOSSES = []


@pytest.mark.parametrize("hook", [reads_the_loss, appends_and_prints, writes_a_record], ids=lambda f: f.__name__)
def test_hooks_that_read_and_record_observe(hook: Any):
    assert observes_only(hook)


@pytest.mark.parametrize(
    "hook",
    [
        stops,
        reads_the_model,
        lowers_the_lr,
        signals,
        raises,
        asserts,
        hands_ctx_on,
        calls_a_helper,
        sets_a_flag,
        declares_a_global,
        lambda self, ctx, metrics: None,  # no def to read
        print,  # no Python source
    ],
    ids=lambda f: getattr(f, "__name__", "?"),
)
def test_hooks_that_act_or_cannot_be_read_do_not(hook: Any):
    assert not observes_only(hook)


def test_a_hook_is_judged_by_the_code_it_runs_not_by_its_file_edited_since(tmp_path):
    """`inspect.getsource` reads the file as it is now: after an edit, the hook's lines may hold another function,
    here an observing one in place of the acting hook that was imported."""
    import importlib.util

    path = tmp_path / "edited_hook.py"
    path.write_text("def on_step_end(self, ctx, metrics):\n    ctx.request_stop('converged')\n")
    spec = importlib.util.spec_from_file_location("edited_hook", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    acting = module.on_step_end
    path.write_text("def on_step_end(self, ctx, metrics):\n    ctx.state_of(self)['losses'].append(metrics['loss'])\n")
    assert not observes_only(acting)


# Declarations and inference --------------------------------------------------------------------------------------
class Tally(Callback, register=False):
    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        ctx.state_of(self)["sum"] += float(metrics["loss"])


class StopAt(Callback, register=False):
    def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
        if ctx.step == 13:
            ctx.request_stop("13")


class Logger(StopAt, register=False):
    """Calls nothing the inference knows (a tracker's client), and says it only observes."""

    observes_only = True


class StopsAtChunkEnd(StopAt, register=False):
    needs_every_step = False


class TallyEveryStep(Tally, register=False):
    observes_only = False


class Contradicts(Tally, register=False):
    needs_every_step = True
    observes_only = True


def test_declarations_win_and_the_rest_is_inferred():
    for cb in (EarlyStopping(), ReduceLROnPlateau(), EMA(), Checkpoint()):  # they do not override on_step_end
        assert step_hook(cb) == "none" and not needs_every_step(cb)
    assert step_hook(Tally()) == "observes"  # inferred
    assert step_hook(StopAt()) == "every_step"  # inferred: it stops the run
    assert step_hook(Logger()) == "observes"  # declared
    assert step_hook(StopsAtChunkEnd()) == "chunk_end"  # declared needs_every_step = False
    assert step_hook(TallyEveryStep()) == "every_step"  # declared observes_only = False
    with pytest.raises(ValueError, match=r"Contradicts declares both needs_every_step = True and observes_only"):
        step_hook(Contradicts())
