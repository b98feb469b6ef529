"""The byte-level tokenizer: UTF-8 bytes are tokens ``0..255``, plus ``BOS`` (256), ``EOS`` (257) and ``PAD`` (258).

It needs no training and no file, so every machine tokenizes the same text to the same ids, and any byte string
(UTF-8 or not) has an encoding. `TextSource` reads files with it; ``pipekit-train generate`` encodes the prompt and
decodes the samples with it. A trained byte-level BPE tokenizer (``tokenizer: {name: bpe, vocab_size: N}``) keeps the
same ids for the 256 bytes and the three special tokens and adds its merges after them (``_bpe.py``);
`tokenizer_setting` reads either setting.

Example:
    >>> from pipekit_train.data._tokenizer import decode, encode
    >>> encode("hé").tolist()
    [256, 104, 195, 169, 257]
    >>> decode(encode("hé"))
    'hé'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipekit import ConfigError, suggestion

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "TOKENIZERS",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "TokenizerSetting",
    "decode",
    "encode",
    "tokenizer_setting",
]

#: The token ids after the 256 byte values.
BOS, EOS, PAD = 256, 257, 258
#: The byte tokenizer's vocabulary: 256 bytes and the three special tokens.
VOCAB_SIZE = 259
#: The tokenizers `TextSource.tokenizer` accepts (its ``name``: a mapping's ``type`` key would name an operator).
TOKENIZERS = ("bytes", "bpe")
#: The settings of ``tokenizer: {name: bpe, ...}``.
BPE_KEYS = ("name", "vocab_size", "min_frequency")
#: The largest BPE vocabulary accepted (ids are int32; far beyond what a corpus of text files trains).
MAX_BPE_VOCAB = 1_000_000


@dataclass(frozen=True)
class TokenizerSetting:
    """`TextSource.tokenizer` read: ``bytes``, or a byte-level BPE of at most `vocab_size` ids whose merges are
    pairs seen at least `min_frequency` times in the training split."""

    kind: str
    vocab_size: int = VOCAB_SIZE
    min_frequency: int = 2

    def text(self) -> str:
        """The setting as the data hash and the recorded tokenizer name it (``bytes`` for the byte tokenizer)."""
        if self.kind == "bytes":
            return "bytes"
        return f"bpe vocab_size={self.vocab_size} min_frequency={self.min_frequency}"


def tokenizer_setting(value: Any, where: str = "TextSource.tokenizer") -> TokenizerSetting:
    """`value` (``bytes``, ``{name: bytes}`` or ``{name: bpe, vocab_size: N, min_frequency: 2}``) read, or one
    `ConfigError` naming `where`, the rule, the value and the nearest valid name."""
    if isinstance(value, str):
        if value == "bytes":
            return TokenizerSetting("bytes")
        hint = " (a trained BPE is a mapping: {name: bpe, vocab_size: 1024})" if value == "bpe" else ""
        raise ConfigError(
            f"{where} must be bytes or a mapping {{name: bpe, vocab_size: N}}, got {value!r}"
            f"{hint or suggestion(value, ['bytes'])}"
        )
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be bytes or a mapping {{name: bpe, vocab_size: N}}, got {value!r}")
    for key in value:
        if key not in BPE_KEYS:
            hint = (
                " (name the tokenizer with name: bpe; in YAML a type: key names an operator)" if key == "type" else ""
            )
            raise ConfigError(
                f"{where} has no setting {key!r}{hint or suggestion(str(key), BPE_KEYS)}; allowed: "
                f"{', '.join(BPE_KEYS)}"
            )
    kind = value.get("name")
    if kind not in TOKENIZERS:
        raise ConfigError(
            f"{where}.name must be one of {', '.join(TOKENIZERS)}, got {kind!r}{suggestion(str(kind), TOKENIZERS)}"
        )
    if kind == "bytes":
        if set(value) != {"name"}:
            raise ConfigError(f"{where}: the bytes tokenizer takes no settings, got {dict(value)}")
        return TokenizerSetting("bytes")
    if "vocab_size" not in value:
        raise ConfigError(f"{where}: a bpe tokenizer needs vocab_size (e.g. {{name: bpe, vocab_size: 1024}})")
    size, freq = value["vocab_size"], value.get("min_frequency", 2)
    if isinstance(size, bool) or not isinstance(size, int) or not VOCAB_SIZE < size <= MAX_BPE_VOCAB:
        raise ConfigError(
            f"{where}.vocab_size must be an int from {VOCAB_SIZE + 1} to {MAX_BPE_VOCAB} (the 256 bytes and BOS, "
            f"EOS, PAD take the first {VOCAB_SIZE} ids), got {size!r}"
        )
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"{where}.min_frequency must be a positive int, got {freq!r}")
    return TokenizerSetting("bpe", size, freq)


class ByteTokenizer:
    """The byte tokenizer as an object with the interface of a trained one (`encode`, `decode`, `vocab_size`)."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
        return encode(text, bos=bos, eos=eos)

    def encode_documents(self, docs: list[bytes]) -> list[np.ndarray]:
        return [encode(d) for d in docs]

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)


def encode(text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    """The int32 ids of `text` (a ``str`` is UTF-8 encoded), after ``BOS`` and before ``EOS`` when asked."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    parts = [np.array([BOS], np.int32)] if bos else []
    parts.append(ids)
    if eos:
        parts.append(np.array([EOS], np.int32))
    return np.concatenate(parts)


def decode(ids: Iterable[int]) -> str:
    """The text of `ids`: the byte ids as UTF-8 (invalid sequences replaced), the special tokens dropped."""
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).ravel()
    return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
