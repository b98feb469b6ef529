"""`export_model`: a trained model's inference function as a `jax.export` file, with a JSON sidecar of provenance.

The file holds the serialized StableHLO of ``predict(x) -> outputs`` for a batch ``x`` with the weights baked in as
constants: another process loads it with nothing but JAX::

    import jax
    exported = jax.export.deserialize(bytearray(open("model.jaxexport", "rb").read()))
    y = exported.call(x)

The batch axis is fixed (``batch=N``) or symbolic (``symbolic_batch=True``: any batch size, one file). The
per-example input shape and dtype come from the artifact's training dataset (`TrainingDataset.element_spec` of
the stage's ``input_key``, after the dataset's transforms), or are given (``input_shape``, ``dtype``) for a bare
model URI. The sidecar ``<file>.json`` records where the model came from: artifact id, weights hash, model URI,
dataset hash, input and output shapes, platforms, the file's sha256 and the JAX version. A stage whose data went
through `Standardize` exports a function of the data's units: the recorded statistics are applied to the input and
inverted on the output inside the file (and recorded in the sidecar's ``data_statistics``).

Backends: a model operator's `ModelOp.inference_function` (``predict(x)`` over a batch, traceable by ``jax.jit``)
is what gets exported; the core names no backend. Equinox gives ``jax.vmap`` of the bound module in inference mode,
Keras its ``stateless_call`` with the arrays closed over, NumPyro and BlackJAX the posterior-predictive mean; a
backend that cannot (torch) raises `NotImplementedError` with its reason, which the refusal quotes.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipekit import PipekitError

__all__ = [
    "ExportError",
    "InputSpec",
    "artifact_input_spec",
    "export_model",
    "inference_function",
    "sidecar_path",
]

FORMAT = "pipekit-train-export/1"
MODEL_URI_PREFIX = "pipekit-model:"

_MSG_FLATBUFFERS = (
    "serializing a jax.export needs the 'flatbuffers' package, which is not installed; pip install flatbuffers"
)


class ExportError(PipekitError):
    """A model cannot be exported: no inference function for its backend, no input shape, a bad option."""


@dataclass(frozen=True)
class InputSpec:
    """One example's input: the dataset key it came from (``None`` when given by hand), its shape and dtype."""

    key: str | None
    shape: tuple[int, ...]
    dtype: str


# Inference functions ------------------------------------------------------------------------------------------
def inference_function(model: Any) -> Callable[[Any], Any]:
    """``predict(x)`` over a batch for the bound model operator `model` (its `ModelOp.inference_function`)."""
    from ..backends._model import ModelOp
    from ..backends._registry import able_to

    if not isinstance(model, ModelOp) or model.module is None:
        raise ExportError(f"{model!r} has no weights bound; export a trained model (an artifact or a model URI)")
    try:
        fn: Callable[[Any], Any] = model.inference_function()
    except NotImplementedError as e:
        # The adapter's own reason when it gives one (the base class names only the method).
        reason = str(e) if str(e) and not str(e).endswith(".inference_function") else None
        raise ExportError(
            f"cannot export {type(model).__name__} (backend {getattr(model, 'backend', '?')!r}): "
            f"{reason or 'its model operator has no JAX inference function (ModelOp.inference_function)'}; the "
            f"models of backends with the export capability can be exported ({able_to('export')})"
        ) from None
    return fn


# Input shapes ------------------------------------------------------------------------------------------------
_DESCRIBED = re.compile(r"^\s*([A-Za-z0-9_]+)\s*\[([0-9,\s]*)\]\s*$")


def _parse_described(text: str, where: str) -> tuple[tuple[int, ...], Any]:
    """``"float32[64, 4]"`` (how an in-memory array is recorded) → ``((4,), dtype('float32'))`` per example."""
    import numpy as np

    match = _DESCRIBED.match(str(text))
    if match is None:
        raise ExportError(f"{where}: cannot read the recorded array {text!r} (expected e.g. float32[64, 4])")
    dims = tuple(int(d) for d in match.group(2).replace(",", " ").split())
    if not dims:
        raise ExportError(f"{where}: the recorded array {text!r} has no record axis")
    return dims[1:], np.dtype(match.group(1))


def _load_operator(node: Any, where: str) -> Any:
    import yaml

    import pipekit

    text = yaml.safe_dump({"pipekit": pipekit.FORMAT_VERSION, **node}, sort_keys=False)
    return pipekit.loads(text, source=where)


def artifact_input_spec(artifact: Any) -> InputSpec:
    """The per-example model input of the stage that made `artifact`: its dataset's ``input_key`` entry of
    `TrainingDataset.element_spec`, after the dataset's transforms.

    A stage trained on in-memory arrays recorded their shapes and dtypes, not the arrays; those are read from the
    record and the transforms are applied to them. A file dataset is opened (not its batches read).
    """
    import yaml

    from pipekit._yaml import IN_MEMORY_KEY

    from ..stage.loop import TrainingLoop

    where = f"artifact {artifact.artifact_id[:12]}"
    try:
        doc = yaml.safe_load(artifact.training_pipeline_yaml or "")
    except yaml.YAMLError as e:
        raise ExportError(f"{where}: its training pipeline is not readable YAML ({e})") from None
    dataset = doc.get("dataset") if isinstance(doc, dict) else None
    if not isinstance(dataset, dict):
        raise ExportError(f"{where} records no training dataset to take the input shape from; pass --input-shape")
    default_key: str = TrainingLoop.__dataclass_fields__["input_key"].default
    key = str(doc.get("input_key", default_key))
    source = dataset.get("source")
    if isinstance(source, dict) and IN_MEMORY_KEY in source:
        described = source[IN_MEMORY_KEY] or {}
        spec = {str(k): _parse_described(v, where) for k, v in described.items()}
        for i, node in enumerate(dataset.get("transforms") or ()):
            spec = _load_operator(node, f"{where} dataset.transforms[{i}]").spec(spec)
    else:
        try:
            spec = _load_operator(dataset, f"{where} dataset").element_spec()
        except PipekitError as e:
            raise ExportError(
                f"{where}: cannot open its training dataset to take the input shape from ({e}); "
                "pass --input-shape and --dtype"
            ) from None
    if key not in spec:
        raise ExportError(f"{where}: its dataset has no input {key!r} (it has {', '.join(spec) or 'nothing'})")
    shape, dtype = spec[key]
    return InputSpec(key=key, shape=tuple(int(d) for d in shape), dtype=str(dtype))


# Exporting ---------------------------------------------------------------------------------------------------
def sidecar_path(path: str | os.PathLike[str]) -> str:
    """Where the provenance of the export file `path` goes: ``<path>.json``."""
    return os.fspath(path) + ".json"


def _resolve(source: str, store: Any, model_registry: Any) -> tuple[Any, Any, str]:
    """(bound model operator, its artifact or ``None``, model URI) for an artifact id or a model URI."""
    from ..provenance._model_registry import load_model, parse_model_uri
    from ..provenance._store import ArtifactStore

    if not isinstance(store, ArtifactStore):
        store = ArtifactStore(store)
    if source.startswith(MODEL_URI_PREFIX):
        digest, _ = parse_model_uri(source)
        artifact = None
        if store.path.exists():
            found = [a for a in store.query(model_hash=f"sha256:{digest}") if a.status == "completed"]
            artifact = found[0] if found else None
        return load_model(source, model_registry), artifact, source
    if not store.path.exists():
        raise ExportError(
            f"no artifact store at {store.path} to find artifact {source!r} in; pass --store PATH (or a model URI, "
            "pipekit-model:sha256:...)"
        )
    artifact = store.get(source)
    if not artifact.model_registry_uri:
        raise ExportError(f"artifact {artifact.artifact_id[:12]} recorded no model URI: its weights were not stored")
    return load_model(artifact.model_registry_uri, model_registry), artifact, str(artifact.model_registry_uri)


def _write_atomic(path: str, data: bytes) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _plain_shape(shape: Sequence[Any]) -> list[int | str]:
    return [d if isinstance(d, int) else str(d) for d in shape]


def export_model(
    source: str,
    path: str | os.PathLike[str],
    *,
    batch: int | None = None,
    symbolic_batch: bool = False,
    input_shape: Sequence[int] | None = None,
    dtype: str | None = None,
    platforms: Sequence[str] | None = None,
    store: Any = None,
    model_registry: Any = None,
) -> dict[str, Any]:
    """Export the inference function of the model `source` names into the file `path`, and its provenance into
    ``<path>.json``; return the provenance (the sidecar's content).

    Args:
        source: An artifact id (or a unique prefix of one) in `store`, or a model URI
            (``pipekit-model:sha256:<hex>[?root=DIR]``).
        path: The file to write (``model.jaxexport`` by convention); ``<path>.json`` is written next to it.
        batch: A fixed batch size. Default: the batch size the stage trained with (1 for a bare model URI).
        symbolic_batch: Export for any batch size (a symbolic dimension ``b``) instead of a fixed one.
        input_shape: One example's input shape; default: from the artifact's training dataset. Required for a
            model URI that no artifact in `store` produced.
        dtype: The input dtype; default: the dataset's (``float32`` with `input_shape`).
        platforms: Lower for these platforms (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``); default: JAX's
            default backend here.
        store: The artifact store (an `ArtifactStore` or its path); default ``$PIPEKIT_ARTIFACT_STORE``, else
            ``./runs/artifacts.sqlite``.
        model_registry: Where to load the weights from; default: the URI's ``root``.
    """
    if symbolic_batch and batch is not None:
        raise ExportError("give either a fixed batch size or a symbolic batch dimension, not both")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ExportError(f"the batch size must be a positive int, got {batch!r}")
    if dtype is not None and input_shape is None:
        raise ExportError("a dtype without an input shape: pass the input shape too (e.g. --input-shape 64)")

    import numpy as np

    model, artifact, uri = _resolve(source, store, model_registry)
    if input_shape is not None:
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in input_shape):
            raise ExportError(f"the input shape must be positive ints, got {list(input_shape)}")
        try:
            dt = np.dtype(dtype or "float32")
        except TypeError:
            raise ExportError(f"not a dtype: {dtype!r} (e.g. float32, int32)") from None
        spec = InputSpec(key=None, shape=tuple(input_shape), dtype=str(dt))
    elif artifact is not None:
        spec = artifact_input_spec(artifact)
    else:
        raise ExportError(
            f"no artifact in the store produced {uri.split('?', 1)[0]}, so the input shape is unknown; "
            "pass --input-shape (one example's shape, e.g. --input-shape 64) and --dtype (e.g. float32)"
        )
    model.check_input(spec.shape, np.dtype(spec.dtype))  # a clear ShapeError before tracing, where it can tell
    if batch is None and not symbolic_batch:
        batch = _trained_batch_size(artifact)

    import jax
    from jax import export as jax_export

    predict = _in_data_units(inference_function(model), artifact, spec)
    dims = ", ".join(["b", *(str(d) for d in spec.shape)])
    shape: tuple[Any, ...] = tuple(jax_export.symbolic_shape(dims)) if symbolic_batch else (batch, *spec.shape)
    try:
        exported = jax_export.export(jax.jit(predict), platforms=list(platforms) if platforms else None)(
            jax.ShapeDtypeStruct(shape, np.dtype(spec.dtype))  # type: ignore[no-untyped-call]
        )
    except PipekitError:
        raise
    except Exception as e:  # tracing or lowering failed: say what was being exported
        raise ExportError(
            f"exporting {type(model).__name__} for input {_plain_shape(shape)} {spec.dtype} failed: "
            f"{type(e).__name__}: {e}"
        ) from e
    try:
        data = bytes(exported.serialize())
    except ImportError:
        raise ExportError(_MSG_FLATBUFFERS) from None

    from .. import __version__

    out = os.fspath(path)
    provenance: dict[str, Any] = {
        "format": FORMAT,
        "file": os.path.basename(out),
        "sha256": "sha256:" + hashlib.sha256(data).hexdigest(),
        "artifact_id": None if artifact is None else artifact.artifact_id,
        "run_id": None if artifact is None else artifact.run_id,
        "stage": None if artifact is None else artifact.stage,
        "dataset_hash": None if artifact is None else artifact.dataset_hash,
        "pipeline_hash": None if artifact is None else artifact.pipeline_hash,
        "model_uri": uri,
        "weights_hash": model.weights_hash(),
        "backend": model.backend,
        "architecture": _architecture(model),
        "input": {"key": spec.key, "shape": _plain_shape(exported.in_avals[0].shape), "dtype": spec.dtype},
        "outputs": [{"shape": _plain_shape(a.shape), "dtype": str(a.dtype)} for a in exported.out_avals],
        "batch": "symbolic" if symbolic_batch else batch,
        "data_statistics": None if artifact is None else artifact.data_statistics,
        "source_statistics": None if artifact is None else artifact.source_statistics,
        "platforms": list(exported.platforms),
        "calling_convention_version": exported.calling_convention_version,
        "jax_version": jax.__version__,
        "jaxlib_version": _version("jaxlib"),
        "pipekit_train_version": __version__,
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
    }
    _write_atomic(out, data)
    _write_atomic(sidecar_path(out), (json.dumps(provenance, indent=2) + "\n").encode())
    return provenance


def _in_data_units(predict: Callable[[Any], Any], artifact: Any, spec: InputSpec) -> Callable[[Any], Any]:
    """`predict` taking inputs and giving outputs in the data's units: the `Standardize` statistics the artifact
    recorded for its input are applied inside the exported function, and those of its target inverted."""
    stats = dict(getattr(artifact, "data_statistics", None) or {})
    if not stats:
        return predict
    import yaml

    from ..data._standardize import invert, standardize
    from ..stage.loop import TrainingLoop

    doc = yaml.safe_load(artifact.training_pipeline_yaml or "") or {}
    default: str = TrainingLoop.__dataclass_fields__["target_key"].default
    x_key, y_key = spec.key or "", str(doc.get("target_key", default)) if isinstance(doc, dict) else default

    def in_data_units(x: Any) -> Any:
        return invert(stats, y_key, predict(standardize(stats, x_key, x)))

    return in_data_units


def _trained_batch_size(artifact: Any) -> int:
    """The batch size the artifact's stage trained with (1 when there is no artifact or it is not recorded)."""
    if artifact is None:
        return 1
    import yaml

    from ..stage.loop import TrainingLoop

    try:
        doc = yaml.safe_load(artifact.training_pipeline_yaml or "")
    except yaml.YAMLError:
        doc = None
    default: int = TrainingLoop.__dataclass_fields__["batch_size"].default
    value = doc.get("batch_size", default) if isinstance(doc, dict) else default
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _architecture(model: Any) -> str | None:
    import pipekit

    try:
        return pipekit.dumps(model)
    except PipekitError:
        return None
