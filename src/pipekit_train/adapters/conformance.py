"""Conformance checks every backend adapter must pass, whatever its framework.

Run them from the shell (``--import`` loads a backend that registers itself in-process with `register_backend`)::

    python -m pipekit_train.adapters.conformance NAME [--import MODULE]

or from a test suite through `CHECKS`, the public API: ``{check name: check(backend_name, tmp_dir)}``. A check
returns ``None`` when the backend conforms and raises `AssertionError` naming the backend and what differed when it
does not; it writes only under ``tmp_dir`` (a fresh directory per check)::

    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_conformance(check, tmp_path):
        CHECKS[check]("my-backend", tmp_path)

Every check trains a tiny regression problem (96 examples of 4 features, a linear target, 30 steps of 16; every stage
of every check as long, so that a sampler compiles one program for all of them) the way users do, through
`TrainingLoop`, `pipekit.Sequential` and the CLI, with validation every 10 steps. The model is the backend's own
``example_model(4, 1)`` (see ``adapters/README.md``), the loss `MSE` and the optimizer SGD with momentum under a
warm-up cosine schedule (``schedule: warmup_cosine``, 5 warm-up steps: `pipekit_train.optim.schedule_numbers` gives
its numbers; `pipekit_train.backends.kit.learning_rate_at` the rate at a step), which every backend with the ``weights``
capability is expected to honour. A backend that trains otherwise (a sampler, a variational fit) gives the loop
fields of its own problem on the same data with ``example_fields()`` (a kernel as `task`, an ELBO as `loss`), and
every check gives it the **sampler variant**: the same checks where they mean something (determinism, SIGTERM and
a bitwise resume, retention, artifacts and lineage, the registry round trip, the hand-off to a next stage, refusing
a foreign model, the CLI), each judged by what the backend is. The backend
must be registered in this process before a check runs (an installed entry point, or the module that calls
`register_backend` imported first).

The checks:

- ``returns_a_trained_model``: a bound model of the loop's architecture, and the logged training loss went down.
- ``is_deterministic``: one seed gives bitwise the same weights twice; another seed gives other weights.
- ``calls_callbacks_in_order``: start, one ``on_step_end`` per step with the right step, evaluations, end.
- ``resumes_exactly``: a run stopped by SIGTERM between two evaluations and resumed ends bitwise where an
  uninterrupted run ends (weights, callbacks' saved state, logged history), with `ReduceLROnPlateau` and
  `EarlyStopping` acting on the evaluations where the backend trains weights.
- ``restores_the_best_checkpoint``: with ``restore_best``, the returned weights are the best checkpoint's and the
  artifact records that step's validation metrics and the step (``restored``).
- ``transfers_by_paths``: with the ``transfer`` capability, ``Transfer(paths=example_transfer())`` starts a second
  stage from the first stage's weights in those parts and fresh weights elsewhere.
- ``keeps_checkpoints_by_selectors``: ``keep=(Last(n=2),)`` leaves exactly the last two steps on disk and in
  ``manifest.json``, and a warm start (``init_from``) from the latest one starts from the final weights.
- ``records_artifacts``: one artifact per stage in a SQLite `ArtifactStore`, with the backend's name, its
  `backend_info` and the parent link between stages.
- ``round_trips_the_model_registry``: `load_model` of the artifact's URI gives an equal operator with the same
  weights hash and the same predictions.
- ``hands_off_in_a_sequential``: the second stage of a `Sequential` starts from the first stage's final weights
  (a sampler: from the first stage's posterior, as its artifact says, with the first stage as its parent).
- ``refuses_a_foreign_model``: pre-flight refuses, with a `pipekit.ConfigError`, a model of another backend.
- ``runs_a_yaml_pipeline_from_the_cli``: ``pipekit-train validate`` and ``run`` of a two-stage YAML pipeline in a
  subprocess (with ``--import MODULE`` for an in-process backend) record both stages, with bitwise the weights the
  same pipeline gets in this process.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CHECKS", "main"]

_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(96, 4)).astype(np.float32)
_Y = (_X @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
_OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "warmup_cosine", "warmup_steps": 5}


# The problem ---------------------------------------------------------------------------------------------------
def _example_model(backend: str, in_size: int, out_size: int) -> Any:
    """The adapter's ``example_model(in_size, out_size)``: the model every check trains."""
    from ..backends._registry import get_backend

    adapter = get_backend(backend)
    model = adapter.example_model(in_size, out_size)
    if model is None:
        raise AssertionError(
            f"{backend}: {adapter!r} has no example_model(in_size, out_size); the conformance kit trains the model "
            "it returns (see adapters/README.md, 'The backend object')"
        )
    model_backend = getattr(model, "backend", None)
    assert model_backend == backend, (
        f"{backend}: example_model({in_size}, {out_size}) returned {model!r}, a model of backend {model_backend!r}"
    )
    return model


def _capabilities(backend: str) -> frozenset[str]:
    from ..backends._registry import get_backend

    return frozenset(get_backend(backend).capabilities)


def _problem(backend: str, **overrides: Any) -> Any:
    from pipekit_train import TrainingDataset, TrainingLoop
    from pipekit_train.data import ArraySource
    from pipekit_train.losses import MSE

    from ..backends._registry import get_backend

    fields: dict[str, Any] = dict(
        model_op=_example_model(backend, 4, 1),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": _X, "y": _Y})),
        val_dataset=TrainingDataset(source=ArraySource(arrays={"x": _X[:32], "y": _Y[:32]}), shuffle=False),
        loss=MSE(),
        optimizer_config=dict(_OPTIMIZER),
        max_steps=30,
        batch_size=16,
        eval_every_n_steps=10,
        log_every_n_steps=10,
        backend=backend,
        progress=False,
    )
    fields.update(get_backend(backend).example_fields())  # a backend that trains another way: its own loss, task
    fields.update(overrides)
    return TrainingLoop(**fields)


def _run(op: Any, run_dir: Path, store: Any = False) -> Any:
    from pipekit_train import run_settings

    with run_settings(run_dir=str(run_dir), store=store):
        return op.run()


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# The checks ----------------------------------------------------------------------------------------------------
def check_returns_a_trained_model(backend: str, tmp: Path) -> None:
    """``run`` returns a bound model operator of the loop's architecture, and the loss went down."""
    loop = _problem(backend)
    model, artifact = _run(loop, tmp / "a")
    assert model == loop.model_op, f"{backend}: the returned model is {model!r}, not the loop's {loop.model_op!r}"
    assert model.module is not None, f"{backend}: the returned model is not bound to weights"
    assert artifact.backend == backend, f"{backend}: the artifact names backend {artifact.backend!r}"
    steps = artifact.backend_info.get("steps")
    assert steps == 30, f"{backend}: backend_info['steps'] is {steps!r} after 30 steps"
    if "weights" not in _capabilities(backend):
        return  # a posterior: its draws are checked by determinism, resume and the registry round trip
    shape = np.shape(model(np.zeros((2, 4), np.float32)))
    assert shape == (2, 1), f"{backend}: the trained model predicts shape {shape} for 2 examples, not (2, 1)"
    records = [json.loads(line) for line in (tmp / "a" / "stage0" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r.get("type") == "metrics" and r.get("context") == "train"]
    assert len(train) == 3 and train[-1] < train[0], f"{backend}: the logged training losses {train} did not go down"


def check_is_deterministic(backend: str, tmp: Path) -> None:
    """The same loop and seed give bitwise the same weights; another seed gives others."""
    a, _ = _run(_problem(backend), tmp / "d1")
    b, _ = _run(_problem(backend), tmp / "d2")
    c, _ = _run(_problem(backend, seed=1), tmp / "d3")
    assert a.weights_hash() == b.weights_hash(), (
        f"{backend}: two runs with seed 0 end with different weights ({a.weights_hash()} vs {b.weights_hash()})"
    )
    assert a.weights_hash() != c.weights_hash(), f"{backend}: seeds 0 and 1 end with the same weights"


def check_calls_callbacks_in_order(backend: str, tmp: Path) -> None:
    """Hooks run in the documented order, once per step / evaluation, with the step counter right."""
    from pipekit_train import Callback

    events: list[tuple[str, int]] = []

    class Record(Callback, register=False):
        def on_train_start(self, ctx: Any) -> None:
            events.append(("start", ctx.step))

        def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
            events.append(("step", ctx.step))

        def on_eval_end(self, ctx: Any, metrics: Mapping[str, float]) -> None:
            assert "validate/loss" in metrics, f"{backend}: on_eval_end got metrics {sorted(metrics)}"
            events.append(("eval", ctx.step))

        def on_train_end(self, ctx: Any) -> None:
            events.append(("end", ctx.step))

    loop = _problem(backend, callbacks=(Record(),))
    _run(loop, tmp / "cb")
    steps = [s for e, s in events if e == "step"]
    evals = [s for e, s in events if e == "eval"]
    assert events[0] == ("start", 0) and events[-1] == ("end", 30), (
        f"{backend}: the callbacks saw {events[:2]} .. {events[-2:]}, not ('start', 0) .. ('end', 30)"
    )
    assert steps == list(range(1, 31)), f"{backend}: on_step_end saw steps {steps}, not 1..30"
    want = [10, 20, 30] if loop.val_dataset is not None else []  # a sampler evaluates no batches
    assert evals == want, f"{backend}: on_eval_end ran at steps {evals}, not {want}"


def check_resumes_exactly(backend: str, tmp: Path) -> None:
    """A run stopped by SIGTERM between two evaluations (step 15 of 30: evaluations and checkpoints at 10, 20,
    30) and resumed ends bitwise where an uninterrupted run ends: the weights, every callback's saved state and
    the logged history. With the ``weights`` capability the stage also has `ReduceLROnPlateau` and
    `EarlyStopping`, which act on the evaluations (the warm-up cosine schedule of every check runs under them)."""
    import signal

    from pipekit_train import Callback, Checkpoint, TrainingInterrupted
    from pipekit_train.callbacks import EarlyStopping, ReduceLROnPlateau
    from pipekit_train.checkpoint import Checkpointer, Last

    class TermAt15(Callback, register=False):
        """SIGTERM after the chunk that reaches step 15, when armed: the loop finishes it, checkpoints, stops."""

        needs_every_step = False  # it only observes: the chunks stay fused (they end at 15, a logging step)
        armed = False

        def on_step_end(self, ctx: Any, metrics: Mapping[str, Any]) -> None:
            if TermAt15.armed and ctx.step == 15:
                TermAt15.armed = False
                os.kill(os.getpid(), signal.SIGTERM)

        def fingerprint(self) -> None:
            return None  # it interrupts the run; it does not change what is trained

    callbacks: list[Any] = [Checkpoint(every_n_steps=10, keep=(Last(n=1),), async_save=False), TermAt15()]
    loop = _problem(backend, log_every_n_steps=5)
    if "weights" in _capabilities(backend) and loop.val_dataset is not None:
        callbacks += [ReduceLROnPlateau(patience=0, factor=0.5, threshold=0.5), EarlyStopping(patience=10)]
    loop = loop.replace(callbacks=tuple(callbacks))
    full, _ = _run(loop, tmp / "full")
    TermAt15.armed = True
    try:
        _run(loop, tmp / "part")
    except TrainingInterrupted as stop:
        assert stop.reason == "SIGTERM" and stop.artifact.status == "stopped: SIGTERM", (
            f"{backend}: the stopped run reports {stop.reason!r} with status {stop.artifact.status!r}"
        )
    else:
        raise AssertionError(f"{backend}: SIGTERM at step 15 did not stop the run")
    finally:
        TermAt15.armed = False
    from pipekit_train import run_settings

    with run_settings(run_dir=str(tmp / "part"), store=False, resume="auto"):
        resumed, _ = loop.run()
    assert resumed.weights_hash() == full.weights_hash(), (
        f"{backend}: the weights resumed from step 15 ({resumed.weights_hash()}) differ from an uninterrupted "
        f"run's ({full.weights_hash()})"
    )

    def final_callbacks(run: str) -> Any:
        with Checkpointer(tmp / run / "stage0" / "checkpoints", async_save=False) as ckpt:
            return ckpt.restore("latest")[2].get("callbacks")

    want, got = final_callbacks("full"), final_callbacks("part")
    assert got == want, f"{backend}: the callbacks' saved state after the resume is {got}, uninterrupted {want}"
    from ..cli._check_resume import history_difference

    differs = history_difference(tmp / "full", tmp / "part")
    assert differs is None, f"{backend}: the logged history after a SIGTERM at step 15 and a resume {differs}"


def check_restores_the_best_checkpoint(backend: str, tmp: Path) -> None:
    """With the ``weights`` capability and validation: ``restore_best`` returns the weights of the best checkpoint
    (here the one of step 10: ``mode: max`` on ``validate/loss`` makes the worst loss the best), and the artifact
    records that step's validation metrics and names the step (`TrainingArtifact.restored`)."""
    if "weights" not in _capabilities(backend):
        return
    from pipekit_train import Callback, Checkpoint
    from pipekit_train.checkpoint import Best, Last

    seen: dict[int, tuple[str, dict[str, float]]] = {}

    class RecordEvals(Callback, register=False):
        def on_eval_end(self, ctx: Any, metrics: Mapping[str, float]) -> None:
            seen[ctx.step] = (ctx.model.weights_hash(), dict(metrics))

    ckpt = Checkpoint(every_n_steps=10, keep=(Best(k=1), Last(n=1)), monitor="validate/loss", mode="max")
    loop = _problem(backend, restore_best=True, callbacks=(ckpt, RecordEvals()))
    if loop.val_dataset is None:
        return
    model, artifact = _run(loop, tmp / "best")
    best = max(seen, key=lambda step: (seen[step][1]["validate/loss"], -step))
    assert best != 30, f"{backend}: the validation loss rose over training ({seen}); the check needs it to fall"
    assert model.weights_hash() == seen[best][0] == artifact.trained_model_hash, (
        f"{backend}: restore_best returned weights {model.weights_hash()}, the artifact says "
        f"{artifact.trained_model_hash}, the best checkpoint (step {best}) held {seen[best][0]}"
    )
    recorded = {k: v for k, v in artifact.final_metrics.items() if k.startswith("validate/")}
    assert recorded == seen[best][1], (
        f"{backend}: the artifact records {recorded} as the validation metrics of the returned model, but the best "
        f"step {best} evaluated to {seen[best][1]}"
    )
    restored = artifact.restored or {}
    assert restored.get("step") == best and restored.get("last_step") == 30, (
        f"{backend}: the artifact's restored record is {artifact.restored}, not step {best} of 30"
    )


def check_transfers_by_paths(backend: str, tmp: Path) -> None:
    """With the ``transfer`` capability: a second stage with ``transfer=Transfer(paths=...)`` (the backend's
    ``example_transfer()``: some parts of its example model, not all) starts from the first stage's final weights
    in those parts and from its own fresh weights everywhere else."""
    if "transfer" not in _capabilities(backend):
        return
    import pipekit
    from pipekit_train import Callback, Transfer

    from ..backends._registry import get_backend

    adapter = get_backend(backend)
    paths = adapter.example_transfer()
    assert paths, (
        f"{backend}: it lists the transfer capability but has no example_transfer(), the paths of its example "
        "model the conformance kit transfers (see adapters/README.md, 'The backend object')"
    )
    starts: dict[str, Any] = {}

    class RecordStart(Callback, register=False):
        def on_train_start(self, ctx: Any) -> None:
            starts[ctx.stage] = ctx.model.weights()

    first = _problem(backend, name="first", callbacks=(RecordStart(),))
    second = first.replace(name="second", transfer=Transfer(paths=paths), seed=7)
    _run(pipekit.Sequential([first, second]), tmp / "transfer")
    from pipekit_train import load_model

    final = load_model(
        _read_json(tmp / "transfer" / "first" / "final.json")["model_uri"].split("?")[0], tmp / "transfer" / "models"
    ).weights()
    fresh = adapter.build(second).weights()
    got = starts["second"]
    copied = [k for k in got if np.array_equal(got[k], final[k]) and not np.array_equal(got[k], fresh[k])]
    kept = [k for k in got if np.array_equal(got[k], fresh[k]) and not np.array_equal(got[k], final[k])]
    other = [k for k in got if k not in copied and k not in kept]
    assert copied and kept and not other, (
        f"{backend}: Transfer(paths={paths}) started the second stage with {copied} from the first stage's final "
        f"weights, {kept} fresh and {other} neither; it should copy the parts it names and leave the rest fresh"
    )


def check_keeps_checkpoints_by_selectors(backend: str, tmp: Path) -> None:
    """``keep=(Last(n=2),)`` keeps the last two checkpoints; the latest holds the final weights (``init_from``)."""
    from pipekit_train import Callback, Checkpoint
    from pipekit_train.checkpoint import Last

    model, _ = _run(_problem(backend, callbacks=(Checkpoint(every_n_steps=5, keep=(Last(n=2),)),)), tmp / "keep")
    directory = tmp / "keep" / "stage0" / "checkpoints"
    on_disk = sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())
    listed = [entry["step"] for entry in _read_json(directory / "manifest.json")["entries"]]
    assert on_disk == [25, 30], f"{backend}: saving every 5 of 30 steps keeping Last(n=2) left steps {on_disk} on disk"
    assert listed == [25, 30], f"{backend}: manifest.json lists steps {listed}, not [25, 30]"
    if "init_from" not in _capabilities(backend):
        return

    starts: list[str] = []

    class RecordStart(Callback, register=False):
        def on_train_start(self, ctx: Any) -> None:
            starts.append(ctx.model.weights_hash())

    warm = _problem(backend, max_steps=1, init_from=f"{directory}@latest", callbacks=(RecordStart(),))
    if warm.optimizer_config.get("warmup_steps"):  # one step: no room for the warm-up
        warm = warm.replace(optimizer_config={**warm.optimizer_config, "warmup_steps": 0})
    _run(warm, tmp / "warm")
    assert starts == [model.weights_hash()], (
        f"{backend}: a warm start from the checkpoint of step 30 starts from weights {starts}, not the final "
        f"weights {model.weights_hash()} (weights_tree / load_weights_tree)"
    )


def check_records_artifacts(backend: str, tmp: Path) -> None:
    """Each stage of a two-stage run is recorded in the SQLite store, with the backend, its info and lineage."""
    import pipekit
    from pipekit_train.provenance import ArtifactStore

    first = _problem(backend, name="first")
    store = tmp / "artifacts.sqlite"
    _, last = _run(pipekit.Sequential([first, first.replace(name="second")]), tmp / "run", store=str(store))
    with ArtifactStore(store) as s:
        stored = {a.stage: a for a in s.query(run_id=last.run_id)}
    assert sorted(stored) == ["first", "second"], f"{backend}: the store holds stages {sorted(stored)} of the run"
    info = _backend_info(backend)
    for stage, artifact in stored.items():
        assert artifact.backend == backend, f"{backend}: the {stage} artifact names backend {artifact.backend!r}"
        recorded = artifact.backend_info
        missing = {k: v for k, v in info.items() if recorded.get(k) != v}
        assert recorded and not missing, (
            f"{backend}: the {stage} artifact's backend_info {recorded} lacks backend_info() items {missing}"
        )
        assert recorded.get("steps") == 30, f"{backend}: the {stage} artifact records steps={recorded.get('steps')!r}"
        assert artifact.status == "completed", f"{backend}: the {stage} artifact has status {artifact.status!r}"
    parents = stored["second"].parent_ids
    assert parents == (stored["first"].artifact_id,), (
        f"{backend}: the second stage's parents are {parents}, not the first stage ({stored['first'].artifact_id})"
    )
    same = json.dumps(stored["second"].to_dict(), sort_keys=True) == json.dumps(last.to_dict(), sort_keys=True)
    assert same, f"{backend}: the stored artifact differs from the one run() returned"  # (NaN metrics compare equal)


def _backend_info(backend: str) -> dict[str, Any]:
    from ..backends._registry import get_backend

    return dict(get_backend(backend).info())


def check_round_trips_the_model_registry(backend: str, tmp: Path) -> None:
    """`load_model` of the artifact's URI: an equal operator, the same weights hash, the same predictions; with the
    ``export`` capability, its `jax.export`-ed inference function predicts the same (else export refuses it)."""
    from pipekit_train import load_model

    model, artifact = _run(_problem(backend), tmp / "reg")
    uri = artifact.model_registry_uri
    assert uri, f"{backend}: the artifact has no model_registry_uri"
    loaded = load_model(uri)
    assert loaded == model, f"{backend}: load_model({uri!r}) gives {loaded!r}, not {model!r}"
    assert loaded.weights_hash() == model.weights_hash() == artifact.trained_model_hash, (
        f"{backend}: weights hashes differ: loaded {loaded.weights_hash()}, trained {model.weights_hash()}, "
        f"artifact {artifact.trained_model_hash}"
    )
    got, want = np.asarray(loaded(_X[:8])), np.asarray(model(_X[:8]))
    assert np.array_equal(got, want), f"{backend}: the loaded model predicts {got.ravel()}, the trained {want.ravel()}"
    _check_export(backend, loaded, want)


def _check_export(backend: str, model: Any, want: np.ndarray) -> None:
    """With the ``export`` capability, the model's inference function traces under ``jax.export`` and predicts what
    the model does; without it, ``pipekit-train export`` refuses it with an `ExportError`."""
    import jax

    from ..inference._export import ExportError, inference_function

    if "export" not in _capabilities(backend):
        try:
            inference_function(model)
        except ExportError:
            return
        raise AssertionError(f"{backend}: no export capability, but its model has an inference function")
    fn = inference_function(model)
    exported = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct(_X[:8].shape, _X.dtype))  # type: ignore[no-untyped-call]
    got = np.asarray(exported.call(_X[:8]))  # type: ignore[no-untyped-call]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4), (
        f"{backend}: the exported inference function predicts {got.ravel()}, the model {want.ravel()}"
    )


def check_hands_off_in_a_sequential(backend: str, tmp: Path) -> None:
    """In ``Sequential([first, second])`` the second stage starts from the first stage's final weights."""
    import pipekit
    from pipekit_train import Callback

    starts: dict[str, tuple[int, str]] = {}
    start_weights: dict[str, Any] = {}

    class RecordStart(Callback, register=False):
        def on_train_start(self, ctx: Any) -> None:
            starts[ctx.stage] = (ctx.step, ctx.model.weights_hash())
            start_weights[ctx.stage] = ctx.model.weights()

    first = _problem(backend, name="first", callbacks=(RecordStart(),))
    second = first.replace(name="second")
    model, last = _run(pipekit.Sequential([first, second]), tmp / "seq")
    handed = _read_json(tmp / "seq" / "first" / "artifact.json")
    from_weights = starts.get("second") == (0, handed["trained_model_hash"])
    init = str(last.backend_info.get("init", ""))
    if not from_weights and "weights" not in _capabilities(backend):
        # A sampler starts from the previous posterior or guide (its artifact says so); a variational fit from the
        # previous guide's parameters, through its constrained -> unconstrained transform (a float32 round-off).
        from pipekit_train import load_model

        final = load_model(
            _read_json(tmp / "seq" / "first" / "final.json")["model_uri"].split("?")[0], tmp / "seq" / "models"
        )
        got = start_weights.get("second", {})
        close = sorted(got) == sorted(final.weights()) and all(
            np.shape(got[k]) == np.shape(v) and np.allclose(got[k], v, rtol=1e-6, atol=0)
            for k, v in final.weights().items()
        )
        assert close or "previous stage" in init or handed["artifact_id"] in init, (
            f"{backend}: the second stage says it started from {init!r}, not from the first stage's posterior "
            f"or guide ({handed['artifact_id']}), and its first weights are not the first stage's final ones"
        )
        from_weights = True
    assert from_weights, (
        f"{backend}: the second stage starts at (step, weights) {starts.get('second')}, not (0, the first "
        f"stage's final {handed['trained_model_hash']}); the first stage started from {starts.get('first')}"
    )
    assert last.parent_ids == (handed["artifact_id"],), (
        f"{backend}: the second stage's parents are {last.parent_ids}, not ({handed['artifact_id']!r},)"
    )
    assert model == second.model_op and model.weights_hash() == last.trained_model_hash, (
        f"{backend}: the Sequential returned {model!r} with weights {model.weights_hash()}, its artifact says "
        f"{last.trained_model_hash}"
    )


def check_refuses_a_foreign_model(backend: str, tmp: Path) -> None:
    """Pre-flight refuses to start from a model of another backend, with a `pipekit.ConfigError`."""
    from pipekit import ConfigError
    from pipekit_train import ModelOp, TrainerCarryState
    from pipekit_train.stage.preflight import check

    class Foreign(ModelOp, register=False):
        backend = "conformance-foreign"

    loop = _problem(backend)
    try:
        check(loop, TrainerCarryState(model=Foreign(), stage_index=1), "stage1")
    except ConfigError:
        return
    raise AssertionError(f"{backend}: pre-flight accepted a previous stage's model of backend 'conformance-foreign'")


def _backend_module(backend: str) -> tuple[str | None, str | None]:
    """What a fresh process needs to find `backend`: ``(module to import, folder to add to the path)``, or Nones
    for an installed entry point."""
    from ..backends._registry import ENTRY_POINT_GROUP, get_backend

    if backend in {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}:
        return None, None
    module = sys.modules[type(get_backend(backend)).__module__]
    path = Path(module.__file__ or ".").resolve()
    if path.stem == "__init__":
        path = path.parent
    for _ in module.__name__.split("."):
        path = path.parent
    return module.__name__, str(path)


def _cli_takes_import() -> bool:
    """Whether ``pipekit-train run`` has the ``--import MODULE`` option (else the subprocess imports it first)."""
    from pipekit_train.cli._main import build_parser

    try:
        _, unknown = build_parser().parse_known_args(["run", "p.yaml", "--import", "m"])
    except SystemExit:
        return False
    return not unknown


_CLI_SCRIPT = """\
import importlib, json, sys
spec = json.loads(sys.argv[1])
for name in spec["imports"]:
    importlib.import_module(name)
from pipekit_train.cli import main
for argv in spec["commands"]:
    code = main(argv)
    if code:
        raise SystemExit(code)
"""


def check_runs_a_yaml_pipeline_from_the_cli(backend: str, tmp: Path, *, fresh_process: bool = True) -> None:
    """``pipekit-train validate`` and ``run`` of a YAML pipeline in a fresh process: both stages recorded, with
    bitwise the weights of the same pipeline run in this process.

    ``fresh_process=False`` runs the same CLI commands through ``pipekit_train.cli.main`` in this process instead:
    for a test suite that proves the fresh process (the backend found by its entry point or ``--import``) on other
    backends and needs not pay a new interpreter, its imports and its compiles once more per backend.
    """
    import pipekit
    from pipekit_train import TrainingDataset
    from pipekit_train.data import NpzSource
    from pipekit_train.provenance import ArtifactStore

    np.savez(tmp / "data.npz", x=_X, y=_Y)
    data = TrainingDataset(source=NpzSource(path=str(tmp / "data.npz")))
    first = _problem(backend, dataset=data, val_dataset=None, name="first")
    pipeline = pipekit.Sequential([first, first.replace(name="second")])
    yaml_path, store = tmp / "pipeline.yaml", tmp / "cli.sqlite"
    yaml_path.write_text(pipekit.dumps(pipeline), encoding="utf-8")

    module, folder = _backend_module(backend)
    flags = ["--import", module] if module and _cli_takes_import() else []
    commands = [
        ["validate", str(yaml_path), *flags],
        ["run", str(yaml_path), "--run-dir", str(tmp / "cli-run"), "--store", str(store), *flags],
    ]
    shown = " && ".join("pipekit-train " + " ".join(c) for c in commands)
    if fresh_process:
        spec = {"imports": [module] if module and not flags else [], "commands": commands}
        env = dict(os.environ)
        if folder:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(
            [sys.executable, "-c", _CLI_SCRIPT, json.dumps(spec)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (
            f"{backend}: `{shown}` exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    else:
        from pipekit_train.cli import main as cli_main

        for argv in commands:
            code = cli_main(argv)
            assert code == 0, f"{backend}: `pipekit-train {' '.join(argv)}` (of `{shown}`) exited with {code}"
    with ArtifactStore(store) as s:
        stored = {a.stage: a for a in s.query()}
    assert sorted(stored) == ["first", "second"], f"{backend}: the CLI run recorded stages {sorted(stored)}"
    wrong = {stage: a.backend for stage, a in stored.items() if a.backend != backend}
    assert not wrong, f"{backend}: the CLI run's artifacts name other backends: {wrong}"
    _, here = _run(pipeline, tmp / "in-process")
    assert stored["second"].trained_model_hash == here.trained_model_hash, (
        f"{backend}: the YAML pipeline run by the CLI ends with weights {stored['second'].trained_model_hash}, "
        f"the same pipeline in this process with {here.trained_model_hash}"
    )


CHECKS: dict[str, Callable[[str, Path], None]] = {
    "returns_a_trained_model": check_returns_a_trained_model,
    "is_deterministic": check_is_deterministic,
    "calls_callbacks_in_order": check_calls_callbacks_in_order,
    "resumes_exactly": check_resumes_exactly,
    "transfers_by_paths": check_transfers_by_paths,
    "restores_the_best_checkpoint": check_restores_the_best_checkpoint,
    "keeps_checkpoints_by_selectors": check_keeps_checkpoints_by_selectors,
    "records_artifacts": check_records_artifacts,
    "round_trips_the_model_registry": check_round_trips_the_model_registry,
    "hands_off_in_a_sequential": check_hands_off_in_a_sequential,
    "refuses_a_foreign_model": check_refuses_a_foreign_model,
    "runs_a_yaml_pipeline_from_the_cli": check_runs_a_yaml_pipeline_from_the_cli,
}


def main(argv: list[str] | None = None) -> int:
    """Run every check against one backend; print one line per check; exit 1 if any failed."""
    parser = argparse.ArgumentParser(
        prog="python -m pipekit_train.adapters.conformance", description="Check a backend adapter's contract."
    )
    parser.add_argument("backend", metavar="NAME", help="the backend's registered name")
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first (a module that calls pipekit_train.register_backend)",
    )  # fmt: skip
    parser.add_argument("--check", action="append", choices=sorted(CHECKS), help="run only this check (repeatable)")
    args = parser.parse_args(argv)
    for name in args.imports:
        importlib.import_module(name)
    _capabilities(args.backend)  # an unknown or uninstalled backend is one clear error, before any check runs
    selected = {name: CHECKS[name] for name in args.check} if args.check else CHECKS
    failed = 0
    for name, check in selected.items():
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                check(args.backend, Path(tmp))
            except AssertionError as e:
                failed, outcome = failed + 1, f"FAIL {name}: {e}"
            except Exception as e:
                failed, outcome = failed + 1, f"FAIL {name}: {type(e).__name__}: {e}"
            else:
                outcome = f"ok   {name}"
        print(f"{outcome} ({time.perf_counter() - started:.1f}s)", flush=True)
    print(f"{len(selected) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
