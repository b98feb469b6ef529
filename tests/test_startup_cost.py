"""What a run does before its first step, counted (never timed): XLA compiles, model builds, imported modules.

The target (docs/performance.md, "Time to first step and peak memory"): a run reaches its first step about as soon
as a hand-written JAX/Equinox/Optax script. Wall-clock time is measured by ``benchmarks/startup.py``; these tests
pin the causes that were cut, so they cannot come back unnoticed:

- the programs XLA compiles before the first step are fewer than the hand script's: the stage's keys, the model's
  initialisation and the optimizer's zeros are one program each (the hand script's eager ``jax.random`` and
  ``zeros`` calls compile one per leaf), then one train step; nothing else (no key indexing in the pre-flight, no
  conversion program for the optimizer's numbers, no compiled learning-rate schedule for the first log line); a
  whole 300-step job compiles at most `MAX_COMPILES` programs;
- the model is built (initialised) once per stage, though the pre-flight checks it before the run trains it, and
  its architecture is traced once;
- the heavy libraries a default run does not need (Grain, Orbax, TensorStore, TensorBoard, msgpack) are not
  imported before the first step, by the Python API or by ``pipekit-train run``.

Compile counts need a fresh process (XLA programs are cached per process), so those tests run real subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipekit_train import MSE, EquinoxModel, NpzSource, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.adapters.equinox import register_model
from pipekit_train.stage import RunSettings, run_pipeline
from pipekit_train.stage.preflight import check_pipeline, plan_pipeline

pytestmark = pytest.mark.xdist_group("startup-cost")  # one worker: each module fixture starts fresh processes once

IN_SIZE, WIDTH, DEPTH, BATCH = 5, 7, 2, 8

#: Imported first (``--import startup_probe`` for the CLI): records XLA backend compiles by program name (from
#: `jax.monitoring` and jax's compile log), and registers a callback that, at the end of the first step (after its
#: loss was read back, as the benchmark's clock), writes ``{"compiles": [...], "modules": [...]}`` to ``$OUT``.
PROBE = textwrap.dedent(
    """
    import json, logging, os, sys
    import jax, jax.monitoring
    from pipekit_train.callbacks import Callback

    COMPILES, NAME = [], {}
    SHAPES = " with global shapes and types "

    class _Names(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Compiling "):
                head, _, rest = message[len("Compiling "):].partition(SHAPES)
                NAME["last"] = head + " " + rest.split(". Argument mapping")[0]

    def _on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            COMPILES.append(NAME.pop("last", "?"))

    jax.monitoring.register_event_duration_secs_listener(_on_event)
    jax.config.update("jax_log_compiles", True)
    _logger = logging.getLogger("jax")
    _logger.addHandler(_Names())
    _logger.setLevel(logging.WARNING)
    _logger.propagate = False  # the compile log is for this recorder, not for stderr

    def first_step():
        if not os.path.exists(os.environ["OUT"]):
            with open(os.environ["OUT"], "w") as out:
                json.dump({"compiles": COMPILES, "modules": sorted(sys.modules)}, out)

    class StartupProbe(Callback):
        def on_step_end(self, ctx, metrics):
            first_step()
    """
)


def _hand_template() -> str:
    """The benchmark's hand-written script (`benchmarks/startup.py`), the reference these counts compare with."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "startup.py"
    spec = importlib.util.spec_from_file_location("pipekit_bench_startup", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return str(module.HAND_TEMPLATE)


HAND = _hand_template().format(in_size=IN_SIZE, width=WIDTH, depth=DEPTH, lr=1e-3, batch=BATCH)

API = textwrap.dedent(
    f"""
    from pipekit_train import MSE, EquinoxModel, NpzSource, TrainingDataset, TrainingLoop, run_settings
    from startup_probe import StartupProbe

    loop = TrainingLoop(
        model_op=EquinoxModel(
            factory="mlp", kwargs={{"in_size": {IN_SIZE}, "out_size": 1, "width_size": {WIDTH}, "depth": {DEPTH}}}
        ),
        dataset=TrainingDataset(source=NpzSource(path="data.npz")),
        loss=MSE(),
        optimizer_config={{"name": "adamw", "lr": 1e-3}},
        max_steps=300,
        batch_size={BATCH},
        log_every_n_steps=100,
        progress=False,
        callbacks=[StartupProbe()],
    )
    with run_settings(store=False, run_dir="run-api"):
        loop.run()
    """
)

#: One process: the hand script, then (XLA's caches cleared, so each compiles from nothing) the Python API.
HAND_THEN_API = textwrap.dedent(
    """
    import json, os, runpy
    import jax
    import startup_probe

    os.environ["OUT"] = "hand.json"
    runpy.run_path("hand.py", run_name="__main__")
    startup_probe.first_step()
    jax.clear_caches()
    startup_probe.COMPILES.clear()
    os.environ["OUT"] = "api.json"
    runpy.run_path("api.py", run_name="__main__")
    with open("api_job.json", "w") as out:  # every program the whole job compiled
        json.dump({"compiles": startup_probe.COMPILES}, out)
    """
)

YAML = f"""\
pipekit: 1
type: TrainingLoop
model_op:
  type: EquinoxModel
  factory: mlp
  kwargs: {{in_size: {IN_SIZE}, out_size: 1, width_size: {WIDTH}, depth: {DEPTH}}}
dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: data.npz}}}}
loss: {{type: MSE}}
optimizer_config: {{name: adamw, lr: 1.0e-3}}
max_steps: 2
batch_size: {BATCH}
log_every_n_steps: 1
progress: false
callbacks: [{{type: StartupProbe}}]
"""

#: Not needed before the first step of a default run (no checkpoints, no TensorBoard, no prefetching).
HEAVY = ("grain", "orbax", "tensorstore", "tensorboard", "tensorboardX", "msgpack", "array_record", "mlflow")


def _data(folder: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, IN_SIZE)).astype(np.float32)
    np.savez(folder / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))


def _run(folder: Path, *argv: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(folder), env.get("PYTHONPATH", "")]).rstrip(":"))
    env["OUT"] = str(folder / "cli.json")
    proc = subprocess.run([sys.executable, *argv], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What the hand script, the Python API and ``pipekit-train run`` had compiled and imported at their first
    step; two fresh processes (hand then API, and the CLI)."""
    folder = tmp_path_factory.mktemp("first-step")
    _data(folder)
    for name, text in (("startup_probe", PROBE), ("hand", HAND), ("api", API), ("hand_then_api", HAND_THEN_API)):
        (folder / f"{name}.py").write_text(text)
    (folder / "pipe.yaml").write_text(YAML)
    _run(folder, "hand_then_api.py")
    _run(
        folder,
        "-m",
        "pipekit_train.cli",
        "run",
        "pipe.yaml",
        "--import",
        "startup_probe",
        "--run-dir",
        "run-cli",
        "--no-store",
    )
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in ("hand", "api", "cli", "api_job")}


#: The programs a stage compiles before its first step, besides its train step: the stage's two keys
#: (`stage_keys`), the model's initialisation (`EquinoxModel.build`, one traced program) and the optimizer's state.
BEFORE_FIRST_STEP = ("jit(_split_seed)", "jit(make)")
#: The optimizer's state is initialised eagerly (a jitted `init` would close over each new optimizer, and its
#: learning rate, and compile again for every stage and sweep trial): its zeros and casts compile once per shape
#: for the process.
OPTIMIZER_EAGER = ("jit(broadcast_in_dim)", "jit(convert_element_type)")
#: What a whole 300-step job compiles (measured): those, the train step, and the seed's key data for the result.
MAX_COMPILES = 11
#: Eager per-leaf programs of the model's initialisation (one per weight shape): none may be compiled by a run.
PER_LEAF = ("jit(_uniform)", "jit(_normal)", "jit(_threefry_split)", "jit(unstack)")


@pytest.mark.parametrize("contender", ["api", "cli"])
def test_no_compile_of_our_own_before_the_first_step(first_steps: dict[str, Any], contender: str) -> None:
    """Before the first step: one program per piece of start-up work (keys, model, optimizer state), then our
    train program; fewer than the hand script, which compiles a program per eager random call and zeros leaf."""
    hand, ours = first_steps["hand"]["compiles"], first_steps[contender]["compiles"]
    assert [c for c in hand if c.startswith("jit(step)")] == [hand[-1]], hand
    assert any(c.startswith("jit(_uniform)") for c in hand), hand  # the reference does compile per leaf
    train = [c for c in ours if c.startswith("jit(_train_chunk_impl)")]
    assert len(train) == 1, ours
    others = [c.split(" ")[0] for c in ours if c not in train and not c.startswith(OPTIMIZER_EAGER)]
    assert sorted(others) == sorted(BEFORE_FIRST_STEP), ours
    assert len(ours) < len(hand), (ours, hand)
    for what in ("_scheduled_lr", "dynamic_slice) (ShapedArray(key<fry>[2])", *PER_LEAF):
        assert not any(what in c for c in ours), ours


def test_a_300_step_job_compiles_at_most_k_programs(first_steps: dict[str, Any]) -> None:
    job = first_steps["api_job"]["compiles"]
    assert len(job) <= MAX_COMPILES, job
    assert not any(c.startswith(PER_LEAF) for c in job), job


@pytest.mark.parametrize("contender", ["api", "cli"])
def test_no_heavy_import_before_the_first_step(first_steps: dict[str, Any], contender: str) -> None:
    modules = first_steps[contender]["modules"]
    assert "pipekit_train" in modules and "optax" in modules  # the report was taken inside the run
    heavy = sorted({m.split(".")[0] for m in modules} & set(HEAVY))
    assert heavy == [], f"{contender} imported {heavy} before its first step"


def _in_abstract() -> bool:
    """Whether the caller runs inside `_tree.abstract` (the architecture's shapes, no weights)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "abstract" and frame.f_code.co_filename.endswith("_tree.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _counting_factory(name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Register a model factory `name` and count its builds (`EquinoxModel.build` with a concrete key: the factory
    itself runs traced, once per architecture, so builds are counted at `build`) and its abstract traces
    (`jax.eval_shape`: the shape checks, counted in the factory)."""
    calls = {"built": 0, "traced": 0}

    @register_model(name)
    def factory(key: Any, in_size: int, out_size: int = 1) -> Any:
        if _in_abstract():
            calls["traced"] += 1
        return eqx.nn.MLP(in_size, out_size, 6, 1, key=key)

    build = EquinoxModel.build

    def counted_build(self: Any, key: Any) -> Any:
        if self.factory == name and not isinstance(key, jax.core.Tracer):
            calls["built"] += 1
        return build(self, key)

    monkeypatch.setattr(EquinoxModel, "build", counted_build)
    return calls


def _loop(factory: str, data: Path) -> TrainingLoop:
    return TrainingLoop(
        model_op=EquinoxModel(factory=factory, kwargs={"in_size": IN_SIZE}),
        dataset=TrainingDataset(source=NpzSource(path=str(data))),
        loss=MSE(),
        max_steps=2,
        batch_size=BATCH,
        progress=False,
    )


def test_the_model_is_built_once_per_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-flight builds the model (it checks the weights it would start from); the run trains that build
    instead of building it again. Its architecture is traced once for every shape check of both."""
    _data(tmp_path)
    calls = _counting_factory("startup_cost_counted", monkeypatch)
    loop = _loop("startup_cost_counted", tmp_path / "data.npz")
    with run_settings(store=False, run_dir=str(tmp_path / "run")):
        model, _ = loop.run()
    assert calls == {"built": 1, "traced": 1}
    # The artifact's dependency lock was collected on a background thread while the stage ran, and joined.
    from pipekit_train.provenance._artifact import collect_deps_lock
    from pipekit_train.stage import record

    (artifact,) = (tmp_path / "run").rglob("artifact.json")
    deps = json.loads(artifact.read_text())["deps_lock"]
    assert deps["distributions"] == collect_deps_lock()["distributions"] and "jax" in deps["distributions"]
    assert not [d for d in record._DEPS_LOCKS if d.startswith(str(tmp_path))]  # joined and dropped
    # Another loop object of the same configuration shares nothing with the first (one build of its own) and trains
    # to the same weights bitwise. (tests/test_loop.py checks those runs bitwise against hand-written optax loops.)
    again_loop = _loop("startup_cost_counted", tmp_path / "data.npz")
    with run_settings(store=False, run_dir=str(tmp_path / "again")):
        again, _ = again_loop.run()
    assert calls["built"] == 2
    for a, b in zip(jax.tree.leaves(model.weights()), jax.tree.leaves(again.weights()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_validate_then_run_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pipekit-train run`` checks the whole pipeline first (`plan_pipeline`, which builds each fresh model) and
    hands the plans to the stages (`run_pipeline`): no stage checks itself again or builds a second model. Without
    plans (the Python API's plain ``run()``) the stage checks itself and builds once; a separate ``check_pipeline``
    call is a validation of its own (it builds its own model: there is no hidden cache between the two calls)."""
    _data(tmp_path)
    calls = _counting_factory("startup_cost_validated", monkeypatch)
    loop = _loop("startup_cost_validated", tmp_path / "data.npz")
    plans = plan_pipeline(loop)
    assert [p.route for p in plans] == ["fresh"] and plans[0].fresh is not None
    run_pipeline(loop, RunSettings(store=False, run_dir=str(tmp_path / "run")), plans)
    assert calls == {"built": 1, "traced": 1}
    with run_settings(store=False, run_dir=str(tmp_path / "run2")):
        loop.run()
    assert calls == {"built": 2, "traced": 1}  # one more build, no more trace (the shape check is cached)
    assert check_pipeline(loop) == "1 training stage, 2 steps in all"
    assert calls["built"] == 3


@pytest.mark.parametrize("warmup", [0, 3])
def test_logged_constant_rate_compiles_nothing_and_is_the_programs(warmup: int) -> None:
    """The first log line's ``lr`` of a constant schedule (past its warm-up) is read on the host: nothing is
    compiled for it, and it is bitwise the compiled formula's value (the rate the step applies)."""
    from pipekit_train.adapters.equinox._steps import CompileCounter
    from pipekit_train.backends._optax_schedule import _schedule_scalars, _scheduled_lr_jit, learning_rate_at
    from pipekit_train.optim._config import resolve_optimizer_config, schedule_numbers

    config = {"name": "adamw", "lr": 0.1 + 1e-9, "warmup_steps": warmup}  # not a float32: rounded once, as the step
    with CompileCounter() as compiles:
        rates = [learning_rate_at(config, step, 20) for step in range(warmup, 20)]
    assert compiles.count == 0
    cfg = resolve_optimizer_config(config)
    scalars = _schedule_scalars("constant", schedule_numbers(cfg, 20))
    assert rates == [float(_scheduled_lr_jit("constant", scalars, np.int32(s))) for s in range(warmup, 20)]
    assert rates[0] == float(np.float32(0.1 + 1e-9))
    if warmup:  # inside the warm-up the formula is evaluated as compiled: 0 at step 0
        assert learning_rate_at(config, 0, 20) == 0.0


class _NormalInits(eqx.Module):
    normal: jax.Array
    truncated: jax.Array
    orthogonal: jax.Array


# Sizes no other test builds: the builder's programs are cached by structure for the whole process, so a structure
# another test built first (in the same xdist worker, in whatever order) would compile nothing here.
@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        ("mlp", {"in_size": 5, "out_size": 2, "width_size": 7, "depth": 2}),
        ("classifier", {"in_size": 6, "num_classes": 3, "hidden": (5,), "head_hidden": (4,)}),
        ("cnn", {"image_size": 8, "out_size": 7}),
        ("autoencoder", {"in_size": 13, "latent_size": 3, "hidden": [7]}),
        ("test_normal_inits", {"in_size": 9}),
    ],
)
def test_model_building_is_one_program_with_the_eager_bits(factory: str, kwargs: dict[str, Any]) -> None:
    """`EquinoxModel.build` compiles one program (not one per weight: an eager `jax.random.uniform` compiles per
    shape), and its weights are the eager factory's bit for bit (checkpoints and recorded runs depend on it). The
    builder is compiled at LLVM -O1 with XLA's elemental emitters on the CPU (`init_compiler_options`): every
    built-in factory and the normal, truncated-normal and orthogonal initialisers (erfinv, a QR) are checked
    here."""
    from pipekit_train.adapters.equinox._adapter import stage_keys
    from pipekit_train.adapters.equinox._model import FACTORIES
    from pipekit_train.adapters.equinox._steps import CompileCounter

    if factory == "test_normal_inits" and factory not in FACTORIES.names():

        @register_model(factory)
        def normal_inits(key: Any, in_size: int) -> Any:
            k1, k2, k3 = jax.random.split(key, 3)
            return _NormalInits(
                normal=jax.nn.initializers.he_normal()(k1, (in_size, 11)),
                truncated=jax.random.truncated_normal(k2, -2.0, 2.0, (in_size, 5)) * 0.02,
                orthogonal=jax.nn.initializers.orthogonal()(k3, (in_size, in_size)),
            )

    op = EquinoxModel(factory=factory, kwargs=kwargs)
    key = stage_keys(3)[0]
    with CompileCounter() as compiles:
        built = op.build(key)
    assert compiles.count == 1
    eager = FACTORIES.get(factory)(key, **kwargs)
    ours, theirs = jax.tree.flatten(built), jax.tree.flatten(eager)
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0], theirs[0], strict=True):
        if eqx.is_array(a):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        else:
            assert a == b
    eager_keys = jax.random.split(jax.random.key(3))
    for a, b in zip(stage_keys(3), eager_keys, strict=True):
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
