"""The ``numpyro-svi`` adapter: NumPyro's `SVI` with the project's optax recipe, stepped by the engine.

Mini-batches come from the engine (so checkpoints hold the data position); the observed sites' log-likelihood is
scaled by ``num_records / batch_size`` (priors are not), so each step's loss estimates the whole data's negative
ELBO. The logged ``loss`` is that estimate divided by the number of records. The SVI state (unconstrained
parameters, optax state, step count, PRNG key) is the checkpoint, so a resumed run continues bitwise.

Data parallel (`TrainingLoop.mesh`, docs/scale.md): with more than one local device the SVI state is replicated on a
one-axis ``data`` mesh and each step's global batch is split along it; the step is the same function compiled with
explicit shardings, and XLA all-reduces the ELBO's gradient (a sum over the records in the plate).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError, PipekitError
from pipekit_train.adapters.bayes import (
    GuideParams,
    NumpyroGuide,
    check_data,
    check_sites,
    data_origin,
    describe_error,
    full_data,
    guide_factory,
    trace_abstract_first,
)
from pipekit_train.backends import StepBackend
from pipekit_train.backends.kit import LearningRateLog, build_optimizer, set_lr_scale
from pipekit_train.data import DataFile
from pipekit_train.scale import mesh_plan

from ._elbo import _ELBO

SCALE = "_pipekit_obs_scale"


def _scaled(fn: Any) -> Any:
    """`fn` with its observed sites' log-likelihood multiplied by the keyword argument `SCALE`."""
    from numpyro.primitives import Messenger

    class ScaleObserved(Messenger):  # type: ignore[misc]  # NumPyro is untyped: Messenger is Any
        def __init__(self, scale: Any) -> None:
            self.scale = scale
            super().__init__()

        def process_message(self, msg: dict[str, Any]) -> None:
            if msg["type"] == "sample" and msg.get("is_observed"):
                msg["scale"] = self.scale if msg.get("scale") is None else msg["scale"] * self.scale

    def model(**kwargs: Any) -> Any:
        scale = kwargs.pop(SCALE, 1.0)
        with ScaleObserved(scale):
            return fn(**kwargs)

    return model


def _guide_for(op: NumpyroGuide, model: Any) -> Any:
    guide = op.make_guide(model)
    if op.guide.startswith("Auto"):
        return guide

    def wrapped(**kwargs: Any) -> Any:  # a hand-written guide never sees the scale argument
        kwargs.pop(SCALE, None)
        return guide(**kwargs)

    return wrapped


def check(loop: Any, incoming: Any, stage: str) -> None:
    """The stage's pre-flight: the ELBO, the data against the model's sites, the hand-off from `incoming`, and the
    guide and the model traced abstractly on a few records, compiling nothing (a guide that does not fit the model
    is one line, now)."""
    op = loop.model_op
    if not isinstance(loop.loss, _ELBO):
        raise ConfigError(
            f"stage {stage!r} (backend 'numpyro-svi') needs an ELBO as its loss (loss: {{type: Trace_ELBO}} or "
            f"TraceMeanField_ELBO), got {loop.loss!r}"
        )
    if loop.task is not None:
        raise ConfigError(f"stage {stage!r}: numpyro-svi takes no task; the guide is NumpyroGuide.guide")
    if loop.transfer is not None:
        raise ConfigError(f"stage {stage!r}: numpyro-svi takes no `transfer`")
    if isinstance(loop.dataset.source, DataFile):
        raise ConfigError(
            f"stage {stage!r}: numpyro-svi fits on mini-batches of records, and a DataFile is one record of named "
            f"values ({loop.dataset.source.path!r}); sample it with numpyro-mcmc or blackjax, or give SVI an NpzSource "
            "of records"
        )
    data = full_data(loop.dataset)
    check_data(op, data, stage, data_origin(loop.dataset))
    check_sites(op, data, stage)
    for role, ds in (("val_dataset", loop.val_dataset), ("test_dataset", loop.test_dataset)):
        if ds is not None:
            check_data(op, full_data(ds), f"{stage}.{role}")
    previous = getattr(incoming, "model", None)
    if previous is not None and not (isinstance(previous, NumpyroGuide) and previous.replace() == op.replace()):
        raise ConfigError(
            f"stage {stage!r} (backend 'numpyro-svi') fits {op!r} but the previous stage produced {previous!r}; "
            "an SVI stage continues only the same model and guide"
        )
    _check_guide(op, data, stage, _start_point(incoming))


def _start_point(incoming: Any) -> Any:
    """The previous stage's guide parameters (the same guide, checked in pre-flight), or ``None``: start fresh."""
    previous = getattr(incoming, "model", None)
    return previous.params if previous is not None and previous.module is not None else None


def build(loop: Any) -> Any:
    """The guide before fitting (no parameters yet: SVI initialises them in `start`)."""
    return loop.model_op.bind(GuideParams({}))


def start(loop: Any, model: Any, incoming: Any) -> SVIBackend:
    """The stage's `SVIBackend`, continuing the previous stage's guide parameters when it handed one over."""
    return SVIBackend(loop, loop.model_op, full_data(loop.dataset), _start_point(incoming))


def info() -> dict[str, Any]:
    import numpyro

    return {
        "backend": "numpyro-svi",
        "numpyro": numpyro.__version__,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
    }


def _check_guide(op: NumpyroGuide, data: dict[str, Any], stage: str, init: Any) -> None:
    """Trace the guide and the model replayed on it once on a few records: a guide that does not fit the model is
    one line, now.

    The traces are taken abstractly (`jax.eval_shape`: the sites' names and shapes, no numbers), so the check compiles
    nothing; run eagerly, each of the guide's initialisation and the model's operations compiled a program of its
    own (104 for the logistic-regression example's AutoNormal, 3.2 s of its first stage's 18). As the model's own
    trace (`trace_abstract_first`): a guide or model that cannot be traced so is traced eagerly, as before, and a
    failure there is the refusal's error."""
    from numpyro import handlers

    model = _scaled(op.fn)
    guide = _guide_for(op, model)
    small = {k: v[: min(len(v), 4)] for k, v in data.items()}
    kwargs = op.model_kwargs(small)
    sites: dict[str, Any] = {}

    def traces() -> None:
        with handlers.block():
            seeded = handlers.seed(guide, jax.random.PRNGKey(0))
            sites["guide"] = handlers.trace(seeded).get_trace(**kwargs)
            replayed = handlers.replay(handlers.seed(model, jax.random.PRNGKey(0)), sites["guide"])
            sites["model"] = handlers.trace(replayed).get_trace(**kwargs)

    try:
        trace_abstract_first(traces)
    except Exception as e:
        raise ConfigError(
            f"stage {stage!r}: guide {op.guide!r} does not fit model {op.model!r}: {describe_error(e)}"
        ) from None
    g_trace, m_trace = sites["guide"], sites["model"]
    latent = {n for n, s in m_trace.items() if s["type"] == "sample" and not s.get("is_observed")}
    guided = {n for n, s in g_trace.items() if s["type"] == "sample" and not s.get("infer", {}).get("is_auxiliary")}
    missing, extra = sorted(latent - guided), sorted(guided - latent - {n for n in m_trace})
    if missing or extra:
        raise ConfigError(
            f"stage {stage!r}: guide {op.guide!r} does not fit model {op.model!r}: "
            + (f"it has no sample site for the latent(s) {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"it samples {extra}, which the model does not have" if extra else "")
        )


class Programs(NamedTuple):
    """The jitted functions of one SVI structure: ``step(state, batch, scale)``, ``chunk(state, batches, scale)``
    (a `lax.scan` of steps over stacked batches) and ``evaluate(state, batch, scale)``."""

    step: Any
    chunk: Any
    evaluate: Any


#: The compiled programs, one `Programs` per structure (`compiled_programs`); the oldest go past `_MAX_PROGRAMS`.
_PROGRAMS: dict[Hashable, Programs] = {}
_MAX_PROGRAMS = 32


def compiled_programs(svi: Any, op: NumpyroGuide, loss: _ELBO, optimizer: Any, n: int, plan: Any) -> Programs:
    """The jitted step, chunk and eval of an SVI fit, shared by every fit of the same structure in this process.

    A `jax.jit` of a fresh function (a bound method of each backend) is a fresh cache: every fit compiled its
    programs again. The programs depend only on the structure: the model and guide (the unbound operator, its
    model function and its guide factory), the ELBO, the optimizer's structure (`StructuredOptimizer`: every
    number is in the state), the number of records (the loss is divided by it) and the mesh; jit's own cache adds
    the shapes and dtypes of the state and the batches. The first fit's `svi` is closed over and later fits of the
    same structure reuse its programs with their own state, which traces to the same computation (an autoguide's
    prototype holds the sites' shapes, and its initial values are replaced by the state's parameters), so results
    are bitwise those of a fresh compile.
    """
    key = (op.replace(), op.fn, guide_factory(op.guide), loss, optimizer, n, plan)
    programs = _PROGRAMS.get(key)
    if programs is not None:
        return programs

    def step(state: Any, batch: Any, scale: Any) -> Any:
        state, value = svi.update(state, **op.model_kwargs(batch), **{SCALE: scale})
        return state, {"loss": value / n}

    def chunk(state: Any, batches: Any, scale: Any) -> Any:
        return jax.lax.scan(lambda s, b: step(s, b, scale), state, batches)

    def evaluate(state: Any, batch: Any, scale: Any) -> Any:
        return {"loss": svi.evaluate(state, **op.model_kwargs(batch), **{SCALE: scale}) / n}

    if plan is None:
        programs = Programs(jax.jit(step), jax.jit(chunk), jax.jit(evaluate))
    else:
        rep = plan.replicated
        programs = Programs(
            jax.jit(step, in_shardings=(rep, plan.batch(False), rep), out_shardings=(rep, rep)),
            jax.jit(chunk, in_shardings=(rep, plan.batch(True), rep), out_shardings=(rep, rep)),
            jax.jit(evaluate),
        )
    while len(_PROGRAMS) >= _MAX_PROGRAMS:
        del _PROGRAMS[next(iter(_PROGRAMS))]
    _PROGRAMS[key] = programs
    return programs


class SVIBackend(StepBackend):
    """The `StepBackend` of ``numpyro-svi``: holds the SVI state between steps."""

    def __init__(self, loop: Any, op: NumpyroGuide, data: dict[str, np.ndarray], init: Any) -> None:
        from numpyro.infer import SVI
        from numpyro.optim import optax_to_numpyro

        self.loop = loop
        self.op = op
        self.n = len(next(iter(data.values())))
        model = _scaled(op.fn)
        self.guide = _guide_for(op, model)
        self.optimizer = build_optimizer(
            loop.optimizer_config, max_steps=loop.max_steps, grad_clip_norm=loop.grad_clip_norm, accum=loop.accum
        )
        self.svi = SVI(model, self.guide, optax_to_numpyro(self.optimizer), loss=loop.loss.numpyro())
        first = {k: v[: min(self.n, loop.batch_size)] for k, v in data.items()}
        init_params = {k: jnp.asarray(v) for k, v in init.items()} if init is not None else None
        self.state = self.svi.init(
            jax.random.PRNGKey(loop.seed), init_params=init_params, **op.model_kwargs(first), **{SCALE: 1.0}
        )
        self.treedef = jax.tree.structure(self.state)
        self.plan = mesh_plan(loop)  # None: one device, the unsharded steps
        self.state = self._placed(self.state)
        programs = compiled_programs(self.svi, op, loop.loss, self.optimizer, self.n, self.plan)
        self._step, self._chunk, self._eval = programs
        self._lr_log = LearningRateLog()  # what `learning_rate` logs, read from the optimizer state's leaves

    def optimizer_state(self) -> Any:
        """The SVI state the stage ends with (`TrainerCarryState.opt_state`)."""
        return self.state

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this fit."""
        return {
            "guide": self.op.guide,
            "elbo": type(self.loop.loss).__name__,
            "num_particles": self.loop.loss.num_particles,
            "num_params": int(sum(np.size(v) for v in self.params().values())),
            "likelihood_scale": self.n / min(self.loop.batch_size, self.n),
        }

    def _placed(self, state: Any) -> Any:
        """`state` replicated on the stage's mesh (as it is without one): what the sharded steps take."""
        return state if self.plan is None else jax.device_put(state, self.plan.replicated)

    # StepBackend -------------------------------------------------------------------------------------------
    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> dict[str, Any]:
        sizes = {len(next(iter(b.values()))) for b in batches}
        if len(batches) == 1 or len(sizes) > 1:
            out = []
            for b in batches:
                scale = np.float32(self.n / len(next(iter(b.values()))))
                before = self.state.optim_state
                self.state, m = self._step(self.state, b, scale)
                self._lr_log.stepped_trees(before, self.state.optim_state)
                out.append(m)
            return out[0] if len(out) == 1 else {k: jnp.stack([m[k] for m in out]) for k in out[0]}
        stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        metrics: dict[str, Any]
        before = self.state.optim_state
        self.state, metrics = self._chunk(self.state, stacked, np.float32(self.n / sizes.pop()))
        self._lr_log.stepped_trees(before, self.state.optim_state)
        return metrics

    def evaluate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        metrics: dict[str, Any] = self._eval(self.state, batch, np.float32(self.n / len(next(iter(batch.values())))))
        return metrics

    def params(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in jax.device_get(self.svi.get_params(self.state)).items()}

    def bound_model(self) -> Any:
        return self.op.bind(GuideParams(self.params()))

    def set_model(self, model_op: Any) -> None:
        raise PipekitError("numpyro-svi: replacing the guide's parameters from a callback is not supported")

    def get_lr_scale(self) -> float:
        # Not read from the state the chunk just returned (that waits for the chunk): `LearningRateLog.stepped`.
        return self._lr_log.scale(*jax.tree.flatten(self.state.optim_state))

    def set_lr_scale(self, value: float) -> None:
        self.state = self._placed(self.state._replace(optim_state=set_lr_scale(self.state.optim_state, value)))

    def learning_rate(self, step: int) -> float:
        leaves, treedef = jax.tree.flatten(self.state.optim_state)
        return self._lr_log.rate(self.loop.optimizer_config, self.loop.max_steps, step, leaves, treedef)

    def state_tree(self) -> dict[str, Any]:
        i, (params, opt) = self.state.optim_state
        rest = jax.tree.leaves((opt, self.state.mutable_state))
        return {
            "params": dict(params),
            "opt": {f"{j:03d}": x for j, x in enumerate(rest)},
            "step": jnp.asarray(i),
            "rng": self.state.rng_key,
        }

    def load_state_tree(self, tree: Mapping[str, Any]) -> None:
        _, (params, opt) = self.state.optim_state
        rest_def = jax.tree.structure((opt, self.state.mutable_state))
        o = tree["opt"]
        opt, mutable = jax.tree.unflatten(rest_def, [jnp.asarray(o[k]) for k in sorted(o)])
        params = {k: jnp.asarray(tree["params"][k]) for k in params}
        count = self.state.optim_state[0]
        i = jnp.asarray(tree["step"], dtype=jnp.result_type(count))
        if getattr(count, "weak_type", False):
            # NumPyro's step count is weakly typed (`jnp.array(0)`); a strongly typed one is another program's
            # argument: the step compiled again after a restore in the same process (a resume, an extension).
            i = jnp.asarray(int(i))
        self.state = self._placed(
            self.state._replace(optim_state=(i, (params, opt)), mutable_state=mutable, rng_key=jnp.asarray(tree["rng"]))
        )

    def weights_tree(self) -> dict[str, Any]:
        return {"params": self.state_tree()["params"]}

    def load_weights_tree(self, tree: Mapping[str, Any]) -> None:
        i, (params, opt) = self.state.optim_state
        params = {k: jnp.asarray(tree["params"][k]) for k in params}
        self.state = self._placed(self.state._replace(optim_state=(i, (params, opt))))
