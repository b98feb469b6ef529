"""The problem every conformance check trains: 96 examples of 4 features with a linear target, the backend's
``example_model(4, 1)`` (and its ``example_fields()``), `MSE`, SGD with momentum under a warm-up cosine schedule,
30 steps of 16 with validation every 10 and logging every 5 (so every check runs chunks of the same length, one
compiled program per backend for most of them); and the helpers the checks share to run it and read what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(96, 4)).astype(np.float32)
_Y = (_X @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
_OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "warmup_cosine", "warmup_steps": 5}


def _example_model(backend: str, in_size: int, out_size: int) -> Any:
    """The adapter's ``example_model(in_size, out_size)``: the model every check trains."""
    from ...backends._registry import get_backend

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
    from ...backends._registry import get_backend

    return frozenset(get_backend(backend).capabilities)


def _problem(backend: str, **overrides: Any) -> Any:
    from pipekit_train import TrainingDataset, TrainingLoop
    from pipekit_train.data import ArraySource
    from pipekit_train.losses import MSE

    from ...backends._registry import get_backend

    fields: dict[str, Any] = dict(
        model_op=_example_model(backend, 4, 1),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": _X, "y": _Y})),
        val_dataset=TrainingDataset(source=ArraySource(arrays={"x": _X[:32], "y": _Y[:32]}), shuffle=False),
        loss=MSE(),
        optimizer_config=dict(_OPTIMIZER),
        max_steps=30,
        batch_size=16,
        eval_every_n_steps=10,
        log_every_n_steps=5,
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


def _backend_info(backend: str) -> dict[str, Any]:
    from ...backends._registry import get_backend

    return dict(get_backend(backend).info())
