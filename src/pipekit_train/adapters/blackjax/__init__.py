"""The ``blackjax`` backend's adapter module (the contract in ``adapters/README.md``); cheap to import.

BlackJAX's NUTS, HMC and MALA kernels sample the log density of a registered NumPyro model
(``BlackjaxModel(model=...)``), stepped in chunks by the engine with Stan's window adaptation driven one iteration
at a time, so the sampler state (adaptation included) and the draws so far are the checkpoint and a resumed run is
bitwise an uninterrupted one. The posterior is the artifact, with the same diagnostics as ``numpyro-mcmc``. The
operators (`BlackjaxModel`, `MALA`, and the shared `NUTS`/`HMC`) live in `pipekit_train.adapters.numpyro`, whose
import registers them for YAML; see ``docs/bayesian.md`` and ``design/blackjax_adapter.md``.
"""

from __future__ import annotations

from typing import Any

from ..numpyro._ops import HMC as HMC
from ..numpyro._ops import MALA as MALA
from ..numpyro._ops import NUTS as NUTS
from ..numpyro._ops import BlackjaxModel as BlackjaxModel

__all__ = ["HMC", "MALA", "NUTS", "BlackjaxModel", "backend_info", "example_model", "preflight", "run"]

#: The packages this backend needs (checked when a stage first uses it): BlackJAX samples, NumPyro gives the model's
#: log density and the transforms to the constrained space.
REQUIRES = ("blackjax", "numpyro")
EXTRA = "blackjax"

#: The conformance kit trains a regression with MSE and SGD, which a sampler cannot do. tests/bayes/ checks the same
#: properties for this backend: the analytic posterior, agreement with numpyro-mcmc, bitwise resume, the artifact.
CONFORMANCE_SKIP = {"*": "a sampler has no MSE/SGD regression to train; tests/bayes/ checks these properties for it"}


def preflight(loop: Any, incoming: Any, stage: str) -> Any:
    """Check the stage (kernel, iterations, data, sites, hand-off) before compiling; the unsampled model."""
    from ._sampler import preflight as impl

    return impl(loop, incoming, stage)


def run(loop: Any, incoming: Any, info: Any, hooks: Any = None) -> Any:
    """Sample one stage in chunks through the engine; the trained model is the posterior."""
    from ._sampler import run as impl

    return impl(loop, incoming, info, hooks)


def backend_info() -> dict[str, Any]:
    from ._sampler import backend_info as impl

    return impl()


def example_model(in_size: int, out_size: int) -> BlackjaxModel:
    """A Bayesian linear regression (``x``, ``y``) for the conformance checks that apply to samplers."""
    return BlackjaxModel(model="linear_regression")
