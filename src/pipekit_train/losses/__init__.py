"""Loss operators: the `Loss` protocol, `MSE`, `NLL`, `KL`, `CrossEntropy` and `Composite`."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._losses import KL as KL
    from ._losses import MSE as MSE
    from ._losses import NLL as NLL
    from ._losses import Composite as Composite
    from ._losses import CrossEntropy as CrossEntropy
    from ._losses import Loss as Loss

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
