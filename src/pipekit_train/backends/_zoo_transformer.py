"""The zoo's transformers across backends: ``transformer`` and ``transformer_classifier`` as one signature every
backend's factory has (`transformer_factory`), one canonical list of weights (`transformer_weights`), the size
checks every backend's factory makes (`check_transformer_sizes`), and the converters between the Equinox and Flax
backends derived from them.

A transformer is not a chain of the zoo's dense and conv layers (`_zoo`), so it has a description of its own: each
weight is an ``embedding`` table ``(num, d_model)``, a layer ``norm`` (scale and bias ``(d_model,)``) or a ``dense``
layer (canonical kernel ``(in, out)``, a bias or none), at its path (``("blocks", 0, "attention", "query_proj")``),
listed in the Equinox module's tree order. Each backend names and lays them out its own way (Equinox ``weight``
``(out, in)``; Flax ``kernel`` ``(in, out)``, ``scale``, ``embedding``); converting is a transpose at most, so
converting back gives the same arrays bit for bit.

Cheap to import: the standard library and `pipekit` only; NumPy is imported when a converter runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipekit import ConfigError

from ._convert import register_converter
from ._zoo import factory

__all__ = [
    "TRANSFORMERS",
    "TransformerWeight",
    "check_transformer_sizes",
    "convert_transformer",
    "default_pad_id",
    "transformer_factory",
    "transformer_from_canonical",
    "transformer_to_canonical",
    "transformer_weights",
]

Path = tuple[str | int, ...]

#: The zoo's transformer factories (registered by the Equinox and the Flax backends with the same kwargs).
TRANSFORMERS = ("transformer", "transformer_classifier")


def check_transformer_sizes(
    vocab_size: int, d_model: int, num_heads: int, num_layers: int, max_len: int, mlp_ratio: int, dropout: float
) -> None:
    """One `pipekit.ConfigError` naming the first size that cannot build a transformer (every backend's check)."""
    sizes = {
        "vocab_size": vocab_size,
        "d_model": d_model,
        "num_heads": num_heads,
        "num_layers": num_layers,
        "max_len": max_len,
        "mlp_ratio": mlp_ratio,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"transformer: {name} must be a positive int, got {value}")
    if d_model % num_heads:
        raise ConfigError(f"transformer: d_model ({d_model}) must be a multiple of num_heads ({num_heads})")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"transformer: dropout must be in [0, 1), got {dropout}")


def _transformer(
    vocab_size: int,
    d_model: int,
    num_heads: int,
    num_layers: int,
    max_len: int,
    mlp_ratio: int = 4,
    causal: bool = True,
    dropout: float = 0.0,
    pad_id: int | None = None,
    remat: bool = False,
) -> dict[str, Any]:
    """A pre-norm transformer language model: token ids `(T,)` to next-token logits `(T, vocab_size)` (with a
    leading batch axis on Flax); parts ``embed``, ``blocks[i]`` (``attention``, ``mlp.up``, ``mlp.down``), ``norm``,
    ``lm_head``.

    `pad_id` (default 258, the ``PAD`` of the byte tokenizer and of a trained BPE; ``vocab_size - 1`` for a vocabulary
    of 258 ids or fewer) is never attended to; `remat` recomputes each block in the backward pass.
    """
    return {"factory": "transformer", **locals()}


def _transformer_classifier(
    vocab_size: int,
    d_model: int,
    num_heads: int,
    num_layers: int,
    max_len: int,
    num_classes: int,
    mlp_ratio: int = 4,
    causal: bool = True,
    dropout: float = 0.0,
    pad_id: int | None = None,
    remat: bool = False,
) -> dict[str, Any]:
    """``transformer``'s ``embed`` and ``blocks`` (same arguments: they take a pretrained language model's weights),
    then ``norm`` and a ``head`` on the mean of the states over the non-padding tokens: class logits.
    """
    return {"factory": "transformer_classifier", **locals()}


_SIGNATURES: dict[str, Callable[..., dict[str, Any]]] = {
    "transformer": _transformer,
    "transformer_classifier": _transformer_classifier,
}


def transformer_factory(name: str, build: Callable[[dict[str, Any], Any], Any], module: str) -> Any:
    """Backend factory `name` (one of `TRANSFORMERS`): ``build(arguments, key)``, where `arguments` holds every
    argument with its default filled in and ``factory`` (the name), under the one signature and docstring every
    backend registers, so each backend's registry checks kwargs alike."""
    return factory(name, build, module, key=True, describe=_SIGNATURES[name])


#: The tokenizers' padding id: the byte tokenizer's ``PAD`` and a trained BPE's (both keep 256-258 for BOS/EOS/PAD).
PAD = 258


def default_pad_id(vocab_size: int) -> int:
    """The padding id when `pad_id` is not given: the tokenizers' ``PAD`` (258) when the vocabulary holds it (the byte
    tokenizer's 259 ids, a BPE's more, or 260 with a ``MaskTokens`` mask id), else the last id."""
    return PAD if vocab_size > PAD else vocab_size - 1


@dataclass(frozen=True)
class TransformerWeight:
    """One weighted layer of a transformer: an ``embedding``, a ``norm`` or a ``dense`` layer (with a `bias` or not)
    at `path`."""

    path: Path
    kind: str
    bias: bool = True


def transformer_weights(factory: str, kwargs: Mapping[str, Any]) -> list[TransformerWeight]:
    """The weighted layers of `factory` (``transformer`` or ``transformer_classifier``) for `kwargs`, in the order
    of the Equinox module's leaves: ``embed``, ``blocks[i]`` (``norm1``, ``attention``'s four bias-free projections,
    ``norm2``, ``mlp.up``, ``mlp.down``), ``norm``, then ``lm_head`` (no bias) or ``head``."""
    W = TransformerWeight
    out = [W(("embed", "tokens"), "embedding"), W(("embed", "positions"), "embedding")]
    for i in range(int(kwargs["num_layers"])):
        block: Path = ("blocks", i)
        out.append(W((*block, "norm1"), "norm"))
        out += [W((*block, "attention", p), "dense", False) for p in ("query_proj", "key_proj", "value_proj")]
        out += [W((*block, "attention", "output_proj"), "dense", False), W((*block, "norm2"), "norm")]
        out += [W((*block, "mlp", "up"), "dense"), W((*block, "mlp", "down"), "dense")]
    out.append(W(("norm",), "norm"))
    out.append(W(("lm_head",), "dense", False) if factory == "transformer" else W(("head",), "dense"))
    return out


#: Each backend's leaf names per kind (the first is the table, scale or kernel; the second the bias) and whether a
#: dense kernel is ``(in, out)``.
_LEAVES: dict[str, dict[str, tuple[str, ...]]] = {
    "equinox": {"embedding": ("weight",), "norm": ("weight", "bias"), "dense": ("weight", "bias")},
    "flax": {"embedding": ("embedding",), "norm": ("scale", "bias"), "dense": ("kernel", "bias")},
}
_IN_OUT = {"equinox": False, "flax": True}


def _name(path: Path, leaf: str) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in (*path, leaf))


def _leaves(backend: str, weight: TransformerWeight) -> tuple[str, ...]:
    leaves = _LEAVES[backend][weight.kind]
    return leaves if weight.kind != "dense" or weight.bias else leaves[:1]


def transformer_to_canonical(
    backend: str, factory: str, kwargs: Mapping[str, Any], weights: Mapping[str, Any]
) -> dict[Path, tuple[Any, ...]]:
    """`weights` (a transformer of `backend`, by its names) as ``{path: arrays}``: a table; a scale and a bias; a
    kernel ``(in, out)`` and its bias when it has one."""
    import numpy as np

    out: dict[Path, tuple[Any, ...]] = {}
    for weight in transformer_weights(factory, kwargs):
        arrays = [np.asarray(weights[_name(weight.path, leaf)]) for leaf in _leaves(backend, weight)]
        if weight.kind == "dense" and not _IN_OUT[backend]:
            arrays[0] = arrays[0].T
        out[weight.path] = tuple(np.ascontiguousarray(a) for a in arrays)
    return out


def transformer_from_canonical(
    backend: str, factory: str, kwargs: Mapping[str, Any], canonical: Mapping[Path, tuple[Any, ...]]
) -> dict[str, Any]:
    """The canonical ``{path: arrays}`` as the weights of a `backend` transformer, by its names, in the Equinox
    module's order (the order Equinox's ``with_weights`` wants)."""
    import numpy as np

    out: dict[str, Any] = {}
    for weight in transformer_weights(factory, kwargs):
        arrays = list(canonical[weight.path])
        if weight.kind == "dense" and not _IN_OUT[backend]:
            arrays[0] = arrays[0].T
        for leaf, array in zip(_leaves(backend, weight), arrays, strict=True):
            out[_name(weight.path, leaf)] = np.ascontiguousarray(array)
    return out


def convert_transformer(model: Any, dst_backend: str) -> Any:
    """A bound ``transformer`` or ``transformer_classifier`` as a bound model of `dst_backend`: the same factory,
    kwargs and function."""
    from ._zoo import converted_op

    factory, kwargs = model.factory, model.kwargs
    canonical = transformer_to_canonical(model.backend, factory, kwargs, model.weights())
    return converted_op(model, dst_backend).with_weights(
        transformer_from_canonical(dst_backend, factory, kwargs, canonical)
    )


def _converter(src: str, dst: str, name: str) -> Callable[[Any], Any]:
    from ._zoo import converted_op

    def fn(model: Any) -> Any:
        return convert_transformer(model, dst)

    fn.architecture = lambda model: converted_op(model, dst)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = f"{src}_{name}_to_{dst}"
    fn.__doc__ = f"A {src} ``{name}`` as a {dst} ``{name}``: the same kwargs, the weights in its layout."
    return fn


for _src, _dst in (("equinox", "flax"), ("flax", "equinox")):
    for _name_ in TRANSFORMERS:
        register_converter(_src, _dst, _name_)(_converter(_src, _dst, _name_))
