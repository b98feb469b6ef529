"""The compiled train and eval steps of the Flax backend: NNX's functional API inside one `jax.jit` we own.

The module is split once (``nnx.split``) into its graph definition (static), its params, its other variables
(BatchNorm statistics) and its RNG streams; the state crosses the `jax.jit` boundary as flat lists of arrays. A step
merges a module from them (``nnx.merge``, training mode), reseeds every RNG stream from ``fold_in(key, step)`` so
dropout masks are a function of ``(seed, step)`` (exact on resume, whatever the streams' counters said), runs the
loss under `jax.grad`, reads the updated statistics back (``nnx.split``) and applies the optax update; the EMA
follows. Nothing mutable outlives a step, so ``n > 1`` steps run in one dispatch with `lax.scan`. With
``TrainingLoop.precision`` the params and the input are cast to the compute dtype inside the differentiated function
(the gradient comes back float32); ``TrainingLoop.mesh`` compiles the same chunk with the batch split over the
devices and the state replicated (`sharded_train_chunk`).

The chunks are `jax.jit`\\ s cached by the graph definition, the loss and the optimizer (hashable), bound once per
configuration (`bound_train_chunk`), so a second stage or run with the same structure compiles nothing new and a
dispatch passes arrays only.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pipekit_train.backends.kit import ema_decay
from pipekit_train.losses import split_loss_output
from pipekit_train.optim import schedule_value, step_context
from pipekit_train.scale import cast_floating

from ._tree import merged

State = tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array]]  # params, rest, opt_state, ema


class Layout(NamedTuple):
    """How the flat lists rebuild the module and the optimizer state: the module's graph definition and the states'
    tree definitions."""

    graphdef: Any
    params: Any
    rest: Any
    rngs: Any
    opt_state: Any


class Static:
    """A `jax.jit` static argument with its hash computed once, compared by identity first.

    JAX hashes and compares static arguments on every call; a `Layout` holds the module's graph definition, whose
    hash walks the graph. `static_arg` gives one wrapper per value, so a dispatch costs a pointer comparison.
    """

    __slots__ = ("_hash", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and (self.value is other.value or bool(self.value == other.value))


@functools.lru_cache(maxsize=256)
def static_arg(value: Any) -> Static:
    """The one `Static` wrapper of `value` (and of every value equal to it) in this process."""
    return Static(value)


class Spec(NamedTuple):
    """What a batch's loss is: `loss` on ``model(batch[input_key])`` against ``batch[target_key]``, computed in
    `compute` (``TrainingLoop.precision``; ``None``: float32)."""

    loss: Any
    input_key: str
    target_key: str
    aux_prefix: str
    compute: str | None = None


def reseed(module: Any, key: jax.Array) -> None:
    """Every RNG stream of `module` set to ``fold_in(key, i)`` (its i-th stream in graph order), its count to 0."""
    streams = [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)]
    for i, stream in enumerate(streams):
        stream.key[...] = jax.random.fold_in(key, i)
        stream.count[...] = jnp.zeros_like(stream.count[...])


def _loss(
    layout: Layout, spec: Spec, params: list[Any], rest: list[Any], rngs: list[Any], batch: dict[str, Any], key: Any
) -> tuple[jax.Array, tuple[dict[str, Any], list[Any]]]:
    training = key is not None
    low = spec.compute  # mixed precision: the float32 params are cast inside the differentiated function
    module = merged(
        layout.graphdef,
        jax.tree.unflatten(layout.params, cast_floating(params, low)),
        jax.tree.unflatten(layout.rngs, rngs),
        jax.tree.unflatten(layout.rest, rest),  # statistics stay float32: NNX updates them in place, in their dtype
        training,
    )
    if training:
        reseed(module, key)
    predicted = module(cast_floating(batch[spec.input_key], low))  # the input is cast, the target is not
    total, aux = split_loss_output(spec.loss(predicted, batch[spec.target_key]))
    if low is not None:
        total, aux = total.astype(jnp.float32), cast_floating(aux, "float32")
    metrics = {"loss": total}
    for name, value in aux.items():
        metrics[f"{spec.aux_prefix}{name}"] = value
    _, *states = nnx.split(module, nnx.Param, nnx.RngState, ...)
    return total, (metrics, jax.tree.leaves(states[2]))


def _one(
    state: State,
    rngs: list[Any],
    batch: dict[str, Any],
    step: jax.Array,
    base_key: jax.Array,
    layout: Layout,
    spec: Spec,
    optimizer: optax.GradientTransformation,
    ema_config: tuple[Any, bool] | None,
) -> tuple[State, dict[str, Any]]:
    params, rest, opt_leaves, ema = state
    # The optimizer state crosses the `jax.jit` boundary as its leaves, as the params do: its optax and `Hyperparams`
    # nodes are pytree classes that JAX flattens (in) and rebuilds (out) in Python at every call, ~4 µs of a small
    # MLP's one-step call.
    opt_state = jax.tree.unflatten(layout.opt_state, opt_leaves)
    key = jax.random.fold_in(base_key, step)
    # The loss and the EMA read the traced step through the context: every `Schedule` they read comes back as a
    # ``schedule/<name>`` metric.
    with step_context(step) as ctx:
        grads, (metrics, rest) = jax.grad(lambda p: _loss(layout, spec, p, rest, rngs, batch, key), has_aux=True)(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if ema_config is not None:
            decay, warmup = ema_config
            d = ema_decay(jnp.asarray(schedule_value(decay, "ema_decay"), jnp.float32), warmup, step)
            ema = [d * e + (1.0 - d) * p for e, p in zip(ema, params)]
    return (list(params), list(rest), jax.tree.leaves(opt_state), ema), {**metrics, **ctx.metrics()}


def _train_chunk(
    state: State,
    rngs: list[Any],
    batches: dict[str, Any],
    step: jax.Array,
    base_key: jax.Array,
    *,
    layout: Static,
    spec: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[float, bool] | None,
) -> tuple[State, dict[str, Any]]:
    """``n`` optimizer steps from `step` (`batches` stacked along a leading axis when ``n > 1``); the state is
    donated and returned updated, with the metrics (a leading axis ``n`` when ``n > 1``). `layout` and `spec` are
    the `Layout` and `Spec` wrapped by `static_arg`; `rngs` the RNG streams' state as leaves."""
    one = functools.partial(
        _one,
        rngs=rngs,
        base_key=base_key,
        layout=layout.value,
        spec=spec.value,
        optimizer=optimizer,
        ema_config=ema_config,
    )
    # Device-resident data (`pipekit_train.data.DeviceWindow`): the chunk slices its own batches, all n at once.
    window: Any = batches if hasattr(batches, "stacked") else None
    if n == 1:
        return one(state, batch=window.take(0) if window is not None else batches, step=step)

    def body(carry: tuple[State, jax.Array], batch: dict[str, Any]) -> Any:
        s, i = carry
        s, m = one(s, batch=batch, step=i)
        return (s, i + 1), m

    xs = window.stacked(n) if window is not None else batches
    (state, _), metrics = jax.lax.scan(body, (state, step), xs)
    return state, metrics


#: The unsharded chunks (`bound_train_chunk`), one `jax.jit` per static configuration.
_BOUND: dict[Any, Any] = {}


def bound_train_chunk(
    *,
    layout: Static,
    spec: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[float, bool] | None,
) -> Any:
    """The unsharded chunk (`_train_chunk`) with its static configuration bound: ``fn(state, rngs, batches, step,
    base_key)``, the state donated. Cached by the configuration (a second stage compiles nothing new); the adapter
    binds it once per chunk length, so a dispatch passes arrays only (JAX hashes and compares static arguments at
    every call)."""
    key = (layout, spec, optimizer, n, ema_config)
    fn = _BOUND.get(key)
    if fn is None:
        fn = _BOUND[key] = jax.jit(_chunk_body(layout, spec, optimizer, n, ema_config), donate_argnums=(0,))
    return fn


def _chunk_body(layout: Static, spec: Static, optimizer: optax.GradientTransformation, n: int, ema_config: Any) -> Any:
    """`_train_chunk` with its static configuration bound: what `bound_train_chunk` and `sharded_train_chunk`
    compile."""
    return functools.partial(_train_chunk, layout=layout, spec=spec, optimizer=optimizer, n=n, ema_config=ema_config)


#: The data-parallel chunks (`sharded_train_chunk`), one `jax.jit` per mesh and static configuration.
_SHARDED: dict[Any, Any] = {}


def sharded_train_chunk(
    plan: Any,
    *,
    layout: Static,
    spec: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[float, bool] | None,
) -> Any:
    """`bound_train_chunk` on `plan`'s mesh (``TrainingLoop.mesh``, data parallel): ``fn(state, rngs, batches, step,
    base_key)`` with the batch split along ``data`` (axis 1 of stacked batches) and everything else replicated; the
    state is donated. Cached by the mesh and the static configuration: a second stage compiles nothing new."""
    key = (plan, layout, spec, optimizer, n, ema_config)
    fn = _SHARDED.get(key)
    if fn is None:
        rep = plan.replicated
        fn = _SHARDED[key] = jax.jit(
            _chunk_body(layout, spec, optimizer, n, ema_config),
            in_shardings=(rep, rep, plan.batch(stacked=n > 1), rep, rep),
            out_shardings=(rep, rep),
            donate_argnums=(0,),
        )
    return fn


@functools.partial(jax.jit, static_argnames=("layout", "spec"))
def eval_batch(
    params: list[Any], rest: list[Any], rngs: list[Any], batch: dict[str, Any], *, layout: Static, spec: Static
) -> dict[str, Any]:
    """Metrics of one batch in inference mode (``eval()``: dropout off, running statistics), no gradients."""
    return _loss(layout.value, spec.value, params, rest, rngs, batch, None)[1][0]
