"""Checkpoint and resume hooks of the engine (filled in with the checkpoint layer)."""

from __future__ import annotations

from typing import Any


def make_hooks(loop: Any, info: Any, settings: Any) -> Any:
    """The engine hooks for `loop`, or ``None`` when the stage neither checkpoints nor resumes."""
    return None
