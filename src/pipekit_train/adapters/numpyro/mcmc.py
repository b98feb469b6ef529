"""The ``numpyro-mcmc`` backend object (the contract in ``adapters/README.md``); cheap to import."""

from __future__ import annotations

from pipekit_train.adapters.bayes import NumpyroModel, SamplerBackendSpec

__all__ = ["NumpyroMCMCBackendSpec", "backend"]


class NumpyroMCMCBackendSpec(SamplerBackendSpec):
    """NumPyro's NUTS and HMC, sampled in chunks by the engine; the trained model is the posterior."""

    name = "numpyro-mcmc"
    requires = ("numpyro",)
    extra = "numpyro"
    impl = "pipekit_train.adapters.numpyro._mcmc"

    def example_model(self, in_size: int, out_size: int) -> NumpyroModel:
        """A Bayesian linear regression (``x``, ``y``) for the sampler variant of the conformance kit."""
        return NumpyroModel(model="linear_regression")


backend = NumpyroMCMCBackendSpec()
