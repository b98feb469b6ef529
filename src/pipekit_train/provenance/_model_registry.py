"""`LocalModelRegistry`: trained weights on disk, content-addressed, verified on every load.

A model is stored under ``<root>/sha256/<hex>/``, where ``sha256:<hex>`` is the weights hash
(`ModelOp.weights_hash()`: the arrays' paths, shapes, dtypes and bytes):

- ``weights.npz``: the arrays of `ModelOp.weights` as ``arr_0 … arr_N`` in a NumPy ``.npz`` (read back with
  ``allow_pickle=False``: nothing is unpickled), whatever the backend;
- ``architecture.yaml``: ``pipekit.dumps(model_op)``, from which the model operator is rebuilt;
- ``meta.json``: the hash, the weights' names in order, the creation time, the file sizes and their sha256, the
  parameter count.

A model's URI is ``pipekit-model:sha256:<hex>``. The registry root is not part of it (the same model may sit in
many registries); it comes from the `registry` argument, else a ``?root=<path>`` query on the URI, else
``$PIPEKIT_MODEL_REGISTRY``, else ``./runs/models``. Other backends (a remote registry) can take other query keys.

Loading recomputes the weights hash and refuses (`ModelIntegrityError`, naming the file) anything that does not
match its address.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import io
import json
import os
import re
import shutil
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import numpy as np

import pipekit
from pipekit import PipekitError

from ..backends._model import ModelOp, weights_digest

__all__ = [
    "LocalModelRegistry",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "ModelRegistryError",
    "load_model",
    "parse_model_uri",
]

ENV_VAR = "PIPEKIT_MODEL_REGISTRY"
DEFAULT_ROOT = os.path.join("runs", "models")
SCHEME = "pipekit-model"
WEIGHTS_FILE = "weights.npz"
ARCHITECTURE_FILE = "architecture.yaml"
META_FILE = "meta.json"
FORMAT = 2

_URI = re.compile(r"^pipekit-model:sha256:([0-9a-f]{64})(?:\?(.*))?$")


class ModelRegistryError(PipekitError):
    """The registry cannot store or find a model as asked."""


class ModelNotFoundError(ModelRegistryError):
    """No model with the URI's hash is in the registry."""


class ModelIntegrityError(ModelRegistryError):
    """A stored model's files do not match its address (modified, truncated or corrupted). Names the file."""


def parse_model_uri(uri: str) -> tuple[str, dict[str, str]]:
    """Split ``pipekit-model:sha256:<hex>[?key=value&…]`` into the hex digest and the query parameters."""
    match = _URI.match(uri) if isinstance(uri, str) else None
    if match is None:
        raise ModelRegistryError(
            f"not a model URI: {uri!r}; expected pipekit-model:sha256:<64 hex digits>, optionally ?root=<registry dir>"
        )
    query = dict(urllib.parse.parse_qsl(match.group(2) or "", keep_blank_values=True))
    return match.group(1), query


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LocalModelRegistry:
    """Models stored as files under `root`, addressed by their weights hash.

    Args:
        root: The registry folder. Default: ``$PIPEKIT_MODEL_REGISTRY``, else ``./runs/models``.

    Example:
        >>> import tempfile
        >>> from pipekit_train.adapters.equinox import EquinoxModel
        >>> op = EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 1, "width_size": 4, "depth": 1})
        >>> trained = op.bind(op.build(1))
        >>> registry = LocalModelRegistry(tempfile.mkdtemp())
        >>> uri = registry.put(trained)
        >>> uri == "pipekit-model:" + trained.weights_hash()
        True
        >>> registry.load(uri).weights_hash() == trained.weights_hash()
        True
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        if root is None:
            root = os.environ.get(ENV_VAR) or DEFAULT_ROOT
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"LocalModelRegistry({str(self.root)!r})"

    def path_of(self, uri: str) -> Path:
        """The folder that holds (or would hold) the model `uri` names."""
        digest, _ = parse_model_uri(uri)
        return self.root / "sha256" / digest

    def locator(self, uri: str) -> str:
        """`uri` with this registry's folder added as ``?root=<path>``, so `load_model` finds it without arguments."""
        digest, _ = parse_model_uri(uri)
        return f"{SCHEME}:sha256:{digest}?root=" + urllib.parse.quote(str(self.root), safe="/")

    def __contains__(self, uri: object) -> bool:
        return isinstance(uri, str) and (self.path_of(uri) / META_FILE).is_file()

    def put(self, model_op: Any) -> str:
        """Store the weights bound to `model_op` with its architecture; return its URI.

        Putting the same model again returns the same URI and writes nothing. The same weights under a different
        architecture are refused: the address covers the weights only, so it could not tell the two apart.
        """
        from ..backends._model import ModelOp

        if not isinstance(model_op, ModelOp) or model_op.module is None:
            raise ModelRegistryError(
                f"LocalModelRegistry.put needs a model operator bound to weights (op.bind(module)), got {model_op!r}"
            )
        arrays = model_op.weights()
        weights_hash = weights_digest(arrays)
        digest = weights_hash.split(":", 1)[1]
        uri = f"{SCHEME}:{weights_hash}"
        architecture = pipekit.dumps(model_op)
        final = self.root / "sha256" / digest
        if (final / META_FILE).is_file():
            self._check_same_architecture(final, architecture)
            return uri
        buffer = io.BytesIO()
        np.savez(buffer, *arrays.values())
        weights = buffer.getvalue()
        arch_bytes = architecture.encode("utf-8")
        meta = {
            "format": FORMAT,
            "hash": weights_hash,
            "uri": uri,
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
            "model_type": type(model_op).__name__,
            "num_parameters": int(sum(np.size(x) for x in arrays.values())),
            "weights": list(arrays),
            "sizes": {WEIGHTS_FILE: len(weights), ARCHITECTURE_FILE: len(arch_bytes)},
            "sha256": {WEIGHTS_FILE: _sha256(weights), ARCHITECTURE_FILE: _sha256(arch_bytes)},
        }
        # Write into a private folder, then rename it into place: readers see a whole entry or none.
        tmp = self.root / "tmp" / uuid.uuid4().hex
        tmp.mkdir(parents=True)
        try:
            (tmp / WEIGHTS_FILE).write_bytes(weights)
            (tmp / ARCHITECTURE_FILE).write_bytes(arch_bytes)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / META_FILE).is_file():  # not a concurrent put of the same model: a real error
                    raise
                self._check_same_architecture(final, architecture)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):  # leave no empty tmp/ behind (another put may still be using it)
                tmp.parent.rmdir()
        return uri

    def _check_same_architecture(self, folder: Path, architecture: str) -> None:
        stored = (folder / ARCHITECTURE_FILE).read_text(encoding="utf-8")
        if stored != architecture:
            raise ModelRegistryError(
                f"{folder} already holds these weights under a different architecture:\n{stored}\n"
                f"the model being registered is:\n{architecture}"
            )

    def load(self, uri: str) -> Any:
        """The model operator `uri` names, bound to its verified weights.

        Raises:
            ModelNotFoundError: nothing is stored under the URI's hash.
            ModelIntegrityError: a file is missing, or its contents do not match the address; the error names it.
        """
        digest, _ = parse_model_uri(uri)
        folder = self.root / "sha256" / digest
        if not folder.is_dir():
            raise ModelNotFoundError(f"no model {uri} in the registry at {self.root} (looked for {folder})")
        paths = {name: folder / name for name in (META_FILE, ARCHITECTURE_FILE, WEIGHTS_FILE)}
        for path in paths.values():
            if not path.is_file():
                raise ModelIntegrityError(f"{path}: missing; the registry entry for {uri} is incomplete")
        try:
            meta = json.loads(paths[META_FILE].read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelIntegrityError(f"{paths[META_FILE]}: not valid JSON ({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), dict):
            raise ModelIntegrityError(
                f"{paths[META_FILE]}: not a registry record (a JSON {type(meta).__name__}); the registry entry for "
                f"{uri} is damaged"
            )
        blobs = {name: paths[name].read_bytes() for name in (ARCHITECTURE_FILE, WEIGHTS_FILE)}
        for name, data in blobs.items():
            expected = (meta.get("sha256") or {}).get(name)
            if expected != _sha256(data):
                raise ModelIntegrityError(
                    f"{paths[name]}: contents changed since the model was registered (sha256 is {_sha256(data)}, "
                    f"meta.json records {expected}); the file was modified or corrupted"
                )
        try:
            op = pipekit.loads(blobs[ARCHITECTURE_FILE].decode("utf-8"), source=str(paths[ARCHITECTURE_FILE]))
        except (PipekitError, UnicodeDecodeError) as e:
            raise ModelIntegrityError(f"{paths[ARCHITECTURE_FILE]}: cannot rebuild the architecture: {e}") from None
        if not isinstance(op, ModelOp):
            raise ModelIntegrityError(
                f"{paths[ARCHITECTURE_FILE]}: rebuilds a {type(op).__name__}, not a model operator (a ModelOp)"
            )
        names = meta.get("weights")
        if meta.get("format") != FORMAT or not isinstance(names, list):
            raise ModelIntegrityError(
                f"{paths[META_FILE]}: format {meta.get('format')!r} is not this registry's format {FORMAT}; "
                "register the model again from its run (pipekit-train reproduce) or with an older pipekit-train"
            )
        try:
            with np.load(io.BytesIO(blobs[WEIGHTS_FILE]), allow_pickle=False) as npz:
                arrays = {name: npz[f"arr_{i}"] for i, name in enumerate(names)}
            bound = op.with_weights(arrays)
        except Exception as e:
            raise ModelIntegrityError(
                f"{paths[WEIGHTS_FILE]}: cannot read the weights into the architecture of {ARCHITECTURE_FILE}: {e}"
            ) from None
        got = bound.weights_hash()
        if got != f"sha256:{digest}":
            raise ModelIntegrityError(
                f"{paths[WEIGHTS_FILE]}: the weights hash to {got}, not sha256:{digest} as their address says; "
                "the file was modified or corrupted"
            )
        return bound


def load_model(uri: str, registry: LocalModelRegistry | str | os.PathLike[str] | None = None) -> Any:
    """The model operator a ``pipekit-model:`` URI names, bound to its verified weights.

    Args:
        uri: ``pipekit-model:sha256:<hex>``, optionally with ``?root=<registry dir>``.
        registry: A `LocalModelRegistry` or its root folder. Default: the URI's ``root``, else
            ``$PIPEKIT_MODEL_REGISTRY``, else ``./runs/models``.
    """
    _, query = parse_model_uri(uri)
    if not isinstance(registry, LocalModelRegistry):
        registry = LocalModelRegistry(registry if registry is not None else query.get("root") or None)
    return registry.load(uri)
