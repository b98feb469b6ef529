"""The conformance checks on what a run records: one artifact per stage in the store (the backend, its info, the
lineage), and the model registry's round trip (`load_model` of the artifact's URI; with ``export``, the exported
inference function predicts the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ._problem import _X, _backend_info, _capabilities, _problem, _run


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

    from ...inference._export import ExportError, inference_function

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
