"""``export``: a trained Equinox model as a jax.export file that a process importing only JAX and NumPy runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pipekit
from pipekit_train import (
    MSE,
    ArraySource,
    ArtifactStore,
    EquinoxModel,
    Flatten,
    ModelOp,
    NpzSource,
    TrainingArtifact,
    TrainingDataset,
    TrainingLoop,
    load_model,
    run_settings,
)
from pipekit_train.cli._common import run_commands
from pipekit_train.cli._export import add_export_commands
from pipekit_train.inference._export import (
    ExportError,
    InputSpec,
    artifact_input_spec,
    export_model,
    inference_function,
    sidecar_path,
)

pytestmark = pytest.mark.xdist_group("export")  # one worker (--dist loadgroup): the module fixture is built once

MODEL = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8, "depth": 1})

# Runs in a fresh interpreter: loads the export with jax.export and calls it on each batch of inputs.npz.
_LOADER = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np

    path, inputs, outputs = sys.argv[1:4]
    with open(path, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    with np.load(inputs) as batches:
        results = {k: np.asarray(exported.call(batches[k])) for k in batches.files}
    np.savez(outputs, **results)
    print(json.dumps({"loaded": sorted(m for m in ("pipekit", "pipekit_train", "equinox") if m in sys.modules)}))
    """
)


def _cli(*argv: str) -> int:
    return run_commands(add_export_commands, list(argv))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 20-step MLP trained on an .npz file, its artifact recorded in a real SQLite store."""
    root = tmp_path_factory.mktemp("export")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    np.savez(root / "train.npz", x=x, y=np.stack([x.sum(axis=1), x[:, 0]], axis=1))
    loop = TrainingLoop(
        model_op=MODEL,
        dataset=TrainingDataset(source=NpzSource(path=str(root / "train.npz"))),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=20,
        batch_size=16,
        progress=False,
    )
    store = str(root / "artifacts.sqlite")
    with run_settings(run_dir=str(root / "run"), store=store):
        model, artifact = loop.run()
    assert ArtifactStore(store).get(artifact.artifact_id).model_registry_uri == artifact.model_registry_uri
    return {"root": root, "model": model, "artifact": artifact, "store": store}


def _run_elsewhere(path: Path, batches: dict[str, np.ndarray], tmp_path: Path) -> dict[str, np.ndarray]:
    """Call the exported function on `batches` in a subprocess that imports only jax and numpy."""
    np.savez(tmp_path / "inputs.npz", **batches)  # type: ignore[arg-type]
    script = tmp_path / "load_export.py"
    script.write_text(_LOADER)
    out = subprocess.run(
        [sys.executable, str(script), str(path), str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"loaded": []}
    with np.load(tmp_path / "outputs.npz") as results:
        return {k: results[k] for k in results.files}


def _inputs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def test_fixed_batch_export_runs_without_pipekit_bitwise(trained: dict[str, Any], tmp_path: Path) -> None:
    art, model = trained["artifact"], trained["model"]
    path = tmp_path / "model.jaxexport"
    record = export_model(art.artifact_id, path, batch=5, store=trained["store"])
    x = _inputs(5, 1)
    got = _run_elsewhere(path, {"x": x}, tmp_path)["x"]
    np.testing.assert_array_equal(got, np.asarray(model(x)))  # same program, same constants: bitwise

    sidecar = json.loads(Path(sidecar_path(path)).read_text())
    assert sidecar == record
    assert sidecar["artifact_id"] == art.artifact_id
    assert sidecar["weights_hash"] == art.trained_model_hash == model.weights_hash()
    assert sidecar["model_uri"] == art.model_registry_uri
    assert sidecar["dataset_hash"] == art.dataset_hash
    assert sidecar["input"] == {"key": "x", "shape": [5, 4], "dtype": "float32"}
    assert sidecar["outputs"] == [{"shape": [5, 2], "dtype": "float32"}]
    assert sidecar["batch"] == 5 and sidecar["platforms"] == ["cpu"]
    import hashlib

    import jax

    assert sidecar["jax_version"] == jax.__version__
    assert sidecar["sha256"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert pipekit.loads(sidecar["architecture"]) == MODEL


def test_symbolic_batch_accepts_two_batch_sizes(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.jaxexport"
    prefix = trained["artifact"].artifact_id[:10]
    assert _cli("export", prefix, "-o", str(path), "--symbolic-batch", "--store", trained["store"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path} (artifact {prefix[:12]}" in out and "float32['b', 4] -> float32['b', 2]" in out
    assert json.loads(Path(sidecar_path(path)).read_text())["input"]["shape"] == ["b", 4]
    batches = {"three": _inputs(3, 2), "eleven": _inputs(11, 3)}
    got = _run_elsewhere(path, batches, tmp_path)
    for name, x in batches.items():
        assert got[name].shape == (len(x), 2)
        # a symbolic batch is compiled for dynamic shapes, which may round the last bit differently
        np.testing.assert_allclose(got[name], np.asarray(trained["model"](x)), rtol=1e-6, atol=1e-6)


def test_default_batch_is_the_training_batch_size(trained: dict[str, Any], tmp_path: Path) -> None:
    record = export_model(trained["artifact"].artifact_id, tmp_path / "m.jaxexport", store=trained["store"])
    assert record["batch"] == 16 and record["input"]["shape"] == [16, 4]


def test_model_uri_needs_an_input_shape_without_an_artifact(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = trained["artifact"].model_registry_uri
    no_store = str(tmp_path / "none.sqlite")
    path = tmp_path / "m.jaxexport"
    assert _cli("export", uri, "-o", str(path), "--store", no_store) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --input-shape" in err and not path.exists()

    assert _cli("export", uri, "-o", str(path), "--store", no_store, "--input-shape", "4", "--dtype", "float32") == 0
    sidecar = json.loads(Path(sidecar_path(path)).read_text())
    assert sidecar["artifact_id"] is None and sidecar["input"] == {"key": None, "shape": [1, 4], "dtype": "float32"}
    x = _inputs(1, 4)
    np.testing.assert_array_equal(_run_elsewhere(path, {"x": x}, tmp_path)["x"], np.asarray(trained["model"](x)))

    # the URI of a model an artifact in the store produced: the artifact gives the input shape
    record = export_model(uri, tmp_path / "n.jaxexport", symbolic_batch=True, store=trained["store"])
    assert record["artifact_id"] == trained["artifact"].artifact_id and record["input"]["shape"] == ["b", 4]


def test_input_shape_that_does_not_fit_is_one_line(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = trained["artifact"].model_registry_uri
    assert _cli("export", uri, "-o", str(tmp_path / "m"), "--input-shape", "5", "--store", trained["store"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipekit-train export: error: ") and err.count("\n") == 1 and "(4,)" in err


def test_usage_errors(trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art, out = trained["artifact"].artifact_id, str(tmp_path / "m")
    assert _cli("export", art, "-o", out, "--batch", "0", "--store", trained["store"]) == 2
    assert "--batch must be a positive int" in capsys.readouterr().err
    assert _cli("export", art, "-o", out, "--batch", "2", "--symbolic-batch") == 2  # argparse: not allowed together
    capsys.readouterr()
    assert _cli("export", art, "-o", out, "--dtype", "int32", "--store", trained["store"]) == 2
    assert "--dtype goes with --input-shape" in capsys.readouterr().err
    assert _cli("export", art, "-o", out, "--input-shape", "4", "x", "--store", trained["store"]) == 2
    assert "--input-shape must be positive ints" in capsys.readouterr().err
    assert _cli("export", "0000ffff", "-o", out, "--store", trained["store"]) == 2
    assert "0000ffff" in capsys.readouterr().err
    assert _cli("export", art, "-o", out, "--store", str(tmp_path / "none.sqlite")) == 2
    assert "no artifact store at" in capsys.readouterr().err
    # A format of a model's own (ModelOp.export_formats) that this model does not have: its formats are named.
    assert _cli("export", art, "-o", out, "--format", "arviz", "--store", trained["store"]) == 2
    err = capsys.readouterr().err
    assert "does not export as 'arviz'" in err and "it exports as: jaxexport" in err and err.count("\n") == 1
    assert _cli("export", art, "-o", out, "--format", "arviz", "--batch", "2", "--store", trained["store"]) == 2
    assert "--batch belong to --format jaxexport" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_input_spec_of_in_memory_data_applies_the_transforms() -> None:
    """An artifact of a stage trained on arrays in memory recorded their shapes; transforms apply to those."""
    images = np.zeros((10, 2, 3), np.float32)
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 6, "out_size": 1}),
        dataset=TrainingDataset(
            source=ArraySource(arrays={"img": images, "y": np.zeros((10, 1), np.float32)}),
            transforms=(Flatten(key="img"),),
        ),
        loss=MSE(),
        input_key="img",
    )
    artifact = TrainingArtifact(run_id="r", training_pipeline_yaml=pipekit.dumps(loop, strict=False))
    assert "in_memory_data" in artifact.training_pipeline_yaml
    assert artifact_input_spec(artifact) == InputSpec(key="img", shape=(6,), dtype="float32")
    with pytest.raises(ExportError, match="records no training dataset"):
        artifact_input_spec(TrainingArtifact(run_id="r"))


class _NoInference(ModelOp, register=False):
    backend = "no-such-backend"


class _OwnInference(ModelOp, register=False):
    backend = "no-such-backend"

    def inference_function(self) -> Any:
        return lambda x: x * 2


def test_inference_function_contract(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no weights bound"):
        inference_function(MODEL)
    with pytest.raises(ExportError, match=r"backend 'no-such-backend'.*has no JAX inference function"):
        inference_function(_NoInference().bind(object()))
    assert inference_function(_OwnInference().bind(object()))(3) == 6
    bound = load_model(_any_uri(tmp_path / "registry"))
    assert np.asarray(inference_function(bound)(np.ones((2, 4), np.float32))).shape == (2, 2)


def _any_uri(root: Path) -> str:
    """A model URI of a freshly built MLP, stored in a throwaway registry at `root` (the test's own directory)."""
    from pipekit_train import LocalModelRegistry

    registry = LocalModelRegistry(str(root))
    return str(registry.locator(registry.put(MODEL.bind(MODEL.build(0)))))
