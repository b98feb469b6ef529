"""Loss operators: the `Loss` protocol, `MSE`, `NLL`, `KL`, `CrossEntropy` and `Composite`; `LossFunction`, a plain
callable as a loss; the target contracts pre-flight checks (`TargetContract`, `CLASS_TARGETS`,
`SAME_SHAPE_FLOATING`)."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._losses import CLASS_TARGETS as CLASS_TARGETS
    from ._losses import KL as KL
    from ._losses import MSE as MSE
    from ._losses import NLL as NLL
    from ._losses import SAME_SHAPE_FLOATING as SAME_SHAPE_FLOATING
    from ._losses import Composite as Composite
    from ._losses import CrossEntropy as CrossEntropy
    from ._losses import Loss as Loss
    from ._losses import LossFunction as LossFunction
    from ._losses import TargetContract as TargetContract
    from ._losses import split_loss_output as split_loss_output

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
