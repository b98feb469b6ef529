"""A byte-level BPE tokenizer trained on a `TextSource`'s training split with Hugging Face ``tokenizers``.

``tokenizer: {name: bpe, vocab_size: N, min_frequency: 2}``: `train_bpe` trains a byte-level BPE (GPT-2's
pre-tokenizer: the text's UTF-8 bytes as 256 symbols, split at words, numbers, punctuation and whitespace) on the
training split's documents and returns its **canonical JSON text** (``Tokenizer.to_str``, ids renumbered): the 256
bytes are ids ``0..255`` and ``BOS``, ``EOS``, ``PAD`` are ``256, 257, 258`` as in the byte tokenizer, so padding
masks and the token losses' default ``pad_id`` hold for both; the merged tokens follow from 259 in merge order, at
most ``N`` ids in all. That text is what a stage records with its artifact (``source_statistics``, under its
sha256), so ``generate``, ``evaluate`` and ``predict`` read it back with ``Tokenizer.from_str`` (no retraining, no
pickle).

The training is deterministic: the documents' word counts are summed, the alphabet is the fixed 256 byte symbols,
ties between equally frequent pairs are broken by the pairs' ids, and no continuing-subword prefix is used (the
one source of hash-order ids in ``tokenizers``' trainer); the renumbering depends only on the merges' order.
Special-token text inside a document (``<|eos|>``) is encoded as ordinary bytes, never as the special id.

``tokenizers`` is the ``text`` extra, imported only here and only when a BPE is trained or read.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipekit import ConfigError

from ._tokenizer import BOS, EOS, PAD, VOCAB_SIZE

__all__ = ["SPECIAL_TOKENS", "BpeTokenizer", "bpe_tokenizer", "byte_symbols", "train_bpe"]

#: The special tokens' text in the tokenizer's JSON, at ids ``BOS``, ``EOS``, ``PAD``.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
_TEXT_EXTRA = "pip install 'pipekit-train[text]'"


def _tokenizers(what: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"{what} needs Hugging Face tokenizers: {_TEXT_EXTRA}") from None
    return tokenizers


@functools.cache
def byte_symbols() -> dict[int, str]:
    """GPT-2's map of each byte to the printable character that stands for it in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int) -> str:
    """The canonical JSON text of a byte-level BPE of at most `vocab_size` ids trained on `texts`."""
    tk = _tokenizers("TextSource.tokenizer bpe")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _canonical(json.loads(tok.to_str()))


def _canonical(spec: dict[str, Any]) -> str:
    """`spec` (a trained tokenizer's JSON) with the bytes at ``0..255``, the specials at ``BOS, EOS, PAD`` and the
    merged tokens from 259 in the order their first merge makes them, as compact JSON text."""
    model = spec["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    ids = {symbol: b for b, symbol in byte_symbols().items()}
    ids.update({text: i for text, i in zip(SPECIAL_TOKENS, (BOS, EOS, PAD), strict=True)})
    for a, b in merges:
        ids.setdefault(a + b, len(ids))
    if set(ids) != set(model["vocab"]):  # every token is a byte, a special token or a merge's result
        raise RuntimeError(f"the trained BPE's vocabulary is not bytes, specials and merges: {len(ids)} ids")
    model["vocab"] = dict(sorted(ids.items(), key=lambda kv: kv[1]))
    for added in spec.get("added_tokens") or []:
        added["id"] = ids[added["content"]]
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


class BpeTokenizer:
    """A trained byte-level BPE from its canonical JSON text: `encode`, `decode`, `vocab_size`, `sha256`."""

    def __init__(self, text: str) -> None:
        tk = _tokenizers("a TextSource's bpe tokenizer")
        self.text = text
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self._tok = tk.Tokenizer.from_str(text)
        self._tok.encode_special_tokens = True  # "<|eos|>" in a document is text, not the EOS id
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        fixed = [*(byte_symbols()[b] for b in range(256)), *SPECIAL_TOKENS]
        if self.vocab_size < VOCAB_SIZE or [self._tok.token_to_id(t) for t in fixed] != list(range(VOCAB_SIZE)):
            raise ConfigError(
                f"the recorded BPE tokenizer (sha256 {self.sha256[:12]}) does not hold the bytes at 0..255 and "
                f"{', '.join(SPECIAL_TOKENS)} at {BOS}, {EOS}, {PAD}: it was not trained by TextSource"
            )

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
        """The int32 ids of `text` (bytes are read as UTF-8, invalid sequences replaced), after ``BOS`` and before
        ``EOS`` when asked."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray([BOS] * bos + list(ids) + [EOS] * eos, np.int32)

    def encode_documents(self, docs: list[bytes]) -> list[np.ndarray]:
        """Each document's ids between ``BOS`` and ``EOS`` (encoded together: ``tokenizers`` runs them in parallel,
        with the same ids as one by one)."""
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray([BOS, *e.ids, EOS], np.int32) for e in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (the special tokens and ids outside the vocabulary dropped; invalid UTF-8 replaced)."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).ravel()
        keep = (arr >= 0) & (arr < self.vocab_size) & (arr != BOS) & (arr != EOS) & (arr != PAD)
        return str(self._tok.decode([int(i) for i in arr[keep]], skip_special_tokens=True))


@functools.lru_cache(maxsize=8)
def bpe_tokenizer(text: str) -> BpeTokenizer:
    """The `BpeTokenizer` of the canonical JSON `text`, built once per process."""
    return BpeTokenizer(text)
