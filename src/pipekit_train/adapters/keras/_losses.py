"""`to_keras_loss`: a pipekit `Loss` as a ``keras.losses.Loss``, for ``model.compile`` / ``fit``.

The backend itself needs no mapping: pipekit losses are JAX functions, and the Keras backend calls them on the
model's outputs inside its compiled step, so `MSE`, `NLL`, `KL`, `CrossEntropy` and `Composite` give the same
values, and log the same aux metrics, as on the Equinox backend.
"""

# Keras has no type information: its classes are `Any` to the checker, so subclassing them is allowed here.
# mypy: disable-error-code="misc,name-defined,no-untyped-def"
from __future__ import annotations

from typing import Any

from pipekit import ConfigError
from pipekit_train.losses import Loss, split_loss_output

from ._env import import_keras

keras = import_keras()

__all__ = ["PipekitKerasLoss", "to_keras_loss"]


class PipekitKerasLoss(keras.losses.Loss):
    """A pipekit `Loss` called the Keras way, ``(y_true, y_pred)``; aux metrics are dropped.

    Targets keep their dtype (integer labels stay integers, which `CrossEntropy` needs): unlike Keras' own
    losses, ``y_true`` is not cast to the predictions' dtype. ``sample_weight`` is not supported.
    """

    def __init__(self, loss: Loss, name: str | None = None) -> None:
        super().__init__(name=name or type(loss).__name__, reduction="sum_over_batch_size")
        self.loss = loss

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        if sample_weight is not None:
            raise ConfigError(f"{self.loss!r} as a Keras loss does not support sample_weight")
        return self.call(y_true, y_pred)

    def call(self, y_true: Any, y_pred: Any) -> Any:
        value, _ = split_loss_output(self.loss(y_pred, y_true))
        return value

    def get_config(self) -> dict[str, Any]:
        import pipekit

        return {"name": self.name, "loss_yaml": pipekit.dumps(self.loss)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PipekitKerasLoss:
        import pipekit

        loss = pipekit.loads(config["loss_yaml"])
        if not isinstance(loss, Loss):
            raise ConfigError(f"PipekitKerasLoss.from_config: loss_yaml holds {loss!r}, not a pipekit_train Loss")
        return cls(loss, name=config.get("name"))


def to_keras_loss(loss: Loss) -> Any:
    """`loss` as a ``keras.losses.Loss`` (for ``model.compile(loss=...)``), giving the same scalar.

    Example:
        >>> import numpy as np
        >>> from pipekit_train.losses import MSE
        >>> float(to_keras_loss(MSE())(np.zeros(2, np.float32), np.array([1.0, 2.0], np.float32)))
        2.5
    """
    if not isinstance(loss, Loss):
        raise ConfigError(f"to_keras_loss expects a pipekit_train Loss, got {type(loss).__name__}")
    return PipekitKerasLoss(loss)
