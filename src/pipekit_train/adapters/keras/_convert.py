"""The ``mlp`` converters between the Equinox and Keras backends (registered with `pipekit_train.register_converter`).

Each Dense kernel is the transpose of the Linear weight; the kwargs are the same. Cheap to import: the frameworks
are imported by the converters when they run.
"""

from __future__ import annotations

from typing import Any

from ...backends._convert import (
    convert_model,
    find_converter,
    refuse_foreign,
    register_converter,
    registered_converters,
)

__all__ = ["convert_model", "find_converter", "refuse_foreign", "register_converter", "registered_converters"]


def _mlp_depth(names: list[str], suffix: str) -> int:
    return sum(1 for n in names if n.endswith(suffix))


@register_converter("equinox", "keras", "mlp")
def equinox_mlp_to_keras(model: Any) -> Any:
    """``EquinoxModel(factory="mlp")`` → ``KerasModel(factory="mlp")`` with the same kwargs and weights."""
    import numpy as np

    from ._model import KerasModel

    src = model.weights()
    n = _mlp_depth(list(src), ".weight")
    arrays: dict[str, Any] = {}
    for i in range(n):
        arrays[f".layers[{i}].kernel"] = np.ascontiguousarray(np.asarray(src[f".layers[{i}].weight"]).T)
        arrays[f".layers[{i}].bias"] = np.asarray(src[f".layers[{i}].bias"])
    return KerasModel(factory="mlp", kwargs=dict(model.kwargs)).with_weights(arrays)


@register_converter("keras", "equinox", "mlp")
def keras_mlp_to_equinox(model: Any) -> Any:
    """``KerasModel(factory="mlp")`` → ``EquinoxModel(factory="mlp")`` with the same kwargs and weights."""
    import numpy as np

    from ..equinox import EquinoxModel

    src = model.weights()
    n = _mlp_depth(list(src), ".kernel")
    arrays: dict[str, Any] = {}
    for i in range(n):
        arrays[f".layers[{i}].weight"] = np.ascontiguousarray(np.asarray(src[f".layers[{i}].kernel"]).T)
        arrays[f".layers[{i}].bias"] = np.asarray(src[f".layers[{i}].bias"])
    return EquinoxModel(factory="mlp", kwargs=dict(model.kwargs)).with_weights(arrays)
