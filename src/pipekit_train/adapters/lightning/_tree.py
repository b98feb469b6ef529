"""torch modules as arrays: seeded building, weights by ``state_dict`` name, fills, checks, predictions, transfers.

Weights are the module's ``state_dict()`` (parameters and buffers) as host NumPy arrays, named as torch names them
(``encoder.layers.0.weight``): stable across processes, unlike anything carrying object ids.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import Transfer
from pipekit_train.backends.kit import MISSING, parse_path, resolve_path

from ._model import FACTORIES, TorchModel

__all__ = [
    "apply_transfer",
    "build_module",
    "check_fits",
    "check_input",
    "copy_module",
    "fill",
    "predict",
    "skeleton",
    "to_numpy",
    "weights",
]


def int_seed(key: Any) -> int:
    """An int seed from an int or a JAX key (``None``: a random one)."""
    if key is None:
        return random.randint(1, 2**31 - 1)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) % (2**63 - 1)
    import jax
    import jax.numpy as jnp

    return int(jax.random.bits(key, dtype=jnp.uint32))


def call_factory(op: TorchModel, seed: int | None) -> nn.Module:
    """A fresh module from `op`'s factory, built under ``torch.manual_seed(seed)`` (the global generator restored)."""
    fn = FACTORIES.get(op.factory)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        module = fn(**op.kwargs)
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"torch model factory {op.factory!r} returned {type(module).__name__}; it must return a torch.nn.Module"
        )
    if not list(module.state_dict()):
        raise ConfigError(f"torch model factory {op.factory!r} returned a module with no parameters or buffers")
    return module


_SKELETONS: dict[Any, nn.Module] = {}


def _arch(op: TorchModel) -> Any:
    from pipekit import canonical

    return type(op), op.factory, canonical(op.kwargs)


def skeleton(op: TorchModel) -> nn.Module:
    """The one module of `op`'s architecture kept in this process: its structure is read, never its values."""
    module = _SKELETONS.get(_arch(op))
    if module is None:
        module = _SKELETONS[_arch(op)] = call_factory(op, 0)
    return module


def build_module(op: TorchModel, key: Any) -> nn.Module:
    module = call_factory(op, int_seed(key))
    check_fits(op, module)
    return module


def copy_module(module: nn.Module) -> nn.Module:
    """An independent copy (its own tensors), for handing out a bound model that training will not change."""
    return copy.deepcopy(module)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy of `t` (never a view of a tensor that training goes on changing)."""
    return t.detach().cpu().numpy().copy()


# The ModelOp protocol ------------------------------------------------------------------------------------------
def _specs(module: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in module.state_dict().items()}


def check_fits(op: TorchModel, module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{op!r}.bind expects a torch.nn.Module, got {type(module).__name__}")
    got, want = _specs(module), _specs(skeleton(op))
    if got != want:
        missing = [k for k in want if k not in got]
        extra = [k for k in got if k not in want]
        differ = [f"{k}: {got[k]} vs {want[k]}" for k in want if k in got and got[k] != want[k]]
        raise ShapeError(
            f"{op!r}.bind: the module does not fit the architecture (missing {missing[:4]}, unexpected {extra[:4]}, "
            f"different {differ[:2]})"
        )


def weights(module: nn.Module) -> dict[str, np.ndarray]:
    """The ``state_dict`` as host arrays by name, in ``state_dict`` order."""
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


def fill(op: TorchModel, arrays: Mapping[str, np.ndarray]) -> nn.Module:
    """A module of `op`'s architecture holding `arrays` (as `weights` returns them)."""
    model = skeleton(op)
    want = _specs(model)
    if list(arrays) != list(want):
        missing = [n for n in want if n not in arrays]
        extra = [n for n in arrays if n not in want]
        raise ShapeError(
            f"{op!r}: the weights do not fit the architecture (missing {missing[:4]}, unexpected {extra[:4]})"
        )
    state = {}
    for name, (shape, dtype) in want.items():
        value = np.asarray(arrays[name])
        if value.shape != shape or str(value.dtype) != dtype:
            raise ShapeError(
                f"{op!r}: weights {name!r} are {value.shape} {value.dtype}, the architecture has {shape} {dtype}"
            )
        state[name] = torch.from_numpy(np.array(value, copy=True))
    module = copy.deepcopy(model)
    module.load_state_dict(state)
    return module


def to_tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` (NumPy, JAX or torch) as a CPU tensor, without a copy where NumPy allows; floats cast to `dtype`."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        host = np.asarray(x)
        t = torch.from_numpy(host) if host.flags.writeable else torch.as_tensor(host.copy())
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    p = next(iter(module.parameters()), None)
    return p.dtype if p is not None else None


def tree_map(fn: Any, tree: Any) -> Any:
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map(fn, t) for t in tree)
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def predict(module: nn.Module, x: Any) -> Any:
    """The module's outputs for the batch `x` in eval mode without gradients, as NumPy arrays."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(tree_map(lambda a: to_tensor(a, _param_dtype(module)), x))
    finally:
        module.train(was_training)
    return tree_map(lambda t: t.detach().cpu().numpy(), out)


def _expects(module: nn.Module) -> str:
    described = getattr(module, "expected_input", None)
    if isinstance(described, str):
        return described
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            return f"({layer.in_features},) (its first Linear layer takes {layer.in_features} features)"
    return "an input it could not run"


def check_input(op: TorchModel, shape: tuple[int, ...], dtype: Any) -> Any:
    """The output shape(s) and dtype(s) for one example (``jax.ShapeDtypeStruct``), from one zero example."""
    import jax

    module = op.module if isinstance(op.module, nn.Module) else skeleton(op)
    example = np.zeros((1, *shape), np.dtype(dtype))
    try:
        out = predict(module, example)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapeError(
            f"the data's per-example input has shape {tuple(shape)} and dtype {np.dtype(dtype)}, but {op!r} "
            f"expects {_expects(module)}; running one example failed with: {first_line}"
        ) from e
    return tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), out)  # type: ignore[no-untyped-call]


# Transfer ------------------------------------------------------------------------------------------------------
def _children(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_children()]


def _sub_module(node: nn.Module, name: str) -> Any:
    return getattr(node, name) if name in _children(node) else MISSING


def _resolve(model: nn.Module, path: str, role: str) -> nn.Module:
    steps = parse_path(path)
    seq = (nn.ModuleList, nn.Sequential)
    node = resolve_path(model, steps, path, role, child=_sub_module, names=_children, sequence=seq, noun="sub-module")
    if not isinstance(node, nn.Module):
        raise ConfigError(f"Transfer: path {path!r} names a {type(node).__name__} in the {role} model, not a module")
    return node


def apply_transfer(transfer: Transfer, source: nn.Module, target: nn.Module) -> nn.Module:
    """`target` with the weights under each ``transfer.paths`` entry replaced by copies of the source's.

    A path that does not exist raises `pipekit.ConfigError`; sub-modules whose weights differ in names, shapes or
    dtypes raise `pipekit.ShapeError` naming both.
    """
    for target_path, source_path in transfer.paths.items():
        src = _resolve(source, source_path, "source")
        dst = _resolve(target, target_path, "target")
        src_specs, dst_specs = _specs(src), _specs(dst)
        if src_specs != dst_specs:
            raise ShapeError(
                f"Transfer: source {source_path!r} does not fit target {target_path!r}: the source's weights are "
                f"{src_specs}, the target's {dst_specs}"
            )
        dst.load_state_dict({k: v.detach().clone() for k, v in src.state_dict().items()})
    return target
