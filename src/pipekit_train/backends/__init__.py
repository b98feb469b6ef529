"""Backends by name (the ``pipekit_train.backends`` entry points and `register_backend`) and converters between
them. The contract a backend implements is in ``adapters/README.md``."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._contract import CAPABILITIES as CAPABILITIES
    from ._contract import Backend as Backend
    from ._contract import LazyBackend as LazyBackend
    from ._contract import StepBackend as StepBackend
    from ._convert import convert_model as convert_model
    from ._convert import register_converter as register_converter
    from ._convert import registered_converters as registered_converters
    from ._model import ModelOp as ModelOp
    from ._model import Transfer as Transfer
    from ._registry import BackendError as BackendError
    from ._registry import available_backends as available_backends
    from ._registry import backends_with as backends_with
    from ._registry import get_backend as get_backend
    from ._registry import register_backend as register_backend

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
