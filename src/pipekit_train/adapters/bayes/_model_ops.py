"""The model operators of a registered NumPyro model: `NumpyroModel` (sampled by MCMC, bound to its `Posterior`
draws), `BlackjaxModel` (the same, sampled by BlackJAX) and `NumpyroGuide` (fitted by SVI, bound to its
`GuideParams`), with the posterior-predictive mean each computes.

Everything here is configuration and host arrays; NumPyro is imported only inside methods that run something.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError, ShapeError, field, suggestion
from pipekit_train.backends import ModelOp

from ._registry import get_numpyro_model, guide_factory, registered_guides

__all__ = ["BlackjaxModel", "GuideParams", "NumpyroGuide", "NumpyroModel", "Posterior"]


# Posterior containers (the bound "module" of the model operators) ----------------------------------------
class Posterior:
    """Posterior draws by site, each of shape ``(chains, draws, *site_shape)``, as host arrays."""

    def __init__(self, draws: Mapping[str, Any]) -> None:
        self.draws = {k: np.asarray(v) for k, v in sorted(draws.items())}

    def flat(self) -> dict[str, np.ndarray]:
        """Draws with the chains merged: ``(chains * draws, *site_shape)``."""
        return {k: v.reshape((-1, *v.shape[2:])) for k, v in self.draws.items()}

    def __repr__(self) -> str:
        return f"Posterior({ {k: v.shape for k, v in self.draws.items()} })"

    def to_arviz(
        self,
        sample_stats: Mapping[str, Any] | None = None,
        observed_data: Mapping[str, Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
        groups: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Any:
        """The draws as an ArviZ ``InferenceData`` (group ``posterior``, dims ``chain``, ``draw``), with the
        ``sample_stats`` and ``observed_data`` groups when given and the other `groups` (``log_likelihood``,
        ``posterior_predictive``, ``prior``, ``prior_predictive``; ``pipekit-train export --format arviz`` adds
        them from the stage's files), and `attrs` on every group. Needs the ``arviz`` package (the numpyro and
        blackjax extras install it)."""
        from ._arviz import inference_data

        return inference_data(self.draws, sample_stats or {}, observed_data or {}, dict(attrs or {}), groups)


class GuideParams:
    """A guide's fitted parameters (constrained values, as ``SVI.get_params`` returns them), as host arrays."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = {k: np.asarray(v) for k, v in sorted(params.items())}

    def __repr__(self) -> str:
        return f"GuideParams({ {k: v.shape for k, v in self.params.items()} })"


def _as_kwargs(x: Any) -> dict[str, Any]:
    return dict(x) if isinstance(x, Mapping) else {"x": x}


# Model operators -----------------------------------------------------------------------------------------
class _NumpyroModelBase(ModelOp, register=False):
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        where = f"{type(self).__name__}.model"
        spec = get_numpyro_model(self.model, where)
        params = list(inspect.signature(spec.fn).parameters.values())
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        for name in self.kwargs:
            if name not in spec.parameters:
                raise ConfigError(
                    f"{type(self).__name__}.kwargs: model {self.model!r} has no parameter {name!r}"
                    f"{suggestion(name, spec.parameters)}; it takes: {', '.join(spec.parameters)}"
                )
            if name in spec.observed:
                raise ConfigError(
                    f"{type(self).__name__}.kwargs: {name!r} is an observed site of {self.model!r}; observations "
                    "come from the stage's dataset, not from kwargs"
                )

    @property
    def fn(self) -> Callable[..., Any]:
        """The registered NumPyro model function."""
        return get_numpyro_model(self.model).fn

    def model_kwargs(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The model's keyword arguments: the operator's `kwargs` and the data."""
        return {**self.kwargs, **data}


class NumpyroModel(_NumpyroModelBase):
    """A NumPyro model sampled by MCMC; bound to its posterior draws once a stage has run.

    Args:
        model: A name registered with `register_numpyro_model` (built-in: ``eight_schools``, ``conjugate_normal``,
            ``linear_regression``, ``logistic_regression``).
        kwargs: The model's non-data arguments (its data comes from the stage's dataset, key by parameter name).

    The trained model is the posterior: ``weights()`` are the draws (``draws/<site>``, ``(chains, draws, ...)``),
    what the model registry stores; call the bound operator on new inputs for the posterior-predictive mean, or
    `predictive` for the draws.

    Example:
        >>> NumpyroModel(model="eight_schools")
        NumpyroModel(model='eight_schools')
    """

    backend: ClassVar[str] = "numpyro-mcmc"

    @classmethod
    def example(cls) -> NumpyroModel:
        return cls(model="eight_schools")

    def build(self, key: Any) -> Posterior:
        """An empty posterior (no draws yet): a sampler fills it."""
        return Posterior({})

    def check_bind(self, module: Any) -> None:
        if not isinstance(module, Posterior):
            raise ShapeError(f"{self!r} binds a Posterior of draws, got {type(module).__name__}")

    def weights(self) -> dict[str, np.ndarray]:
        post = self.require_module("weights")
        return {f"draws/{k}": v for k, v in post.draws.items()}

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> Any:
        bad = [k for k in arrays if not k.startswith("draws/")]
        if bad:
            raise ShapeError(f"{self!r}.with_weights: expected 'draws/<site>' arrays, got {bad}")
        return self.bind(Posterior({k[len("draws/") :]: v for k, v in arrays.items()}), check=False)

    @property
    def posterior(self) -> Posterior:
        posterior: Posterior = self.require_module("posterior")
        return posterior

    def export_formats(self) -> tuple[str, ...]:
        """``("arviz",)``: the posterior as ArviZ netCDF (``pipekit-train export --format arviz``)."""
        return ("arviz",)

    def export(self, fmt: str, path: str, *, attrs: Mapping[str, str], stage_dir: str | None = None) -> dict[str, Any]:
        """Write the posterior draws, the stage's sample statistics and observed data (from `stage_dir`) as an
        ArviZ ``InferenceData`` netCDF file at `path`, `attrs` (the run's provenance) on every group."""
        if fmt != "arviz":
            return super().export(fmt, path, attrs=attrs, stage_dir=stage_dir)
        from ._arviz import write_arviz

        return write_arviz(self.posterior, path, attrs=attrs, stage_dir=stage_dir)

    def predict_draws(self, data: str, path: str, *, attrs: Mapping[str, str], seed: int = 0) -> dict[str, Any]:
        """Posterior-predictive draws for the inputs in the file `data` (a `DataFile`: Stan's JSON data format or
        an ``.npz`` of named values), written with the posterior to `path` as ArviZ netCDF: groups ``posterior``,
        ``posterior_predictive`` (``(chains, draws, ...)``) and, when the file holds the observations too,
        ``observed_data``. A name the model does not take is refused, as before sampling."""
        from pipekit_train.data import DataFile

        from ._arviz import inference_data, write_netcdf
        from ._data import check_names, values_of
        from ._predictive import predictive_for

        source = DataFile(path=data)
        values = values_of(source.values())
        spec = get_numpyro_model(self.model)
        check_names(self, values, f"predict ({self!r})", f"DataFile {data!r}")
        groups = predictive_for(self.fn, self.model_kwargs(values), self.posterior.draws, spec.observed, seed)
        idata = inference_data(self.posterior.draws, {}, groups.get("observed_data", {}), attrs, groups)
        return write_netcdf(idata, path)

    def compare(self, entries: Any, criterion: str) -> dict[str, Any]:
        """``criterion`` ``"loo"``: ArviZ's ``az.compare`` by PSIS-LOO of the posteriors `entries` (``(label, model,
        stage_dir)``), from the pointwise log-likelihood each stage recorded (`_compare.compare_loo`)."""
        if criterion != "loo":
            return super().compare(entries, criterion)
        others = [label for label, model, _ in entries if not isinstance(model, NumpyroModel)]
        if others:
            raise ConfigError(f"compare --loo compares sampler posteriors; {', '.join(others)} is not one")
        from ._compare import compare_loo

        return compare_loo(entries)

    def predictive(self, data: Any, seed: int = 0) -> dict[str, np.ndarray]:
        """Posterior-predictive draws of every site for inputs `data` (a mapping of model arguments, or ``x``)."""
        import jax
        from numpyro.infer import Predictive

        samples = self.posterior.flat()
        pred = Predictive(self.fn, posterior_samples=samples, batch_ndims=1)
        out = pred(jax.random.PRNGKey(seed), **self.model_kwargs(_as_kwargs(data)))
        return {k: np.asarray(v) for k, v in out.items()}

    def __call__(self, x: Any) -> Any:
        """The posterior-predictive mean of the observed site(s) for inputs `x` (`inference_function`), compiled
        once per configuration and input shapes (`_compiled_mean`)."""
        out = _compiled_mean(self, x, self.posterior.flat(), _posterior_kwargs)
        return {k: np.asarray(v) for k, v in out.items()} if isinstance(out, dict) else np.asarray(out)

    def inference_function(self) -> Any:
        """``predict(x)``: the posterior-predictive mean of the observed site(s) over the bound draws (closed over
        as constants), traceable by ``jax.jit``: what ``pipekit-train export`` serializes. Same as calling the
        operator."""
        import jax.numpy as jnp

        samples = {k: jnp.asarray(v) for k, v in self.posterior.flat().items()}
        return _traceable_mean(self, lambda: _posterior_kwargs(self, samples))


class BlackjaxModel(NumpyroModel):
    """A registered NumPyro model sampled by the ``blackjax`` backend (BlackJAX's NUTS/HMC/MALA on its log density).

    Everything but the backend is `NumpyroModel`'s: the same registered models, ``kwargs``, posterior draws as
    weights, `predictive` and the posterior-predictive mean.

    Example:
        >>> BlackjaxModel(model="eight_schools")
        BlackjaxModel(model='eight_schools')
    """

    backend: ClassVar[str] = "blackjax"


class NumpyroGuide(_NumpyroModelBase):
    """A NumPyro model fitted by SVI: the guide (variational family) and, once trained, its parameters.

    Args:
        model: A registered NumPyro model name (see `NumpyroModel`).
        kwargs: The model's non-data arguments.
        guide: An autoguide (``AutoNormal``, ``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
            ``AutoLaplaceApproximation``, ``AutoDelta``) or a name registered with `register_numpyro_guide`.
        guide_kwargs: Keyword arguments of the autoguide (``init_scale``, ...).

    Example:
        >>> NumpyroGuide(model="logistic_regression", guide="AutoDelta")
        NumpyroGuide(model='logistic_regression', guide='AutoDelta')
    """

    backend: ClassVar[str] = "numpyro-svi"

    guide: str = "AutoNormal"
    guide_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def example(cls) -> NumpyroGuide:
        return cls(model="conjugate_normal", guide="AutoNormal")

    def validate(self) -> None:
        super().validate()
        if self.guide not in registered_guides():
            raise ConfigError(
                f"NumpyroGuide.guide {self.guide!r} is not an autoguide or a registered guide"
                f"{suggestion(self.guide, registered_guides())}; choose one of {', '.join(registered_guides())}"
            )

    def make_guide(self, model_fn: Callable[..., Any] | None = None) -> Any:
        """The NumPyro guide for `model_fn` (the registered model by default)."""
        model_fn = model_fn or self.fn
        make = guide_factory(self.guide)
        if make is not None:
            return make(model_fn, **self.guide_kwargs)
        from numpyro.infer import autoguide

        return getattr(autoguide, self.guide)(model_fn, **self.guide_kwargs)

    def prediction_guide(self) -> Any:
        """The guide for predicting on inputs without observations: its model hides the observed sites from it.

        An autoguide finds its sites by running the model once (its prototype). Run on new inputs, with the
        observed sites left ``None``, it took them for latent variables: the guide then drew the predictions from
        its own initial values instead of the model's likelihood under the fitted parameters (a fitted linear
        regression predicted ~0 everywhere), and a discrete observed site (a logistic regression's) made NumPyro
        ask for ``funsor``. Here the model the guide sees draws its observed sites out of the guide's sight (a
        seed inside the block, so they still have a value), so the guide holds the latent sites alone, as it did
        when fitted on data.
        """
        from numpyro import handlers

        hidden = list(get_numpyro_model(self.model).observed)
        if not hidden:
            return self.make_guide()
        return self.make_guide(model_fn=handlers.block(handlers.seed(self.fn, rng_seed=0), hide=hidden))

    def build(self, key: Any) -> GuideParams:
        """No parameters yet: SVI initialises them from the data."""
        return GuideParams({})

    def check_bind(self, module: Any) -> None:
        if not isinstance(module, GuideParams):
            raise ShapeError(f"{self!r} binds GuideParams, got {type(module).__name__}")

    def weights(self) -> dict[str, np.ndarray]:
        return {f"params/{k}": v for k, v in self.require_module("weights").params.items()}

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> Any:
        bad = [k for k in arrays if not k.startswith("params/")]
        if bad:
            raise ShapeError(f"{self!r}.with_weights: expected 'params/<name>' arrays, got {bad}")
        return self.bind(GuideParams({k[len("params/") :]: v for k, v in arrays.items()}), check=False)

    @property
    def params(self) -> dict[str, np.ndarray]:
        bound: GuideParams = self.require_module("params")
        return bound.params

    def _ready_guide(self, data: Mapping[str, Any]) -> Any:
        """The guide, run once on `data` so an autoguide knows the model's sites."""
        import jax
        from numpyro import handlers

        guide = self.make_guide()
        with handlers.block(), handlers.seed(rng_seed=jax.random.PRNGKey(0)):
            handlers.substitute(guide, data=self.params)(**self.model_kwargs(data))
        return guide

    def median(self, data: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The guide's median of every latent site (constrained values), the model run on `data`."""
        guide = self._ready_guide(data)
        if hasattr(guide, "median"):
            out = guide.median(self.params)
        else:  # a hand-written guide: one draw with its noise switched off is not defined; use its sample mean
            samples = self.sample_posterior(data, num_samples=200)
            out = {k: v.mean(0) for k, v in samples.items()}
        return {k: np.asarray(v) for k, v in out.items()}

    def sample_posterior(self, data: Mapping[str, Any], num_samples: int = 1000, seed: int = 0) -> dict[str, Any]:
        """Draws of every latent site from the fitted guide."""
        import jax
        from numpyro.infer import Predictive

        guide = self.make_guide()
        pred = Predictive(guide, params=self.params, num_samples=num_samples)
        out = pred(jax.random.PRNGKey(seed), **self.model_kwargs(data))
        return {k: np.asarray(v) for k, v in out.items()}

    def predictive(self, data: Any, num_samples: int = 500, seed: int = 0) -> dict[str, np.ndarray]:
        """Posterior-predictive draws under the fitted guide for inputs `data`."""
        import jax
        from numpyro.infer import Predictive

        pred = Predictive(self.fn, guide=self.prediction_guide(), params=self.params, num_samples=num_samples)
        out = pred(jax.random.PRNGKey(seed), **self.model_kwargs(_as_kwargs(data)))
        return {k: np.asarray(v) for k, v in out.items()}

    def __call__(self, x: Any) -> Any:
        """The posterior-predictive mean of the observed site(s) for inputs `x` (`inference_function`), compiled
        once per configuration and input shapes (`_compiled_mean`): calling it again, or another fit of the same
        guide, compiles nothing."""
        out = _compiled_mean(self, x, self.params, _guide_kwargs)
        return {k: np.asarray(v) for k, v in out.items()} if isinstance(out, dict) else np.asarray(out)

    def inference_function(self) -> Any:
        """``predict(x)``: the posterior-predictive mean of the observed site(s) (500 draws under the fitted guide,
        its parameters closed over), traceable by ``jax.jit``: what ``pipekit-train export`` serializes."""
        import jax.numpy as jnp

        params = {k: jnp.asarray(v) for k, v in self.params.items()}
        return _traceable_mean(self, lambda: _guide_kwargs(self, params))


#: `__call__`'s compiled posterior-predictive means (`_compiled_mean`), by unbound operator and non-array inputs.
_MEANS: dict[Any, Any] = {}
_MEANS_MAX = 64


def _posterior_kwargs(template: Any, draws: Any) -> dict[str, Any]:
    """`Predictive`'s arguments for a sampler's posterior: the draws, one batch dimension (chains flattened)."""
    return {"posterior_samples": draws, "batch_ndims": 1}


def _guide_kwargs(template: Any, params: Any) -> dict[str, Any]:
    """`Predictive`'s arguments for a fitted guide: 500 draws under its parameters (a fresh guide per trace: an
    autoguide keeps the prototype trace of its first call)."""
    return {"guide": template.prediction_guide(), "params": params, "num_samples": 500}


def _compiled_mean(
    op: _NumpyroModelBase, x: Any, bound: Any, predictive_kwargs: Callable[[Any, Any], dict[str, Any]]
) -> Any:
    """``op(x)``: the operator's `inference_function` under one `jax.jit` per configuration, with `bound` (the
    draws, or the guide's parameters) and the input arrays as its arguments.

    Calling NumPyro's `Predictive` eagerly compiled its draws' loop again on every call (a new closure each time:
    about a second a call for a small model, three calls of one kit check 3.4 s); here a second call, or another
    fit of the same configuration, finds the program. The unbound operator (model, kwargs, guide) and the inputs
    that are not arrays (sizes a model reads as Python numbers) key it; the cache holds no draws or parameters.
    """
    import jax

    from pipekit import canonical

    data = _as_kwargs(x)
    arrays = {k: v for k, v in data.items() if hasattr(v, "shape") and hasattr(v, "dtype")}
    others = {k: v for k, v in data.items() if k not in arrays}
    template = op.replace()
    key = (template, template.fn, canonical(others))  # the function too: a model name registered again
    fn = _MEANS.get(key)
    if fn is None:

        def mean(bound: Any, arrays: Any) -> Any:
            return _traceable_mean(template, lambda: predictive_kwargs(template, bound))({**others, **arrays})

        while len(_MEANS) >= _MEANS_MAX:
            _MEANS.pop(next(iter(_MEANS)))
        fn = _MEANS[key] = jax.jit(mean)
    return fn(bound, arrays)


def _traceable_mean(op: _NumpyroModelBase, predictive_kwargs: Callable[[], dict[str, Any]]) -> Any:
    """``predict(x)``: the mean over draws of the observed site(s) of ``Predictive(op.fn, **predictive_kwargs())``
    at seed 0, in JAX."""
    import jax
    from numpyro.infer import Predictive

    observed = list(get_numpyro_model(op.model).observed) or None

    def predict(x: Any) -> Any:
        pred = Predictive(op.fn, return_sites=observed, **predictive_kwargs())
        samples = pred(jax.random.PRNGKey(0), **op.model_kwargs(_as_kwargs(x)))
        return _predictive_mean(op, samples)

    return predict


def _predictive_mean(op: _NumpyroModelBase, samples: Mapping[str, np.ndarray]) -> Any:
    spec = get_numpyro_model(op.model)
    sites = [s for s in spec.observed if s in samples] or list(samples)
    means = {s: samples[s].mean(axis=0) for s in sites}
    return means[sites[0]] if len(sites) == 1 else means
