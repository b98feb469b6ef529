"""LocalModelRegistry: content-addressed storage, URIs, and refusing tampered files."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipekit_train.adapters.equinox import EquinoxModel
from pipekit_train.provenance._model_registry import (
    LocalModelRegistry,
    ModelIntegrityError,
    ModelNotFoundError,
    ModelRegistryError,
    load_model,
    parse_model_uri,
)

MLP = {"in_size": 3, "out_size": 2, "width_size": 8, "depth": 2}


def _trained(seed: int = 1, **kwargs) -> EquinoxModel:
    op = EquinoxModel(factory="mlp", kwargs={**MLP, **kwargs})
    return op.bind(op.build(jax.random.key(seed)))


def test_put_stores_weights_architecture_and_meta_under_the_weights_hash(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path / "models")
    model = _trained()
    uri = registry.put(model)
    digest = model.weights_hash().split(":")[1]
    assert uri == f"pipekit-model:sha256:{digest}"
    folder = tmp_path / "models" / "sha256" / digest
    assert registry.path_of(uri) == folder
    assert sorted(p.name for p in folder.iterdir()) == ["architecture.yaml", "meta.json", "weights.npz"]
    assert "factory: mlp" in (folder / "architecture.yaml").read_text()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["hash"] == model.weights_hash() and meta["uri"] == uri
    assert meta["sizes"]["weights.npz"] == (folder / "weights.npz").stat().st_size
    assert meta["num_parameters"] == 3 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2
    assert meta["created_at"].endswith("+00:00")
    assert not (folder / "weights.npz").read_bytes().startswith(b"\x80")  # NumPy's format, not a pickle
    assert uri in registry and not (tmp_path / "models" / "tmp").exists()


def test_load_round_trip_gives_the_same_model(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    model = _trained()
    uri = registry.put(model)
    loaded = load_model(uri, registry=tmp_path)
    assert loaded == model  # the same architecture
    assert loaded.weights_hash() == model.weights_hash()
    x = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    assert registry.put(model) == uri  # putting again is a no-op with the same URI


def test_uri_root_query_and_environment_choose_the_registry(tmp_path: Path, monkeypatch):
    registry = LocalModelRegistry(tmp_path / "elsewhere")
    model = _trained(seed=2)
    uri = registry.put(model)
    located = registry.locator(uri)
    assert located == f"{uri}?root={tmp_path / 'elsewhere'}"
    assert parse_model_uri(located) == (uri.rsplit(":", 1)[1], {"root": str(tmp_path / "elsewhere")})
    assert load_model(located).weights_hash() == model.weights_hash()
    odd = LocalModelRegistry(tmp_path / "my models+1&x=2")  # spaces, '+' and '&' survive the query
    assert load_model(odd.locator(odd.put(model))).weights_hash() == model.weights_hash()
    monkeypatch.setenv("PIPEKIT_MODEL_REGISTRY", str(tmp_path / "elsewhere"))
    assert LocalModelRegistry().root == tmp_path / "elsewhere"
    assert load_model(uri).weights_hash() == model.weights_hash()
    monkeypatch.delenv("PIPEKIT_MODEL_REGISTRY")
    monkeypatch.chdir(tmp_path)
    assert LocalModelRegistry().root == tmp_path / "runs" / "models"


def test_a_modified_weights_file_is_refused_naming_the_file(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    uri = registry.put(_trained())
    weights = registry.path_of(uri) / "weights.npz"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit near the end of the file
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelIntegrityError, match=rf"{weights}: contents changed since the model was registered"):
        load_model(uri, registry=registry)


def test_a_modified_weights_file_with_a_forged_meta_is_still_refused(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    uri = registry.put(_trained())
    folder = registry.path_of(uri)
    # A well-formed .npz holding other numbers (one bit of one weight flipped), and a meta.json forged to match it.
    with np.load(folder / "weights.npz") as npz:
        arrays = [npz[f"arr_{i}"].copy() for i in range(len(npz.files))]
    arrays[0].view(np.uint8).reshape(-1)[0] ^= 0x01
    buffer = io.BytesIO()
    np.savez(buffer, *arrays)
    data = buffer.getvalue()
    (folder / "weights.npz").write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["sha256"]["weights.npz"] = "sha256:" + hashlib.sha256(bytes(data)).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ModelIntegrityError, match=r"weights.npz: the weights hash to sha256:\w+, not sha256:\w+"):
        load_model(uri, registry=registry)


def test_a_changed_architecture_or_missing_file_is_refused(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    uri = registry.put(_trained())
    folder = registry.path_of(uri)
    arch = folder / "architecture.yaml"
    arch.write_text(arch.read_text().replace("width_size: 8", "width_size: 9"))
    with pytest.raises(ModelIntegrityError, match=r"architecture.yaml: contents changed"):
        registry.load(uri)
    (folder / "meta.json").unlink()
    with pytest.raises(ModelIntegrityError, match=r"meta.json: missing; the registry entry .* is incomplete"):
        registry.load(uri)


def test_truncated_weights_with_matching_meta_are_refused(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    uri = registry.put(_trained())
    folder = registry.path_of(uri)
    data = (folder / "weights.npz").read_bytes()[:100]
    (folder / "weights.npz").write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["sha256"]["weights.npz"] = "sha256:" + hashlib.sha256(data).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ModelIntegrityError, match=r"weights.npz: cannot read the weights into the architecture"):
        registry.load(uri)


def test_errors_for_unknown_bad_and_unbound(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    missing = "pipekit-model:sha256:" + "0" * 64
    with pytest.raises(ModelNotFoundError, match=rf"no model {missing} in the registry at {tmp_path}"):
        registry.load(missing)
    with pytest.raises(ModelRegistryError, match=r"not a model URI: 'sha256:abc'; expected pipekit-model:sha256:"):
        load_model("sha256:abc", registry=tmp_path)
    with pytest.raises(ModelRegistryError, match=r"needs a model operator bound to weights"):
        registry.put(EquinoxModel(factory="mlp", kwargs=MLP))


def test_same_weights_under_another_architecture_are_refused(tmp_path: Path):
    registry = LocalModelRegistry(tmp_path)
    relu, tanh = _trained(seed=3), _trained(seed=3, activation="tanh")
    assert relu.weights_hash() == tanh.weights_hash()  # the activation is not an array
    registry.put(relu)
    with pytest.raises(ModelRegistryError, match=r"already holds these weights under a different architecture"):
        registry.put(tanh)
