"""LoRA on Equinox models: targeted `eqx.nn.Linear` layers wrapped with low-rank adapters, and merged back.

`attach` replaces each targeted linear layer with a `LoraLinear` holding the frozen layer and the two adapter
matrices; `trainable` is the filter that makes the adapters, and nothing else, the step's ``params`` (the frozen
weights travel as the step's ``consts``: no gradient, no optimizer state, no checkpoint); `merge` folds the
adapters into the weights, ``W + (alpha / rank) B A``, giving back a plain model of the original architecture.
The settings and the matching of targets are backend-neutral (`pipekit_train.optim.select_targets`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError
from pipekit_train.optim import LoraSettings, lora_settings, select_targets

__all__ = [
    "LoraLinear",
    "StageAdapters",
    "attach",
    "check_lora",
    "describe",
    "linear_paths",
    "merge",
    "start_adapters",
    "trainable",
]

#: Folded into the stage's init key for the adapters' ``A`` (ASCII "LoRA"): a key of its own, from the seed.
LORA_SALT = 0x4C6F5241


class LoraLinear(eqx.Module):
    """A frozen `eqx.nn.Linear` plus a trained low-rank update: ``base(x) + scale * B (A x)``.

    Two ways to compute it, the same function: the **thin** form applies the adapters to the input (``A x`` then
    ``B``: the frozen weight gets no gradient, the adapters' products are ``rank`` wide), and the **folded** form
    adds ``scale * B @ A`` to the weight first (in float32, as `merge` does) and multiplies once: one full-size weight
    gradient, flowing to ``A`` and ``B``, instead of the thin products. Which is faster depends on how XLA compiles
    the thin products: measured on the CPU, thin is 1.7x faster than full training on an 8.4 M-parameter MLP, but
    inside the zoo's transformers (two nested ``vmap`` calls, examples then tokens) it is slower than full training
    (258 against 195 ms a gradient step at ``d_model`` 128), and folded faster (178 ms). `attach` folds the
    transformers' layers and keeps the rest thin. A folded layer computes exactly what its merged export computes.

    Attributes:
        base: The linear layer, frozen.
        lora_a: ``(rank, in_features)``, random at the start.
        lora_b: ``(out_features, rank)``, zeros at the start (so the layer starts as `base`).
        scale: ``alpha / rank``.
        fold: Compute with the folded weight ``W + scale * B @ A`` (see above) instead of the thin products.
    """

    base: eqx.nn.Linear
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = eqx.field(static=True)
    fold: bool = eqx.field(static=True, default=False)

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        if self.fold:
            y = _folded_weight(self) @ x
            return y if self.base.bias is None else y + self.base.bias
        update = self.lora_b @ (self.lora_a @ x)
        return self.base(x) + (self.scale * update).astype(x.dtype)


def _folded_weight(node: LoraLinear) -> jax.Array:
    """``W + scale * B @ A``, computed in float32 and cast to the weight's dtype (the merged layer's weight)."""
    delta = (node.lora_b.astype(jnp.float32) @ node.lora_a.astype(jnp.float32)) * node.scale
    return (node.base.weight.astype(jnp.float32) + delta).astype(node.base.weight.dtype)


def _is_linear(node: Any) -> bool:
    return isinstance(node, eqx.nn.Linear)


def _is_lora(node: Any) -> bool:
    return isinstance(node, LoraLinear)


def _linears(module: Any) -> list[tuple[str, eqx.nn.Linear]]:
    """Every `eqx.nn.Linear` of `module` with vector input and output, by part path (``layers[0]``)."""
    flat = jax.tree_util.tree_flatten_with_path(module, is_leaf=_is_linear)[0]
    return [
        (jax.tree_util.keystr(path).lstrip("."), node)
        for path, node in flat
        if _is_linear(node) and node.in_features != "scalar" and node.out_features != "scalar"
    ]


def linear_paths(module: Any) -> list[str]:
    """The part paths of `module`'s linear layers (what `optimizer_config.lora.targets` select from)."""
    return [path for path, _ in _linears(module)]


def targets(module: Any, settings: LoraSettings, model: str) -> list[str]:
    """The part paths the adapters go on (`select_targets` over `linear_paths`; errors name `model`)."""
    return select_targets(linear_paths(module), settings, model)


@functools.partial(jax.jit, static_argnames=("shapes",))
def _init(key: jax.Array, shapes: tuple[tuple[int, int, int], ...]) -> list[tuple[jax.Array, jax.Array]]:
    """Each adapter's ``(A, B)`` for ``(rank, in, out)`` in `shapes`: ``A`` uniform in ``±1/sqrt(in)`` (the bound
    `eqx.nn.Linear` draws its weights in), ``B`` zeros.

    One draw of ``uniform(fold_in(key, LORA_SALT), -1, 1)`` for every ``A``, cut in order and scaled, in one small
    compiled program (a draw per adapter compiled a random-bits expansion each: seconds on a small CPU).
    """
    sizes = [rank * fan_in for rank, fan_in, _ in shapes]
    bits = jax.random.uniform(jax.random.fold_in(key, LORA_SALT), (sum(sizes),), jnp.float32, -1.0, 1.0)
    out, start = [], 0
    for (rank, fan_in, fan_out), size in zip(shapes, sizes):
        a = bits[start : start + size].reshape(rank, fan_in) * np.float32(1.0 / np.sqrt(fan_in))
        out.append((a, jnp.zeros((fan_out, rank), jnp.float32)))
        start += size
    return out


def _folds(module: Any) -> bool:
    """Whether `module`'s adapters compute in the folded form: the zoo's transformers (see `LoraLinear`)."""
    from ._transformer import LanguageModel, SequenceClassifier

    return isinstance(module, (LanguageModel, SequenceClassifier))


def attach(module: Any, settings: LoraSettings, key: jax.Array, model: str) -> tuple[Any, list[str]]:
    """`module` with a `LoraLinear` in place of each targeted linear layer, and the targeted paths.

    ``A`` comes from `key` (the stage's init key), ``B`` is zeros: the model computes what `module` computes.
    """
    chosen = set(targets(module, settings, model))
    layers = [(path, node) for path, node in _linears(module) if path in chosen]
    fold = _folds(module)
    shapes = tuple((settings.rank, int(node.in_features), int(node.out_features)) for _, node in layers)
    wrapped = [
        LoraLinear(
            base=node,
            lora_a=a if a.dtype == node.weight.dtype else a.astype(node.weight.dtype),
            lora_b=b if b.dtype == node.weight.dtype else b.astype(node.weight.dtype),
            scale=settings.scale,
            fold=fold,
        )
        for (_, node), (a, b) in zip(layers, _init(key, shapes))
    ]
    chosen_at = [i for i, (path, _) in enumerate(_linears(module)) if path in chosen]

    def where(m: Any) -> list[Any]:
        found = [node for _, node in _linears(m)]
        return [found[i] for i in chosen_at]

    out = eqx.tree_at(where, module, replace=wrapped) if wrapped else module
    return out, [path for path, _ in layers]


def _wrappers(module: Any) -> list[LoraLinear]:
    return [n for n in jax.tree.leaves(module, is_leaf=_is_lora) if _is_lora(n)]


def trainable(module: Any) -> Any:
    """The filter (a tree of bools) that is ``True`` at the adapters' arrays and ``False`` everywhere else."""
    spec = jax.tree.map(lambda _: False, module)
    count = len(_wrappers(module))
    return eqx.tree_at(
        lambda m: [w.lora_a for w in _wrappers(m)] + [w.lora_b for w in _wrappers(m)],
        spec,
        replace=[True] * (2 * count),
    )


@eqx.filter_jit
def _merged(module: Any) -> Any:
    def fold(node: Any) -> Any:
        if not _is_lora(node):
            return node
        return eqx.tree_at(lambda lin: lin.weight, node.base, _folded_weight(node))

    return jax.tree.map(fold, module, is_leaf=_is_lora)


def merge(module: Any) -> Any:
    """`module` with every `LoraLinear` folded into a plain linear layer: ``W + scale * B @ A`` (bias kept)."""
    return _merged(module) if _wrappers(module) else module


class StageAdapters(NamedTuple):
    """What a LoRA stage keeps besides its train state.

    Attributes:
        settings: The resolved ``optimizer_config.lora``.
        digest: The sha256 of the frozen model's weights (`ModelOp.weights_hash`) as 32 bytes: the checkpoints'
            ``base``, in place of the weights.
        info: What the artifact's ``backend_info.lora`` records: rank, alpha, the targeted layers, the digest.
    """

    settings: LoraSettings
    digest: np.ndarray
    info: dict[str, Any]

    def check_base(self, saved: Any) -> None:
        """Refuse a checkpoint whose adapters were trained on another base model than this stage's."""
        got = np.asarray(saved).tobytes().hex()
        if got != self.digest.tobytes().hex():
            raise ConfigError(
                f"this LoRA checkpoint's adapters were trained on a base model with weights sha256:{got}, but the "
                f"stage starts from {self.info['base_weights']}: resume from the model the adapters were trained on "
                "(the same previous stage and seed)"
            )


def start_adapters(
    model_op: Any, module: Any, settings: LoraSettings, key: jax.Array
) -> tuple[Any, Any, StageAdapters]:
    """A stage's model with its adapters attached (`attach`, ``A`` from `key`), the filter of the adapters'
    arrays (`trainable`) and the `StageAdapters`; the frozen base is named by its weights' digest."""
    base_hash = model_op.bind(module, check=False).weights_hash()
    module, paths = attach(module, settings, key, describe(model_op))
    digest = np.frombuffer(bytes.fromhex(base_hash.split(":", 1)[1]), dtype=np.uint8).copy()
    info = {"rank": settings.rank, "alpha": settings.alpha, "targets": paths, "base_weights": base_hash}
    return module, trainable(module), StageAdapters(settings, digest, info)


def describe(model_op: Any) -> str:
    """How errors name a model: ``the 'mlp' model``."""
    factory = getattr(model_op, "factory", None)
    return f"the {factory!r} model" if factory else repr(model_op)


def check_lora(loop: Any, stage: str) -> None:
    """Pre-flight: refuse `optimizer_config.lora` with the fields it cannot go with, and targets that select no
    linear layer of the stage's architecture (traced abstractly: nothing is built)."""
    from ._tree import abstract

    settings = lora_settings(loop.optimizer_config)
    if settings is None:
        return
    clash = [
        (name, why)
        for name, value, why in (
            ("param_groups", loop.param_groups, "LoRA trains only the adapters; groups would select frozen weights"),
            ("carry", loop.carry, "the adapters' optimizer state starts fresh"),
            ("init_from", loop.init_from, "the stage starts from the previous stage's model, adapters from zero"),
        )
        if value
    ]
    if clash:
        name, why = clash[0]
        raise ConfigError(
            f"stage {stage!r}: optimizer_config.lora cannot be combined with TrainingLoop.{name} ({why}); remove one"
        )
    module = loop.model_op.module if loop.model_op.module is not None else abstract(loop.model_op)
    try:
        targets(module, settings, describe(loop.model_op))
    except ConfigError as e:
        raise ConfigError(f"stage {stage!r}: {e}") from None
