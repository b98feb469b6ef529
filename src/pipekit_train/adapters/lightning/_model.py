"""`TorchModel`: a torch ``nn.Module`` built by a registered factory, and `register_torch_model`.

Cheap to import (torch is imported inside the methods that need it): this module is loaded whenever a pipeline file
is read, to make the ``TorchModel`` type known. The built-in factories are registered on first lookup.

A bound `TorchModel` holds a torch module. Its weights are the module's ``state_dict()`` (parameters and buffers)
by name, as host NumPy arrays: what the model registry stores and ``weights_hash`` digests. The training backend
hands out a copy of its module whenever it binds one, so a bound model never changes under its holder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pipekit import field
from pipekit_train.backends import ModelOp
from pipekit_train.backends.kit import FactoryRegistry

__all__ = ["TorchModel", "register_torch_model", "registered_torch_models"]

#: The torch model factories (built-ins: `_factories`, which imports no framework).
FACTORIES = FactoryRegistry("TorchModel", "torch model factory", f"{__package__}._factories")


def register_torch_model(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a factory ``fn(**kwargs) -> torch.nn.Module`` under `name`, for ``TorchModel(factory=name)``.

    The factory runs under ``torch.manual_seed`` of the stage's seed (the global torch generator is restored
    afterwards), so default initialisers are reproducible. Inputs are batches (a leading batch axis).

    Example:
        >>> @register_torch_model("doc_torch_linear")
        ... def doc_torch_linear(in_size: int, out_size: int = 1):
        ...     import torch
        ...     return torch.nn.Linear(in_size, out_size)
        >>> TorchModel(factory="doc_torch_linear", kwargs={"in_size": 3})
        TorchModel(factory='doc_torch_linear', kwargs={'in_size': 3})
    """

    return FACTORIES.register(name, "register_torch_model")


def registered_torch_models() -> list[str]:
    """The names `TorchModel.factory` accepts, sorted."""
    return FACTORIES.names()


#: Why ``pipekit-train export`` refuses a torch model, and what to do instead.
_MSG_NO_JAX_EXPORT = (
    "a TorchModel runs PyTorch, not JAX, so jax.export cannot trace it; export the module with torch.export "
    "(torch.export.export(TorchModel.to_torch(), (example_batch,))) or ONNX instead"
)


class TorchModel(ModelOp):
    """A PyTorch module built by a registered factory: ``factory(**kwargs)``.

    Built-in factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``, with the Equinox backend's kwargs and
    structure (``encoder``, ``decoder``, ``head``, ``layers[i]``), so ``Transfer(paths={"encoder": "encoder"})``
    works between Lightning stages. Register more with `register_torch_model`.

    Args:
        factory: a name registered with `register_torch_model`.
        kwargs: keyword arguments for the factory, checked against its signature on construction.

    Example:
        >>> import numpy as np
        >>> op = TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2})
        >>> op.bind(op.build(0))(np.zeros((3, 4), np.float32)).shape
        (3, 2)
    """

    backend = "lightning"

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def example(cls) -> TorchModel:
        return cls(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8})

    def validate(self) -> None:
        FACTORIES.check_kwargs(self.factory, self.kwargs)

    # Building ------------------------------------------------------------------------------------------------
    def build(self, key: Any) -> Any:
        """A freshly initialised ``torch.nn.Module`` for `key` (an int seed or a JAX key): the same key, the same
        weights."""
        from . import _tree

        return _tree.build_module(self, key)

    def to_torch(self) -> Any:
        """A copy of the bound module, in eval mode (for ``torch.save``, tracing, or your own loop)."""
        from . import _tree

        return _tree.copy_module(self.require_module("to_torch")).eval()

    # The ModelOp protocol ------------------------------------------------------------------------------------
    def factory_name(self) -> str:
        """The factory that builds it: converters between backends are found by it."""
        return self.factory

    def check_bind(self, module: Any) -> None:
        from . import _tree

        _tree.check_fits(self, module)

    def weights(self) -> dict[str, np.ndarray]:
        from . import _tree

        return _tree.weights(self.require_module("weights"))

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> TorchModel:
        from . import _tree

        return self.bind(_tree.fill(self, arrays), check=False)  # type: ignore[return-value]

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        from . import _tree

        return _tree.check_input(self, shape, dtype)

    def inference_function(self) -> Any:
        """Refused: a torch module runs PyTorch kernels, which ``jax.export`` cannot trace (`_MSG_NO_JAX_EXPORT`)."""
        raise NotImplementedError(_MSG_NO_JAX_EXPORT)

    def __call__(self, x: Any) -> Any:
        """Predictions (eval mode, no gradients) for a batch `x`, as NumPy arrays."""
        from . import _tree

        return _tree.predict(self.require_module("__call__"), x)
