"""The ``blackjax`` adapter: BlackJAX's NUTS/HMC/MALA kernels on a NumPyro model's log density, in chunks.

``blackjax.window_adaptation(...).run`` runs the whole warm-up in one ``lax.scan``, which cannot be checkpointed.
This adapter runs the same steps itself, one iteration of every chain per engine step: the kernel with the current
step size and inverse mass matrix, then Stan's adaptation update of that schedule entry (``build_schedule``; dual
averaging from ``blackjax.adaptation.step_size``, the Welford mass matrix from ``blackjax.adaptation.mass_matrix``,
the arithmetic of BlackJAX's ``window_adaptation``), and after the last warm-up iteration the adapted step size
(the dual-averaging average) and mass matrix are fixed for sampling. Chains are ``vmap``ped, each adapting on its
own. The key of every iteration is fixed by ``(seed, chain, iteration)``, so the checkpoint (the kernel state, the
adaptation state, the draws so far) is all a resumed run needs to continue bitwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipekit_train.adapters.bayes import (
    HMC,
    MALA,
    NUTS,
    Posterior,
    SamplerControls,
    SamplerSetup,
    cached_program,
    check_digest,
    config_digest,
    init_strategy,
    precision,
    prepare,
    program_key,
)
from pipekit_train.backends.kit import stage_name

KERNELS = (NUTS, HMC, MALA)


class Adaptation(NamedTuple):
    """One chain's warm-up state: dual averaging, the Welford estimator, and the parameters the kernel uses."""

    ss_state: Any
    imm_state: Any
    step_size: Any
    inverse_mass_matrix: Any


class ChainState(NamedTuple):
    """Everything one chain carries from one iteration to the next (with a leading chain axis when stored)."""

    state: Any  # BlackJAX's HMCState / MALAState: position (unconstrained), log density, its gradient
    adapt: Adaptation
    accept_sum: Any  # acceptance probabilities summed since the phase (warm-up, sampling) began
    divergences: Any  # divergent transitions after warm-up


def _strong(x: Any) -> Any:
    """`x` as an array of its own dtype, not weakly typed (so a restored checkpoint compiles the same program)."""
    x = jnp.asarray(x)
    return jnp.array(x, dtype=x.dtype)


def chain_keys(seed: int, chains: int) -> tuple[Any, Any]:
    """The keys of chain ``c``: ``k_init, k_warm, k_sample = split(split(PRNGKey(seed), chains)[c], 3)``; warm-up
    iteration ``i`` uses ``fold_in(k_warm, i)`` and sampling iteration ``j`` (counted from the end of warm-up)
    ``fold_in(k_sample, j)`` (`iteration_key`), so a draw's key does not depend on how many draws the stage takes
    and a stage extended by N draws (`pipekit_train.stage.extend`) draws what one planned N longer draws. Returns
    the init keys ``(chains, 2)`` and the phase keys ``(chains, 2, 2)`` (``[k_warm, k_sample]`` of every chain)."""
    per_chain = jax.vmap(lambda k: jax.random.split(k, 3))(jax.random.split(jax.random.PRNGKey(seed), chains))
    return per_chain[:, 0], per_chain[:, 1:]


def iteration_key(phase_keys: Any, i: Any, num_warmup: int) -> Any:
    """The key of iteration `i` of one chain (its ``[k_warm, k_sample]``): `chain_keys`'s rule, traced."""
    warm = jax.random.fold_in(phase_keys[0], i)
    sample = jax.random.fold_in(phase_keys[1], i - num_warmup)
    return jnp.where(i < num_warmup, warm, sample)


def initial_positions(model_op: Any, kernel: Any, model_kwargs: dict[str, Any], keys: Any, init_values: Any) -> Any:
    """NumPyro's initial point of every chain (unconstrained), the log density and the constrained transform."""
    from numpyro.infer.util import initialize_model

    strategy = init_strategy(kernel, init_values)
    chains = keys.shape[0]
    info = initialize_model(
        keys[0] if chains == 1 else keys, model_op.fn, model_kwargs=model_kwargs, init_strategy=strategy
    )
    z = info.param_info.z
    if chains == 1:
        z = jax.tree.map(lambda x: x[None], z)
    potential = info.potential_fn
    return z, (lambda position: -potential(position)), info.postprocess_fn


def adaptation_fns(kernel: Any) -> tuple[Any, Any, Any]:
    """``init(position)``, ``update(adapt, stage, window_end, position, acceptance)`` and ``final(adapt)`` of Stan's
    window adaptation, with BlackJAX's building blocks (the welford path of ``window_adaptation``)."""
    from blackjax.adaptation.mass_matrix import mass_matrix_adaptation
    from blackjax.adaptation.step_size import dual_averaging_adaptation
    from blackjax.util import pytree_size

    mm_init, mm_update, mm_final = mass_matrix_adaptation(is_diagonal_matrix=not kernel.dense_mass)
    da_init, da_update, da_final = dual_averaging_adaptation(kernel.target_accept_prob)

    def init(position: Any) -> Adaptation:
        imm = mm_init(pytree_size(position))
        return Adaptation(da_init(kernel.step_size), imm, kernel.step_size, imm.inverse_mass_matrix)

    def fast(a: Adaptation, position: Any, acc: Any) -> Adaptation:
        ss = da_update(a.ss_state, acc)
        return Adaptation(ss, a.imm_state, jnp.exp(ss.log_step_size), a.inverse_mass_matrix)

    def slow(a: Adaptation, position: Any, acc: Any) -> Adaptation:
        imm = mm_update(a.imm_state, position)
        ss = da_update(a.ss_state, acc)
        return Adaptation(ss, imm, jnp.exp(ss.log_step_size), imm.inverse_mass_matrix)

    def window_end(a: Adaptation) -> Adaptation:
        imm = mm_final(a.imm_state)
        ss = da_init(da_final(a.ss_state))
        return Adaptation(ss, imm, jnp.exp(ss.log_step_size), imm.inverse_mass_matrix)

    def update(a: Adaptation, stage: Any, is_end: Any, position: Any, acc: Any) -> Adaptation:
        a = jax.lax.switch(stage, (fast, slow), a, position, acc)
        out: Adaptation = jax.lax.cond(is_end, window_end, lambda x: x, a)
        return out

    def final(a: Adaptation) -> Adaptation:
        step_size = jnp.exp(a.ss_state.log_step_size_avg)  # the dual-averaging average, as window_adaptation
        return a._replace(step_size=step_size, inverse_mass_matrix=a.imm_state.inverse_mass_matrix)

    return init, update, final


def schedule_of(kernel: Any) -> np.ndarray:
    """Stan's warm-up schedule ``(num_warmup, 2)``: (0 fast / 1 slow window, last step of a slow window)."""
    from blackjax.adaptation.window_adaptation import build_schedule

    if isinstance(kernel, MALA):  # no mass matrix: step-size windows only
        sched = np.zeros((kernel.num_warmup, 2), np.int32)
    else:
        sched = np.asarray(build_schedule(kernel.num_warmup), np.int32).reshape(-1, 2)
    return sched if len(sched) else np.zeros((1, 2), np.int32)


def transition(kernel: Any, logdensity: Any) -> Any:
    """``step(key, state, adapt) -> (state, acceptance, diverging, leapfrog steps, extra statistics)`` of the kernel
    operator (the extras: ``energy``, and NUTS's ``tree_depth``)."""
    import blackjax

    if isinstance(kernel, NUTS):
        base = blackjax.nuts.build_kernel()

        def nuts_step(key: Any, state: Any, a: Adaptation) -> Any:
            new, info = base(
                key, state, logdensity, a.step_size, a.inverse_mass_matrix, max_num_doublings=kernel.max_tree_depth
            )
            extra = {"energy": info.energy, "tree_depth": info.num_trajectory_expansions}
            return new, info.acceptance_rate, info.is_divergent, info.num_integration_steps, extra

        return nuts_step
    if isinstance(kernel, HMC):
        base = blackjax.hmc.build_kernel()

        def hmc_step(key: Any, state: Any, a: Adaptation) -> Any:
            if kernel.num_steps is not None:
                n = jnp.int32(kernel.num_steps)
            else:  # NumPyro's rule: the trajectory length over the current step size, rounded up
                n = jnp.clip(jnp.ceil(kernel.trajectory_length / a.step_size), 1, 1024).astype(jnp.int32)
            new, info = base(key, state, logdensity, a.step_size, a.inverse_mass_matrix, n)
            return new, info.acceptance_rate, info.is_divergent, n, {"energy": info.energy}

        return hmc_step
    base = blackjax.mala.build_kernel()

    def step(key: Any, state: Any, a: Adaptation) -> Any:
        new, info = base(key, state, logdensity, a.step_size)
        return new, info.acceptance_rate, jnp.zeros((), bool), jnp.int32(1), {}

    return step


def init_state(kernel: Any, position: Any, logdensity: Any) -> Any:
    import blackjax

    module = blackjax.mala if isinstance(kernel, MALA) else blackjax.hmc
    return module.init(position, logdensity)


class _Program:
    """What one sampler program needs, traced once per process: the log density and constraining transform (from
    NumPyro), the kernel step, the adaptation, and the jitted initialisation and chunk."""

    def __init__(self, setup: SamplerSetup, model_kwargs: dict[str, Any], init_keys: Any) -> None:
        k = setup.kernel
        z, logdensity, post = initial_positions(setup.model_op, k, model_kwargs, init_keys, setup.init_values)
        self.first_z = z
        self.post = post
        self.step = transition(k, logdensity)
        adapt_init, self.adapt_update, self.adapt_final = adaptation_fns(k)
        self.schedule = jnp.asarray(schedule_of(k))
        zero = jnp.zeros((), jnp.float32)

        def init_one(position: Any) -> ChainState:
            return ChainState(init_state(k, position, logdensity), adapt_init(position), zero, jnp.zeros((), jnp.int32))

        self.init = jax.jit(jax.vmap(init_one))
        self.chunk: Any = None  # the first backend's jitted chunk
        self.shapes: Any = None  # (a draw, the carry, a draw's statistics), abstract: traced by the first backend


class BlackjaxBackend(SamplerControls):
    """The `StepBackend` of ``blackjax``: one engine step is one iteration of every chain."""

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this run: the kernel, chains, draws, adapted step sizes."""
        adapted = self.adapted()
        return {**super().summary(), "step_size": [float(x) for x in adapted["step_size"].reshape(-1)]}

    def __init__(self, loop: Any, setup: SamplerSetup) -> None:
        self.loop = loop
        self.setup = setup
        k = setup.kernel
        self.kernel = k
        self.chains = k.num_chains
        self.num_warmup = k.num_warmup
        self.thinning = k.thinning
        self.total = k.num_warmup + setup.num_samples
        self.start_idx = k.num_warmup + setup.num_samples % k.thinning  # as numpyro-mcmc (NumPyro's fori_collect)
        model_kwargs = setup.model_op.model_kwargs(setup.data)
        init_keys, self.keys = chain_keys(loop.seed, self.chains)
        built: list[_Program] = []

        def build() -> _Program:
            built.append(_Program(setup, model_kwargs, init_keys))
            return built[0]

        program = cached_program(program_key("blackjax", setup), build)
        first = program.first_z if built else None

        def initial() -> ChainState:  # the program may be shared: this run's seed has its own initial point
            z = first if first is not None else initial_positions(setup.model_op, k, model_kwargs, init_keys,
                                                                   setup.init_values)[0]  # fmt: skip
            return jax.tree.map(_strong, program.init(z))  # type: ignore[no-any-return]

        # Computed when first needed: a resumed or extended stage replaces it from a checkpoint, and NumPyro
        # compiles its search for a valid initial point anew for every run.
        self._initial = initial
        self._carry: ChainState | None = None
        self._post, self._step, self.schedule = program.post, program.step, program.schedule
        self._adapt_update, self._adapt_final = program.adapt_update, program.adapt_final
        if program.shapes is None:  # tracing one NUTS iteration for its statistics' shapes takes about 0.5 s

            def stats_of(c: ChainState) -> Any:
                return self._all_chains(jnp.zeros((self.chains, 2), jnp.uint32), c, jnp.int32(0), 0, False)[1][1]

            carry_shape = jax.eval_shape(program.init, program.first_z)
            program.shapes = (
                jax.eval_shape(jax.vmap(self._post), program.first_z),
                carry_shape,
                jax.eval_shape(stats_of, carry_shape),
            )
        sample, carry_shape, stats = program.shapes
        # The kept draws and their sampler statistics, each ``(kept, chains, ...)``.
        self.draws_buf = jax.tree.map(lambda s: jnp.zeros((setup.kept, *s.shape), s.dtype), (sample, stats))
        self.treedef = jax.tree.structure(carry_shape)
        self.draws_def = jax.tree.structure(self.draws_buf)
        self.digest = config_digest(loop.task, setup.model_op)
        self.step = 0
        if program.chunk is None:
            program.chunk = jax.jit(self._chunk_impl, static_argnums=4)
        self._chunk = program.chunk

    @property
    def carry(self) -> ChainState:
        """Every chain's state; the initial one is computed on first use."""
        if self._carry is None:
            self._carry = self._initial()
        return self._carry

    @carry.setter
    def carry(self, value: ChainState) -> None:
        self._carry = value

    # One iteration of one chain ----------------------------------------------------------------------------
    def _one(self, key: Any, c: ChainState, i: Any, stage: Any, is_end: Any) -> tuple[ChainState, Any]:
        new, acc, diverging, num_steps, extra = self._step(key, c.state, c.adapt)
        stats = {  # this draw's sampler statistics (ArviZ's sample_stats names), kept with the draw
            "lp": new.logdensity,
            "acceptance_rate": acc,
            "diverging": diverging,
            "step_size": c.adapt.step_size,
            "n_steps": jnp.asarray(num_steps, jnp.int32),
            **extra,
        }
        warm = i < self.num_warmup
        adapt = jax.lax.cond(
            warm, lambda a: self._adapt_update(a, stage, is_end, new.position, acc), lambda a: a, c.adapt
        )
        adapt = jax.lax.cond(i == self.num_warmup - 1, self._adapt_final, lambda a: a, adapt)
        acc = acc.astype(jnp.float32)
        accept_sum = jnp.where(i == self.num_warmup, acc, c.accept_sum + acc)
        divergences = c.divergences + jnp.logical_and(diverging, jnp.logical_not(warm)).astype(jnp.int32)
        out = ChainState(new, adapt, accept_sum, divergences)
        seen = jnp.where(warm, i + 1, i - self.num_warmup + 1).astype(jnp.float32)
        info = {
            "loss": -new.logdensity,
            "accept_prob": acc,
            "mean_accept_prob": accept_sum / seen,
            "step_size": adapt.step_size,
            "diverging": diverging.astype(jnp.float32),
            "num_steps": jnp.asarray(num_steps, jnp.float32),
        }
        return out, (info, stats)

    def _all_chains(self, keys: Any, carry: ChainState, i: Any, stage: Any, is_end: Any) -> Any:
        if self.chains == 1:  # unbatched: the program of a plain single-chain BlackJAX loop
            squeeze = jax.tree.map(lambda x: x[0], (keys, carry))
            out, info = self._one(squeeze[0], squeeze[1], i, stage, is_end)
            return jax.tree.map(lambda x: x[None], (out, info))
        return jax.vmap(self._one, in_axes=(0, 0, None, None, None))(keys, carry, i, stage, is_end)

    def _chunk_impl(self, carry: ChainState, draws: Any, keys: Any, first: Any, n: int) -> Any:
        schedule = self.schedule
        last = schedule.shape[0] - 1

        def body(c: Any, j: Any) -> Any:
            carry, draws = c
            i = first + j
            key = jax.vmap(lambda k: iteration_key(k, i, self.num_warmup))(keys)
            entry = jax.lax.dynamic_index_in_dim(schedule, jnp.minimum(i, last), keepdims=False)
            carry, (info, stats) = self._all_chains(key, carry, i, entry[0], entry[1].astype(bool))
            idx = (i - self.start_idx) // self.thinning
            value = (jax.vmap(self._post)(carry.state.position), stats)

            def update(buf: Any, v: Any) -> Any:
                return jax.lax.cond(idx >= 0, lambda b: b.at[idx].set(v), lambda b: b, buf)

            draws = jax.tree.map(update, draws, value)
            metrics = {k: jnp.mean(v) for k, v in info.items()}
            metrics["warmup"] = (i < self.num_warmup).astype(jnp.float32)
            return (carry, draws), metrics

        (carry, draws), metrics = jax.lax.scan(body, (carry, draws), jnp.arange(n))
        return carry, draws, metrics

    # StepBackend -------------------------------------------------------------------------------------------
    def train(self, batches: list[Any], step: int) -> dict[str, Any]:
        n = len(batches)
        self.carry, self.draws_buf, metrics = self._chunk(self.carry, self.draws_buf, self.keys, jnp.int32(step), n)
        self.step = step + n
        return metrics if n > 1 else {k: v[0] for k, v in metrics.items()}

    def filled(self) -> int:
        return max(0, min(self.setup.kept, (self.step - self.start_idx) // self.thinning))

    def draws(self) -> dict[str, np.ndarray]:
        """The draws kept so far, ``(chains, draws, ...)`` by site."""
        z = jax.device_get(self.draws_buf[0])
        m = self.filled()
        return {k: np.swapaxes(np.asarray(v), 0, 1)[:, :m] for k, v in z.items()}

    def chain_divergences(self) -> np.ndarray | None:
        """Divergences after warm-up per chain so far ``(chains,)``, or ``None`` while the latest chunk runs."""
        divergences = self.carry.divergences
        return np.asarray(divergences) if getattr(divergences, "is_ready", lambda: True)() else None

    def chain_stats(self) -> dict[str, np.ndarray] | None:
        """Each chain's step size and mean acceptance rate of the phase so far; ``None`` while the latest chunk
        runs. (Its tree depth is kept with each draw, in ``sample_stats``.)"""
        c = self._carry
        if c is None:
            return {}
        if not getattr(c.accept_sum, "is_ready", lambda: True)():
            return None
        seen = self.step if self.step <= self.num_warmup else self.step - self.num_warmup
        accept = np.asarray(c.accept_sum, np.float64) / max(seen, 1)
        return {"step size": np.atleast_1d(np.asarray(c.adapt.step_size)), "accept": np.atleast_1d(accept)}

    def sample_stats(self) -> dict[str, np.ndarray]:
        """The kept draws' sampler statistics, ``(chains, draws)`` by name."""
        z = jax.device_get(self.draws_buf[1])
        m = self.filled()
        return {k: np.swapaxes(np.asarray(v), 0, 1)[:, :m] for k, v in z.items()}

    def divergences(self) -> int:
        return int(np.asarray(jax.device_get(self.carry.divergences)).sum())

    def adapted(self) -> dict[str, Any]:
        """Each chain's step size and inverse mass matrix (the adapted ones once warm-up is over)."""
        a = jax.device_get(self.carry.adapt)
        return {"step_size": np.asarray(a.step_size), "inverse_mass_matrix": np.asarray(a.inverse_mass_matrix)}

    def bound_model(self) -> Any:
        return self.setup.model_op.bind(Posterior(self.draws()))

    def state_tree(self) -> dict[str, Any]:
        return {
            "sampler": {f"{i:03d}": x for i, x in enumerate(jax.tree.leaves(self.carry))},
            "draws": self.draws_tree(),
            "step": np.asarray(self.step, np.int32),
            "config": self.digest,
        }

    def load_state_tree(self, tree: Any) -> None:
        check_digest(tree["config"], self.digest, self.loop.name or "stage")
        s, d = tree["sampler"], tree["draws"]
        self.carry = jax.tree.unflatten(self.treedef, [jnp.asarray(s[k]) for k in sorted(s)])
        self.draws_buf = jax.tree.unflatten(self.draws_def, [jnp.asarray(d[k]) for k in sorted(d)])
        self.step = int(np.asarray(tree["step"]))

    def draws_tree(self) -> dict[str, Any]:
        return {f"{i:03d}": x for i, x in enumerate(jax.tree.leaves(self.draws_buf))}

    def weights_tree(self) -> dict[str, Any]:
        return {"draws": self.draws_tree()}

    def load_weights_tree(self, tree: Any) -> None:
        raise NotImplementedError("init_from is refused before a sampler stage starts")


def check(loop: Any, incoming: Any, stage: str) -> None:
    """The stage's pre-flight: the kernel, iterations, data against the model's sites, the hand-off."""
    prepare(loop, incoming, stage, KERNELS)


def build(loop: Any) -> Any:
    """The model before sampling: no draws yet."""
    return loop.model_op.bind(Posterior({}))


def start(loop: Any, model: Any, incoming: Any) -> BlackjaxBackend:
    """The stage's `BlackjaxBackend`, from the previous stage's posterior or guide median when it handed one over."""
    return BlackjaxBackend(loop, prepare(loop, incoming, stage_name(loop, incoming), KERNELS, check=False))


def info() -> dict[str, Any]:
    import blackjax
    import numpyro

    return {
        "backend": "blackjax",
        "blackjax": blackjax.__version__,
        "numpyro": numpyro.__version__,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "precision": precision(),
    }
