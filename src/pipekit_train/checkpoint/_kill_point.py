"""A kill inside a checkpoint write, for ``pipekit-train check-resume``: the resume probe (`pipekit_train.engine`'s
probe) arms a step with `arm`, and the writers call `at_save` between writing a step's arrays and committing it,
where the process then SIGKILLs itself. Unarmed (every ordinary run), `at_save` tests one module global."""

from __future__ import annotations

import json
import os
import signal

__all__ = ["arm", "at_save"]

#: The step whose checkpoint write SIGKILLs the process, and the trace file the kill is recorded in.
_ARMED: tuple[int, str] | None = None


def arm(step: int | None, trace: str | None = None) -> None:
    """SIGKILL this process in the write of `step`'s checkpoint, after noting it in `trace` (``None``: disarm)."""
    global _ARMED
    _ARMED = (step, trace or "") if step is not None else None


def at_save(step: int) -> None:
    """Called by the checkpoint writers between writing a step's arrays and committing it."""
    if _ARMED is None or step != _ARMED[0]:
        return
    record = {"kill": "SIGKILL", "during_save": True, "step": step, "pid": os.getpid()}
    fd = os.open(_ARMED[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write: never half a line
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
