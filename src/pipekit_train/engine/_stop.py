"""A graceful stop: SIGINT/SIGTERM during training only set a flag, which the checkpoint hooks read after each chunk
(the chunk finishes, a checkpoint is written with the signal as its stop reason, the stage stops and is resumed
from it later); a second SIGINT aborts at once. Outside training the command's own handlers (`pipekit_train._signals`)
answer a signal."""

from __future__ import annotations

import signal
import threading
from typing import Any

#: The stop reasons of a signal's stop: a checkpoint written with one is resumed from; any other ended the stage.
_SIGNAL_NAMES = ("SIGINT", "SIGTERM")


class _Signals:
    """SIGINT/SIGTERM → a flag the loop reads after each step; a second SIGINT aborts at once."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # inherited ignored (a background job of a shell): Ctrl+C is not this process's to hear
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt("second Ctrl+C: aborting without a checkpoint")
        self.reason = signal.Signals(signum).name
        self.signum = signum

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
