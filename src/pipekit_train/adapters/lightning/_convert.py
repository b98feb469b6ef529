"""The ``mlp`` converters between the Lightning backend and the Equinox and Keras backends.

Registered with `pipekit_train.register_converter` when this package is imported. A torch ``Linear`` weight is
``(out, in)`` like Equinox's (copied as is) and the transpose of a Keras ``Dense`` kernel; the kwargs are the same
on every backend. Cheap to import: the frameworks are imported by the converters when they run.
"""

from __future__ import annotations

from typing import Any

from ...backends._convert import register_converter

__all__: list[str] = []


def _count(names: list[str], suffix: str) -> int:
    return sum(1 for n in names if n.endswith(suffix))


def _to_torch(model: Any, weight_of: Any) -> Any:
    import numpy as np

    from ._model import TorchModel

    src = model.weights()
    n = _count(list(src), "weight") or _count(list(src), "kernel")
    arrays: dict[str, Any] = {}
    for i in range(n):
        arrays[f"layers.{i}.weight"] = np.ascontiguousarray(weight_of(src, i))
        arrays[f"layers.{i}.bias"] = np.asarray(src[f".layers[{i}].bias"])
    return TorchModel(factory="mlp", kwargs=dict(model.kwargs)).with_weights(arrays)


@register_converter("equinox", "lightning", "mlp")
def equinox_mlp_to_torch(model: Any) -> Any:
    """``EquinoxModel(factory="mlp")`` → ``TorchModel(factory="mlp")`` with the same kwargs and weights."""
    import numpy as np

    return _to_torch(model, lambda src, i: np.asarray(src[f".layers[{i}].weight"]))


@register_converter("keras", "lightning", "mlp")
def keras_mlp_to_torch(model: Any) -> Any:
    """``KerasModel(factory="mlp")`` → ``TorchModel(factory="mlp")`` (each kernel transposed)."""
    import numpy as np

    return _to_torch(model, lambda src, i: np.asarray(src[f".layers[{i}].kernel"]).T)


def _from_torch(model: Any, weight_name: str, transpose: bool) -> dict[str, Any]:
    import numpy as np

    src = model.weights()
    n = _count(list(src), ".weight")
    arrays: dict[str, Any] = {}
    for i in range(n):
        w = np.asarray(src[f"layers.{i}.weight"])
        arrays[f".layers[{i}].{weight_name}"] = np.ascontiguousarray(w.T if transpose else w)
        arrays[f".layers[{i}].bias"] = np.asarray(src[f"layers.{i}.bias"])
    return arrays


@register_converter("lightning", "equinox", "mlp")
def torch_mlp_to_equinox(model: Any) -> Any:
    """``TorchModel(factory="mlp")`` → ``EquinoxModel(factory="mlp")`` with the same kwargs and weights."""
    from ..equinox import EquinoxModel

    return EquinoxModel(factory="mlp", kwargs=dict(model.kwargs)).with_weights(_from_torch(model, "weight", False))


@register_converter("lightning", "keras", "mlp")
def torch_mlp_to_keras(model: Any) -> Any:
    """``TorchModel(factory="mlp")`` → ``KerasModel(factory="mlp")`` (each weight transposed)."""
    from ..keras import KerasModel

    return KerasModel(factory="mlp", kwargs=dict(model.kwargs)).with_weights(_from_torch(model, "kernel", True))
