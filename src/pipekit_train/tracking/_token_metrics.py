"""Whole-split metrics of sequence models: `Perplexity` and `TokenAccuracy`, over the tokens that count.

Both read the model's logits ``(batch, T, vocab)`` and the target token ids ``(batch, T)``; with ``shift`` (the
default, a causal language model) position ``t`` is scored against token ``t + 1``, and a target equal to
``pad_id`` never counts. Their states are sums (summed negative log-likelihood, correct tokens, counted tokens), so
the result is exact over the whole split, not a mean of per-batch values: ``perplexity`` is
``exp(total NLL / counted tokens)``.
"""

from __future__ import annotations

import math
from typing import Any

from pipekit import ConfigError

from ..losses._tokens import token_cross_entropy
from ._metrics import Metric, _ratio

__all__ = ["Perplexity", "TokenAccuracy"]


class _TokenMetric(Metric, register=False):
    pad_id: int = 258
    shift: bool = True

    def validate(self) -> None:
        if self.pad_id < 0:
            raise ConfigError(f"{type(self).__name__}.pad_id must be a non-negative token id, got {self.pad_id}")

    def init(self) -> Any:
        import jax.numpy as jnp

        zero = jnp.zeros((), jnp.int32)
        return {"nll": jnp.zeros((), jnp.float32), "correct": zero, "count": zero}

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        nll, correct, count = token_cross_entropy(
            y_pred, y_true, pad_id=self.pad_id, shift=self.shift, owner=type(self).__name__
        )
        return {
            "nll": state["nll"] + nll,
            "correct": state["correct"] + correct.astype(state["correct"].dtype),
            "count": state["count"] + count.astype(state["count"].dtype),
        }


class Perplexity(_TokenMetric):
    """``exp`` of the mean negative log-likelihood per counted token over the split. Names: ``perplexity``.

    Args:
        pad_id: the padding id, never counted (the byte tokenizer's ``PAD``, 258).
        shift: score position ``t`` against token ``t + 1`` (a causal language model); ``false`` scores each
            position against its own target (masked language modelling).
    """

    def compute(self, state: Any) -> dict[str, float]:
        return {"perplexity": math.exp(_ratio(state["nll"], state["count"]))}


class TokenAccuracy(_TokenMetric):
    """The fraction of counted tokens whose highest logit is the target token. Names: ``token_accuracy``.

    Args:
        pad_id: the padding id, never counted (the byte tokenizer's ``PAD``, 258).
        shift: score position ``t`` against token ``t + 1`` (a causal language model), else each position.
    """

    def compute(self, state: Any) -> dict[str, float]:
        return {"token_accuracy": _ratio(state["correct"], state["count"])}
