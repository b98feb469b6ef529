"""The sampler kernels' settings (`NUTS`, `HMC`, `MALA`): iterations, chains, thinning, adaptation targets, where
chains start, and ``until`` (sample until converged). Configuration only: the ``numpyro-mcmc`` and ``blackjax``
backends turn them into their framework's kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pipekit import ConfigError, Operator, suggestion

__all__ = ["HMC", "MALA", "NUTS", "check_until"]

InitStrategy = Literal["uniform", "median", "sample", "feasible", "mean"]


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
        log_likelihood: Record the pointwise log-likelihood of the observed sites at every kept draw (for LOO and
            model comparison); ``false`` for data so large that ``chains x draws x observations`` does not fit.
        posterior_predictive: Record posterior-predictive draws of the observed sites on the stage's data (off by
            default: ``pipekit-train predict`` draws them from a posterior artifact, for new data too).
        prior_predictive: Record this many draws from the prior and the prior predictive (0: none).

    The last three say what the stage records after sampling; they change neither the draws nor the checkpoint.
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
    log_likelihood: bool = True
    posterior_predictive: bool = False
    prior_predictive: int = 0

    def validate(self) -> None:
        name = type(self).__name__
        if self.prior_predictive < 0:
            raise ConfigError(
                f"{name}.prior_predictive must be an int >= 0 (draws; 0: none), got {self.prior_predictive}"
            )
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

    def extended(self, steps: int, stage: str) -> _Kernel:
        """This kernel for a stage `steps` iterations longer (``num_samples`` grows when it is set); a
        `ConfigError` when `steps` is not a multiple of `thinning` (the kept draws would start elsewhere)."""
        if steps % self.thinning:
            raise ConfigError(
                f"extend: steps must be a multiple of {type(self).__name__}.thinning ({self.thinning}) for stage "
                f"{stage!r}, got {steps}; the kept draws of a longer stage would otherwise start elsewhere"
            )
        return self if self.num_samples is None else self.replace(num_samples=self.num_samples + steps)

    def sampler_settings(self) -> _Kernel:
        """This kernel with what it records after sampling at the defaults: what the draws, the compiled program
        and the checkpoint depend on (a resumed stage may switch the recording settings)."""
        return self.replace(log_likelihood=True, posterior_predictive=False, prior_predictive=0)

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
