"""Searching a pipeline's settings: sweeps, and the learning-rate finder.

A sweep trains one pipeline over a grid or a search of its fields, every trial an ordinary recorded run: `Sweep` is
a registered operator (``type: Sweep`` in YAML); `run_sweep` runs it resumably in a run directory and
`sweep_status` reads its table of trials back. Optuna (``sampler: optuna``) is imported only when a sweep uses it.
`lr_find` sweeps one stage's learning rate exponentially over a copy of it (``pipekit-train lr-find``) and
suggests one, recording nothing.
"""

from __future__ import annotations

from ._driver import load_sweep, run_sweep
from ._lr_find import LRFindResult, lr_find
from ._report import SweepResult, sweep_status
from ._sweep import LocalExecutor, RayExecutor, Sweep, SweepPruning

__all__ = [
    "LRFindResult",
    "LocalExecutor",
    "RayExecutor",
    "Sweep",
    "SweepPruning",
    "SweepResult",
    "load_sweep",
    "lr_find",
    "run_sweep",
    "sweep_status",
]
