"""Loss operators: the `Loss` protocol, `MSE`, `NLL`, `KL`, `CrossEntropy`, `Composite`, the token losses
`NextTokenCrossEntropy` and `MaskedTokenCrossEntropy`; `LossFunction`, a plain
callable as a loss; the target contracts pre-flight checks (`TargetContract`, `CLASS_TARGETS`,
`SAME_SHAPE_FLOATING`)."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._builtin import KL as KL
    from ._builtin import MSE as MSE
    from ._builtin import NLL as NLL
    from ._builtin import CrossEntropy as CrossEntropy
    from ._composite import Composite as Composite
    from ._function import LossFunction as LossFunction
    from ._loss import Loss as Loss
    from ._loss import split_loss_output as split_loss_output
    from ._targets import CLASS_TARGETS as CLASS_TARGETS
    from ._targets import SAME_SHAPE_FLOATING as SAME_SHAPE_FLOATING
    from ._targets import TargetContract as TargetContract
    from ._tokens import TOKEN_TARGETS as TOKEN_TARGETS
    from ._tokens import MaskedTokenCrossEntropy as MaskedTokenCrossEntropy
    from ._tokens import NextTokenCrossEntropy as NextTokenCrossEntropy

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
