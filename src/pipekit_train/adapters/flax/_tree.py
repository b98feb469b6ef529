"""Flax NNX states for the `ModelOp` protocol: building, weights by path, filling a skeleton, fitting checks,
predictions, the export function and transfers by path.

A `FlaxState`'s weights are its ``nnx.Param`` variables, then its other variables (BatchNorm statistics), named by
their path as the kit's canonical layout writes them (``.encoder.layers[0].kernel``); the RNG streams' state is
not a weight (the backend reseeds it from ``(seed, step)`` before every step).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import ModelOp, Transfer
from pipekit_train.backends.kit import init_compiler_options, parse_path

from ._model import FACTORIES, FlaxState

__all__ = [
    "apply_transfer",
    "build_state",
    "check_fits",
    "check_input",
    "fill",
    "inference_function",
    "predict",
    "split",
    "state_of",
    "weights",
]

Path = tuple[str | int, ...]


def name_of(path: Path) -> str:
    """``("encoder", "layers", 0, "kernel")`` as ``.encoder.layers[0].kernel`` (the kit's canonical naming)."""
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path)


def split(module: Any) -> FlaxState:
    """An ``nnx.Module`` as a `FlaxState` (graph definition, params, other variables, RNG state)."""
    graphdef, *states = nnx.split(module, nnx.Param, nnx.RngState, ...)
    # `nnx.split`'s states hold the module's own `Variable` objects: new ones, so that whatever the caller does to
    # its module afterwards (trains it, reseeds it) never reaches the bound state.
    params, rngs, rest = (fresh(state) for state in states)
    return FlaxState(graphdef, params, rest, rngs)


def state_of(module: Any) -> FlaxState:
    if not isinstance(module, nnx.Module):
        raise ConfigError(f"FlaxModel.bind expects a FlaxState or an nnx.Module, got {type(module).__name__}")
    return split(module)


def _factory_call(op: ModelOp, rngs: Any) -> Any:
    fn = FACTORIES.get(op.factory)  # type: ignore[attr-defined]
    try:
        module = fn(rngs, **op.kwargs)  # type: ignore[attr-defined]
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a kwarg of the wrong kind: `in_size: 4.5`
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"FlaxModel: factory {op.factory!r} failed with kwargs {op.kwargs}: {type(e).__name__}: {first}"  # type: ignore[attr-defined]
        ) from e
    if not isinstance(module, nnx.Module):
        raise ConfigError(
            f"Flax model factory {op.factory!r} returned {type(module).__name__}; it must return an nnx.Module"  # type: ignore[attr-defined]
        )
    return module


_BUILDERS: dict[Any, Any] = {}


def build_state(op: ModelOp, key: Any) -> FlaxState:
    """``factory(nnx.Rngs(key), **kwargs)`` traced and compiled as one program (`_builder`), split. The builder
    is kept per factory and kwargs, so a second build of the architecture (another seed, stage or trial) compiles
    nothing; a factory that needs concrete values runs eagerly."""
    key = jax.random.key(key) if isinstance(key, (int, np.integer)) else key
    try:
        cache_key: Any = (op.factory, json.dumps(op.kwargs, sort_keys=True))  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        cache_key = None
    builder = _BUILDERS.get(cache_key)
    if builder is None:
        builder = _builder(op)
        if cache_key is not None:
            _BUILDERS[cache_key] = builder
    try:
        module = builder(key)
    except jax.errors.JAXTypeError:  # concretization: the factory needs concrete values
        _BUILDERS.pop(cache_key, None)
        module = _factory_call(op, nnx.Rngs(key))
    return split(module)


def _builder(op: ModelOp) -> Any:
    """``key -> nnx.Module`` of `op`'s factory: the module's variables drawn by one `jax.jit` program compiled with
    the kit's `init_compiler_options` (on the CPU a quarter to three quarters of the default compile time, the
    same bits: the tests compare every built-in factory with a build at XLA's default level), merged with the
    graph definition its trace found (static: one per factory and kwargs)."""
    graphdef: list[Any] = []

    def variables(k: Any) -> Any:
        found, state = nnx.split(_factory_call(op, nnx.Rngs(k)))
        graphdef[:] = [found]
        return state

    draw = jax.jit(variables, **init_compiler_options())

    def build(k: Any) -> Any:
        state = draw(k)  # traced on the first call: the graph definition is known after it
        return nnx.merge(graphdef[0], state)

    return build


_ABSTRACT: list[tuple[Any, FlaxState]] = []


def abstract(op: ModelOp) -> FlaxState:
    """The architecture's state with `jax.ShapeDtypeStruct` leaves: nothing is initialised."""
    if _ABSTRACT and _ABSTRACT[0][0] is op:
        return _ABSTRACT[0][1]
    state = split(nnx.eval_shape(lambda: _factory_call(op, nnx.Rngs(0))))
    _ABSTRACT[:] = [(op, state)]
    return state


def _flat(state: Any) -> list[tuple[Path, Any]]:
    return [(tuple(path), var) for path, var in nnx.to_flat_state(state)]  # type: ignore[arg-type]


def _specs(state: FlaxState) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        name_of(path): (tuple(var.get_value().shape), str(var.get_value().dtype))
        for part in (state.params, state.rest)
        for path, var in _flat(part)
    }


def check_fits(op: ModelOp, module: Any) -> None:
    if not isinstance(module, FlaxState):
        raise ConfigError(f"{type(op).__name__}.bind expects a FlaxState, got {type(module).__name__}")
    expected, got = _specs(abstract(op)), _specs(module)
    if expected != got:
        diff = next((n for n in [*expected, *got] if expected.get(n) != got.get(n)), "<root>")
        raise ShapeError(
            f"{op!r}.bind: the module does not fit the architecture: at {diff} it has {got.get(diff, 'nothing')}, "
            f"the architecture {expected.get(diff, 'nothing')}"
        )


def weights(state: FlaxState) -> dict[str, np.ndarray]:
    """The params, then the other variables, as host arrays by path name, in the state's order."""
    return {
        name_of(path): np.asarray(var.get_value()) for part in (state.params, state.rest) for path, var in _flat(part)
    }


def _replaced(state: Any, values: Mapping[Path, Any]) -> Any:
    return nnx.from_flat_state([(path, var.replace(values.get(path, var.get_value()))) for path, var in _flat(state)])


_SKELETONS: dict[Any, FlaxState] = {}


def fill(op: ModelOp, arrays: Mapping[str, np.ndarray]) -> FlaxState:
    """A state of `op`'s architecture holding `arrays` (as `weights` returns them); the RNG streams as built from
    seed 0 (training reseeds them every step)."""
    skeleton = abstract(op)
    names = list(_specs(skeleton))
    if set(arrays) != set(names):  # any order: a converter writes each layer's kernel, then its bias
        missing = [n for n in names if n not in arrays]
        extra = [n for n in arrays if n not in names]
        raise ShapeError(
            f"{op!r}: the weights do not fit the architecture (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    values: dict[Path, Any] = {}
    for part in (skeleton.params, skeleton.rest):
        for path, var in _flat(part):
            value = np.asarray(arrays[name_of(path)])
            if value.shape != tuple(var.get_value().shape) or value.dtype != np.dtype(var.get_value().dtype):
                raise ShapeError(
                    f"{op!r}: weights {name_of(path)!r} are {value.shape} {value.dtype}, the architecture has "
                    f"{tuple(var.get_value().shape)} {np.dtype(var.get_value().dtype)}"
                )
            values[path] = jnp.asarray(value)
    key = (op.factory, json.dumps(op.kwargs, sort_keys=True, default=str))  # type: ignore[attr-defined]
    base = _SKELETONS.get(key)
    if base is None:
        base = _SKELETONS[key] = build_state(op, 0)
    return FlaxState(base.graphdef, _replaced(base.params, values), _replaced(base.rest, values), base.rngs)


def fresh(state: Any) -> Any:
    """`state` with new `Variable` objects holding the same (immutable) arrays."""
    return jax.tree.map(lambda x: x, state)


def merged(graphdef: Any, params: Any, rngs: Any, rest: Any, training: bool) -> Any:
    """A fresh module merged from its parts, in training or inference mode (``train()`` / ``eval()``).

    ``nnx.merge`` reuses the `Variable` objects of the states it is given; each state is mapped to new ones first,
    so whatever the module does to its variables (a BatchNorm update, a reseeded RNG stream) stays in it, at the
    trace level it runs at, and never reaches the caller's states.
    """
    module = nnx.merge(graphdef, fresh(params), fresh(rngs), fresh(rest))
    module.train() if training else module.eval()
    return module


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _predict(params: Any, rngs: Any, rest: Any, x: Any, *, graphdef: Any) -> Any:
    return merged(graphdef, params, rngs, rest, False)(x)


def predict(state: FlaxState, x: Any) -> Any:
    """Predictions (inference mode) for a batch, compiled once per architecture and batch shape."""
    return _predict(state.params, state.rngs, state.rest, x, graphdef=state.graphdef)


def inference_function(state: FlaxState) -> Any:
    """``predict(x)``: the module in inference mode with the state's arrays closed over (pure, traceable)."""

    def predict_fn(x: Any) -> Any:
        return merged(state.graphdef, state.params, state.rngs, state.rest, False)(x)

    return predict_fn


def _expects(module: Any) -> str:
    described = getattr(module, "expected_input", None)
    if isinstance(described, str):
        return described
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Linear):
            return f"({node.in_features},) (its first Linear takes {node.in_features} features)"
        if isinstance(node, nnx.Conv):
            return f"(..., {node.in_features}) channels-last (its first Conv takes {node.in_features} channels)"
    return "an input it could not trace (no Linear or Conv layer found to describe)"


_CHECKED: list[tuple[Any, Any, Any]] = []


def check_input(op: ModelOp, shape: tuple[int, ...], dtype: Any) -> Any:
    """The output `jax.ShapeDtypeStruct` (or pytree of them) for one example of `shape` and `dtype`: the module
    traced with `jax.eval_shape` on a batch of one, nothing compiled or run; a `pipekit.ShapeError` naming what the
    model expects when the example does not fit."""
    key = (tuple(shape), jnp.dtype(dtype))
    if _CHECKED and _CHECKED[0][0] is op and _CHECKED[0][1] == key:
        return _CHECKED[0][2]
    state = op.module if op.module is not None else abstract(op)
    example = jax.ShapeDtypeStruct((1, *shape), jnp.dtype(dtype))  # type: ignore[no-untyped-call]
    try:
        out = jax.eval_shape(
            lambda p, r, s, x: merged(state.graphdef, p, r, s, False)(x), state.params, state.rngs, state.rest, example
        )
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        module = nnx.merge(state.graphdef, state.params, state.rngs, state.rest)
        raise ShapeError(
            f"the data's per-example input has shape {tuple(shape)} and dtype {jnp.dtype(dtype)}, but {op!r} "
            f"expects {_expects(module)}; tracing one example failed with: {first_line}"
        ) from e
    out = jax.tree.map(lambda o: jax.ShapeDtypeStruct(tuple(o.shape[1:]), o.dtype), out)  # type: ignore[no-untyped-call]
    _CHECKED[:] = [(op, key, out)]
    return out


# Transfer -------------------------------------------------------------------------------------------------
def _under(state: FlaxState, prefix: Path) -> dict[Path, Any]:
    """The weights below `prefix`, by their path relative to it."""
    return {
        path[len(prefix) :]: var.get_value()
        for part in (state.params, state.rest)
        for path, var in _flat(part)
        if path[: len(prefix)] == prefix
    }


def _spec(values: Mapping[Path, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name_of(p): (tuple(v.shape), str(v.dtype)) for p, v in values.items()}


def apply_transfer(transfer: Transfer, source: Any, target: Any) -> FlaxState:
    """`target` with each ``transfer.paths`` entry replaced by the source's sub-tree (the same arrays, bit for bit).

    A path that does not exist raises `pipekit.ConfigError` naming the top-level parts there are; sub-trees whose
    variable paths, shapes or dtypes differ raise `pipekit.ShapeError` naming both.
    """
    if isinstance(source, ModelOp):
        source = source.require_module("Transfer source")
    if isinstance(target, ModelOp):
        target = target.require_module("Transfer target")
    values: dict[Path, Any] = {}
    for target_path, source_path in transfer.paths.items():
        t_steps, s_steps = tuple(parse_path(target_path)), tuple(parse_path(source_path))
        src, dst = _under(source, s_steps), _under(target, t_steps)
        for role, found, path, state in (("source", src, source_path, source), ("target", dst, target_path, target)):
            if not found:
                parts = sorted({str(p[0]) for p, _ in _flat(state.params)})
                raise ConfigError(
                    f"Transfer: path {path!r} not found in the {role} model; its top-level parts: {', '.join(parts)}"
                )
        src_spec, dst_spec = _spec(src), _spec(dst)
        if src_spec != dst_spec:
            diff = next(n for n in [*dst_spec, *src_spec] if src_spec.get(n) != dst_spec.get(n))
            raise ShapeError(
                f"Transfer: source {source_path!r} does not fit target {target_path!r}: at {diff or '<root>'} the "
                f"source has {src_spec.get(diff, 'nothing')} and the target has {dst_spec.get(diff, 'nothing')}"
            )
        for rel, value in src.items():
            values[(*t_steps, *rel)] = value
    return FlaxState(target.graphdef, _replaced(target.params, values), _replaced(target.rest, values), target.rngs)
