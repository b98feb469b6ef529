"""The ``numpyro-svi`` backend's adapter module (the contract in ``adapters/README.md``); cheap to import."""

from __future__ import annotations

from typing import Any

from ._ops import NumpyroGuide

#: The packages this backend needs (checked when a stage first uses it).
REQUIRES = ("numpyro", "optax")
EXTRA = "numpyro"
#: The scale settings this adapter honours: data parallel over the local devices (docs/scale.md).
SCALE = ("mesh",)

#: The conformance kit trains a regression with MSE and SGD, which a variational fit cannot do. tests/bayes/ checks
#: the same properties for this backend: determinism for a seed, bitwise resume after SIGKILL, callbacks, artifacts
#: with their parents, the model-registry round trip and the hand-off between stages.
CONFORMANCE_SKIP = {
    "*": "a variational fit has no MSE/SGD regression to train; tests/bayes/ checks these properties for it"
}


def preflight(loop: Any, incoming: Any, stage: str) -> Any:
    """Check the stage (guide, ELBO, data, sites, optimizer) before compiling; the unfitted guide."""
    from ._svi import preflight as impl

    return impl(loop, incoming, stage)


def run(loop: Any, incoming: Any, info: Any, hooks: Any = None) -> Any:
    """Fit the guide with SVI through the engine (mini-batches, checkpoints, exact resume)."""
    from ._svi import run as impl

    return impl(loop, incoming, info, hooks)


def backend_info() -> dict[str, Any]:
    from ._svi import backend_info as impl

    return impl()


def example_model(in_size: int, out_size: int) -> NumpyroGuide:
    """A Bayesian linear regression with an AutoNormal guide, for the conformance checks."""
    return NumpyroGuide(model="linear_regression", guide="AutoNormal")
