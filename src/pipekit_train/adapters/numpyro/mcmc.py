"""The ``numpyro-mcmc`` backend's adapter module (the contract in ``adapters/README.md``); cheap to import."""

from __future__ import annotations

from typing import Any

from ._ops import NumpyroModel

#: The packages this backend needs (checked when a stage first uses it).
REQUIRES = ("numpyro",)
EXTRA = "numpyro"

#: The conformance kit trains a regression with MSE and SGD, which a sampler cannot do. tests/bayes/ checks the same
#: properties for this backend: determinism for a seed, bitwise resume after SIGKILL, callbacks, artifacts with
#: their parents, the model-registry round trip and the hand-off between stages.
CONFORMANCE_SKIP = {"*": "a sampler has no MSE/SGD regression to train; tests/bayes/ checks these properties for it"}


def preflight(loop: Any, incoming: Any, stage: str) -> Any:
    """Check the stage (kernel, iterations, data, sites, hand-off) before compiling; the unsampled model."""
    from ._mcmc import preflight as impl

    return impl(loop, incoming, stage)


def run(loop: Any, incoming: Any, info: Any, hooks: Any = None) -> Any:
    """Sample one stage in chunks through the engine; the trained model is the posterior."""
    from ._mcmc import run as impl

    return impl(loop, incoming, info, hooks)


def backend_info() -> dict[str, Any]:
    from ._mcmc import backend_info as impl

    return impl()


def example_model(in_size: int, out_size: int) -> NumpyroModel:
    """A Bayesian linear regression (``x``, ``y``) for the conformance checks that apply to samplers."""
    return NumpyroModel(model="linear_regression")
