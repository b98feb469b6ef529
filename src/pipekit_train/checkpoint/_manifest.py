"""The manifest of a checkpoint directory: ``manifest.json`` listing the retained checkpoints (read, written
atomically), and the list rebuilt from the steps' own records when the manifest misses some or is unreadable.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._jsonio import write_text
from .._warnings import PipekitTrainWarning
from ._errors import CheckpointError
from ._flat import RECORD, is_flat
from ._layout import FORMAT, _json_digest, _uncommitted_reason, _with_io_retry
from ._selectors import ManifestEntry

logger = logging.getLogger("pipekit_train.checkpoint")

MANIFEST = "manifest.json"


def _step(entry: ManifestEntry) -> int:
    return entry.step


def _read_manifest(directory: Path) -> tuple[dict[str, Any], list[ManifestEntry]]:
    data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"not a format-{FORMAT} pipekit manifest")
    header = {k: v for k, v in data.items() if k != "entries"}
    return header, [ManifestEntry.from_json(e) for e in data["entries"]]


def _write_manifest(directory: Path, header: Mapping[str, Any], entries: list[ManifestEntry]) -> None:
    """Replace ``manifest.json`` atomically: write a temporary file, fsync it, rename it over the old one.

    One line per entry, each encoded by the C encoder (``json.dumps`` with an ``indent`` runs the pure-Python
    one: most of what a save of a small state spent in the background, holding the GIL the training thread
    needs).
    """
    head = json.dumps({"format": FORMAT, **header, "updated": time.time()}, allow_nan=False)
    lines = ",\n".join(json.dumps(e.to_json(), allow_nan=False) for e in entries)
    write_text(directory / MANIFEST, f'{head[:-1]}, "entries": [\n{lines}\n]}}')


def _load_entries(directory: Path) -> tuple[dict[str, Any], dict[int, ManifestEntry]]:
    """The manifest's header and entries, plus committed step directories it misses (a crash after commit)."""
    header, entries, _ = _scan(directory)
    return header, entries


def _scan(directory: Path) -> tuple[dict[str, Any], dict[int, ManifestEntry], list[int]]:
    """`_load_entries`, and the steps that were committed but missing from ``manifest.json`` (now included)."""
    header: dict[str, Any] = {}
    entries: dict[int, ManifestEntry] = {}
    if (directory / MANIFEST).exists():
        try:
            header, listed = _with_io_retry(lambda: _read_manifest(directory))
            entries = {e.step: e for e in listed}
        except (ValueError, TypeError) as e:
            warnings.warn(
                f"{directory / MANIFEST} is unreadable ({e}); rebuilding the list from the checkpoints themselves",
                PipekitTrainWarning,
                stacklevel=3,
            )
    unlisted = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.name.isdigit() and int(child.name) not in entries and _uncommitted_reason(child) is None:
                entry = _entry_from_checkpoint(child)
                if entry is not None:
                    entries[entry.step] = entry
                    unlisted.append(entry.step)
    return header, entries, sorted(unlisted)


def _read_record_json(step_dir: Path) -> dict[str, Any]:
    """A committed step's meta record (its ``meta.json``, or ``meta/metadata`` written by Orbax), checked against
    its own digest; no Orbax."""
    path = step_dir / RECORD if is_flat(step_dir) else step_dir / "meta" / "metadata"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint's record ({e})") from None
    if not isinstance(record, dict) or "record_sha256" not in record:
        raise CheckpointError(f"{path}: not a pipekit checkpoint record")
    if record.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir} has checkpoint format {record.get('format')!r}; this version reads {FORMAT}")
    if _json_digest({k: v for k, v in record.items() if k != "record_sha256"}) != record["record_sha256"]:
        raise CheckpointError(f"{path}: the record does not match its checksum (damaged)")
    return record


def _entry_from_checkpoint(step_dir: Path) -> ManifestEntry | None:
    step = int(step_dir.name)
    try:
        record = _read_record_json(step_dir)
    except CheckpointError as e:
        logger.warning("ignoring %s: %s", step_dir, e)
        return None
    user = record.get("user", {})
    return ManifestEntry(
        step=step,
        epoch=user.get("epoch"),
        stage=user.get("stage"),
        run_id=user.get("run_id"),
        metric=record.get("metric"),
        mode=record.get("mode", "min"),
        score=record.get("score"),
        stop_reason=user.get("stop_reason"),
        resume_point=user.get("resume_point") is True,
        time=float(record.get("time", 0.0)),
    )
