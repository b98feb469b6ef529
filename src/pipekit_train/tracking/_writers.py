"""Metric writers: where the records of a run (parameters, metrics, the finish line) go.

A record is a plain dict::

    {"type": "metrics", "context": "train", "step": 100, "epoch": 1, "loss": 0.25}

``type`` is ``"params"``, ``"metrics"``, ``"phase_start"``, ``"phase"``, ``"finish"`` or another word a caller chooses
(docs/metrics.md lists the loop's records and their keys);
``context`` is ``"train"``, ``"validate"``, ``"test"`` or ``"time"``; every other key is a value (numbers, strings,
and nested dicts for parameters). A writer is an operator: its fields are its configuration and go to YAML with
the pipeline. What it holds while a run is open (a file, an event writer) lives in private attributes, never in
fields, so two equal writers are equal whatever they have open.

`open(run_dir)` and `close()` bracket a run; `write(record)` adds one record in between. Every writer gets the same
records, so a metric has one name and one value everywhere: ``<context>/<key>`` (docs/metrics.md has the table).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipekit import ConfigError, Operator

__all__ = [
    "ConsoleWriter",
    "JsonLinesWriter",
    "MetricWriter",
    "MultiWriter",
    "NullWriter",
    "TensorBoardWriter",
    "read_jsonl",
]

#: Keys of a record that describe it rather than hold a value. ``interrupted`` marks the records a stage wrote at
#: the step a signal stopped it (off the logging cadence); `pipekit_train.tracking.history` drops them once the
#: resumed run logs on.
RESERVED_KEYS = ("type", "context", "step", "epoch", "time", "interrupted")

_MSG_TENSORBOARD = (
    "TensorBoardWriter needs the 'tensorboard' package, which is not installed; "
    "install the extra: pip install 'pipekit-train[tensorboard]'"
)


def _plain(value: Any) -> Any:
    """`value` as JSON-able data: device and numpy scalars become Python numbers, tuples become lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    if isinstance(value, Operator):
        return repr(value)
    return str(value)


def _values(record: Mapping[str, Any]) -> dict[str, Any]:
    """The value entries of a record (everything but the reserved keys)."""
    return {k: v for k, v in record.items() if k not in RESERVED_KEYS}


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, name))
        else:
            out[name] = v
    return out


class MetricWriter(Operator, register=False):
    """Base class of metric writers. Subclasses override `write`, and `open` / `close` when they hold resources."""

    def open(self, run_dir: str | None) -> None:
        """Start writing for a run whose files live in `run_dir` (``None``: no directory)."""

    def write(self, record: dict[str, Any]) -> None:
        """Add one record (see the module docstring for its shape)."""
        raise NotImplementedError

    def close(self) -> None:
        """Finish writing: flush and release whatever `open` took. Closing twice is harmless."""


class NullWriter(MetricWriter):
    """A writer that drops every record (the loop's fallback when no writer is configured)."""

    def write(self, record: dict[str, Any]) -> None:
        pass


class JsonLinesWriter(MetricWriter):
    """Append each record to a JSON Lines file, one flushed line per record, with a ``time`` field added.

    The file is opened in append mode, so a resumed run extends it rather than starting over; read it back with
    `read_jsonl`. Non-finite floats are written as ``NaN`` / ``Infinity`` (which Python's `json` reads back).

    Args:
        path: The file to append to. Default: ``<run_dir>/metrics.jsonl``.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> w = JsonLinesWriter()
        >>> w.open(d)
        >>> w.write({"type": "metrics", "context": "train", "step": 1, "epoch": 0, "loss": 0.5})
        >>> w.close()
        >>> [(r["step"], r["loss"]) for r in read_jsonl(os.path.join(d, "metrics.jsonl"))]
        [(1, 0.5)]
    """

    path: str | None = None

    def resolved_path(self, run_dir: str | None) -> Path:
        """The file this writer appends to for a run in `run_dir`."""
        if self.path is not None:
            return Path(self.path)
        if run_dir is None:
            raise ConfigError(
                "JsonLinesWriter.path is None and the run has no run_dir, so there is nowhere to write; "
                "set JsonLinesWriter(path=...) or give the run a run_dir"
            )
        return Path(run_dir) / "metrics.jsonl"

    def open(self, run_dir: str | None) -> None:
        self.close()
        path = self.resolved_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(path)
        object.__setattr__(self, "_fh", path.open("a", encoding="utf-8"))

    def write(self, record: dict[str, Any]) -> None:
        fh = getattr(self, "_fh", None)
        if fh is None:
            raise RuntimeError("JsonLinesWriter.write called before open(run_dir) (or after close())")
        line = json.dumps({**_plain(record), "time": time.time()}, separators=(",", ":"))
        fh.write(line + "\n")
        fh.flush()

    def close(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()
            object.__setattr__(self, "_fh", None)


def _drop_partial_line(path: Path) -> None:
    """Cut an unterminated last line (left by a process killed mid-write) so that appended records stay readable."""
    if not path.exists():
        return
    with path.open("r+b") as fh:
        end = fh.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - 65536)
            fh.seek(start)
            chunk = fh.read(pos - start)
            if pos == end and chunk.endswith(b"\n"):
                return
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                fh.truncate(start + cut + 1)
                return
            pos = start
        fh.truncate(0)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON Lines file, in order.

    A last line without its newline (a process killed mid-write) is skipped; a bad line elsewhere is an error
    naming the file and line number.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # garbage, not records: name the file
        raise ValueError(f"{path}: not a JSON Lines file (not UTF-8 text at byte {e.start})") from None
    lines = text.split("\n")
    out: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # the unterminated tail of an interrupted write
                break
            raise ValueError(f"{path}:{number}: not a JSON record ({e.msg}): {line[:80]!r}") from None
    return out


class ConsoleWriter(MetricWriter):
    """Print a readable one-line summary of records to standard error.

    Args:
        every: Print train and time metrics only at steps that are multiples of `every`; other records (validation,
            test, phases, the finish line) always print.

    Example line: ``[train] step 200 epoch 3 | loss 0.1234 accuracy 0.9500``.
    """

    every: int = 1

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError(f"ConsoleWriter.every must be a positive int, got {self.every}")

    @staticmethod
    def format(record: Mapping[str, Any]) -> str:
        """The one-line text `write` prints for `record`."""
        kind = record.get("type", "metrics")
        context = record.get("context")
        head = f"[{context}]" if kind == "metrics" and context else f"[{kind}]"
        where = []
        if record.get("step") is not None:
            where.append(f"step {record['step']}")
        if record.get("epoch") is not None:
            where.append(f"epoch {record['epoch']}")
        parts = []
        for k, v in _flatten(_values(record)).items():
            v = _plain(v)
            if isinstance(v, float):
                parts.append(f"{k} {v:.4g}" if math.isfinite(v) and abs(v) >= 1e4 else f"{k} {v:.4f}")
            else:
                parts.append(f"{k} {v}")
        text = " ".join([head, *where])
        if parts:
            text += " | " + " ".join(parts)
        return text if len(text) <= 400 else text[:397] + "..."

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type", "metrics") == "metrics" and record.get("context", "train") in ("train", "time"):
            step = record.get("step")
            if isinstance(step, int) and step % self.every:
                return
        print(self.format(record), file=sys.stderr, flush=True)


class MultiWriter(MetricWriter):
    """Send every record to each of `writers`, in order.

    Args:
        writers: The writers to fan out to.
    """

    writers: tuple[MetricWriter, ...] = ()

    @classmethod
    def example(cls) -> MultiWriter:
        return cls(writers=(JsonLinesWriter(path="metrics.jsonl"), ConsoleWriter(every=10)))

    def open(self, run_dir: str | None) -> None:
        for w in self.writers:
            w.open(run_dir)

    def write(self, record: dict[str, Any]) -> None:
        for w in self.writers:
            w.write(record)

    def close(self) -> None:
        errors = []
        for w in self.writers:
            try:
                w.close()
            except Exception as e:  # close the others anyway, then report the first failure
                errors.append(e)
        if errors:
            raise errors[0]


class TensorBoardWriter(MetricWriter):
    """Write scalars as TensorBoard event files, named ``<context>/<metric>`` (``train/loss``).

    ``params`` records become one text summary named ``params`` (a Markdown table); strings and the other
    record types are skipped. Needs the ``tensorboard`` extra: ``pip install 'pipekit-train[tensorboard]'``.

    Args:
        logdir: The event-file directory. Default: ``<run_dir>/tensorboard``.
    """

    logdir: str | None = None

    def open(self, run_dir: str | None) -> None:
        self.close()
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ImportError(_MSG_TENSORBOARD) from None
        if self.logdir is not None:
            logdir = self.logdir
        elif run_dir is not None:
            logdir = os.path.join(run_dir, "tensorboard")
        else:
            raise ConfigError(
                "TensorBoardWriter.logdir is None and the run has no run_dir, so there is nowhere to write; "
                "set TensorBoardWriter(logdir=...) or give the run a run_dir"
            )
        object.__setattr__(self, "_events", EventFileWriter(logdir, flush_secs=10))

    def write(self, record: dict[str, Any]) -> None:
        events = getattr(self, "_events", None)
        if events is None:
            raise RuntimeError("TensorBoardWriter.write called before open(run_dir) (or after close())")
        from tensorboard.compat.proto import event_pb2, summary_pb2

        step = int(record.get("step") or 0)
        kind = record.get("type", "metrics")
        if kind == "params":
            from tensorboard.plugins.text.summary_v2 import text_pb

            rows = "\n".join(f"| {k} | {_plain(v)} |" for k, v in _flatten(_values(record)).items())
            summary = text_pb("params", "| name | value |\n|---|---|\n" + rows)
        elif kind == "metrics":
            if record.get("interrupted") is True:  # what a signal's stop shows: no event file takes it back
                return
            context = record.get("context", "train")
            summary = summary_pb2.Summary()
            for name, value in _flatten(_values(record)).items():
                value = _plain(value)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                tag = name if name.startswith(f"{context}/") else f"{context}/{name}"
                summary.value.add(tag=tag, simple_value=float(value))
            if not summary.value:
                return
        else:
            return
        events.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        events = getattr(self, "_events", None)
        if events is not None:
            events.close()
            object.__setattr__(self, "_events", None)
