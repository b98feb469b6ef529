"""The ``numpyro-mcmc`` backend object (the contract in ``adapters/README.md``); cheap to import."""

from __future__ import annotations

from typing import Any

from pipekit_train.adapters.bayes import NUTS, NumpyroModel
from pipekit_train.backends import LazyBackend

__all__ = ["NumpyroMCMCBackendSpec", "backend"]


class NumpyroMCMCBackendSpec(LazyBackend):
    """NumPyro's NUTS and HMC, sampled in chunks by the engine; the trained model is the posterior."""

    name = "numpyro-mcmc"
    requires = ("numpyro",)
    extra = "numpyro"
    #: The posterior-predictive mean over the draws is a JAX function of the inputs (`NumpyroModel.inference_function`).
    capabilities: frozenset[str] = frozenset({"export"})
    impl = "pipekit_train.adapters.numpyro._mcmc"

    def example_fields(self) -> dict[str, Any]:
        """The conformance kit's loop fields for a sampler: NUTS as the task (5 warm-up iterations), no loss."""
        return {"loss": None, "task": NUTS(num_warmup=5, max_tree_depth=4), "val_dataset": None}

    def example_model(self, in_size: int, out_size: int) -> NumpyroModel:
        """A Bayesian linear regression (``x``, ``y``) for the sampler variant of the conformance kit."""
        return NumpyroModel(model="linear_regression")


backend = NumpyroMCMCBackendSpec()
