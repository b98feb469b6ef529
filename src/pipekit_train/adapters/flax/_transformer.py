"""The zoo's transformer in Flax NNX: `LanguageModel` (``transformer``) and `SequenceClassifier`
(``transformer_classifier``), built from pre-norm `Block`\\ s, part for part the Equinox backend's.

The input is a batch of token ids ``(B, T)`` (``T <= max_len``), as everywhere in Flax. Both models share their
first parts: ``embed`` (``tokens`` and learned ``positions``, ``nnx.Embed``) and ``blocks[i]``, each holding
``norm1``, ``attention`` (`Attention`: bias-free ``query_proj``, ``key_proj``, ``value_proj``, ``output_proj``),
``norm2`` and ``mlp`` (``up``, ``down``); then ``norm`` and ``lm_head`` (next-token logits ``(B, T, vocab_size)``)
or ``head`` (class logits, from the mean of the final states over the non-padding tokens). The classifier draws
``embed`` and ``blocks`` from its ``nnx.Rngs`` exactly as the language model does, so the same seed and sizes give
the same weights and ``Transfer(paths={embed: embed, blocks: blocks})`` hands a pretrained model's over. Padding
tokens (`pad_id`) are never attended to.

The arithmetic is the Equinox module's (``equinox.nn.MultiheadAttention``: queries scaled before the product,
masked logits set to the dtype's minimum, the softmax in at least float32; ``LayerNorm`` with ``eps`` 1e-5), so a
converted model gives the same outputs to float rounding. Dropout (attention weights, and each residual branch)
draws from ``nnx.Dropout`` streams kept in the module, which the backend reseeds from ``(seed, step)`` before every
training step. ``remat`` wraps each block in ``nnx.remat``: its activations are recomputed in the backward pass,
the numbers are the same.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pipekit import ConfigError, ShapeError
from pipekit_train.backends.kit import check_transformer_sizes, default_pad_id

__all__ = ["Attention", "Block", "Embed", "LanguageModel", "Mlp", "SequenceClassifier"]


def _layer_norm(d_model: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """``equinox.nn.LayerNorm(d_model)``'s numbers: ``eps`` 1e-5, the variance as ``mean((x - mean)**2)``."""
    return nnx.LayerNorm(d_model, epsilon=1e-5, use_fast_variance=False, rngs=rngs)


class Embed(nnx.Module):
    """Token embeddings ``(vocab_size, d_model)`` plus learned position embeddings ``(max_len, d_model)``."""

    def __init__(self, vocab_size: int, d_model: int, max_len: int, *, rngs: nnx.Rngs) -> None:
        self.tokens = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.positions = nnx.Embed(max_len, d_model, rngs=rngs)
        self.max_len = int(max_len)

    def __call__(self, ids: jax.Array) -> jax.Array:
        if ids.ndim != 2 or ids.shape[1] > self.max_len or not jnp.issubdtype(ids.dtype, jnp.integer):
            example = tuple(ids.shape[1:]) if ids.ndim else ()
            raise ShapeError(
                f"a transformer expects ({self.max_len},) or shorter integer token ids per example (max_len "
                f"{self.max_len}), got shape {example} {ids.dtype}"
            )
        return self.tokens.embedding[...][ids] + self.positions.embedding[...][: ids.shape[1]]


class Attention(nnx.Module):
    """Multi-head self-attention as ``equinox.nn.MultiheadAttention`` computes it: four bias-free projections
    (``query_proj``, ``key_proj``, ``value_proj``, ``output_proj``) and dropout on the attention weights."""

    def __init__(self, d_model: int, num_heads: int, dropout: float, *, rngs: nnx.Rngs) -> None:
        self.num_heads = int(num_heads)
        self.query_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.key_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.value_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.output_proj = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """`x` ``(B, T, d_model)``; `mask` ``(B, T, T)``: query ``i`` may attend to key ``j``."""
        b, t, d = x.shape
        heads = (b, t, self.num_heads, d // self.num_heads)
        q = self.query_proj(x).reshape(heads) / math.sqrt(heads[-1])
        k, v = self.key_proj(x).reshape(heads), self.value_proj(x).reshape(heads)
        logits = jnp.einsum("bshd,bShd->bhsS", q, k)
        logits = jnp.where(mask[:, None], logits, jnp.finfo(logits.dtype).min)  # type: ignore[no-untyped-call]
        weights = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32))).astype(logits.dtype)
        weights = self.dropout(weights)
        return self.output_proj(jnp.einsum("bhsS,bShd->bshd", weights, v).reshape(b, t, d))


class Mlp(nnx.Module):
    """``down(gelu(up(x)))``: ``d_model -> mlp_ratio * d_model -> d_model``."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(d_model, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """A pre-norm block: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))``, each with dropout."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, dropout: float, *, rngs: nnx.Rngs) -> None:
        self.norm1 = _layer_norm(d_model, rngs)
        self.attention = Attention(d_model, num_heads, dropout, rngs=rngs)
        self.norm2 = _layer_norm(d_model, rngs)
        self.mlp = Mlp(d_model, mlp_ratio * d_model, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.dropout(self.attention(self.norm1(x), mask))
        return x + self.dropout(self.mlp(self.norm2(x)))


def _call_block(block: Block, x: jax.Array, mask: jax.Array) -> jax.Array:
    return block(x, mask)


#: A block recomputed in the backward pass (``remat: true``); NNX lifts its RNG streams through the checkpoint.
_remat_block = nnx.remat(_call_block)


def _mask(ids: jax.Array, pad_id: int, causal: bool) -> jax.Array:
    """``(B, T, T)``: query ``i`` attends to key ``j`` when ``j`` is not padding (and ``j <= i`` if causal), or
    ``i == j``."""
    b, n = ids.shape
    allowed = jnp.broadcast_to((ids != pad_id)[:, None, :], (b, n, n))
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((n, n), bool))
    return allowed | jnp.eye(n, dtype=bool)


class _Trunk(nnx.Module):
    """What both models share: ``embed``, ``blocks``, ``norm`` and the settings (static: in the graph definition)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        max_len: int,
        mlp_ratio: int,
        causal: bool,
        dropout: float,
        pad_id: int | None,
        remat: bool,
        rngs: nnx.Rngs,
    ) -> None:
        check_transformer_sizes(vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, dropout)
        self.embed = Embed(vocab_size, d_model, max_len, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, num_heads, mlp_ratio, dropout, rngs=rngs) for _ in range(num_layers)])
        self.norm = _layer_norm(d_model, rngs)
        self.causal, self.remat = bool(causal), bool(remat)
        self.pad_id = default_pad_id(vocab_size) if pad_id is None else int(pad_id)

    @property
    def expected_input(self) -> str:
        return f"({self.embed.max_len},) or shorter integer token ids"

    def states(self, ids: jax.Array) -> jax.Array:
        """The final normalised states ``(B, T, d_model)``."""
        x = self.embed(ids)
        mask = _mask(ids, self.pad_id, self.causal)
        for block in self.blocks:
            x = _remat_block(block, x, mask) if self.remat else block(x, mask)
        out: jax.Array = self.norm(x)
        return out


class LanguageModel(_Trunk):
    """``embed``, ``blocks``, ``norm``, ``lm_head``: token ids ``(B, T)`` to next-token logits
    ``(B, T, vocab_size)``."""

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
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(
            vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, causal, dropout, pad_id, remat, rngs
        )
        self.lm_head = nnx.Linear(d_model, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.lm_head(self.states(ids))


class SequenceClassifier(_Trunk):
    """``embed``, ``blocks``, ``norm`` (a language model's), ``head``: token ids ``(B, T)`` to class logits."""

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
        rngs: nnx.Rngs,
    ) -> None:
        if num_classes < 2:
            raise ConfigError(f"transformer_classifier: num_classes must be an int >= 2, got {num_classes}")
        super().__init__(
            vocab_size, d_model, num_heads, num_layers, max_len, mlp_ratio, causal, dropout, pad_id, remat, rngs
        )
        self.head = nnx.Linear(d_model, num_classes, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        states = self.states(ids)
        keep = (ids != self.pad_id).astype(states.dtype)[..., None]
        pooled = jnp.sum(states * keep, axis=1) / jnp.maximum(jnp.sum(keep, axis=1), 1)
        return self.head(pooled)
