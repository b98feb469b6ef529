"""A custom loss for the house-price example, loaded with ``--import house_loss`` (with this folder on PYTHONPATH).

Defining a `Loss` subclass registers it under its class name, so ``houses.yaml`` can say ``loss: {type:
PriceHuber, delta: 1.0}``. It returns the loss and one auxiliary term, logged as ``train/loss/outliers``.
"""

from __future__ import annotations

import jax.numpy as jnp

from pipekit_train.losses import Loss


class PriceHuber(Loss):
    """Huber loss on standardized prices: quadratic within `delta` standard deviations, linear beyond.

    Args:
        delta: where the loss turns linear, in standard deviations of the training prices.
    """

    delta: float = 1.0

    def __call__(self, predicted, target):  # type: ignore[no-untyped-def,override]
        error = jnp.abs(predicted - target)
        quadratic = jnp.minimum(error, self.delta)
        loss = jnp.mean(0.5 * quadratic**2 + self.delta * (error - quadratic))
        return loss, {"outliers": jnp.mean(error > self.delta)}
