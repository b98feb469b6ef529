"""Token losses for sequence models: `NextTokenCrossEntropy` (causal language modelling) and
`MaskedTokenCrossEntropy` (masked language modelling), with padding left out of both.

`predicted` holds logits ``(..., T, vocab)``; `target` the token ids ``(..., T)`` (integer). A target equal to
`pad_id` counts nowhere (its loss and accuracy are masked out; the mean is over the counted tokens). The logits are
cast to float32 before the softmax, so a bfloat16 forward pass (``precision: {compute: bfloat16}``) still gets a
float32 loss. `token_cross_entropy` is the one computation both losses and the `Perplexity` and `TokenAccuracy`
metrics share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pipekit import ConfigError, ShapeError

from ._loss import Loss
from ._targets import TargetContract

if TYPE_CHECKING:
    import jax

__all__ = ["TOKEN_TARGETS", "MaskedTokenCrossEntropy", "NextTokenCrossEntropy", "token_cross_entropy"]

#: The byte tokenizer's padding id (``pipekit_train.data._tokenizer.PAD``; the losses sit below the data layer).
_PAD = 258


def _check_token_targets(predicted: Any, target: Any) -> str | None:
    import numpy as np

    if not hasattr(predicted, "shape") or not hasattr(target, "shape"):
        return f"the predictions are a {type(predicted).__name__}, not one array of logits"
    if np.dtype(target.dtype).kind not in "iu":
        return f"the targets are {target.dtype} of shape {tuple(target.shape)}, not integer token ids"
    if tuple(target.shape) != tuple(predicted.shape)[:-1] or len(target.shape) < 2:
        return (
            f"token ids {tuple(target.shape)} need logits of shape {tuple(target.shape)} + (vocab,) with a sequence "
            f"axis, got predictions of shape {tuple(predicted.shape)}"
        )
    return None


#: Integer token ids ``(batch, T)`` for logits ``(batch, T, vocab)``.
TOKEN_TARGETS = TargetContract(
    "integer token ids of the predictions' shape without the last axis, with a sequence axis", _check_token_targets
)


def token_cross_entropy(
    logits: Any, target: Any, *, pad_id: int, shift: bool, owner: str = "token loss"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(summed negative log-likelihood, correct predictions, counted tokens)`` over the tokens that count.

    With `shift`, position ``t`` predicts token ``t + 1`` (the last position predicts nothing).
    """
    import jax
    import jax.numpy as jnp

    logits, target = jnp.asarray(logits), jnp.asarray(target)
    if not jnp.issubdtype(target.dtype, jnp.integer) or target.shape != logits.shape[:-1] or target.ndim < 1:
        raise ShapeError(
            f"{owner}: token ids {target.shape} {target.dtype} need logits of shape {target.shape} + (vocab,), got "
            f"{logits.shape}"
        )
    logits = logits.astype(jnp.float32)
    if shift:
        logits, target = logits[..., :-1, :], target[..., 1:]
    counted = target != pad_id
    safe = jnp.clip(target, 0, logits.shape[-1] - 1)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), safe[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == target) & counted
    return jnp.sum(jnp.where(counted, nll, 0.0)), jnp.sum(correct), jnp.sum(counted)


class _TokenLoss(Loss, register=False):
    pad_id: int = _PAD
    shift: ClassVar[bool] = True
    aux_prefix: ClassVar[str] = ""
    targets: ClassVar[TargetContract | None] = TOKEN_TARGETS

    def validate(self) -> None:
        if self.pad_id < 0:
            raise ConfigError(f"{type(self).__name__}.pad_id must be a non-negative token id, got {self.pad_id}")

    def __call__(self, predicted: Any, target: Any) -> tuple[jax.Array, dict[str, jax.Array]]:  # type: ignore[override]  # see Loss.__call__
        import jax.numpy as jnp

        nll, correct, count = token_cross_entropy(
            predicted, target, pad_id=self.pad_id, shift=self.shift, owner=type(self).__name__
        )
        count = jnp.maximum(count, 1)
        return nll / count, {"token_accuracy": correct / count}


class NextTokenCrossEntropy(_TokenLoss):
    """Causal language modelling: the logits at position ``t`` against the token at ``t + 1``, padding masked.

    The target is the input's token ids themselves (``target_key: x``): the loss shifts them. Returns ``(mean loss
    per counted token, {"token_accuracy": ...})``.

    Args:
        pad_id: the padding id, never a target (the byte tokenizer's ``PAD``, 258).

    Example:
        >>> import jax.numpy as jnp
        >>> logits = jnp.zeros((1, 3, 4))  # uniform over 4 tokens
        >>> loss, aux = NextTokenCrossEntropy(pad_id=3)(logits, jnp.array([[0, 1, 3]]))  # one counted target
        >>> round(float(loss), 6), float(aux["token_accuracy"])  # log(4); argmax of a tie is token 0
        (1.386294, 0.0)
    """


class MaskedTokenCrossEntropy(_TokenLoss):
    """Masked language modelling: the logits at each position against the target token there, padding masked.

    The targets hold the original token at each masked position and `pad_id` everywhere else, so only the masked
    positions count (``(mean loss per counted token, {"token_accuracy": ...})``).

    Args:
        pad_id: the id of the positions that do not count (the byte tokenizer's ``PAD``, 258).
    """

    shift: ClassVar[bool] = False
