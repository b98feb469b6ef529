"""The zoo's transformer in Equinox: `LanguageModel` (``transformer``) and `SequenceClassifier`
(``transformer_classifier``), built from pre-norm `Block`\\ s.

One example is a ``(T,)`` integer array of token ids (``T <= max_len``). Both models share their first parts:
``embed`` (token and learned position embeddings) and ``blocks[i]``, each holding ``attention`` (an
``equinox.nn.MultiheadAttention``: ``query_proj``, ``key_proj``, ``value_proj``, ``output_proj``) and ``mlp``
(``up``, ``down``); then ``norm`` and ``lm_head`` (the next-token logits, ``(T, vocab_size)``) or ``head`` (class
logits, from the mean of the final states over the non-padding tokens). Built from the same key and sizes, the
classifier's ``embed`` and ``blocks`` are the language model's, so ``Transfer(paths={embed: embed, blocks:
blocks})`` hands a pretrained model's weights over. Padding tokens (`pad_id`) are never attended to.

``remat`` recomputes each block's activations in the backward pass (``equinox.filter_checkpoint``) instead of
keeping them: less memory, the same numbers.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from pipekit import ConfigError, ShapeError
from pipekit_train.backends.kit import check_transformer_sizes as check_sizes
from pipekit_train.backends.kit import default_pad_id

__all__ = ["Block", "Embed", "LanguageModel", "Mlp", "SequenceClassifier", "check_sizes"]


class Embed(eqx.Module):
    """Token embeddings ``(vocab_size, d_model)`` plus learned position embeddings ``(max_len, d_model)``."""

    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding

    def __init__(self, vocab_size: int, d_model: int, max_len: int, *, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        self.tokens = eqx.nn.Embedding(vocab_size, d_model, key=k1)
        self.positions = eqx.nn.Embedding(max_len, d_model, key=k2)

    def __call__(self, ids: jax.Array) -> jax.Array:
        max_len = self.positions.num_embeddings
        if ids.ndim != 1 or ids.shape[0] > max_len or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ShapeError(
                f"a transformer expects ({max_len},) or shorter integer token ids (max_len {max_len}), got shape "
                f"{ids.shape} {ids.dtype}"
            )
        return self.tokens.weight[ids] + self.positions.weight[: ids.shape[0]]


class Mlp(eqx.Module):
    """``down(gelu(up(x)))``: ``d_model -> mlp_ratio * d_model -> d_model``."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d_model: int, hidden: int, *, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d_model, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, d_model, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(eqx.Module):
    """A pre-norm block: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))``, each with dropout."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: Mlp
    dropout: eqx.nn.Dropout

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, dropout: float, *, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(d_model)
        self.attention = eqx.nn.MultiheadAttention(num_heads, d_model, dropout_p=dropout, key=k1)
        self.norm2 = eqx.nn.LayerNorm(d_model)
        self.mlp = Mlp(d_model, mlp_ratio * d_model, key=k2)
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(self, x: jax.Array, mask: jax.Array, key: Any) -> jax.Array:
        off = key is None
        k1, k2, k3 = jax.random.split(key, 3) if key is not None else (None, None, None)
        h = jax.vmap(self.norm1)(x)
        h = self.attention(h, h, h, mask=mask, key=k1, inference=True if off else None)
        x = x + self.dropout(h, key=k2, inference=True if off else None)
        h = jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return x + self.dropout(h, key=k3, inference=True if off else None)


def _run_blocks(blocks: tuple[Block, ...], x: jax.Array, mask: jax.Array, key: Any, remat: bool) -> jax.Array:
    keys = jax.random.split(key, len(blocks)) if key is not None else [None] * len(blocks)
    for block, k in zip(blocks, keys, strict=True):
        call = eqx.filter_checkpoint(type(block).__call__) if remat else type(block).__call__
        x = call(block, x, mask, k)
    return x


def _mask(ids: jax.Array, pad_id: int, causal: bool) -> jax.Array:
    """``(T, T)``: query ``i`` attends to key ``j`` when ``j`` is not padding (and ``j <= i`` if causal), or
    ``i == j``."""
    n = ids.shape[0]
    allowed = jnp.broadcast_to(ids[None, :] != pad_id, (n, n))
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((n, n), bool))
    return allowed | jnp.eye(n, dtype=bool)


class _Trunk(eqx.Module):
    """What both models share: ``embed``, ``blocks``, ``norm`` and the settings."""

    embed: Embed
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    causal: bool = eqx.field(static=True)
    pad_id: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    @property
    def expected_input(self) -> str:
        return f"({self.embed.positions.num_embeddings},) or shorter integer token ids"

    def states(self, ids: jax.Array, key: Any) -> jax.Array:
        """The final normalised states ``(T, d_model)``."""
        x = self.embed(ids)
        x = _run_blocks(self.blocks, x, _mask(ids, self.pad_id, self.causal), key, self.remat)
        return jax.vmap(self.norm)(x)


def _trunk_parts(
    vocab_size: int,
    d_model: int,
    num_heads: int,
    num_layers: int,
    max_len: int,
    mlp_ratio: int,
    dropout: float,
    key: Any,
) -> tuple[Embed, tuple[Block, ...], Any]:
    check_sizes(vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, dropout)
    k_embed, k_blocks, k_head = jax.random.split(key, 3)
    blocks = tuple(Block(d_model, num_heads, mlp_ratio, dropout, key=k) for k in jax.random.split(k_blocks, num_layers))
    return Embed(vocab_size, d_model, max_len, key=k_embed), blocks, k_head


#: ``PAD`` of the byte tokenizer and of a trained BPE (``pipekit_train.data._tokenizer.PAD``; adapters import no
#: private core module).
class LanguageModel(_Trunk):
    """``embed``, ``blocks``, ``norm``, ``lm_head``: token ids ``(T,)`` to next-token logits ``(T, vocab_size)``."""

    lm_head: eqx.nn.Linear

    def __init__(
        self,
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
        *,
        key: Any,
    ) -> None:
        self.embed, self.blocks, k_head = _trunk_parts(
            vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, dropout, key
        )
        self.norm = eqx.nn.LayerNorm(d_model)
        self.lm_head = eqx.nn.Linear(d_model, vocab_size, use_bias=False, key=k_head)
        self.causal, self.remat = bool(causal), bool(remat)
        self.pad_id = default_pad_id(vocab_size) if pad_id is None else int(pad_id)

    def __call__(self, ids: jax.Array, *, key: Any = None) -> jax.Array:
        return jax.vmap(self.lm_head)(self.states(ids, key))


class SequenceClassifier(_Trunk):
    """``embed``, ``blocks``, ``norm`` (a language model's), ``head``: token ids ``(T,)`` to class logits."""

    head: eqx.nn.Linear

    def __init__(
        self,
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
        *,
        key: Any,
    ) -> None:
        if num_classes < 2:
            raise ConfigError(f"transformer_classifier: num_classes must be an int >= 2, got {num_classes}")
        self.embed, self.blocks, k_head = _trunk_parts(
            vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, dropout, key
        )
        self.norm = eqx.nn.LayerNorm(d_model)
        self.head = eqx.nn.Linear(d_model, num_classes, key=k_head)
        self.causal, self.remat = bool(causal), bool(remat)
        self.pad_id = default_pad_id(vocab_size) if pad_id is None else int(pad_id)

    def __call__(self, ids: jax.Array, *, key: Any = None) -> jax.Array:
        states = self.states(ids, key)
        keep = (ids != self.pad_id).astype(states.dtype)[:, None]
        pooled = jnp.sum(states * keep, axis=0) / jnp.maximum(jnp.sum(keep), 1)
        return self.head(pooled)
