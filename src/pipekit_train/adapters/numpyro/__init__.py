"""The NumPyro backends: ``numpyro-mcmc`` (NUTS/HMC, the posterior draws are the trained model) and
``numpyro-svi`` (a guide fitted by stochastic variational inference).

Importing this package is cheap (no NumPyro, no JAX beyond what the loss base class needs): it registers the
operators a YAML file names — `NumpyroModel`, `BlackjaxModel` (the same models for the ``blackjax`` backend),
`NumpyroGuide`, the kernels `NUTS`, `HMC` and `MALA` (BlackJAX only), the losses `Trace_ELBO` and
`TraceMeanField_ELBO` — and `register_numpyro_model`. The backend objects of the two backends are
``backend`` in `pipekit_train.adapters.numpyro.mcmc` and `pipekit_train.adapters.numpyro.svi`. See ``docs/bayesian.md``.
"""

from __future__ import annotations

from ._ops import HMC as HMC
from ._ops import MALA as MALA
from ._ops import NUTS as NUTS
from ._ops import BlackjaxModel as BlackjaxModel
from ._ops import GuideParams as GuideParams
from ._ops import NumpyroGuide as NumpyroGuide
from ._ops import NumpyroModel as NumpyroModel
from ._ops import Posterior as Posterior
from ._ops import Trace_ELBO as Trace_ELBO
from ._ops import TraceMeanField_ELBO as TraceMeanField_ELBO
from ._ops import register_numpyro_guide as register_numpyro_guide
from ._ops import registered_guides as registered_guides
from ._registry import register_numpyro_model as register_numpyro_model
from ._registry import registered_numpyro_models as registered_numpyro_models

__all__ = [
    "HMC",
    "MALA",
    "NUTS",
    "BlackjaxModel",
    "GuideParams",
    "NumpyroGuide",
    "NumpyroModel",
    "Posterior",
    "TraceMeanField_ELBO",
    "Trace_ELBO",
    "register_numpyro_guide",
    "register_numpyro_model",
    "registered_guides",
    "registered_numpyro_models",
]
