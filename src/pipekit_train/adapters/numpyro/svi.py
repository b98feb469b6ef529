"""The ``numpyro-svi`` backend object (the contract in ``adapters/README.md``); cheap to import."""

from __future__ import annotations

from typing import Any

from pipekit_train.adapters.bayes import NumpyroGuide
from pipekit_train.backends import LazyBackend

from ._elbo import Trace_ELBO

__all__ = ["NumpyroSVIBackendSpec", "backend"]


class NumpyroSVIBackendSpec(LazyBackend):
    """A guide fitted with SVI through the engine (mini-batches, checkpoints, exact resume); data parallel over the
    local devices (docs/scale.md)."""

    name = "numpyro-svi"
    requires = ("numpyro", "optax")
    extra = "numpyro"
    capabilities = frozenset({"init_from", "mesh", "export"})
    impl = "pipekit_train.adapters.numpyro._svi"

    def example_fields(self) -> dict[str, Any]:
        """The conformance kit's loop fields for a variational fit: the ELBO as the loss, Adam."""
        return {"loss": Trace_ELBO(), "optimizer_config": {"name": "adam", "lr": 0.05}}

    def example_model(self, in_size: int, out_size: int) -> NumpyroGuide:
        """A Bayesian linear regression with an AutoNormal guide, for the conformance kit."""
        return NumpyroGuide(model="linear_regression", guide="AutoNormal")


backend = NumpyroSVIBackendSpec()
