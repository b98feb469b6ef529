"""The sweep's journal: ``sweep.json`` in the sweep's run directory, one entry per trial number, and where that
directory is by default.

Only the driver writes it (rewritten atomically on every change of a trial's state: `_jsonio.write_json`); a
restarted sweep reads it back to skip what finished (`_driver`), and `sweep_status` reads it for the table.
"""

from __future__ import annotations

import os
from typing import Any

from pipekit import ConfigError

from .._jsonio import read_json, write_json
from ._sweep import Sweep

JOURNAL = "sweep.json"
STATES = ("completed", "running", "pending", "failed", "pruned")


class Journal:
    """``sweep.json``: the trials by number, rewritten atomically on every change (one writer: the driver).

    One entry per trial number: two trials with the same values (a search over choices or integers may ask for the
    same ones again) are two entries with one key, and share that key's run directory (the second takes the
    first's result as it is).
    """

    def __init__(self, run_dir: str, sweep: Sweep) -> None:
        self.path = os.path.join(run_dir, JOURNAL)
        self.trials: dict[int, dict[str, Any]] = {}  # by number
        if os.path.exists(self.path):
            data = read_json(self.path, what="the sweep's journal", required=("sweep", "trials"))
            if data["sweep"] != sweep.name:
                raise ConfigError(
                    f"{self.path}: this run directory holds sweep {data['sweep']!r}, not {sweep.name!r}; "
                    "choose another --run-dir"
                )
            self.trials = {int(t["number"]): t for t in data["trials"]}
        self.sweep = sweep

    def save(self) -> None:
        trials = sorted(self.trials.values(), key=lambda t: t["number"])
        write_json(self.path, {"sweep": self.sweep.name, "sampler": self.sweep.sampler, "trials": trials})

    def set(self, entry: dict[str, Any]) -> None:
        self.trials[entry["number"]] = entry
        self.save()


def default_run_dir(sweep: Sweep) -> str:
    return os.path.join("runs", "sweeps", sweep.name)
