"""`list_runs`: the runs under a directory and their checkpoints, read from manifests alone."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._warnings import PipekitTrainWarning
from ._errors import CheckpointNotFoundError
from ._layout import _is_tmp, _uncommitted_reason
from ._manifest import MANIFEST, _scan
from ._selectors import Best, ManifestEntry


# Runs --------------------------------------------------------------------------------------------------------
def list_runs(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The checkpointed runs under `root`, newest first, read from the manifests (and the JSON records of steps a
    crash kept out of a manifest), never from the arrays.

    Each row: ``run_id``, ``stage``, ``directory``, ``checkpoints`` (committed ones), ``steps``, ``latest_step``,
    ``best_step``, ``best_score``, ``metric``, ``mode`` and ``last_write`` (``time.time()`` of its newest
    checkpoint). A directory holding checkpoints of several runs gives one row per run.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"run directory not found: {root}")
    rows = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if MANIFEST not in filenames:
            continue
        directory = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not (d.isdigit() or _is_tmp(d))]  # never walk into checkpoints
        try:
            # The manifest, plus steps that committed but never reached it (a crash right after a save).
            header, found, _ = _scan(directory)
        except (OSError, ValueError, TypeError) as err:
            warnings.warn(f"skipping {directory / MANIFEST}: {err}", PipekitTrainWarning, stacklevel=2)
            continue
        entries = [found[s] for s in sorted(found)]
        committed = [e for e in entries if _uncommitted_reason(directory / str(e.step)) is None]
        by_run: dict[str | None, list[ManifestEntry]] = {}
        for e in entries:
            by_run.setdefault(e.run_id, [])
        for e in committed:
            by_run[e.run_id].append(e)
        for run_id, run_entries in by_run.items():
            mode = header.get("mode", "min")
            own = [e for e in run_entries if e.metric == header.get("monitor", e.metric) and e.mode == mode]
            best = next(iter(Best(k=1).select(own, mode)), None)
            listed = [e for e in entries if e.run_id == run_id]
            rows.append(
                {
                    "run_id": run_id,
                    "stage": next((e.stage for e in reversed(listed) if e.stage), None),
                    "directory": str(directory),
                    "checkpoints": len(run_entries),
                    "steps": [e.step for e in run_entries],
                    "latest_step": run_entries[-1].step if run_entries else None,
                    "best_step": best,
                    "best_score": next((e.score for e in run_entries if e.step == best), None),
                    "metric": header.get("monitor"),
                    "mode": mode,
                    "last_write": max((e.time for e in listed), default=0.0),
                }
            )
    rows.sort(key=lambda r: r["last_write"], reverse=True)
    return rows


def format_runs_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """`list_runs` rows as an aligned text table (what ``pipekit-train runs RUN_DIR`` prints)."""
    if not rows:
        return "no checkpointed runs found"
    header = ("RUN", "STAGE", "CKPTS", "LATEST", "BEST", "METRIC", "LAST WRITE", "DIRECTORY")
    lines = [header]
    for r in rows:
        score = r.get("best_score")
        best = "-" if score is None or not math.isfinite(score) else f"{score:.4g} @ {r['best_step']}"
        metric = f"{r['metric']} ({r['mode']})" if r.get("metric") else "-"
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["last_write"])) if r.get("last_write") else "-"
        latest = "-" if r.get("latest_step") is None else str(r["latest_step"])
        lines.append(
            (
                str(r.get("run_id") or "-"),
                str(r.get("stage") or "-"),
                str(r.get("checkpoints", 0)),
                latest,
                best,
                metric,
                written,
                str(r.get("directory", "")),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
