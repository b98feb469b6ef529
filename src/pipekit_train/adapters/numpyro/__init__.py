"""The NumPyro backends: ``numpyro-mcmc`` (NUTS/HMC, the posterior draws are the trained model) and
``numpyro-svi`` (a guide fitted by stochastic variational inference).

Importing this package is cheap (no NumPyro, no JAX beyond what the loss base class needs): it registers the
operators a YAML file names — `NumpyroModel`, `BlackjaxModel` (the same models for the ``blackjax`` backend),
`NumpyroGuide`, the kernels `NUTS`, `HMC` and `MALA` (BlackJAX only), the losses `Trace_ELBO` and
`TraceMeanField_ELBO` — and `register_numpyro_model`. The model operators, kernels and registries are those of
`pipekit_train.adapters.bayes` (what the NumPyro-model backends share), re-exported here; the ELBOs are this
package's own. The backend objects of the two backends are ``backend`` in `pipekit_train.adapters.numpyro.mcmc`
and `pipekit_train.adapters.numpyro.svi`. See ``docs/bayesian.md``.
"""

from __future__ import annotations

from pipekit_train.adapters.bayes import HMC as HMC
from pipekit_train.adapters.bayes import MALA as MALA
from pipekit_train.adapters.bayes import NUTS as NUTS
from pipekit_train.adapters.bayes import BlackjaxModel as BlackjaxModel
from pipekit_train.adapters.bayes import GuideParams as GuideParams
from pipekit_train.adapters.bayes import NumpyroGuide as NumpyroGuide
from pipekit_train.adapters.bayes import NumpyroModel as NumpyroModel
from pipekit_train.adapters.bayes import Posterior as Posterior
from pipekit_train.adapters.bayes import register_numpyro_guide as register_numpyro_guide
from pipekit_train.adapters.bayes import register_numpyro_model as register_numpyro_model
from pipekit_train.adapters.bayes import registered_guides as registered_guides
from pipekit_train.adapters.bayes import registered_numpyro_models as registered_numpyro_models

from ._elbo import Trace_ELBO as Trace_ELBO
from ._elbo import TraceMeanField_ELBO as TraceMeanField_ELBO

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
