"""What the backends of registered NumPyro models share (``numpyro-mcmc``, ``numpyro-svi``, ``blackjax``): not a
backend itself, the public kit they build on.

- **Models by name**: `register_numpyro_model` (the built-in ``eight_schools``, ``conjugate_normal``,
  ``linear_regression``, ``logistic_regression`` register on first lookup), `get_numpyro_model`, and hand-written
  guides (`register_numpyro_guide`, `guide_factory`).
- **The operators** a YAML file names: the model operators `NumpyroModel` (bound to its `Posterior` draws),
  `BlackjaxModel` and `NumpyroGuide` (bound to its `GuideParams`), and the kernels `NUTS`, `HMC`, `MALA`.
- **The checks before compiling**: the data against the model's parameters (`check_data`) and its sites
  (`check_sites`: one abstract trace), `full_data`, `describe_error`, `trace_abstract_first`.
- **The chunked sampler stage**: `prepare` (the checks, the initial point a previous stage hands over),
  `init_strategy`, the `StepBackend` base `SamplerControls` (``until``, the progress line, the posterior report),
  the configuration digest of the checkpoint (`config_digest`, `check_digest`) and the program cache
  (`program_key`, `cached_program`).
- **Diagnostics and the posterior report**: R-hat, bulk and tail ESS as ArviZ computes them (`r_hat`, `ess_bulk`,
  `ess_tail`, `diagnostics`, `evaluate`), the summary table (`report`) and the groups an ArviZ export adds
  (`write_groups`, `read_groups`); the ArviZ export itself (`write_arviz`, `inference_data`;
  `NumpyroModel.export` calls it).

Importing this package registers the operator types and imports no framework: NumPyro, JAX, SciPy and ArviZ are
imported inside the functions that run something, and the names of the second half are imported on first use.
``docs/bayesian.md`` is the user's guide; ``design/numpyro_adapter.md`` and ``design/blackjax_adapter.md`` the
decisions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipekit_train.backends.kit import attach_lazily as _attach

from ._kernels import HMC as HMC
from ._kernels import MALA as MALA
from ._kernels import NUTS as NUTS
from ._kernels import UNTIL_DEFAULT_CHECK_EVERY as UNTIL_DEFAULT_CHECK_EVERY
from ._kernels import UNTIL_DEFAULT_CHECK_GROWTH as UNTIL_DEFAULT_CHECK_GROWTH
from ._kernels import check_until as check_until
from ._model_ops import BlackjaxModel as BlackjaxModel
from ._model_ops import GuideParams as GuideParams
from ._model_ops import NumpyroGuide as NumpyroGuide
from ._model_ops import NumpyroModel as NumpyroModel
from ._model_ops import Posterior as Posterior
from ._registry import NumpyroModelSpec as NumpyroModelSpec
from ._registry import get_numpyro_model as get_numpyro_model
from ._registry import guide_factory as guide_factory
from ._registry import register_numpyro_guide as register_numpyro_guide
from ._registry import register_numpyro_model as register_numpyro_model
from ._registry import registered_guides as registered_guides
from ._registry import registered_numpyro_models as registered_numpyro_models
from ._spec import SamplerBackendSpec as SamplerBackendSpec

if TYPE_CHECKING:
    from ._arviz import inference_data as inference_data
    from ._arviz import write_arviz as write_arviz
    from ._data import check_data as check_data
    from ._data import check_sites as check_sites
    from ._data import data_origin as data_origin
    from ._data import describe_error as describe_error
    from ._data import full_data as full_data
    from ._data import trace_abstract_first as trace_abstract_first
    from ._diagnostics import diagnostics as diagnostics
    from ._diagnostics import ess_bulk as ess_bulk
    from ._diagnostics import ess_tail as ess_tail
    from ._diagnostics import evaluate as evaluate
    from ._diagnostics import load_scipy as load_scipy
    from ._diagnostics import r_hat as r_hat
    from ._posterior import GROUPS_NPZ as GROUPS_NPZ
    from ._posterior import SUMMARY_JSON as SUMMARY_JSON
    from ._posterior import SUMMARY_TXT as SUMMARY_TXT
    from ._posterior import read_groups as read_groups
    from ._posterior import report as report
    from ._posterior import site_table as site_table
    from ._posterior import write_groups as write_groups
    from ._sampling import SamplerControls as SamplerControls
    from ._sampling import SamplerSetup as SamplerSetup
    from ._sampling import cached_program as cached_program
    from ._sampling import check_after as check_after
    from ._sampling import check_digest as check_digest
    from ._sampling import config_digest as config_digest
    from ._sampling import engine_loop as engine_loop
    from ._sampling import init_strategy as init_strategy
    from ._sampling import precision as precision
    from ._sampling import prepare as prepare
    from ._sampling import program_key as program_key

__getattr__, __dir__, _lazy_all = _attach(__name__, __file__, globals())
__all__ = sorted(
    [
        "HMC",
        "MALA",
        "NUTS",
        "UNTIL_DEFAULT_CHECK_EVERY",
        "UNTIL_DEFAULT_CHECK_GROWTH",
        "BlackjaxModel",
        "GuideParams",
        "NumpyroGuide",
        "NumpyroModel",
        "NumpyroModelSpec",
        "Posterior",
        "check_until",
        "get_numpyro_model",
        "guide_factory",
        "register_numpyro_guide",
        "register_numpyro_model",
        "registered_guides",
        "registered_numpyro_models",
        *_lazy_all,
    ]
)
