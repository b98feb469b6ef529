"""The Bayesian operators: kernels (`NUTS`, `HMC`), ELBOs (`Trace_ELBO`, `TraceMeanField_ELBO`), and the model
operators `NumpyroModel` (a posterior: draws) and `NumpyroGuide` (a variational posterior: guide parameters).

Everything here is configuration; NumPyro is imported only inside methods that run something.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import numpy as np

from pipekit import ConfigError, Operator, ShapeError, field, suggestion
from pipekit_train.backends import ModelOp
from pipekit_train.losses import Loss

from ._registry import get_numpyro_model

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
    "registered_guides",
]

InitStrategy = Literal["uniform", "median", "sample", "feasible", "mean"]


# Kernels -------------------------------------------------------------------------------------------------
#: The keys of a kernel's ``until``: the criteria (at least one), how often they are checked, the budget.
UNTIL_KEYS = ("r_hat_max", "ess_bulk_min", "ess_tail_min", "check_every", "check_growth", "max_draws")
UNTIL_CRITERIA = ("r_hat_max", "ess_bulk_min", "ess_tail_min")
UNTIL_DEFAULT_CHECK_EVERY = 250
#: The spacing of later checks as a fraction of the draws so far (`_sampling.check_after`): checks then cost a
#: bounded share of sampling, and a run samples at most this fraction past the first draw that would have met.
UNTIL_DEFAULT_CHECK_GROWTH = 0.25


def check_until(until: Any, num_samples: int | None, kernel: str) -> None:
    """One-line `ConfigError`s for a kernel's ``until`` mapping: unknown keys, types, non-positive values."""
    where = f"{kernel}.until"
    if not isinstance(until, Mapping):
        raise ConfigError(f"{where} must be a mapping such as {{r_hat_max: 1.01, ess_bulk_min: 400}}, got {until!r}")
    for key, value in until.items():
        if key not in UNTIL_KEYS:
            raise ConfigError(
                f"{where}: unknown key {key!r}{suggestion(str(key), list(UNTIL_KEYS))}; keys: {', '.join(UNTIL_KEYS)}"
            )
        ok_type = isinstance(value, int) if key in ("check_every", "max_draws") else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type:
            kind = "an int" if key in ("check_every", "max_draws") else "a number"
            raise ConfigError(f"{where}.{key} must be {kind}, got {value!r}")
        if key == "check_growth":
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{where}.check_growth must be >= 0 (0: check every check_every), got {value!r}")
        elif not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{where}.{key} must be > 0, got {value!r}")
        if key == "r_hat_max" and value <= 1.0:
            raise ConfigError(f"{where}.r_hat_max must be > 1 (R-hat is 1 at best), got {value!r}")
    if not any(k in until for k in UNTIL_CRITERIA):
        raise ConfigError(f"{where} names no criterion: give at least one of {', '.join(UNTIL_CRITERIA)}")
    max_draws = until.get("max_draws")
    if max_draws is not None and num_samples is not None and max_draws != num_samples:
        raise ConfigError(
            f"{where}.max_draws ({max_draws}) and {kernel}.num_samples ({num_samples}) disagree: with until, "
            "the budget of sampling iterations is max_draws; remove num_samples"
        )


class _Kernel(Operator, register=False):
    """What every sampler kernel shares: how many iterations, chains, which draws are kept, where chains start.

    One loop step is one iteration of every chain, so a stage's ``max_steps`` is ``num_warmup + num_samples``.

    Args:
        num_warmup: Adaptation iterations (their draws are discarded).
        num_samples: Iterations after warm-up; ``None`` takes ``max_steps - num_warmup``.
        num_chains: Chains, run vectorized on one device.
        thinning: Keep every ``thinning``-th draw.
        target_accept_prob: The acceptance probability the step size adapts to.
        dense_mass: Adapt a dense mass matrix instead of a diagonal one.
        step_size: The initial step size.
        init_strategy: Where chains start (NumPyro's ``init_to_*``); a previous SVI stage's median overrides it.
        until: Sample until converged: ``{r_hat_max, ess_bulk_min, ess_tail_min}`` (at least one), checked every
            ``check_every`` draws (spaced by ``check_growth``), within ``max_draws`` (docs/bayesian.md).
    """

    num_warmup: int = 500
    num_samples: int | None = None
    num_chains: int = 1
    thinning: int = 1
    target_accept_prob: float = 0.8
    dense_mass: bool = False
    step_size: float = 1.0
    init_strategy: InitStrategy = "uniform"
    until: dict[str, Any] | None = None

    def validate(self) -> None:
        name = type(self).__name__
        if self.until is not None:
            check_until(self.until, self.num_samples, name)
        for key in ("num_warmup", "num_chains", "thinning"):
            value = getattr(self, key)
            low = 0 if key == "num_warmup" else 1
            if value < low:
                raise ConfigError(f"{name}.{key} must be an int >= {low}, got {value}")
        if self.num_samples is not None and self.num_samples < 1:
            raise ConfigError(f"{name}.num_samples must be an int >= 1 or null, got {self.num_samples}")
        if not 0.0 < self.target_accept_prob < 1.0:
            raise ConfigError(f"{name}.target_accept_prob must be in (0, 1), got {self.target_accept_prob}")
        if not (math.isfinite(self.step_size) and self.step_size > 0):
            raise ConfigError(f"{name}.step_size must be a float > 0, got {self.step_size}")

    def samples_for(self, max_steps: int) -> int:
        """`num_samples`, or ``max_steps - num_warmup`` when it is left null; a `ConfigError` when they disagree."""
        name = type(self).__name__
        num_samples = self.num_samples if self.num_samples is not None else self.max_draws
        total = self.num_warmup + (num_samples or 0)
        if num_samples is None:
            if max_steps <= self.num_warmup:
                raise ConfigError(
                    f"TrainingLoop.max_steps ({max_steps}) must be more than {name}.num_warmup ({self.num_warmup}): "
                    "one loop step is one MCMC iteration, and the samples are max_steps - num_warmup"
                )
            return max_steps - self.num_warmup
        if max_steps != total:
            raise ConfigError(
                f"TrainingLoop.max_steps is {max_steps} but {self!r} runs {total} iterations "
                f"(num_warmup + num_samples); set max_steps: {total} (one loop step is one MCMC iteration of "
                "every chain), or leave num_samples null to take max_steps - num_warmup"
            )
        return num_samples

    @property
    def max_draws(self) -> int | None:
        """``until.max_draws``: the most sampling iterations per chain a stage sampling until converged runs."""
        return None if self.until is None else self.until.get("max_draws")

    def kept(self, max_steps: int) -> int:
        """How many draws per chain are kept: ``num_samples // thinning``."""
        kept = self.samples_for(max_steps) // self.thinning
        if kept < 1:
            raise ConfigError(f"{self!r}: thinning {self.thinning} keeps no draw of {self.samples_for(max_steps)}")
        return kept


class NUTS(_Kernel):
    """The No-U-Turn sampler with Stan's windowed adaptation of step size and (diagonal or dense) mass matrix.

    Args:
        num_warmup: Adaptation iterations (their draws are discarded).
        num_samples: Iterations after warm-up; ``None`` takes ``max_steps - num_warmup``.
        num_chains: Chains, run vectorized on one device.
        thinning: Keep every ``thinning``-th draw.
        target_accept_prob: The acceptance probability the step size adapts to.
        max_tree_depth: The trajectory doubles at most this many times.
        dense_mass: Adapt a dense mass matrix instead of a diagonal one.
        step_size: The initial step size.
        init_strategy: Where chains start (NumPyro's ``init_to_*``); a previous SVI stage's median overrides it.

    Example:
        >>> NUTS(num_warmup=200, num_samples=300, num_chains=2)
        NUTS(num_warmup=200, num_samples=300, num_chains=2)
    """

    max_tree_depth: int = 10

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.max_tree_depth <= 20:
            raise ConfigError(f"NUTS.max_tree_depth must be in [1, 20], got {self.max_tree_depth}")


class HMC(_Kernel):
    """Hamiltonian Monte Carlo with a fixed trajectory length (or a fixed number of leapfrog steps).

    Other fields as for `NUTS`.

    Args:
        num_steps: Leapfrog steps per iteration; ``None`` uses `trajectory_length` / step size.
        trajectory_length: The integration time when `num_steps` is null.
    """

    num_steps: int | None = None
    trajectory_length: float = 2.0 * math.pi

    def validate(self) -> None:
        super().validate()
        if self.num_steps is not None and self.num_steps < 1:
            raise ConfigError(f"HMC.num_steps must be an int >= 1 or null, got {self.num_steps}")


class MALA(_Kernel):
    """The Metropolis-adjusted Langevin algorithm (``blackjax`` backend only): one gradient step per iteration.

    Warm-up adapts the step size alone (dual averaging to `target_accept_prob`, 0.574 by default, the optimal
    MALA rate); MALA has no mass matrix, so `dense_mass` must stay false. Other fields as for `NUTS`.

    Example:
        >>> MALA(num_warmup=300, num_samples=1000, num_chains=4)
        MALA(num_warmup=300, num_samples=1000, num_chains=4)
    """

    target_accept_prob: float = 0.574
    step_size: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.dense_mass:
            raise ConfigError("MALA has no mass matrix: remove dense_mass (or use NUTS/HMC)")


# ELBOs ---------------------------------------------------------------------------------------------------
class _ELBO(Loss, register=False):
    """The negative ELBO as the SVI stage's loss; `num_particles` Monte-Carlo samples per step.

    It is not called on ``(predicted, target)``: the ``numpyro-svi`` backend hands it to NumPyro's `SVI`.

    Args:
        num_particles: Monte-Carlo samples of the ELBO per step (>= 1).
    """

    num_particles: int = 1
    aux_prefix: ClassVar[str] = ""

    def validate(self) -> None:
        if self.num_particles < 1:
            raise ConfigError(f"{type(self).__name__}.num_particles must be an int >= 1, got {self.num_particles}")

    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        raise ConfigError(
            f"{self!r} is the loss of a Bayesian stage: use it with backend: numpyro-svi, not on predictions"
        )

    def numpyro(self) -> Any:
        """The NumPyro ELBO object."""
        import numpyro.infer

        return getattr(numpyro.infer, type(self).__name__)(num_particles=self.num_particles)


class Trace_ELBO(_ELBO):
    """NumPyro's ``Trace_ELBO``: the ELBO estimated from sampled guide traces.

    Example:
        >>> Trace_ELBO(num_particles=4)
        Trace_ELBO(num_particles=4)
    """


class TraceMeanField_ELBO(_ELBO):
    """NumPyro's ``TraceMeanField_ELBO``: analytic KL terms where the guide and model sites allow it."""


# Guides --------------------------------------------------------------------------------------------------
_AUTO_GUIDES = ("AutoNormal", "AutoDiagonalNormal", "AutoMultivariateNormal", "AutoLaplaceApproximation", "AutoDelta")
_GUIDES: dict[str, Callable[..., Any]] = {}


def register_numpyro_guide(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a hand-written guide: a function ``make(model_fn) -> guide_fn`` (``NumpyroGuide(guide=name)``)."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _AUTO_GUIDES:
            raise ConfigError(f"register_numpyro_guide: {name!r} is a built-in autoguide name")
        _GUIDES[name] = fn
        return fn

    return decorator


def registered_guides() -> list[str]:
    """The names `NumpyroGuide.guide` accepts."""
    return [*_AUTO_GUIDES, *sorted(_GUIDES)]


# Posterior containers (the bound "module" of the model operators) -----------------------------------------
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
    ) -> Any:
        """The draws as an ArviZ ``InferenceData`` (group ``posterior``, dims ``chain``, ``draw``), with the
        ``sample_stats`` and ``observed_data`` groups when given (``pipekit-train export --format arviz`` adds
        them from the stage's files) and `attrs` on every group. Needs the ``arviz`` package (the numpyro and
        blackjax extras install it)."""
        from .._arviz import inference_data

        return inference_data(self.draws, sample_stats or {}, observed_data or {}, dict(attrs or {}))


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
        post = self._bound("weights")
        return {f"draws/{k}": v for k, v in post.draws.items()}

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> Any:
        bad = [k for k in arrays if not k.startswith("draws/")]
        if bad:
            raise ShapeError(f"{self!r}.with_weights: expected 'draws/<site>' arrays, got {bad}")
        return self.bind(Posterior({k[len("draws/") :]: v for k, v in arrays.items()}), check=False)

    @property
    def posterior(self) -> Posterior:
        posterior: Posterior = self._bound("posterior")
        return posterior

    def predictive(self, data: Any, seed: int = 0) -> dict[str, np.ndarray]:
        """Posterior-predictive draws of every site for inputs `data` (a mapping of model arguments, or ``x``)."""
        import jax
        from numpyro.infer import Predictive

        samples = self.posterior.flat()
        pred = Predictive(self.fn, posterior_samples=samples, batch_ndims=1)
        out = pred(jax.random.PRNGKey(seed), **self.model_kwargs(_as_kwargs(data)))
        return {k: np.asarray(v) for k, v in out.items()}

    def __call__(self, x: Any) -> Any:
        """The posterior-predictive mean of the observed site(s) for inputs `x`."""
        return _predictive_mean(self, self.predictive(x))

    def inference_function(self) -> Any:
        """``predict(x)``: the posterior-predictive mean of the observed site(s) over the bound draws (closed over
        as constants), traceable by ``jax.jit``: what ``pipekit-train export`` serializes. Same as calling the
        operator."""
        import jax.numpy as jnp

        samples = {k: jnp.asarray(v) for k, v in self.posterior.flat().items()}
        return _traceable_mean(self, lambda: {"posterior_samples": samples, "batch_ndims": 1})


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
        if self.guide in _GUIDES:
            return _GUIDES[self.guide](model_fn, **self.guide_kwargs)
        from numpyro.infer import autoguide

        return getattr(autoguide, self.guide)(model_fn, **self.guide_kwargs)

    def build(self, key: Any) -> GuideParams:
        """No parameters yet: SVI initialises them from the data."""
        return GuideParams({})

    def check_bind(self, module: Any) -> None:
        if not isinstance(module, GuideParams):
            raise ShapeError(f"{self!r} binds GuideParams, got {type(module).__name__}")

    def weights(self) -> dict[str, np.ndarray]:
        return {f"params/{k}": v for k, v in self._bound("weights").params.items()}

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> Any:
        bad = [k for k in arrays if not k.startswith("params/")]
        if bad:
            raise ShapeError(f"{self!r}.with_weights: expected 'params/<name>' arrays, got {bad}")
        return self.bind(GuideParams({k[len("params/") :]: v for k, v in arrays.items()}), check=False)

    @property
    def params(self) -> dict[str, np.ndarray]:
        bound: GuideParams = self._bound("params")
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

        pred = Predictive(self.fn, guide=self.make_guide(), params=self.params, num_samples=num_samples)
        out = pred(jax.random.PRNGKey(seed), **self.model_kwargs(_as_kwargs(data)))
        return {k: np.asarray(v) for k, v in out.items()}

    def __call__(self, x: Any) -> Any:
        """The posterior-predictive mean of the observed site(s) for inputs `x` (`inference_function`)."""
        out = self.inference_function()(x)
        return {k: np.asarray(v) for k, v in out.items()} if isinstance(out, dict) else np.asarray(out)

    def inference_function(self) -> Any:
        """``predict(x)``: the posterior-predictive mean of the observed site(s) (500 draws under the fitted guide,
        its parameters closed over), traceable by ``jax.jit``: what ``pipekit-train export`` serializes."""
        import jax.numpy as jnp

        params = {k: jnp.asarray(v) for k, v in self.params.items()}
        # A fresh guide per call: an autoguide keeps the prototype trace of its first call (a tracer under jit).
        return _traceable_mean(self, lambda: {"guide": self.make_guide(), "params": params, "num_samples": 500})


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
