"""The Flax NNX backend (``backend: flax``): the conformance kit, the zoo's four factories with the Equinox
backend's part names, converters to and from Equinox, a user ``nnx.Module`` with dropout and BatchNorm whose run
resumes bitwise after a SIGKILL, EMA, and a bound model that training never changes."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")

import pipekit
from pipekit_train import (
    Checkpoint,
    Last,
    TrainingDataset,
    TrainingLoop,
    available_backends,
    register_backend,
    run_settings,
)
from pipekit_train.adapters.conformance import CHECKS, check_runs_a_yaml_pipeline_from_the_cli
from pipekit_train.adapters.flax import FlaxModel, FlaxState, register_flax_model
from pipekit_train.backends import convert_model
from pipekit_train.backends._registry import ENTRY_POINT_GROUP
from pipekit_train.callbacks import EMA
from pipekit_train.data import ArraySource
from pipekit_train.losses import MSE

pytestmark = pytest.mark.xdist_group("kit-flax")  # one worker: Flax imported and the steps compiled once

INSTALLED = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
if "flax" not in available_backends():  # a checkout whose installed metadata predates the entry point
    register_backend("flax", "pipekit_train.adapters.flax:backend")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 4)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)

KWARGS = {
    "mlp": {"in_size": 5, "out_size": 3, "width_size": 6, "depth": 2, "activation": "tanh"},
    "cnn": {"image_size": 8, "out_size": 4, "channels": (2, 3), "hidden": 6, "activation": "gelu"},
    "autoencoder": {"in_size": 6, "latent_size": 2, "hidden": (5, 4), "activation": "silu"},
    "classifier": {"in_size": 6, "num_classes": 3, "latent_size": 2, "hidden": (4,), "head_hidden": (5,)},
}
IN_SIZE = {"mlp": 5, "cnn": 64, "autoencoder": 6, "classifier": 6}


# The conformance kit ----------------------------------------------------------------------------------------------
@pytest.mark.skipif("flax" in INSTALLED, reason="tests/adapters/test_conformance.py runs the kit over installed ones")
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_conformance_kit_passes(check, tmp_path):
    """Until the package is reinstalled with the ``flax`` entry point, the kit runs here (the CLI in-process)."""
    if check == "runs_a_yaml_pipeline_from_the_cli":
        check_runs_a_yaml_pipeline_from_the_cli("flax", tmp_path, fresh_process=False)
    else:
        CHECKS[check]("flax", tmp_path)


# The zoo ------------------------------------------------------------------------------------------------------------
def test_the_four_factories_have_the_equinox_part_names_and_check_their_input():
    parts = {}
    for factory, kw in KWARGS.items():
        op = FlaxModel(factory=factory, kwargs=kw)
        bound = op.bind(op.build(0))
        parts[factory] = sorted({name.split("[")[0].split(".")[1] for name in bound.weights()})
        out = op.check_input((IN_SIZE[factory],), np.float32)
        assert hasattr(out, "shape") and hasattr(out, "dtype")
        # three rows, as the converters' test predicts: the same prediction programs, compiled once
        assert np.asarray(bound(np.zeros((3, IN_SIZE[factory]), np.float32))).shape == (3, *out.shape)
    assert parts == {
        "mlp": ["layers"],
        "cnn": ["convs", "head"],
        "autoencoder": ["decoder", "encoder"],
        "classifier": ["encoder", "head"],
    }
    with pytest.raises(pipekit.ShapeError, match=r"expects \(5,\)"):
        FlaxModel(factory="mlp", kwargs=KWARGS["mlp"]).check_input((7,), np.float32)


# Sizes no other test builds: the builder is kept per factory and kwargs for the process, so a structure another
# test built first (in the same xdist worker) would compile nothing here.
BUILDS = {
    "mlp": {"in_size": 7, "out_size": 2, "width_size": 5, "depth": 2},
    "cnn": {"image_size": 8, "out_size": 3, "channels": (3,), "hidden": 5},
    "autoencoder": {"in_size": 9, "latent_size": 2, "hidden": (3,)},
    "classifier": {"in_size": 9, "num_classes": 4, "hidden": (3,), "head_hidden": (2,)},
    "transformer": {"vocab_size": 13, "d_model": 8, "num_heads": 2, "num_layers": 1, "max_len": 6, "dropout": 0.1},
    "transformer_classifier": {
        "vocab_size": 13,
        "d_model": 8,
        "num_heads": 2,
        "num_layers": 1,
        "max_len": 6,
        "num_classes": 2,
    },
    "test_flax_dropout_bn": {"in_size": 3, "out_size": 2},  # a user module: BatchNorm statistics, dropout streams
}


@pytest.mark.parametrize("factory", list(BUILDS))
def test_building_is_one_program_with_the_default_levels_bits(factory):
    """`FlaxModel.build` draws the variables in one compiled program at the kit's `init_compiler_options` (LLVM
    -O1 and XLA's elemental emitters on the CPU), bit for bit what the same factory gives compiled at XLA's
    default level (``nnx.jit``, how the backend built before): params, BatchNorm statistics and RNG streams. (Not
    the eager factory's bits: XLA fuses a truncated normal's inverse error function into other last bits than its
    eager operations give.)"""
    import jax
    from flax import nnx

    from pipekit_train.adapters.equinox._steps import CompileCounter
    from pipekit_train.adapters.flax._model import FACTORIES

    op, key = FlaxModel(factory=factory, kwargs=BUILDS[factory]), jax.random.key(3)
    with CompileCounter() as compiles:
        state = op.build(key)
    assert compiles.count == 1
    built = op.bind(state).to_nnx()
    default = nnx.jit(lambda k: FACTORIES.get(factory)(nnx.Rngs(k), **BUILDS[factory]))(key)
    ours, theirs = nnx.to_flat_state(nnx.state(built)), nnx.to_flat_state(nnx.state(default))
    assert [path for path, _ in ours] == [path for path, _ in theirs]

    def raw(variable):
        value = variable.get_value()
        is_key = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(value) if is_key else value)

    for (path, a), (_, b) in zip(ours, theirs, strict=True):
        assert raw(a).dtype == raw(b).dtype and raw(a).tobytes() == raw(b).tobytes(), path


@pytest.mark.parametrize("factory", list(KWARGS))
def test_every_factory_converts_to_equinox_and_back(factory):
    """The same function to float rounding, and back the same arrays bit for bit, both ways round."""
    from pipekit_train.adapters.equinox import EquinoxModel

    x = np.random.default_rng(1).normal(size=(3, IN_SIZE[factory])).astype(np.float32)
    for cls in (FlaxModel, EquinoxModel):
        op = cls(factory=factory, kwargs=KWARGS[factory])
        fresh = op.bind(op.build(1))
        weights = {k: RNG.normal(0, 0.5, v.shape).astype(v.dtype) for k, v in fresh.weights().items()}
        model = fresh.with_weights(weights)
        other = convert_model(model, "equinox" if cls is FlaxModel else "flax")
        np.testing.assert_allclose(np.asarray(other(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-5)
        back = convert_model(other, model.backend).weights()
        for name, array in model.weights().items():
            np.testing.assert_array_equal(back[name], array)


# A user nnx.Module: dropout and BatchNorm ---------------------------------------------------------------------------
@register_flax_model("test_flax_dropout_bn")
def dropout_bn(rngs, in_size: int, out_size: int = 1, rate: float = 0.3):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self) -> None:
            self.dense = nnx.Linear(in_size, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.dropout = nnx.Dropout(rate, rngs=rngs)
            self.out = nnx.Linear(8, out_size, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(nnx.relu(self.norm(self.dense(x)))))

    return Net()


def _loop(**overrides) -> TrainingLoop:
    fields = dict(
        model_op=FlaxModel(factory="test_flax_dropout_bn", kwargs={"in_size": 4}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        loss=MSE(),
        optimizer_config={"name": "adamw", "lr": 0.01, "schedule": "warmup_cosine", "warmup_steps": 3},
        max_steps=12,
        batch_size=16,
        backend="flax",
        progress=False,
        log_every_n_steps=4,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def _train(loop, run_dir):
    with run_settings(run_dir=str(run_dir), store=False):
        return loop.run()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`_loop` trained once, for the tests that need a trained model of it and never change it."""
    model, _ = _train(_loop(), tmp_path_factory.mktemp("flax-trained") / "run")
    return model


def test_dropout_draws_from_seed_and_step_and_batch_statistics_are_state(trained, tmp_path):
    a = trained
    b, _ = _train(_loop(), tmp_path / "b")
    c, _ = _train(_loop(seed=1), tmp_path / "c")
    assert a.weights_hash() == b.weights_hash() != c.weights_hash()
    weights = a.weights()
    assert not np.allclose(weights[".norm.mean"], 0.0)  # the running statistics were updated and kept
    # inference mode: dropout off, running statistics; the same predictions twice
    np.testing.assert_array_equal(np.asarray(a(X[:8])), np.asarray(a(X[:8])))
    assert isinstance(a.module, FlaxState)


def test_training_never_changes_a_bound_model_it_started_from(trained):
    """The step donates its state: the bound model handed to `start` (a previous stage's) keeps its arrays."""
    first = trained
    before = first.weights_hash()
    loop = _loop()
    steps = loop.adapter().start(loop, first, None)
    steps.train([{"x": X[:16], "y": Y[:16]}, {"x": X[16:32], "y": Y[16:32]}], 0)
    assert first.weights_hash() == before != steps.bound_model().weights_hash()
    np.testing.assert_array_equal(np.asarray(first(X[:4])), np.asarray(first(X[:4])))


def test_binding_an_nnx_module_takes_a_snapshot_the_module_cannot_change():
    op = FlaxModel(factory="mlp", kwargs=KWARGS["mlp"])
    module = op.bind(op.build(0)).to_nnx()
    bound = op.bind(module)
    before = bound.weights_hash()
    module.layers[0].kernel[...] = module.layers[0].kernel[...] * 0.0  # the user's module, changed in place
    assert bound.weights_hash() == before
    assert op.bind(module).weights_hash() != before


def test_ema_is_kept_evaluated_returned_and_checkpointed(trained, tmp_path):
    """A decay near 1 keeps the starting weights; near 0 it follows the parameters; the stage returns it. (The
    stages are `_loop`'s: the plain one is the module's trained model, and the schedule's steps compile once.)"""
    plain = trained
    fresh = _loop().adapter().build(_loop())
    slow_ema, fast_ema = (EMA(decay=d, warmup=False, return_ema=True) for d in (0.999999, 1e-6))
    slow, _ = _train(_loop(callbacks=(slow_ema,)), tmp_path / "slow")
    fast, _ = _train(_loop(callbacks=(fast_ema,)), tmp_path / "fast")
    for name, value in fresh.weights().items():
        if not name.startswith(".norm"):  # the statistics are not averaged: they are the trained ones
            np.testing.assert_allclose(slow.weights()[name], value, atol=1e-4)
            np.testing.assert_allclose(fast.weights()[name], plain.weights()[name], atol=1e-4)


_HELPER = '''
import time

import pipekit_train
from pipekit_train import Callback

if "flax" not in pipekit_train.available_backends():
    pipekit_train.register_backend("flax", "pipekit_train.adapters.flax:backend")

import test_flax_dropout_bn_factory  # noqa: F401  the user model, registered


class SlowFlaxSteps(Callback):
    """Sleeps after each step, so a test can kill the process in the middle of a run."""

    seconds: float = 0.02

    def on_step_end(self, ctx, metrics):
        time.sleep(self.seconds)

    def fingerprint(self):
        return None
'''


@pytest.mark.slow
# a kill between a save's commit and the manifest's update is one of the windows: the resume says so, and lists it
@pytest.mark.filterwarnings("ignore:.*were committed but missing from manifest.json")
def test_sigkill_then_resume_auto_is_bitwise_with_dropout_and_batchnorm(tmp_path):
    """A ``pipekit-train run`` subprocess killed with SIGKILL after a checkpoint, then resumed with
    ``resume="auto"``: bitwise the uninterrupted run's weights (dropout masks and BatchNorm statistics included)."""
    import inspect
    import signal
    import textwrap
    import time

    from pipekit_train import NpzSource

    # The same factory for the subprocess (registered here already: the import in this process is a no-op).
    source = textwrap.dedent(inspect.getsource(dropout_bn)).split("\n", 1)[1]  # without the decorator
    (tmp_path / "test_flax_dropout_bn_factory.py").write_text(
        "from pipekit_train.adapters.flax import register_flax_model, registered_flax_models\n\n"
        + source
        + '\nif "test_flax_dropout_bn" not in registered_flax_models():\n'
        + '    register_flax_model("test_flax_dropout_bn")(dropout_bn)\n'
    )
    (tmp_path / "slow_flax_helper.py").write_text(_HELPER)
    sys.path.insert(0, str(tmp_path))
    try:
        import slow_flax_helper
    finally:
        sys.path.remove(str(tmp_path))
    np.savez(tmp_path / "data.npz", x=X, y=Y)
    loop = _loop(
        dataset=TrainingDataset(source=NpzSource(path=str(tmp_path / "data.npz"))),
        max_steps=40,
        steps_per_call=2,
        log_every_n_steps=10,
        callbacks=(Checkpoint(every_n_steps=10, keep=(Last(n=2),)), slow_flax_helper.SlowFlaxSteps()),
    )
    (tmp_path / "pipe.yaml").write_text(pipekit.dumps(loop))
    full, _ = _train(loop, tmp_path / "full")

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    args = [sys.executable, "-m", "pipekit_train.cli", "run", "pipe.yaml", "--run-dir", "part", "--no-store"]
    args += ["--import", "slow_flax_helper"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = tmp_path / "part" / "stage0" / "checkpoints" / "20" / "commit_success.txt"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    with run_settings(run_dir=str(tmp_path / "part"), store=False, resume="auto"):
        resumed, artifact = loop.run()
    assert artifact.backend_info["steps"] == 40
    assert resumed.weights_hash() == full.weights_hash()


def test_the_digits_pretrain_finetune_example_runs_from_yaml_with_the_cli(tmp_path, monkeypatch, capsys):
    """``examples/digits/pretrain_finetune_flax.yaml``, shortened, through ``pipekit-train run``: the pretrained
    encoder is transferred into the classifier, and the finetuned model is a trained Flax classifier."""
    from pipekit_train.cli import main

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    pipeline = pipekit.load(root / "examples" / "digits" / "pretrain_finetune_flax.yaml")
    short = pipeline.replace(
        stages=tuple(
            s.replace(
                max_steps=20,
                eval_every_n_steps=10,
                log_every_n_steps=10,
                steps_per_call=5,
                callbacks=(),
                optimizer_config={**s.optimizer_config, "warmup_steps": 5},
            )
            for s in pipeline.stages
        )
    )
    (tmp_path / "pipe.yaml").write_text(pipekit.dumps(short))
    assert main(["run", str(tmp_path / "pipe.yaml"), "--run-dir", str(tmp_path / "run"), "--no-store"]) == 0
    out = capsys.readouterr().out
    assert "pretrain" in out and "finetune" in out


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_weights(trained, tmp_path):
    full = trained
    low, low_art = _train(_loop(precision={"compute": "bfloat16"}), tmp_path / "low")
    assert low_art.backend_info["precision"] == "bfloat16"
    assert all(np.asarray(w).dtype == np.float32 for w in low.weights().values())  # statistics included
    assert low.weights_hash() != full.weights_hash()
    np.testing.assert_allclose(np.asarray(low(X)), np.asarray(full(X)), rtol=0.1, atol=0.1)


def test_scheduled_loss_weight_and_ema_decay_follow_the_step_and_are_logged(tmp_path):
    """The `schedules` capability: a `Composite` weight and the EMA decay read at the traced step, logged as
    ``schedule/<name>``; a `Constant` schedule is bitwise its float."""
    from pipekit_train import Composite, Constant, Cosine, CrossEntropy, Linear, read_jsonl

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    labels = x[:, :3].argmax(axis=1).astype(np.int32)

    def run(decay, name):
        loop = _loop(
            model_op=FlaxModel(factory="classifier", kwargs={"in_size": 8, "num_classes": 3, "latent_size": 4}),
            dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": labels})),
            loss=Composite(
                components=(
                    (1.0, CrossEntropy()),
                    (Linear(start=0.0, end=1.0, steps=6, begin=2), CrossEntropy(label_smoothing=0.5)),
                )
            ),
            log_every_n_steps=1,
            steps_per_call=1,
            callbacks=(EMA(decay=decay, warmup=False),),
        )
        model, _ = _train(loop, tmp_path / name)
        records = read_jsonl(tmp_path / name / "stage0" / "metrics.jsonl")
        return model, [r for r in records if r.get("context") == "train" and r.get("type") == "metrics"]

    plain, _ = run(0.8, "plain")
    constant, _ = run(Constant(value=0.8), "constant")
    assert constant.weights_hash() == plain.weights_hash()
    _, records = run(Cosine(start=0.5, end=0.9, steps=4), "cosine")
    weights = {r["step"]: r["schedule/weight/CrossEntropy_1"] for r in records}
    assert [weights[t] for t in range(1, 13)] == pytest.approx(
        [0.0, 0.0, 0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0, 1.0, 1.0, 1.0], abs=1e-6
    )
    decays = [r["schedule/ema_decay"] for r in records]
    assert (decays[0], decays[-1]) == pytest.approx((0.5, 0.9), abs=1e-6)


def test_the_learning_rate_finder_sweeps_a_flax_stage():
    from pipekit_train.sweep import lr_find

    result = lr_find(_loop(), min_lr=1e-4, max_lr=1.0, steps=20)
    assert len(result.lrs) == len(result.losses) > 5 and result.suggestion > 0
    assert all(np.isfinite(result.losses[:5]))
