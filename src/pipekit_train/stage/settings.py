"""Where and how a pipeline run writes (`RunSettings`), and the one place Python code sets them for ``op.run()``.

`run_settings` is the Python API's channel: ``with run_settings(run_dir="runs/a", store=False): op.run()`` (the
operator algebra's ``run()`` takes no arguments, so the settings reach each `TrainingLoop` through a context
variable, read once, when the stage starts). Everything inside the training core passes `RunSettings` explicitly
(`pipekit_train.stage.driver`); ``pipekit-train run``, sweeps and extensions never use the context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["RunSettings", "current_settings", "run_settings"]


@dataclass(frozen=True)
class RunSettings:
    """Where a pipeline run writes, set for a block of code with `run_settings`.

    Attributes:
        run_dir: The run's directory; default ``runs/<run_id>`` under the working directory.
        store: Path of the artifact store (SQLite); ``None`` means `ArtifactStore`'s default; ``False``: record
            nothing.
        resume: ``"never"`` starts fresh; ``"auto"`` continues the run found in `run_dir` exactly.
        force_resume: With ``resume="auto"``, continue a checkpoint written under another configuration (warned
            about and recorded in the artifact) instead of refusing.
        pipeline: The whole pipeline being run (recorded with each stage's artifact for `reproduce`).
        imports: The user modules imported before the pipeline was read (``--import``, ``$PIPEKIT_IMPORT``), each
            ``{"module": name, "file": path or None, "sha256": hex digest of the file or None}``; recorded in
            every stage's artifact (`TrainingArtifact.imports`).
        code: The `provenance._code.CodeSnapshot` taken when the command started (patch, imported modules,
            pipeline file): its record goes in every stage's artifact (`TrainingArtifact.code`), its blobs into the
            store. ``None``: no code is stored.
        fork: A `checkpoint._fork.ForkPoint` (``--fork``): the run's first stage starts from that checkpoint of
            another run, and its artifact records the edge (`TrainingArtifact.fork`).
        sweep: The sweep trial this run is, ``{"name", "trial", "params", "key"}`` (`pipekit_train.sweep`);
            recorded in every stage's artifact (`TrainingArtifact.sweep`).
        extension: The finished stage the stage being run continues (`stage.extension.Extension`, set by
            `stage.extension.extend`): it starts from that stage's final checkpoint and records it in its artifact.
    """

    run_dir: str | None = None
    store: str | Literal[False] | None = None
    resume: Literal["never", "auto"] = "never"
    force_resume: bool = False
    pipeline: Any = None
    imports: tuple[dict[str, Any], ...] = ()
    code: Any = None
    fork: Any = None
    sweep: dict[str, Any] | None = None
    extension: Any = None


_DEFAULT_SETTINGS = RunSettings()
_SETTINGS: contextvars.ContextVar[RunSettings] = contextvars.ContextVar(
    "pipekit_train_run",
    default=_DEFAULT_SETTINGS,  # a frozen dataclass: safe to share
)


@contextlib.contextmanager
def run_settings(**kwargs: Any) -> Iterator[RunSettings]:
    """Set where runs inside the block write: ``with run_settings(run_dir="runs/a", store=False): op.run()``."""
    settings = replace(_SETTINGS.get(), **kwargs)
    token = _SETTINGS.set(settings)
    try:
        yield settings
    finally:
        _SETTINGS.reset(token)


def current_settings() -> RunSettings:
    """The settings `run_settings` set for this block (the defaults outside one)."""
    return _SETTINGS.get()
