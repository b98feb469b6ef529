"""`TextSource`: text files as fixed-length token records, for language models and text classifiers.

`paths` are glob patterns (``**`` recurses; ``{stdlib}`` stands for CPython's standard library directory,
``sysconfig.get_paths()["stdlib"]``). Every matched file is one document, tokenized by the byte tokenizer
(``_tokenizer.py``: ``BOS``, its bytes, ``EOS``) or by a byte-level BPE trained on the training split's files
(``tokenizer: {name: bpe, vocab_size: N}``, ``_bpe.py``: ``BOS``, its tokens, ``EOS``), fitted and recorded like
the classes (``statistics["tokenizer"]``: its canonical JSON text and sha256). The files are split
deterministically by file (`fractions`, `split`, `seed`: a seeded permutation of the sorted files of each parent
folder, or of each class with CSV labels), so no document is in two splits, and a language model's source and a
classifier's with the same `fractions` and `seed` split the same files.

Without labels the documents of the split are packed end to end and cut into records of `seq_len` tokens (the last
one padded with ``PAD``); ``segments`` marks the boundaries: the 1-based number of the document each token belongs
to within its record, 0 for padding. With labels (`labels`: each file's parent folder, or a CSV column), each file
is cut into its own records (its last one padded) and each record gets its file's class index, into the sorted
classes of the training split (fitted and recorded like `CsvSource`'s ``class_labels``).

The data hash (`content_digest`) covers the tokenizer setting, the file list (each file by its name under its
pattern's fixed prefix, so the same tree on another machine hashes the same) and each file's sha256; the dataset's
hash also covers the token ids themselves, so a different trained tokenizer is different data.

Example:
    >>> import os, tempfile
    >>> from pipekit_train.data._text import TextSource
    >>> root = tempfile.mkdtemp()
    >>> _ = open(os.path.join(root, "a.txt"), "w").write("hello")
    >>> arrays = TextSource(paths=(os.path.join(root, "*.txt"),), seq_len=4).load()
    >>> arrays["x"].tolist(), arrays["segments"].tolist()
    ([[256, 104, 101, 108], [108, 111, 257, 258]], [[1, 1, 1, 1], [1, 1, 1, 0]])
"""

from __future__ import annotations

import csv
import glob
import hashlib
import math
import os
import sysconfig
from collections.abc import Hashable
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from pipekit import ConfigError, field, suggestion

from ._sources import Arrays, Source, check_arrays
from ._tokenizer import PAD, ByteTokenizer, TokenizerSetting, tokenizer_setting

__all__ = ["TextSource"]

_GLOB_CHARS = "*?["


def _expand(pattern: str) -> str:
    return pattern.replace("{stdlib}", sysconfig.get_paths()["stdlib"])


def _base(pattern: str) -> str:
    """The directory part of `pattern` before its first glob character (``{stdlib}/json`` of ``{stdlib}/json/*.py``)."""
    parts = pattern.replace(os.sep, "/").split("/")
    fixed: list[str] = []
    for part in parts[:-1]:
        if any(c in part for c in _GLOB_CHARS):
            break
        fixed.append(part)
    return "/".join(fixed)


class TextSource(Source):
    """Text files as records of `seq_len` token ids: packed documents for a language model, or labelled snippets.

    Args:
        paths: glob patterns of the text files (``data/**/*.txt``; ``{stdlib}``: CPython's standard library
            directory). Each pattern must match at least one file; relative patterns are read from the working
            directory. A file matched twice counts once.
        seq_len: tokens per record (at least 2).
        tokenizer: ``bytes``: UTF-8 bytes plus ``BOS``/``EOS``/``PAD``, a vocabulary of 259; or
            ``{name: bpe, vocab_size: N, min_frequency: 2}``: a byte-level BPE of at most ``N`` ids trained on the
            training split's files (merges of pairs seen at least `min_frequency` times), with the bytes at
            ``0..255`` and ``BOS``/``EOS``/``PAD`` at 256, 257, 258 as in the byte tokenizer. Needs the ``text``
            extra (Hugging Face ``tokenizers``).
        labels: ``none`` (a language model's packed records), ``folder`` (each file's class is the name of its
            parent folder) or ``csv`` (its class is `label_column` of the row of `label_file` whose `file_column`
            names it: by its path, or the longest trailing part of its path there (``cats/a.txt``)).
        label_file: the CSV file of the labels (``labels: csv``).
        file_column: the CSV column naming the files.
        label_column: the CSV column holding the labels.
        split: with `fractions`, the named part of the files to read.
        fractions: ``{name: fraction}`` summing to 1: the files cut by a permutation from `seed`, per parent folder
            (per class with ``labels: csv``).
        seed: the permutation's seed (non-negative); it also picks `max_records`.
        max_records: keep at most this many records, picked by `seed` (in order); ``null`` keeps them all.
        input_key: the key of the token records ``(records, seq_len)`` int32.
        target_key: the key of the class indices ``(records,)`` int32 (with labels).
        segment_key: the key of the document numbers ``(records, seq_len)`` int32 (0: padding).
        statistics: the fitted values (``classes``; ``tokenizer``: a BPE's ``setting``, ``sha256`` and ``json``);
            leave it out to fit them on the training split.
    """

    paths: tuple[str, ...]
    seq_len: int
    tokenizer: str | dict[str, Any] = "bytes"
    labels: Literal["none", "folder", "csv"] = "none"
    label_file: str | None = None
    file_column: str = "file"
    label_column: str = "label"
    split: str | None = None
    fractions: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    max_records: int | None = None
    input_key: str = "x"
    target_key: str = "y"
    segment_key: str = "segments"
    statistics: dict[str, Any] | None = None

    def validate(self) -> None:
        if not self.paths or any(not p for p in self.paths):
            raise ConfigError(f"TextSource.paths must be non-empty glob patterns of text files, got {list(self.paths)}")
        if self.seq_len < 2:
            raise ConfigError(
                f"TextSource.seq_len must be an int >= 2 (a next-token target needs two tokens), got {self.seq_len}"
            )
        tokenizer_setting(self.tokenizer)
        if self.labels == "csv" and not self.label_file:
            raise ConfigError("TextSource.label_file must name a CSV file of labels with labels: csv, got null")
        if self.labels != "csv" and self.label_file:
            raise ConfigError(f"TextSource.label_file is for labels: csv, got labels: {self.labels}")
        if self.seed < 0:
            raise ConfigError(f"TextSource.seed must be a non-negative int, got {self.seed}")
        if self.max_records is not None and self.max_records < 1:
            raise ConfigError(f"TextSource.max_records must be a positive int or null, got {self.max_records}")
        keys = [self.input_key, self.segment_key] + ([self.target_key] if self.labels != "none" else [])
        if len(set(keys)) != len(keys):
            raise ConfigError(f"TextSource: input_key, segment_key and target_key must differ, got {keys}")
        if self.statistics is not None and set(self.statistics) - {"classes", "tokenizer"}:
            raise ConfigError(
                "TextSource.statistics holds only classes and tokenizer (fitted on the training split), got "
                f"{sorted(self.statistics)}"
            )
        if self.fractions:
            bad = {k: v for k, v in self.fractions.items() if not (math.isfinite(v) and 0 < v <= 1)}
            if bad:
                raise ConfigError(f"TextSource.fractions must each be in (0, 1], got {bad}")
            total = sum(self.fractions.values())
            if abs(total - 1.0) > 1e-9:
                raise ConfigError(f"TextSource.fractions must sum to 1, got {total:g} from {self.fractions}")
            if self.split not in self.fractions:
                raise ConfigError(
                    f"TextSource.split {self.split!r} is not one of the fractions"
                    f"{suggestion(str(self.split), self.fractions)}; they are {', '.join(self.fractions)}"
                )
        elif self.split is not None:
            raise ConfigError(
                f"TextSource.split {self.split!r} needs fractions (e.g. {{train: 0.8, val: 0.2}}) to cut the files by"
            )

    @classmethod
    def example(cls) -> TextSource:
        return cls(
            paths=("{stdlib}/json/*.py",),
            seq_len=128,
            split="train",
            fractions={"train": 0.8, "val": 0.2},
        )

    # The files ------------------------------------------------------------------------------------------------
    def _matched(self) -> list[tuple[str, str]]:
        """Every matched file as ``(its name under its pattern's fixed prefix, its path)``, sorted by name."""
        seen: dict[str, str] = {}
        reals: set[str] = set()
        for pattern in self.paths:
            expanded = _expand(pattern)
            files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
            if not files:
                where = "" if os.path.isabs(expanded) else f" (relative patterns are read from {os.getcwd()})"
                raise ConfigError(f"TextSource.paths: no file matches {pattern!r}{where}")
            base, expanded_base = _base(pattern), _base(expanded)
            for f in files:
                rel = os.path.relpath(f, expanded_base or ".").replace(os.sep, "/")
                name = f"{base}/{rel}" if base else rel
                real = os.path.realpath(f)
                if real not in reals and name not in seen:
                    seen[name] = real
                    reals.add(real)
        return sorted(seen.items())

    def _labelled(self) -> list[tuple[str, str, str | None]]:
        """``(name, path, label)`` of every matched file (``label`` None without labels)."""
        files = self._matched()
        if self.labels == "none":
            return [(n, p, None) for n, p in files]
        if self.labels == "folder":
            return [(n, p, os.path.basename(os.path.dirname(p))) for n, p in files]
        table = self._label_table()
        out: list[tuple[str, str, str | None]] = []
        for name, path in files:
            parts = path.replace(os.sep, "/").split("/")
            suffixes = ["/".join(parts[k:]) for k in range(len(parts))]  # the longest first
            label = next((table[s] for s in [name, *suffixes] if s in table), None)
            if label is None:
                raise ConfigError(
                    f"TextSource.label_file {self.label_file!r} has no row for {name!r} (column {self.file_column!r}"
                    f"{suggestion(name, table)}); every matched file needs a label"
                )
            out.append((name, path, label))
        return out

    def _label_table(self) -> dict[str, str]:
        path = str(self.label_file)
        if not os.path.isfile(path):
            raise ConfigError(f"TextSource.label_file: file not found: {path!r}")
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
        header = list(rows[0]) if rows else []
        for column in (self.file_column, self.label_column):
            if column not in header:
                raise ConfigError(
                    f"TextSource: column {column!r} is not in the header of {path!r}{suggestion(column, header)}; "
                    f"its columns: {', '.join(header) or '(none)'}"
                )
        return {r[self.file_column].strip(): r[self.label_column].strip() for r in rows}

    def _split_files(self) -> list[tuple[str, str, str | None]]:
        """The files of `split` (all of them without `fractions`), in name order."""
        files = self._labelled()
        if not self.fractions:
            return files
        groups: dict[str | None, list[int]] = {}
        for i, (_, path, label) in enumerate(files):  # per class, else per parent folder: the same files either way
            groups.setdefault(label if self.labels == "csv" else os.path.dirname(path), []).append(i)
        names = list(self.fractions)
        chosen: list[int] = []
        for members in groups.values():
            n = len(members)
            perm = np.random.default_rng([self.seed, n]).permutation(n)
            bounds = np.round(np.cumsum([self.fractions[k] for k in names]) * n).astype(int)
            at = names.index(str(self.split))
            start = int(bounds[at - 1]) if at else 0
            chosen += [members[j] for j in perm[start : int(bounds[at])]]
        if not chosen:
            raise ConfigError(
                f"TextSource.split {self.split!r} holds no file: {len(files)} files cut by fractions {self.fractions} "
                "leave it empty; match more files or give it a larger fraction"
            )
        return [files[i] for i in sorted(chosen)]

    # The tokenizer ------------------------------------------------------------------------------------------------
    @property
    def setting(self) -> TokenizerSetting:
        """The `tokenizer` field read (``bytes`` or a BPE's size)."""
        return tokenizer_setting(self.tokenizer)

    def text_tokenizer(self) -> Any:
        """The tokenizer that reads this source (``encode``, ``decode``, ``vocab_size``): the byte tokenizer, or the
        BPE of `statistics` (fitted on this source's own files when it has none: give another split the training
        split's with `with_fitted`)."""
        if self.setting.kind == "bytes":
            return ByteTokenizer()
        from ._bpe import bpe_tokenizer

        recorded = (self.statistics or {}).get("tokenizer")
        if recorded is None:
            recorded = self._trained_tokenizer()
        else:  # given: its setting and sha256 are checked
            recorded = self._recorded_tokenizer(recorded, "TextSource.statistics")
        return bpe_tokenizer(str(recorded["json"]))

    def _trained_tokenizer(self) -> dict[str, Any]:
        """``{setting, sha256, json}`` of the BPE trained on this source's split (once per process per file set)."""
        setting = self.setting
        files = []
        for _, path, _ in self._split_files():
            st = os.stat(path)
            files.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
        text = _train(setting.vocab_size, setting.min_frequency, tuple(files))
        return {"setting": setting.text(), "sha256": hashlib.sha256(text.encode()).hexdigest(), "json": text}

    def _recorded_tokenizer(self, recorded: Any, owner: str) -> dict[str, Any]:
        """`recorded` (another split's ``statistics["tokenizer"]``) after checking it is whole and of this setting."""
        want = self.setting.text()
        if not isinstance(recorded, dict) or not {"setting", "sha256", "json"} <= set(recorded):
            raise ConfigError(
                f"{owner}: TextSource.tokenizer is {want}, but the training split recorded no trained tokenizer "
                "(statistics.tokenizer with setting, sha256 and json); read the training data with the same tokenizer"
            )
        if recorded["setting"] != want:
            raise ConfigError(
                f"{owner}: TextSource.tokenizer is {want}, but the training split's tokenizer is "
                f"{recorded['setting']}; every split must be read with the training split's tokenizer setting"
            )
        digest = hashlib.sha256(str(recorded["json"]).encode()).hexdigest()
        if digest != recorded["sha256"]:
            raise ConfigError(
                f"{owner}: the recorded BPE tokenizer's text has sha256 {digest[:12]}, not the recorded "
                f"{str(recorded['sha256'])[:12]}: the record was changed"
            )
        return dict(recorded)

    # The Source protocol ----------------------------------------------------------------------------------------
    @property
    def fitted(self) -> bool:
        stats = self.statistics or {}
        return (self.labels == "none" or "classes" in stats) and (self.setting.kind == "bytes" or "tokenizer" in stats)

    def fit(self) -> TextSource:
        if self.fitted:
            return self
        stats = dict(self.statistics or {})
        if self.labels != "none" and "classes" not in stats:
            stats["classes"] = sorted({str(label) for _, _, label in self._split_files()})
        if self.setting.kind != "bytes" and "tokenizer" not in stats:
            stats["tokenizer"] = self._trained_tokenizer()
        return self.replace(statistics=stats)

    def fitted_statistics(self) -> dict[str, Any] | None:
        return None if self.statistics is None else dict(self.statistics)

    def with_fitted(self, statistics: dict[str, Any] | None, owner: str) -> TextSource:
        if self.fitted or not statistics:
            return self
        stats = dict(self.statistics or {})
        if self.labels != "none" and "classes" not in stats:
            if "classes" not in statistics:
                raise ConfigError(
                    f"{owner}: TextSource.labels needs the training split's classes, but it recorded none; read the "
                    "training data with labels too"
                )
            stats["classes"] = list(statistics["classes"])
        if self.setting.kind != "bytes" and "tokenizer" not in stats:
            stats["tokenizer"] = self._recorded_tokenizer(statistics.get("tokenizer"), owner)
        return self.replace(statistics=stats)

    def files_identity(self) -> Hashable:
        """Each matched file's resolved path and stat: a file rewritten in place is another cache entry."""
        out = []
        for _, path in self._matched():
            st = os.stat(path)
            out.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def content_digest(self) -> str:
        """``sha256:`` of the tokenizer setting, `seq_len`, the labels and each file of the split: its name and
        sha256. (A trained BPE is determined by its setting and the training split's files; the dataset's hash
        covers the token ids it gives too.)"""
        head = f"pipekit-train text v1\n{self.setting.text()}\n{self.seq_len}\n{self.labels}\n"
        h = hashlib.sha256(head.encode())
        for name, path, label in self._split_files():
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            h.update(f"{name}\t{label}\t{digest}\n".encode())
        return "sha256:" + h.hexdigest()

    def load(self) -> Arrays:
        files = self._split_files()
        raw = []
        for _, path, _ in files:
            with open(path, "rb") as f:
                raw.append(f.read())
        fitted = self.fit()  # itself when fitted (given the training split's values); else fitted on its own files
        docs = fitted.text_tokenizer().encode_documents(raw)
        if self.labels == "none":
            out = self._packed(docs)
        else:
            classes = list((fitted.statistics or {})["classes"])
            out = self._snippets(docs, [str(label) for _, _, label in files], [n for n, _, _ in files], classes)
        if self.max_records is not None and len(out[self.input_key]) > self.max_records:
            n = len(out[self.input_key])
            keep = np.sort(np.random.default_rng([self.seed, n, 1]).choice(n, self.max_records, replace=False))
            out = {k: v[keep] for k, v in out.items()}
        return check_arrays("TextSource", out)

    def _packed(self, docs: list[np.ndarray]) -> Arrays:
        tokens = np.concatenate(docs)
        doc_index = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d in docs])
        n = -(-len(tokens) // self.seq_len)
        padded = np.full(n * self.seq_len, PAD, np.int32)
        padded[: len(tokens)] = tokens
        flat = np.full(n * self.seq_len, -1, np.int64)
        flat[: len(tokens)] = doc_index
        index = flat.reshape(n, self.seq_len)
        first = np.where(index[:, :1] >= 0, index[:, :1], 0)
        segments = np.where(index >= 0, index - first + 1, 0).astype(np.int32)
        return {self.input_key: padded.reshape(n, self.seq_len), self.segment_key: segments}

    def _snippets(self, docs: list[np.ndarray], labels: list[str], names: list[str], classes: list[str]) -> Arrays:
        index = {c: i for i, c in enumerate(classes)}
        xs, ys = [], []
        for doc, label, name in zip(docs, labels, names, strict=True):
            if label not in index:
                raise ConfigError(
                    f"TextSource: {name}: class {label!r} was not in the training split{suggestion(label, classes)}; "
                    f"its classes: {', '.join(classes)}"
                )
            n = -(-len(doc) // self.seq_len)
            padded = np.full(n * self.seq_len, PAD, np.int32)
            padded[: len(doc)] = doc
            xs.append(padded.reshape(n, self.seq_len))
            ys.append(np.full(n, index[label], np.int32))
        x = np.concatenate(xs)
        return {self.input_key: x, self.segment_key: (x != PAD).astype(np.int32), self.target_key: np.concatenate(ys)}


@lru_cache(maxsize=4)
def _train(vocab_size: int, min_frequency: int, files: tuple[tuple[str, int, int, int], ...]) -> str:
    """The canonical JSON of the BPE trained on `files` (``(path, inode, size, mtime)``: a rewritten file is another
    entry), so pre-flight, the stage and its validation data train it once per process."""
    from ._bpe import train_bpe

    def texts() -> Any:
        for path, *_ in files:
            with open(path, "rb") as f:
                yield f.read().decode("utf-8", errors="replace")

    return train_bpe(texts(), vocab_size, min_frequency)
