"""Progress reporting: a bar on a terminal, plain periodic lines elsewhere (CI logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Reports ``step / total`` with the latest loss. On a TTY it redraws one line; otherwise it prints a plain
    line about every tenth of the run, so logs stay short."""

    def __init__(self, stage: str, total: int, start: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.stage = stage
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, total // 10)
        self.start_step = start
        self.t0 = time.perf_counter()
        self.last_print = start
        self.last_draw = 0.0

    def update(self, step: int, loss: float | None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = (step - self.start_step) / max(now - self.t0, 1e-9)
        loss_text = f" loss {loss:.4g}" if loss is not None else ""
        if self.tty:
            if now - self.last_draw < 0.1 and step < self.total:
                return
            self.last_draw = now
            width = 30
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r{self.stage} [{bar}] {step}/{self.total}{loss_text} {rate:.0f} steps/s ")
            self.stream.flush()
        elif step - self.last_print >= self.every or step == self.total:
            self.last_print = step
            self.stream.write(f"{self.stage}: step {step}/{self.total}{loss_text} ({rate:.0f} steps/s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
