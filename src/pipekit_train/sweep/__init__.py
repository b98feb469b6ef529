"""Sweeps: one pipeline trained over a grid or a search of its fields, every trial an ordinary recorded run.

`Sweep` is a registered operator (``type: Sweep`` in YAML); `run_sweep` runs it resumably in a run directory and
`sweep_status` reads its table of trials back. Optuna (``sampler: optuna``) is imported only when a sweep uses it.
"""

from __future__ import annotations

from ._driver import SweepResult, load_sweep, run_sweep, sweep_status
from ._sweep import LocalExecutor, RayExecutor, Sweep, SweepPruning

__all__ = [
    "LocalExecutor",
    "RayExecutor",
    "Sweep",
    "SweepPruning",
    "SweepResult",
    "load_sweep",
    "run_sweep",
    "sweep_status",
]
