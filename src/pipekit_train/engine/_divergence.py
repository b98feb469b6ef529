"""Divergence: a stage stops on the first non-finite training loss (`TrainingLoop.stop_on_nonfinite`).

The loop checks a chunk's losses one dispatch late, only once the device has computed them (it never waits for
them) and at most once per `_loop.FINITE_READ_STEPS` steps, and every step's loss again when its log window is
written (`LogWindow._flush`) or a checkpoint is taken (`Saves.snapshot`), so no record and no checkpoint holds a
step past a NaN. The weights' own check before a save is `CheckpointHooks._save`; the errors are
`NonFiniteLossError` and `NonFiniteWeightsError` (`_protocol`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ._protocol import NonFiniteLossError


class Divergence:
    """The engine's divergence check (a part of `Engine`)."""

    loop: Any
    stage: str

    if TYPE_CHECKING:

        def epoch_of(self, step: int) -> int: ...

    def _check_finite(self, step: int, loss: Any) -> None:
        """Raise `NonFiniteLossError` if `loss` (the last step's, or a chunk's per-step losses) is not finite."""
        if not self.loop.stop_on_nonfinite:
            return
        # One read to the host (a JAX array's NumPy view, cached on it for the log window's later read), then
        # one step's finite loss, the usual case, returns at once.
        host = np.asarray(loss)
        if host.ndim == 0 and math.isfinite(host):
            return
        values = np.atleast_1d(host.astype(np.float64))
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            step = step - len(values) + 1 + int(bad[0])
            value = float(values[bad[0]])
            raise NonFiniteLossError(
                f"stage {self.stage!r}: the training loss became {value} at step {step} "
                f"(epoch {self.epoch_of(step)}). Lower the learning rate, set grad_clip_norm, "
                "or set stop_on_nonfinite: false to train on regardless."
            )
