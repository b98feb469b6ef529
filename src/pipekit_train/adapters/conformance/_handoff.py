"""The conformance checks on what a stage starts from when it follows another: ``Transfer(paths=...)`` copies the
parts it names, a `Sequential`'s next stage starts from the previous stage's final weights (a sampler: its
posterior), and pre-flight refuses a previous stage's model of another backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ._problem import _capabilities, _problem, _read_json, _run


def check_transfers_by_paths(backend: str, tmp: Path) -> None:
    """With the ``transfer`` capability: a second stage with ``transfer=Transfer(paths=...)`` (the backend's
    ``example_transfer()``: some parts of its example model, not all) starts from the first stage's final weights
    in those parts and from its own fresh weights everywhere else."""
    if "transfer" not in _capabilities(backend):
        return
    import pipekit
    from pipekit_train import Callback, Transfer

    from ...backends._registry import get_backend

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
