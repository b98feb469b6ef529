"""The compiled train and eval steps of the Equinox adapter.

The model is partitioned once per stage into ``params`` (inexact arrays, trained), ``consts`` (other arrays) and
``static`` (everything else). The step is one `jax.jit` per static configuration (`bound_train_chunk`): ``static``,
the loss (or the static part of a task) and the optimizer are bound into it and key a module-level cache, so a second
stage (or a second run in the same process) with the same model structure, loss, optimizer and batch shapes
compiles nothing new. A task's arrays are arguments of the step, like the parameters. Parameters and optimizer
state are donated. ``n > 1`` runs ``n`` steps in one dispatch with `lax.scan` over stacked batches.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from pipekit_train.backends.kit import ema_decay
from pipekit_train.losses import split_loss_output
from pipekit_train.optim import schedule_value, step_context
from pipekit_train.scale import cast_floating

from ._primitives import task_loss
from ._recipe_step import diagnostics, sam_gradient

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Static:
    """A `jax.jit` static argument with its hash computed once.

    JAX hashes static arguments on every call; hashing an Equinox module's static tree walks it each time. The
    wrapper hashes once and compares by identity first, so a dispatch costs a pointer comparison.
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
    """The one `Static` wrapper of `value` (and of every value equal to it) in this process.

    JAX's compile cache keeps the static argument of the call that compiled and compares each later call's with
    it. With a fresh wrapper per stage the identity check fails, so every dispatch of a second stage or run in the
    process compares the Equinox trees (`Module.__eq__`: about a quarter of a small MLP's dispatch time); one
    wrapper per value keeps that comparison a pointer check.
    """
    return Static(value)


class StepLoss(eqx.Module):
    """What the compiled step specialises on: the loss, or the static part of a task, and the batch keys.

    Hashable and compared by value, so a second stage (or run) with an equal loss, or a task of the same
    structure, reuses the compiled step. A task's arrays are not here: the step receives them as arguments.
    """

    loss: Any = eqx.field(static=True)
    task: Any = eqx.field(static=True)
    task_def: Any = eqx.field(static=True)
    input_key: str = eqx.field(static=True)
    target_key: str = eqx.field(static=True)
    aux_prefix: str = eqx.field(static=True)
    #: The recipes' part of the step (`_recipe_step.StepRecipe`: SAM, diagnostics), or ``None``.
    recipe: Any = eqx.field(static=True, default=None)

    def __call__(
        self, model: Any, batch: dict[str, jax.Array], key: jax.Array, task_leaves: list[jax.Array]
    ) -> tuple[jax.Array, dict[str, Any]]:
        """The loss and the metrics of `model` on `batch`; `task_leaves` are the task's arrays."""
        if self.task is not None:
            task = eqx.combine(jax.tree.unflatten(self.task_def, task_leaves), self.task)
            return task_loss(task, model, batch, key)
        x = batch[self.input_key]
        keys = jax.random.split(key, x.shape[0])
        predicted = jax.vmap(lambda xi, ki: model(xi, key=ki))(x, keys)
        total, aux = split_loss_output(self.loss(predicted, batch[self.target_key]))
        metrics = {"loss": total}
        for name, value in aux.items():
            metrics[f"{self.aux_prefix}{name}"] = value
        return total, metrics


class TaskArrays:
    """The array leaves of a task (a teacher model, class weights), compared by identity.

    A `jax.jit` static argument must be hashable and is compiled into the program as constants; a task's arrays
    are neither hashable nor meant to be constants. They enter the compiled step as arguments, the way
    ``eqx.filter_jit`` treats them in `train_step`. Identity keeps two specs with different arrays apart.
    """

    __slots__ = ("leaves",)

    def __init__(self, leaves: list[Any]) -> None:
        # NumPy leaves become device arrays once here, not on every dispatch.
        self.leaves = [jnp.asarray(leaf) for leaf in leaves]

    def __hash__(self) -> int:
        return len(self.leaves)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TaskArrays)
            and len(self.leaves) == len(other.leaves)
            and all(a is b for a, b in zip(self.leaves, other.leaves))
        )


class LossSpec(eqx.Module):
    """How a batch becomes a loss: a `Loss` on ``model(batch[input_key])`` vs ``batch[target_key]``, or a task.

    Static (hashable) so it can be a `jax.jit` static argument. It holds the `StepLoss` the compiled step
    specialises on (wrapped once by `static_arg`) and the task's arrays (`TaskArrays`), which the step receives
    as arguments: a task may hold arrays, and a new task of the same structure compiles nothing new.
    """

    step_loss: Static = eqx.field(static=True)
    task_arrays: TaskArrays = eqx.field(static=True)

    def __init__(
        self, loss: Any, task: Any, input_key: str, target_key: str, aux_prefix: str, recipe: Any = None
    ) -> None:
        arrays, rest = eqx.partition(task, eqx.is_array)
        leaves, task_def = jax.tree.flatten(arrays)
        self.step_loss = static_arg(StepLoss(loss, rest, task_def, input_key, target_key, aux_prefix, recipe))
        self.task_arrays = TaskArrays(leaves)

    def __call__(self, model: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        """The loss and the metrics of `model` on `batch`."""
        step_loss: StepLoss = self.step_loss.value
        return step_loss(model, batch, key, self.task_arrays.leaves)


def partition(model: Any, trainable: Any = None) -> tuple[Any, Any, Any]:
    """Split a model into (params, consts, static): trained arrays, other arrays, everything else.

    The trained arrays are the inexact ones, or those `trainable` (a filter tree, `_lora.trainable`) marks.
    """
    params, rest = eqx.partition(model, eqx.is_inexact_array if trainable is None else trainable)
    consts, static = eqx.partition(rest, eqx.is_array)
    return params, consts, static


def combine(params: Any, consts: Any, static: Any) -> Any:
    return eqx.combine(params, consts, static)


def _ema_decay(decay: Any, warmup: bool, step: jax.Array) -> jax.Array:
    """`pipekit_train.backends.kit.ema_decay` of `decay`, which may be a `Schedule` (read through `schedule_value`:
    logged as ``schedule/ema_decay``)."""
    d: jax.Array = ema_decay(jnp.asarray(schedule_value(decay, "ema_decay"), jnp.float32), warmup, step)
    return d


def _one_step(
    params: Any,
    opt_state: Any,
    ema: Any,
    consts: Any,
    batch: dict[str, jax.Array],
    step: jax.Array,
    base_key: jax.Array,
    static: Any,
    spec: StepLoss,
    task_leaves: list[jax.Array],
    optimizer: optax.GradientTransformation,
    ema_config: tuple[Any, bool] | None,
    compute: str | None = None,
) -> tuple[Any, Any, Any, dict[str, jax.Array]]:
    key = jax.random.fold_in(base_key, step)

    def loss_of(p: Any) -> tuple[jax.Array, dict[str, Any]]:
        if compute is None:
            return spec(combine(p, consts, static), batch, key, task_leaves)
        # Mixed precision (`_precision`): the float32 parameters are cast inside the differentiated function, so
        # the gradient comes back through the cast in float32; the model input is cast, the target is not.
        model = combine(cast_floating(p, compute), cast_floating(consts, compute), static)
        low = dict(batch)
        if spec.input_key in low:
            low[spec.input_key] = cast_floating(low[spec.input_key], compute)
        total, aux = spec(model, low, key, task_leaves)
        return total.astype(jnp.float32), cast_floating(aux, "float32")

    grads, metrics = jax.grad(loss_of, has_aux=True)(params)
    recipe = spec.recipe
    if recipe is not None and recipe.sam is not None:
        grads = sam_gradient(loss_of, params, grads, *recipe.sam)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    if recipe is not None and recipe.diagnostics:
        metrics = {**metrics, **diagnostics(recipe, params, grads, updates)}
    params = eqx.apply_updates(params, updates)
    if ema_config is not None:
        d = _ema_decay(*ema_config, step)
        ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * p, ema, params)
    return params, opt_state, ema, metrics


class Layout(eqx.Module):
    """How the flat leaf lists the step passes around rebuild the trees (static, hashed once via `Static`).

    The train state crosses the `jax.jit` boundary as flat lists of arrays, not as Equinox modules: flattening a
    module tree in Python on every dispatch costs tens of microseconds per step for a small MLP.
    """

    static: Any = eqx.field(static=True)
    params: Any = eqx.field(static=True)
    opt_state: Any = eqx.field(static=True)
    ema: Any = eqx.field(static=True)
    consts: Any = eqx.field(static=True)


def _train_chunk_impl(
    state: tuple[list[jax.Array], list[jax.Array], list[jax.Array]],
    consts: list[jax.Array],
    task_leaves: list[jax.Array],
    batches: dict[str, jax.Array],
    step: jax.Array,
    base_key: jax.Array,
    *,
    layout: Static,
    spec: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[Any, bool] | None = None,
    compute: str | None = None,
) -> tuple[tuple[list[jax.Array], list[jax.Array], list[jax.Array]], dict[str, jax.Array]]:
    lay: Layout = layout.value
    loss_spec: StepLoss = spec.value
    params = jax.tree.unflatten(lay.params, state[0])
    opt_state = jax.tree.unflatten(lay.opt_state, state[1])
    ema = jax.tree.unflatten(lay.ema, state[2]) if ema_config is not None else None
    const_tree = jax.tree.unflatten(lay.consts, consts)
    static = lay.static

    def one(p: Any, o: Any, e: Any, batch: dict[str, jax.Array], s: jax.Array) -> tuple[Any, Any, Any, Any]:
        # The loss and the EMA read the traced step through the context (`_schedules`): every schedule they read
        # comes back as a `schedule/<name>` metric, computed from the step outside `jax.grad`.
        with step_context(s) as ctx:
            p, o, e, m = _one_step(
                p, o, e, const_tree, batch, s, base_key, static, loss_spec, task_leaves, optimizer, ema_config, compute
            )
        return p, o, e, {**m, **ctx.metrics()}

    # Device-resident data (`data._device.DeviceWindow`): the chunk slices its own batches, all n at once.
    window: Any = batches if hasattr(batches, "stacked") else None
    if n == 1:
        batch = window.take(0) if window is not None else batches
        params, opt_state, ema, metrics = one(params, opt_state, ema, batch, step)
    else:

        def body(carry: tuple[Any, Any, Any, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, Any]:
            p, o, e, s = carry
            p, o, e, m = one(p, o, e, batch, s)
            return (p, o, e, s + 1), m

        xs = window.stacked(n) if window is not None else batches
        (params, opt_state, ema, _), metrics = jax.lax.scan(body, (params, opt_state, ema, step), xs)
    new_state = (jax.tree.leaves(params), jax.tree.leaves(opt_state), jax.tree.leaves(ema) if ema is not None else [])
    return new_state, metrics


#: The unsharded chunks (`bound_train_chunk`), one `jax.jit` per static configuration.
_BOUND_STEPS: dict[tuple[Any, ...], Any] = {}


def _chunk_body(
    layout: Static,
    step_loss: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[Any, bool] | None,
    compute: str | None,
) -> Any:
    """`_train_chunk_impl` with its static configuration bound: what `bound_train_chunk` and `sharded_train_chunk`
    compile."""
    return functools.partial(
        _train_chunk_impl,
        layout=layout,
        spec=step_loss,
        optimizer=optimizer,
        n=n,
        ema_config=ema_config,
        compute=compute,
    )


def bound_train_chunk(
    *,
    layout: Static,
    spec: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[Any, bool] | None = None,
    compute: str | None = None,
) -> Any:
    """The unsharded chunk with its static configuration bound: ``fn(state, consts, task_leaves, batches, step,
    base_key)``: ``n`` optimizer steps, with ``n == 1`` `batches` one batch, else each leaf with a leading axis ``n``.

    `state` is ``(params, opt_state, ema)`` as flat leaf lists (``ema`` empty when `ema_config` is ``None``),
    donated and returned updated; the EMA is updated after every step inside the same dispatch. `spec` is the
    loss's `StepLoss` (``LossSpec.step_loss``), on which the program specialises; `task_leaves` are the task's
    arrays (``LossSpec.task_arrays.leaves``). The call returns the new state and the metrics (a leading axis ``n``
    when ``n > 1``).

    One `jax.jit` per configuration, cached here, so a second stage with the same configuration compiles nothing
    new. Bound once per stage rather than passed as static arguments on every call: JAX hashes and compares each
    static argument at every dispatch (Python ``__hash__``/``__eq__`` calls), about 4 µs of a small MLP's
    one-step call (`make bench` row 1).
    """
    key = (layout, spec, optimizer, n, ema_config, compute)
    fn = _BOUND_STEPS.get(key)
    if fn is None:
        body = _chunk_body(layout, spec, optimizer, n, ema_config, compute)
        fn = _BOUND_STEPS[key] = jax.jit(body, donate_argnums=(0,))
    return fn


def chunk_cache_size() -> int:
    """The compiled unsharded chunks: one entry per configuration and argument shapes (what tests count)."""
    return sum(fn._cache_size() for fn in list(_BOUND_STEPS.values()))


#: The sharded steps (`sharded_train_chunk`), one `jax.jit` per mesh, state shardings and static configuration.
_SHARDED_STEPS: dict[tuple[Any, ...], Any] = {}


def sharded_train_chunk(
    plan: Any,
    state_shardings: tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]],
    *,
    layout: Static,
    spec: Static,
    optimizer: optax.GradientTransformation,
    n: int,
    ema_config: tuple[Any, bool] | None = None,
    compute: str | None = None,
) -> Any:
    """The data-parallel chunk on `plan`'s mesh: ``fn(state, consts, task_leaves, batches, step, base_key)``.

    The same step as `bound_train_chunk`, compiled with explicit shardings: the batch split along ``data`` (axis 1 of
    stacked batches), the state placed as `state_shardings` says (replicated, or split for ``shard_params``) and
    returned the same way, everything else replicated; the state is donated. `jax.jit` takes no keyword arguments
    with explicit shardings, so the static configuration is bound here and the function is cached by it: a
    second stage with the same configuration compiles nothing new.
    """
    loss_spec: LossSpec = spec.value
    key = (plan, state_shardings, n, layout, loss_spec.step_loss, optimizer, ema_config, compute)
    fn = _SHARDED_STEPS.get(key)
    if fn is None:
        rep = plan.replicated
        state = tuple(list(s) for s in state_shardings)
        body = _chunk_body(layout, loss_spec.step_loss, optimizer, n, ema_config, compute)
        fn = jax.jit(
            body,
            in_shardings=(state, rep, rep, plan.batch(stacked=n > 1), rep, rep),
            out_shardings=(state, rep),
            donate_argnums=(0,),
        )
        _SHARDED_STEPS[key] = fn
    return fn


@functools.partial(jax.jit, static_argnames=("static", "spec"))
def _eval_batch(
    params: Any,
    consts: Any,
    task_leaves: list[jax.Array],
    batch: dict[str, jax.Array],
    base_key: jax.Array,
    *,
    static: Static,
    spec: Static,
) -> dict[str, jax.Array]:
    model = eqx.nn.inference_mode(combine(params, consts, static.value))
    step_loss: StepLoss = spec.value
    _, metrics = step_loss(model, batch, base_key, task_leaves)
    return metrics


def eval_batch(
    params: Any, consts: Any, batch: dict[str, jax.Array], base_key: jax.Array, *, static: Static, spec: Static
) -> dict[str, jax.Array]:
    """Metrics of one batch in inference mode, without gradients."""
    loss_spec: LossSpec = spec.value
    metrics: dict[str, jax.Array] = _eval_batch(
        params, consts, loss_spec.task_arrays.leaves, batch, base_key, static=static, spec=loss_spec.step_loss
    )
    return metrics


class CompileCounter:
    """Counts XLA backend compiles while active (`jax.monitoring` events): ``with CompileCounter() as c: ...``."""

    _installed = False
    _active: list[CompileCounter] = []

    def __init__(self) -> None:
        self.count = 0

    @classmethod
    def _listener(cls, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE_EVENT:
            for counter in cls._active:
                counter.count += 1

    def __enter__(self) -> CompileCounter:
        if not CompileCounter._installed:
            jax.monitoring.register_event_duration_secs_listener(CompileCounter._listener)
            CompileCounter._installed = True
        CompileCounter._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        CompileCounter._active.remove(self)


def host_copy(tree: Any) -> Any:
    """A fresh device copy of every array leaf, so donation never deletes arrays the caller still holds.

    One ``device_put(..., may_alias=False)`` for all leaves: a copy on the leaf's own sharding that compiles
    nothing (``jnp.array(x, copy=True)`` compiled one XLA ``copy`` per leaf shape before the first step).
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    values = [leaves[i] for i in arrays]
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in values):
        # Several processes (jax.distributed): a global array is copied onto its own sharding, named explicitly.
        copies = [jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array) else x for x in values]
    else:
        copies = jax.device_put(values, may_alias=False)
    for i, copy in zip(arrays, copies):
        leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


def is_hashable(value: Any) -> bool:
    return isinstance(value, Hashable)
