"""The ELBOs, the losses of a ``numpyro-svi`` stage (`Trace_ELBO`, `TraceMeanField_ELBO`): configuration of
NumPyro's own, which is imported only when a stage runs."""

from __future__ import annotations

from typing import Any, ClassVar

from pipekit import ConfigError
from pipekit_train.losses import Loss

__all__ = ["TraceMeanField_ELBO", "Trace_ELBO"]


class _ELBO(Loss, register=False):
    """The negative ELBO as the SVI stage's loss; `num_particles` Monte-Carlo samples per step.

    It is not called on ``(predicted, target)``: the ``numpyro-svi`` backend hands it to NumPyro's `SVI`.

    Args:
        num_particles: Monte-Carlo samples of the ELBO per step (>= 1).
    """

    num_particles: int = 1
    aux_prefix: ClassVar[str] = ""

    def validate(self) -> None:
        if self.num_particles < 1:
            raise ConfigError(f"{type(self).__name__}.num_particles must be an int >= 1, got {self.num_particles}")

    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        raise ConfigError(
            f"{self!r} is the loss of a Bayesian stage: use it with backend: numpyro-svi, not on predictions"
        )

    def numpyro(self) -> Any:
        """The NumPyro ELBO object."""
        import numpyro.infer

        return getattr(numpyro.infer, type(self).__name__)(num_particles=self.num_particles)


class Trace_ELBO(_ELBO):
    """NumPyro's ``Trace_ELBO``: the ELBO estimated from sampled guide traces.

    Example:
        >>> Trace_ELBO(num_particles=4)
        Trace_ELBO(num_particles=4)
    """


class TraceMeanField_ELBO(_ELBO):
    """NumPyro's ``TraceMeanField_ELBO``: analytic KL terms where the guide and model sites allow it."""
