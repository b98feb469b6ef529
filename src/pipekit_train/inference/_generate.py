"""`generate`: sample text from a trained language model, a quick look that pretraining worked (nothing recorded).

The model is the one an artifact (or a model URI with its artifact in the store) names; its training stage's
`TextSource` gives the tokenizer and the window (``seq_len``): a trained BPE is the one the artifact recorded
(``source_statistics``: its JSON text, read back with ``tokenizers``, never retrained). The prompt is encoded
(``BOS`` and its tokens), and
each new token is drawn from the logits at the last position of the window, which holds the latest ``seq_len``
tokens padded with ``PAD`` (a causal model never looks at the padding after the position it predicts from), so one
compiled forward pass serves every step. Sampling is on the host with NumPy: token ``i`` from
``default_rng([seed, i])``, the logits divided by `temperature` (``0``: the most likely token). It stops after
`max_new_tokens` or at ``EOS``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipekit import ConfigError

__all__ = ["generate"]


def _text_source(loop: Any, model: str, why_not: str) -> Any:
    from ..data._text import TextSource

    source = getattr(getattr(loop, "dataset", None), "source", None) if loop is not None else None
    if not isinstance(source, TextSource):
        reason = why_not or f"its training data is a {type(source).__name__}, not a TextSource"
        raise ConfigError(f"generate {model}: needs a language model trained on a TextSource: {reason}")
    return source


def generate(
    model: str,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    seed: int = 0,
    store: Any = None,
) -> str:
    """The prompt's continuation: up to `max_new_tokens` tokens sampled from the language model `model` names.

    Args:
        model: an artifact id (or a unique prefix) in `store`, or a model URI whose artifact is in `store`.
        prompt: the text to continue.
        max_new_tokens: how many tokens to sample at most (a positive int).
        temperature: the logits are divided by it (``0``: always the most likely token).
        seed: a non-negative int; the same seed gives the same text.
        store: the artifact store (a path, an `ArtifactStore`, or ``None`` for the default).
    """
    from ..data._tokenizer import EOS, PAD
    from ..provenance._store import ArtifactStore
    from ._evaluate import _training_loop
    from ._export import _resolve

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ConfigError(f"generate: temperature must be a number >= 0, got {temperature!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"generate: seed must be a non-negative int, got {seed!r}")
    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    bound, artifact, _ = _resolve(model, store, None)
    loop, why_not = _training_loop(artifact)
    source = _text_source(loop, model, why_not)
    recorded = dict(getattr(artifact, "source_statistics", None) or {})
    if source.setting.kind != "bytes" and "tokenizer" not in recorded:
        raise ConfigError(
            f"generate {model}: its TextSource.tokenizer is {source.setting.text()}, but the artifact recorded no "
            "trained tokenizer (source_statistics.tokenizer)"
        )
    tokenizer = source.with_fitted(recorded, f"generate {model}").text_tokenizer()
    window = int(source.seq_len)
    ids = list(tokenizer.encode(prompt, eos=False))
    new: list[int] = []
    for i in range(max_new_tokens):
        context = ids[-window:]
        tokens = np.full((1, window), PAD, np.int32)
        tokens[0, : len(context)] = context
        out = np.asarray(bound(tokens))
        if out.ndim != 3 or out.shape[:2] != (1, window):
            raise ConfigError(
                f"generate {model}: the model gives {out.shape[1:]} per example, not next-token logits "
                f"({window}, vocab): it is not a language model (a transformer, not a transformer_classifier)"
            )
        logits = out[0, len(context) - 1].astype(np.float64)
        if temperature == 0:
            token = int(np.argmax(logits))
        else:
            z = logits / float(temperature)
            p = np.exp(z - z.max())
            token = int(np.random.default_rng([seed, i]).choice(len(p), p=p / p.sum()))
        if token == EOS:
            break
        ids.append(token)
        new.append(token)
    return str(tokenizer.decode(new))
