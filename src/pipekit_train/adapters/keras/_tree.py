"""Keras models as arrays: one shared model per architecture, weights by attribute path, fills, checks, transfers.

Weights are named by where they live in the model's attribute tree, the way Equinox names them
(``.encoder.layers[0].kernel``), not by Keras' variable paths, which carry process-wide counters (``dense_3``) and
so differ between processes. A Keras model that is not reachable through attributes (a Functional or Sequential
model) is named through ``model.layers[i]``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import Transfer
from pipekit_train.backends.kit import MISSING, parse_path, resolve_path

from ._env import import_keras
from ._model import FACTORIES, KerasModel, KerasState

keras = import_keras()

__all__ = [
    "Layout",
    "apply_transfer",
    "build_state",
    "check_fits",
    "check_input",
    "fill",
    "layout_of",
    "predict",
    "skeleton",
    "state_of",
    "to_keras",
    "weights",
]

Spec = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class Layout:
    """Where each weight of a Keras model lives in its `KerasState`.

    Attributes:
        names: The weights' names in ``model.weights`` order (what `weights` returns).
        slots: ``("trainable" | "non_trainable", index)`` of each name.
        trainable: ``(shape, dtype)`` of each trainable variable, in ``model.trainable_variables`` order.
        non_trainable: The same for ``model.non_trainable_variables``.
        seeds: Indices into ``non_trainable`` of seed-generator states (set from ``(seed, step)`` every step).
    """

    names: tuple[str, ...]
    slots: tuple[tuple[str, int], ...]
    trainable: tuple[Spec, ...]
    non_trainable: tuple[Spec, ...]
    seeds: tuple[int, ...]


def _spec(v: Any) -> Spec:
    return tuple(int(d) for d in v.shape), str(np.dtype(v.dtype))


def _children(layer: Any) -> list[tuple[str, Any]]:
    """``(attribute path step, sub-layer)`` pairs: public attributes first, then ``model.layers[i]``."""
    Layer = keras.layers.Layer
    out: list[tuple[str, Any]] = []
    for attr, value in vars(layer).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, Layer):
            out.append((f".{attr}", value))
        elif isinstance(value, (list, tuple)):
            out += [(f".{attr}[{i}]", v) for i, v in enumerate(value) if isinstance(v, Layer)]
    if isinstance(layer, keras.Model):
        out += [(f".layers[{i}]", v) for i, v in enumerate(layer.layers)]
    return out


def _walk(root: Any) -> Iterator[tuple[str, Any]]:
    seen = {id(root)}
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        prefix, layer = stack.pop(0)
        yield prefix, layer
        for step, child in _children(layer):
            if id(child) not in seen:
                seen.add(id(child))
                stack.append((prefix + step, child))


_LAYOUTS: dict[int, tuple[Any, Layout]] = {}


def layout_of(model: Any) -> Layout:
    """The `Layout` of a built Keras model (computed once per model object)."""
    hit = _LAYOUTS.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    names: dict[int, str] = {}
    seed_ids: set[int] = set()
    for prefix, layer in _walk(model):
        own = list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))
        for v in own:
            if id(v) not in names:
                names[id(v)] = f"{prefix}.{v.name}"
        seed_ids.update(id(sg.state) for sg in getattr(layer, "_seed_generators", []))
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    index = {id(v): ("trainable", i) for i, v in enumerate(trainable)}
    index.update({id(v): ("non_trainable", i) for i, v in enumerate(non_trainable)})
    out_names: list[str] = []
    slots: list[tuple[str, int]] = []
    for i, v in enumerate(model.weights):
        name = names.get(id(v), f"weights[{i}]")
        if name in out_names:
            name = f"{name}#{i}"
        out_names.append(name)
        slots.append(index[id(v)])
    layout = Layout(
        names=tuple(out_names),
        slots=tuple(slots),
        trainable=tuple(_spec(v) for v in trainable),
        non_trainable=tuple(_spec(v) for v in non_trainable),
        seeds=tuple(i for i, v in enumerate(non_trainable) if id(v) in seed_ids),
    )
    _LAYOUTS[id(model)] = (model, layout)
    return layout


# Building ----------------------------------------------------------------------------------------------------
def _int_seed(key: Any) -> int:
    if key is None:
        return random.randint(1, 2**31 - 1)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) % (2**31 - 1)
    return int(jax.random.bits(key, dtype=jnp.uint32)) % (2**31 - 1)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Keras' global seeds set to `seed` for the block; Python's and NumPy's global random state restored after."""
    from keras.src.backend.common import global_state  # type: ignore[import-untyped]  # no public getter

    py_state, np_state = random.getstate(), np.random.get_state()
    generator = global_state.get_global_attribute("global_seed_generator")
    keras.utils.set_random_seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        global_state.set_global_attribute("global_seed_generator", generator)


def call_factory(op: KerasModel, key: Any) -> Any:
    """A fresh Keras model from `op`'s factory, built under the seed of `key` (``None``: unseeded)."""
    fn = FACTORIES.get(op.factory)
    context = _seeded(_int_seed(key)) if key is not None else contextlib.nullcontext()
    with context:
        model = fn(**op.kwargs)
    if not isinstance(model, keras.layers.Layer):
        raise ConfigError(
            f"Keras model factory {op.factory!r} returned {type(model).__name__}; it must return a keras.Model"
        )
    if not model.built or not model.weights:
        raise ConfigError(
            f"Keras model factory {op.factory!r} returned an unbuilt model ({type(model).__name__} with no weights); "
            "build it in the factory: start a Sequential with keras.Input(shape) or call model.build(input_shape)"
        )
    return model


_SKELETONS: dict[Any, Any] = {}


def _arch(op: KerasModel) -> Any:
    from pipekit import canonical

    return type(op), op.factory, canonical(op.kwargs)


def skeleton(op: KerasModel) -> Any:
    """The one Keras model of `op`'s architecture in this process: structure only, its values are never read."""
    model = _SKELETONS.get(_arch(op))
    if model is None:
        model = _SKELETONS[_arch(op)] = call_factory(op, 0)
    return model


def _values(model: Any) -> tuple[list[Any], list[Any]]:
    return [jnp.array(v.value) for v in model.trainable_variables], [
        jnp.array(v.value) for v in model.non_trainable_variables
    ]


def build_state(op: KerasModel, key: Any) -> KerasState:
    fresh = call_factory(op, key)
    model = _SKELETONS.setdefault(_arch(op), fresh)
    trainable, non_trainable = _values(fresh)
    state = KerasState(model, trainable, non_trainable)
    if model is not fresh:
        _check_specs(op, state, layout_of(model))
    return state


def state_of(op: KerasModel, model: Any) -> KerasState:
    """A `KerasState` holding a copy of a live Keras model's values (for ``op.bind(keras_model)``)."""
    if not isinstance(model, keras.layers.Layer):
        raise ConfigError(f"{op!r}.bind expects a KerasState or a keras.Model, got {type(model).__name__}")
    trainable, non_trainable = _values(model)
    return KerasState(skeleton(op), trainable, non_trainable)


def to_keras(op: KerasModel, state: KerasState) -> Any:
    model = call_factory(op, None)
    for var, value in zip(model.trainable_variables, state.trainable, strict=True):
        var.assign(np.asarray(value))
    for var, value in zip(model.non_trainable_variables, state.non_trainable, strict=True):
        var.assign(np.asarray(value))
    return model


# The ModelOp protocol ------------------------------------------------------------------------------------------
def _check_specs(op: KerasModel, state: KerasState, layout: Layout) -> None:
    for kind, specs, values in (
        ("trainable", layout.trainable, state.trainable),
        ("non_trainable", layout.non_trainable, state.non_trainable),
    ):
        got = tuple(_spec(v) for v in values)
        if got != specs:
            where = next((i for i, (a, b) in enumerate(zip(got, specs)) if a != b), min(len(got), len(specs)))
            raise ShapeError(
                f"{op!r}.bind: the model does not fit the architecture: it has {len(got)} {kind} arrays, the "
                f"architecture {len(specs)}; the first difference is at {kind}[{where}]: "
                f"{got[where] if where < len(got) else 'missing'} vs {specs[where] if where < len(specs) else 'none'}"
            )


def check_fits(op: KerasModel, state: Any) -> None:
    if not isinstance(state, KerasState):
        raise ConfigError(f"{op!r}.bind expects a KerasState or a keras.Model, got {type(state).__name__}")
    _check_specs(op, state, layout_of(skeleton(op)))


def weights(state: KerasState) -> dict[str, np.ndarray]:
    """The weights as host arrays by attribute path, in ``model.weights`` order (no seed-generator states)."""
    layout = layout_of(state.model)
    parts = {"trainable": state.trainable, "non_trainable": state.non_trainable}
    return {name: np.asarray(parts[kind][i]) for name, (kind, i) in zip(layout.names, layout.slots)}


def fill(op: KerasModel, arrays: Mapping[str, np.ndarray]) -> KerasState:
    """A `KerasState` of `op`'s architecture holding `arrays` (as `weights` returns them)."""
    model = skeleton(op)
    layout = layout_of(model)
    if list(arrays) != list(layout.names):
        missing = [n for n in layout.names if n not in arrays]
        extra = [n for n in arrays if n not in layout.names]
        raise ShapeError(
            f"{op!r}: the weights do not fit the architecture (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    parts: dict[str, list[Any]] = {
        "trainable": [None] * len(layout.trainable),
        "non_trainable": [jnp.array(v.value) for v in model.non_trainable_variables],
    }
    specs = {"trainable": layout.trainable, "non_trainable": layout.non_trainable}
    for name, (kind, i) in zip(layout.names, layout.slots):
        value = np.asarray(arrays[name])
        shape, dtype = specs[kind][i]
        if value.shape != shape or value.dtype != np.dtype(dtype):
            raise ShapeError(
                f"{op!r}: weights {name!r} are {value.shape} {value.dtype}, the architecture has {shape} {dtype}"
            )
        parts[kind][i] = jnp.asarray(value)
    return KerasState(model, parts["trainable"], parts["non_trainable"])


def _expects(model: Any) -> str:
    described = getattr(model, "expected_input", None)
    if isinstance(described, str):
        return described
    for _, layer in _walk(model):
        if isinstance(layer, keras.layers.Dense):
            n = int(layer.kernel.shape[0])
            return f"({n},) (its first Dense layer takes {n} features)"
    return "an input it could not trace"


def check_input(op: KerasModel, shape: tuple[int, ...], dtype: Any) -> Any:
    """The output `jax.ShapeDtypeStruct` (or pytree of them) for one example; nothing is compiled or run."""
    model = skeleton(op)
    state = op.module if isinstance(op.module, KerasState) else None
    layout = layout_of(model)
    # jax.ShapeDtypeStruct is untyped (no-untyped-call below)
    trainable = [jax.ShapeDtypeStruct(s, d) for s, d in layout.trainable]  # type: ignore[no-untyped-call]
    non_trainable = [jax.ShapeDtypeStruct(s, d) for s, d in layout.non_trainable]  # type: ignore[no-untyped-call]
    if state is not None:
        trainable, non_trainable = list(state.trainable), list(state.non_trainable)
    example = jax.ShapeDtypeStruct((1, *shape), jnp.dtype(dtype))  # type: ignore[no-untyped-call]
    try:
        out = jax.eval_shape(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0], trainable, non_trainable,
                             example)  # fmt: skip
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapeError(
            f"the data's per-example input has shape {tuple(shape)} and dtype {jnp.dtype(dtype)}, but {op!r} "
            f"expects {_expects(model)}; tracing one example failed with: {first_line}"
        ) from e
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), out)  # type: ignore[no-untyped-call]


_PREDICT: dict[tuple[int, bool], tuple[Any, Any]] = {}


def predict(state: KerasState, x: Any, training: bool = False) -> Any:
    model = state.model
    hit = _PREDICT.get((id(model), training))
    if hit is None or hit[0] is not model:

        def call(trainable: list[Any], non_trainable: list[Any], x: Any) -> Any:
            return model.stateless_call(trainable, non_trainable, x, training=training)[0]

        hit = _PREDICT[(id(model), training)] = (model, jax.jit(call))
    return hit[1](list(state.trainable), list(state.non_trainable), x)


def inference_function(state: KerasState) -> Any:
    """``predict(x)``: the Keras model's stateless call in inference mode, its variables closed over as arrays."""
    model = state.model
    trainable = [jnp.asarray(v) for v in state.trainable]
    non_trainable = [jnp.asarray(v) for v in state.non_trainable]

    def predict(x: Any) -> Any:
        return model.stateless_call(trainable, non_trainable, x, training=False)[0]

    return predict


# Transfer ------------------------------------------------------------------------------------------------------
def _sub_layer(node: Any, name: str) -> Any:
    value = getattr(node, name, None) if not name.startswith("_") else None
    return value if isinstance(value, (keras.layers.Layer, list, tuple)) else MISSING


def _sub_layer_names(node: Any) -> list[str]:
    return sorted({s.lstrip(".").split("[")[0] for s, _ in _children(node)})


def _resolve(model: Any, path: str, role: str) -> Any:
    steps = parse_path(path)
    node = resolve_path(model, steps, path, role, child=_sub_layer, names=_sub_layer_names, noun="layer")
    if not isinstance(node, keras.layers.Layer):
        raise ConfigError(f"Transfer: path {path!r} names a {type(node).__name__} in the {role} model, not a layer")
    return node


def apply_transfer(transfer: Transfer, source: KerasState, target: KerasState) -> KerasState:
    """`target` with the weights under each ``transfer.paths`` entry replaced by the source's (the same arrays).

    A path that does not exist raises `pipekit.ConfigError`; sub-layers whose weights differ in number, shape or
    dtype raise `pipekit.ShapeError` naming both.
    """
    src_model, dst_model = source.model, target.model
    src_index = _slot_index(src_model)
    dst_index = _slot_index(dst_model)
    parts = {"trainable": list(target.trainable), "non_trainable": list(target.non_trainable)}
    src_parts = {"trainable": source.trainable, "non_trainable": source.non_trainable}
    for target_path, source_path in transfer.paths.items():
        src = _resolve(src_model, source_path, "source").weights
        dst = _resolve(dst_model, target_path, "target").weights
        src_specs, dst_specs = [_spec(v) for v in src], [_spec(v) for v in dst]
        if src_specs != dst_specs:
            raise ShapeError(
                f"Transfer: source {source_path!r} does not fit target {target_path!r}: the source's weights are "
                f"{src_specs}, the target's {dst_specs}"
            )
        for s, d in zip(src, dst):
            s_kind, s_i = src_index[id(s)]
            d_kind, d_i = dst_index[id(d)]
            parts[d_kind][d_i] = src_parts[s_kind][s_i]
    return KerasState(dst_model, parts["trainable"], parts["non_trainable"])


def _slot_index(model: Any) -> dict[int, tuple[str, int]]:
    index = {id(v): ("trainable", i) for i, v in enumerate(model.trainable_variables)}
    index.update({id(v): ("non_trainable", i) for i, v in enumerate(model.non_trainable_variables)})
    return index
