"""`Checkpoint`: the callback that configures when checkpoints are written and which are kept."""

from __future__ import annotations

import difflib
import os
from typing import TYPE_CHECKING, Any, Literal

from pipekit import ConfigError

from ..callbacks._base import Callback
from ._selectors import Best, Every, Last, Mode, Selector

if TYPE_CHECKING:
    from ._checkpointer import Checkpointer


# The operator ------------------------------------------------------------------------------------------------
class Checkpoint(Callback):
    """When to checkpoint and what to keep: the one place cadence and retention are configured.

    The training loop drives saving: it asks `should_save` after each step, saves through the `Checkpointer`
    that `checkpointer` builds, and saves once more at the end when `save_on_end` is set.

    Attributes:
        every_n_steps: Save at every multiple of this many optimizer steps.
        keep: Retain the union of what these selectors pick; everything else is deleted once a newer
            checkpoint has committed. The default keeps the best 3 by `monitor` plus the latest.
        monitor: The metric `Best` ranks by (the ``score`` a save is given).
        mode: ``"min"`` if lower `monitor` is better, ``"max"`` if higher is.
        async_save: Write in the background; `save` returns once the arrays are copied (on their device).
        save_on_end: Also save when the run ends (completion or a requested stop).
        layout: How a checkpoint is written: ``"flat"`` (pipekit's own four files and one atomic rename; a single
            process), ``"orbax"`` (an Orbax composite checkpoint) or ``"auto"`` (flat for one process, Orbax for
            several). Both are read back whatever this says (design/checkpoints.md).
    """

    every_n_steps: int = 500
    keep: tuple[Selector, ...] = (Best(k=3), Last(n=1))
    monitor: str = "validate/loss"
    mode: Mode = "min"
    async_save: bool = True
    save_on_end: bool = True
    layout: Literal["auto", "flat", "orbax"] = "auto"

    def fingerprint(self) -> None:
        """Not part of a resume's fingerprint: it changes what is recorded, not what is trained."""
        return None

    def validate(self) -> None:
        if self.every_n_steps < 1:
            raise ConfigError(f"Checkpoint.every_n_steps must be a positive int, got {self.every_n_steps}")
        if not self.monitor:
            raise ConfigError("Checkpoint.monitor must name a metric, got ''")
        _check_keep("Checkpoint.keep", self.keep)
        check_layout("Checkpoint.layout", self.layout)

    def should_save(self, step: int) -> bool:
        """Whether the periodic cadence asks for a checkpoint after `step` optimizer steps."""
        return step > 0 and step % self.every_n_steps == 0

    def checkpointer(self, directory: str | os.PathLike[str]) -> Checkpointer:
        """A `Checkpointer` writing into `directory` with this configuration."""
        from ._checkpointer import Checkpointer

        return Checkpointer(
            directory,
            keep=self.keep,
            monitor=self.monitor,
            mode=self.mode,
            async_save=self.async_save,
            layout=self.layout,
        )

    @classmethod
    def example(cls) -> Checkpoint:
        return cls(
            every_n_steps=100,
            keep=(Best(k=2), Last(n=3), Every(n=1000)),
            monitor="validate/accuracy",
            mode="max",
            async_save=False,
            save_on_end=False,
        )


LAYOUTS = ("auto", "flat", "orbax")


def check_layout(where: str, layout: Any) -> None:
    if layout not in LAYOUTS:
        near = difflib.get_close_matches(str(layout), LAYOUTS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{where} must be one of {', '.join(map(repr, LAYOUTS))}{hint}, got {layout!r}")


def _check_keep(where: str, keep: Any) -> tuple[Selector, ...]:
    if not isinstance(keep, (tuple, list)) or not keep:
        raise ConfigError(f"{where} must be a non-empty list of selectors (Best, Last, Every), got {keep!r}")
    for i, sel in enumerate(keep):
        if not isinstance(sel, Selector):
            raise ConfigError(f"{where}[{i}] must be a selector (Best, Last, Every), got {sel!r}")
        if isinstance(sel, Best) and sel.among is not None:
            raise ConfigError(
                f"{where}[{i}] = {sel!r}: `among` is for choosing what to load or average, not for retention "
                f"(it would rank only what earlier deletions left); keep Best(k={sel.k}) and a Last instead"
            )
    return tuple(keep)
