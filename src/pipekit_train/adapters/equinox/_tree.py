"""Equinox model trees for the `ModelOp` protocol: fitting checks, weights by path, filling a skeleton, transfers."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import ModelOp, Transfer
from pipekit_train.backends.kit import MISSING, parse_path, resolve_path

__all__ = ["apply_transfer", "batched_call", "check_fits", "check_input", "fill", "weights"]


@eqx.filter_jit
def _batched_call(module: Any, x: Any) -> Any:
    return jax.vmap(lambda xi: module(xi))(x)


def batched_call(module: Any, x: Any) -> Any:
    return _batched_call(module, x)


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    arrays = eqx.filter(tree, _is_array_like)
    return {
        jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]
    }


def _fmt(spec: tuple[tuple[int, ...], str] | None) -> str:
    return "missing" if spec is None else f"{spec[0]} {spec[1]}"


def _diff(got: dict[str, Any], expected: dict[str, Any]) -> str:
    if set(got) != set(expected):
        return (
            f"its arrays are at {', '.join(list(got)[:4]) or 'nowhere'}{'...' if len(got) > 4 else ''} but the "
            f"architecture has them at {', '.join(list(expected)[:4])}{'...' if len(expected) > 4 else ''}"
        )
    for path in expected:
        if got.get(path) != expected.get(path):
            return f"{path or '<root>'}: got {_fmt(got.get(path))}, expected {_fmt(expected.get(path))}"
    return "the structures differ"


_ABSTRACT: list[tuple[Any, Any]] = []  # (op, its abstract module): the last one traced, reused for that same object


def abstract(op: ModelOp) -> Any:
    """The architecture's module with `jax.ShapeDtypeStruct` leaves: nothing is initialised.

    The pre-flight and the run of one stage ask for the same operator several times; it is traced once.
    """
    if _ABSTRACT and _ABSTRACT[0][0] is op:
        return _ABSTRACT[0][1]
    # The key is made inside the trace too: an eager `jax.random.key(0)` would compile the seeding on its own.
    module = eqx.filter_eval_shape(lambda: op.build(jax.random.key(0)))
    _ABSTRACT[:] = [(op, module)]
    return module


def check_fits(op: ModelOp, module: Any) -> None:
    if not isinstance(module, eqx.Module):
        raise ConfigError(f"{type(op).__name__}.bind expects an equinox Module, got {type(module).__name__}")
    expected = leaf_specs(abstract(op))
    got = leaf_specs(module)
    if expected != got:
        raise ShapeError(f"{op!r}.bind: the module does not fit the architecture: {_diff(got, expected)}")


def weights(module: Any) -> dict[str, np.ndarray]:
    """The module's array leaves as host arrays, keyed by `jax.tree_util.keystr` path, in tree order."""
    arrays = eqx.filter(module, eqx.is_array)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]}


def fill(op: ModelOp, arrays: Mapping[str, np.ndarray]) -> Any:
    """A module of `op`'s architecture holding `arrays` (as `weights` returns them)."""
    skeleton = abstract(op)
    params, static = eqx.partition(skeleton, _is_array_like)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(p) for p, _ in flat]
    if list(arrays) != names:
        missing = [n for n in names if n not in arrays]
        extra = [n for n in arrays if n not in names]
        raise ShapeError(
            f"{op!r}: the weights do not fit the architecture (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    leaves = []
    for (_, spec), name in zip(flat, names):
        value = np.asarray(arrays[name])
        if value.shape != tuple(spec.shape) or value.dtype != np.dtype(spec.dtype):
            raise ShapeError(
                f"{op!r}: weights {name!r} are {value.shape} {value.dtype}, the architecture has "
                f"{tuple(spec.shape)} {np.dtype(spec.dtype)}"
            )
        leaves.append(jnp.asarray(value))
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)


def _expects(module: Any) -> str:
    """What `module` expects of one example, in words, for shape-mismatch messages."""
    described = getattr(module, "expected_input", None)
    if isinstance(described, str):
        return described
    first = next(
        (
            leaf
            for leaf in jax.tree.leaves(module, is_leaf=lambda n: isinstance(n, (eqx.nn.Linear, eqx.nn.Conv)))
            if isinstance(leaf, (eqx.nn.Linear, eqx.nn.Conv))
        ),
        None,
    )
    if isinstance(first, eqx.nn.Linear):
        shape = "()" if first.in_features == "scalar" else f"({first.in_features},)"
        return f"{shape} (its first Linear has in_features={first.in_features})"
    if isinstance(first, eqx.nn.Conv):
        return (
            f"({first.in_channels}, ...) with {first.num_spatial_dims} spatial dimension(s) "
            f"(its first Conv has in_channels={first.in_channels})"
        )
    return "an input it could not trace (no Linear or Conv layer found to describe)"


_CHECKED: list[tuple[Any, Any, Any]] = []  # (op, (shape, dtype), output spec): the last `check_input`


def check_input(op: ModelOp, shape: tuple[int, ...], dtype: Any) -> Any:
    """The output `jax.ShapeDtypeStruct` (or pytree of them) for one example of `shape` and `dtype`.

    Nothing is compiled or run: the bound module (or, when unbound, an abstract `build`) is traced with
    `jax.eval_shape`. When the example does not fit, a `pipekit.ShapeError` names the data's per-example shape and
    what the model expects.
    """
    key = (tuple(shape), jnp.dtype(dtype))
    if _CHECKED and _CHECKED[0][0] is op and _CHECKED[0][1] == key:  # the pre-flight's check, asked again by the run
        return _CHECKED[0][2]
    module = op.module
    if module is None:
        module = abstract(op)
    example = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))  # type: ignore[no-untyped-call]
    try:
        out = eqx.filter_eval_shape(lambda m, x: m(x), module, example)
        _CHECKED[:] = [(op, key, out)]
        return out
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapeError(
            f"the data's per-example input has shape {tuple(shape)} and dtype {jnp.dtype(dtype)}, but {op!r} "
            f"expects {_expects(module)}; tracing one example failed with: {first_line}"
        ) from e


# Transfer -------------------------------------------------------------------------------------------------
def _child(node: Any, name: str) -> Any:
    """The field `name` of a module (not a method), or `MISSING`."""
    return MISSING if not hasattr(node, name) or callable(getattr(type(node), name, None)) else getattr(node, name)


def _fields(node: Any) -> list[str]:
    return [n for n in getattr(node, "__dataclass_fields__", {}) if not n.startswith("_")]


def _resolve(tree: Any, steps: list[str | int], path: str, role: str) -> Any:
    return resolve_path(tree, steps, path, role, child=_child, names=_fields, noun="attribute")


def _pair_diff(src: dict[str, Any], dst: dict[str, Any]) -> str:
    for path in [*dst, *src]:
        if src.get(path) != dst.get(path):
            return (
                f"at {path or '<root>'} the source has {_fmt(src.get(path))} and the target has {_fmt(dst.get(path))}"
            )
    return "the structures differ"


def apply_transfer(transfer: Transfer, source: Any, target: Any) -> Any:
    """`target` with each ``transfer.paths`` entry replaced by the source's sub-tree (the same arrays, bit for bit).

    `source` and `target` are Equinox modules (or bound `ModelOp`\\ s, whose modules are used). A path that does
    not exist raises `pipekit.ConfigError`; sub-trees whose array paths, shapes or dtypes differ raise
    `pipekit.ShapeError` naming the path and both shapes.
    """
    if isinstance(source, ModelOp):
        source = source.require_module("Transfer source")
    if isinstance(target, ModelOp):
        target = target.require_module("Transfer target")
    out = target
    for target_path, source_path in transfer.paths.items():
        t_steps, s_steps = parse_path(target_path), parse_path(source_path)
        src = _resolve(source, s_steps, source_path, "source")
        dst = _resolve(out, t_steps, target_path, "target")
        src_specs, dst_specs = leaf_specs(src), leaf_specs(dst)
        if src_specs != dst_specs:
            raise ShapeError(
                f"Transfer: source {source_path!r} does not fit target {target_path!r}: "
                f"{_pair_diff(src_specs, dst_specs)}"
            )
        # jax annotates `structure` with an alias (`PyTreeDef`, from a compiled module) mypy cannot resolve.
        if jax.tree.structure(eqx.filter(src, eqx.is_array)) != jax.tree.structure(eqx.filter(dst, eqx.is_array)):  # type: ignore[operator]
            raise ShapeError(
                f"Transfer: source {source_path!r} and target {target_path!r} have equal shapes but different "
                f"structure (static fields such as the activation differ): {type(src).__name__} vs "
                f"{type(dst).__name__}"
            )
        out = eqx.tree_at(functools.partial(_resolve, steps=t_steps, path=target_path, role="target"), out, src)
    return out
