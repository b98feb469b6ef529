"""The byte-level tokenizer: UTF-8 bytes are tokens ``0..255``, plus ``BOS`` (256), ``EOS`` (257) and ``PAD`` (258).

It needs no training and no file, so every machine tokenizes the same text to the same ids, and any byte string
(UTF-8 or not) has an encoding. `TextSource` reads files with it; ``pipekit-train generate`` encodes the prompt and
decodes the samples with it. A trained BPE tokenizer (Hugging Face ``tokenizers``) is not implemented.

Example:
    >>> from pipekit_train.data._tokenizer import decode, encode
    >>> encode("hé").tolist()
    [256, 104, 195, 169, 257]
    >>> decode(encode("hé"))
    'hé'
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pipekit import ConfigError, suggestion

__all__ = ["BOS", "EOS", "PAD", "TOKENIZERS", "VOCAB_SIZE", "check_tokenizer", "decode", "encode"]

#: The token ids after the 256 byte values.
BOS, EOS, PAD = 256, 257, 258
#: The byte tokenizer's vocabulary: 256 bytes and the three special tokens.
VOCAB_SIZE = 259
#: The tokenizers `TextSource.tokenizer` accepts, with their vocabulary sizes.
TOKENIZERS = {"bytes": VOCAB_SIZE}


def check_tokenizer(name: str, where: str) -> int:
    """The vocabulary size of tokenizer `name`, or one `ConfigError` naming `where` and the tokenizers there are."""
    if name not in TOKENIZERS:
        raise ConfigError(
            f"{where} must be one of {', '.join(TOKENIZERS)}, got {name!r}{suggestion(str(name), TOKENIZERS)} "
            "(a trained BPE tokenizer is not implemented)"
        )
    return TOKENIZERS[name]


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
