"""The ``numpyro-mcmc`` adapter: NumPyro's NUTS/HMC kernels stepped in chunks by the engine.

The chunk body is NumPyro's own ``fori_collect`` body (sample, then write the post-processed draw at
``(i - start) // thinning``), jitted on its own inside the chunk's ``lax.scan`` as NumPyro jits it inside its
``fori_loop``, so one chunk of ``num_warmup + num_samples`` iterations gives bitwise the draws of
``MCMC(..., chain_method="vectorized").run``, for one chain and for vectorized chains;
the sampler state (adaptation included, and each chain's PRNG key)
and the draw buffer are the checkpoint, so a resumed run continues bitwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipekit_train.adapters.bayes import (
    HMC,
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


def numpyro_kernel(model_fn: Any, kernel: Any, init_values: dict[str, Any] | None = None) -> Any:
    """The NumPyro kernel object a `NUTS`/`HMC` operator describes."""
    import numpyro.infer as infer

    common = dict(
        target_accept_prob=kernel.target_accept_prob,
        dense_mass=kernel.dense_mass,
        step_size=kernel.step_size,
        init_strategy=init_strategy(kernel, init_values),
    )
    if isinstance(kernel, NUTS):
        return infer.NUTS(model_fn, max_tree_depth=kernel.max_tree_depth, **common)
    return infer.HMC(model_fn, num_steps=kernel.num_steps, trajectory_length=kernel.trajectory_length, **common)


def tree_depth(n_steps: np.ndarray) -> np.ndarray:
    """NUTS's tree depth from its leapfrog steps: NumPyro's iterative NUTS doubles the trajectory `d` times and
    stops the last doubling early (at a U-turn or divergence) after at least one step, so a tree of depth `d` takes
    between ``2**(d-1)`` and ``2**d - 1`` steps: ``d = floor(log2(n_steps)) + 1`` (Stan's ``treedepth__``)."""
    steps = np.maximum(np.asarray(n_steps, np.int64), 1)
    return (np.floor(np.log2(steps)).astype(np.int64) + 1).astype(np.int64)


class _Program:
    """The jitted chunk shared by the runs of one sampler program, and the backend whose kernel it samples with."""

    def __init__(self, first: MCMCBackend) -> None:
        self.first = first
        self.chunk = jax.jit(first._chunk_impl, static_argnums=3)


class MCMCBackend(SamplerControls):
    """The `StepBackend` of ``numpyro-mcmc``: one engine step is one iteration of every chain."""

    def __init__(self, loop: Any, setup: SamplerSetup) -> None:
        self.loop = loop
        self.setup = setup
        k = setup.kernel
        self.chains = k.num_chains
        self.num_warmup = k.num_warmup
        self.thinning = k.thinning
        self.total = k.num_warmup + setup.num_samples
        self.start_idx = k.num_warmup + setup.num_samples % k.thinning  # NumPyro's fori_collect
        self.model_kwargs = setup.model_op.model_kwargs(setup.data)
        self.kernel = numpyro_kernel(setup.model_op.fn, k, setup.init_values)
        self.digest = config_digest(loop.task, setup.model_op)
        self.step = 0
        self._state: Any = None
        # Runs of the same program (a resumed run, a reference run) share one trace and compilation: the chunk of
        # the first backend built for it, whose kernel it samples with (initialised here).
        program = cached_program(program_key("numpyro-mcmc", setup), lambda: _Program(self))
        self._chunk = program.chunk
        if program.first is self:
            self.state = self._initial()
        # Another run's state has the same structure: this run's initial state is computed when first needed (a
        # resumed or extended stage replaces it; NumPyro compiles its search for a valid initial point per run).
        first = program.first
        self.treedef = first.treedef
        self.collection = jax.tree.map(np.zeros_like, first.collection)
        self.coll_def = jax.tree.structure(self.collection)

    def _initial(self) -> Any:
        """The initial sampler state of this run's seed (``kernel.init``)."""
        key = jax.random.PRNGKey(self.loop.seed)
        if self.chains > 1:
            key = jax.random.split(key, self.chains)
        state = self.kernel.init(key, self.num_warmup, None, (), self.model_kwargs)
        post = self.kernel.postprocess_fn((), self.model_kwargs)
        self._post = jax.vmap(post) if self.chains > 1 else post
        if not hasattr(self, "treedef"):  # the first backend of a program: its state and draws set the layout
            self.treedef = jax.tree.structure(state)
            # Host zeros of the shapes `_transform` gives (traced abstractly: no eager program to compile); the
            # first chunk takes them as its input like device zeros (same shapes and dtypes: the same program).
            kept = self.setup.kept
            layout = jax.eval_shape(self._transform, state)
            self.collection = jax.tree.map(lambda x: np.zeros((kept, *x.shape), x.dtype), layout)
        return state

    @property
    def state(self) -> Any:
        """Every chain's NumPyro sampler state; the initial one is computed on first use."""
        if self._state is None:
            self._state = self._initial()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value

    def _transform(self, state: Any) -> list[Any]:
        """What every kept draw records: the constrained sites, divergence, and the sampler's statistics (ArviZ's
        ``sample_stats`` names; NumPyro keeps no tree depth, only the leapfrog steps)."""
        stats = {
            "lp": -state.potential_energy,
            "energy": state.energy,
            "acceptance_rate": state.accept_prob,
            "step_size": state.adapt_state.step_size,
            "n_steps": state.num_steps,
        }
        return [self._post(state.z), state.diverging, stats]

    def _iteration(self, i: Any, state: Any, collection: Any) -> Any:
        """One iteration, NumPyro's ``fori_collect`` body: sample, then write the draw at ``(i - start) // thinning``.

        Jitted on its own inside the chunk, as NumPyro jits its ``_body_fn`` inside the ``fori_loop``: the data the
        kernel closes over are then literals of this inner program, which XLA constant-folds (``log(sigma)``, ...)
        exactly as in ``MCMC.run``. Inlined into the scan body, JAX would hoist them into loop-carried operands that
        are computed at run time instead; the compile-time and run-time values can differ in the last bit, and NUTS
        turns one bit into different draws (single-chain eight schools: every draw). See design/numpyro_adapter.md.
        """
        state = self.kernel.sample(state, (), self.model_kwargs)
        idx = (i - self.start_idx) // self.thinning

        def update(c: Any, v: Any) -> Any:
            return jax.lax.cond(idx >= 0, lambda c: c.at[idx].set(v), lambda c: c, c)

        return state, jax.tree.map(update, collection, self._transform(state))

    def _chunk_impl(self, state: Any, collection: Any, first: Any, n: int) -> Any:
        iteration = jax.jit(self._iteration)

        def body(carry: Any, j: Any) -> Any:
            i = first + j
            state, collection = iteration(i, *carry)
            metrics = {
                "loss": jnp.mean(state.potential_energy),
                "accept_prob": jnp.mean(state.accept_prob),
                "mean_accept_prob": jnp.mean(state.mean_accept_prob),
                "step_size": jnp.mean(state.adapt_state.step_size),
                "diverging": jnp.mean(state.diverging.astype(jnp.float32)),
                "num_steps": jnp.mean(state.num_steps.astype(jnp.float32)),
                "warmup": (i < self.num_warmup).astype(jnp.float32),
            }
            return (state, collection), metrics

        (state, collection), metrics = jax.lax.scan(body, (state, collection), jnp.arange(n))
        return state, collection, metrics

    # StepBackend -------------------------------------------------------------------------------------------
    def train(self, batches: list[Any], step: int) -> dict[str, Any]:
        n = len(batches)
        self.state, self.collection, metrics = self._chunk(self.state, self.collection, jnp.int32(step), n)
        self.step = step + n
        return metrics if n > 1 else {k: v[0] for k, v in metrics.items()}

    def filled(self) -> int:
        return max(0, min(self.setup.kept, (self.step - self.start_idx) // self.thinning))

    def draws(self) -> dict[str, np.ndarray]:
        """The draws kept so far, ``(chains, draws, ...)`` by site."""
        z = jax.device_get(self.collection[0])
        m = self.filled()
        if self.chains > 1:
            return {k: np.swapaxes(np.asarray(v), 0, 1)[:, :m] for k, v in z.items()}
        return {k: np.asarray(v)[None, :m] for k, v in z.items()}

    def divergences(self) -> int:
        return int(np.asarray(jax.device_get(self.collection[1]))[: self.filled()].sum())

    def chain_divergences(self) -> np.ndarray | None:
        """Divergences after warm-up per chain so far ``(chains,)``, or ``None`` while the latest chunk runs (read
        on the host: no program to compile, no wait for the device)."""
        diverging = self.collection[1]
        if not getattr(diverging, "is_ready", lambda: True)():
            return None
        counts = np.asarray(diverging)[: self.filled()].sum(axis=0)
        return np.atleast_1d(counts)

    def chain_stats(self) -> dict[str, np.ndarray] | None:
        """Each chain's latest step size, mean acceptance rate of the phase and (NUTS) tree depth, from the sampler
        state; ``None`` while the latest chunk runs."""
        state = self._state
        if state is None:
            return {}
        if not getattr(state.num_steps, "is_ready", lambda: True)():
            return None
        out = {
            "step size": np.atleast_1d(np.asarray(state.adapt_state.step_size)),
            "accept": np.atleast_1d(np.asarray(state.mean_accept_prob)),
        }
        if isinstance(self.setup.kernel, NUTS):
            out["tree depth"] = tree_depth(np.atleast_1d(np.asarray(state.num_steps)))
        return out

    def sample_stats(self) -> dict[str, np.ndarray]:
        """The kept draws' sampler statistics, ``(chains, draws)`` by name (``diverging`` included)."""
        stats = {"diverging": self.collection[1], **self.collection[2]}
        m = self.filled()
        out = {}
        for k, v in jax.device_get(stats).items():
            a = np.asarray(v)[:m]
            out[k] = np.swapaxes(a, 0, 1) if self.chains > 1 else a[None]
        if isinstance(self.setup.kernel, NUTS):
            out["tree_depth"] = tree_depth(out["n_steps"])
        return out

    def bound_model(self) -> Any:
        return self.setup.model_op.bind(Posterior(self.draws()))

    def state_tree(self) -> dict[str, Any]:
        leaves = jax.tree.leaves(self.state)
        return {
            "sampler": {f"{i:03d}": x for i, x in enumerate(leaves)},
            "draws": self.draws_tree(),
            "config": self.digest,
        }

    def draws_tree(self) -> dict[str, Any]:
        return {f"{i:03d}": x for i, x in enumerate(jax.tree.leaves(self.collection))}

    def load_state_tree(self, tree: Any) -> None:
        check_digest(tree["config"], self.digest, self.loop.name or "stage")
        s = tree["sampler"]
        self.state = jax.tree.unflatten(self.treedef, [jnp.asarray(s[k]) for k in sorted(s)])
        d = tree["draws"]
        self.collection = jax.tree.unflatten(self.coll_def, [jnp.asarray(d[k]) for k in sorted(d)])
        i = np.asarray(self.state.i).reshape(-1)[0]
        self.step = int(i)

    def weights_tree(self) -> dict[str, Any]:
        return {"draws": self.draws_tree()}

    def load_weights_tree(self, tree: Any) -> None:
        raise NotImplementedError("init_from is refused before a sampler stage starts")


def check(loop: Any, incoming: Any, stage: str) -> None:
    """The stage's pre-flight: the kernel, iterations, data against the model's sites, the hand-off."""
    prepare(loop, incoming, stage, (NUTS, HMC))


def build(loop: Any) -> Any:
    """The model before sampling: no draws yet."""
    return loop.model_op.bind(Posterior({}))


def start(loop: Any, model: Any, incoming: Any) -> MCMCBackend:
    """The stage's `MCMCBackend`, from the previous stage's posterior or guide median when it handed one over."""
    return MCMCBackend(loop, prepare(loop, incoming, stage_name(loop, incoming), (NUTS, HMC), check=False))


def info() -> dict[str, Any]:
    import numpyro

    return {
        "backend": "numpyro-mcmc",
        "numpyro": numpyro.__version__,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "precision": precision(),
    }
