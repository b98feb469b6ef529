"""The ``blackjax`` backend (its object `backend`: the contract in ``adapters/README.md``); cheap to import.

BlackJAX's NUTS, HMC and MALA kernels sample the log density of a registered NumPyro model
(``BlackjaxModel(model=...)``), stepped in chunks by the engine with Stan's window adaptation driven one iteration
at a time, so the sampler state (adaptation included) and the draws so far are the checkpoint and a resumed run is
bitwise an uninterrupted one. The posterior is the artifact, with the same diagnostics as ``numpyro-mcmc``. The
operators (`BlackjaxModel`, `MALA`, and the shared `NUTS`/`HMC`) live in `pipekit_train.adapters.bayes` (what the
NumPyro-model backends share: the kernels, the chunked sampler stage, the diagnostics), re-exported here; the
``pipekit.operators`` entry point (`pipekit_train.adapters.numpyro`) registers them for YAML. See
``docs/bayesian.md`` and ``design/blackjax_adapter.md``.
"""

from __future__ import annotations

from pipekit_train.adapters.bayes import HMC as HMC
from pipekit_train.adapters.bayes import MALA as MALA
from pipekit_train.adapters.bayes import NUTS as NUTS
from pipekit_train.adapters.bayes import BlackjaxModel as BlackjaxModel
from pipekit_train.adapters.bayes import SamplerBackendSpec

__all__ = ["HMC", "MALA", "NUTS", "BlackjaxBackendSpec", "BlackjaxModel", "backend"]


class BlackjaxBackendSpec(SamplerBackendSpec):
    """BlackJAX's kernels over a registered NumPyro model's log density; the trained model is the posterior."""

    name = "blackjax"
    #: BlackJAX samples; NumPyro gives the model's log density and the transforms to the constrained space.
    requires = ("blackjax", "numpyro")
    extra = "blackjax"
    impl = "pipekit_train.adapters.blackjax._sampler"

    def example_model(self, in_size: int, out_size: int) -> BlackjaxModel:
        """A Bayesian linear regression (``x``, ``y``) for the sampler variant of the conformance kit."""
        return BlackjaxModel(model="linear_regression")


backend = BlackjaxBackendSpec()
