"""Seeing a run: where a stage's time goes (`PhaseClock`) and the progress display (`Progress`).

`PhaseClock` splits a stage's wall time into phases: compiling (a dispatch during which XLA compiled something),
stepping, evaluating and checkpointing, and measures how long the loop waited for data. Its `summary` is what the
``time/...`` metrics hold (docs/metrics.md).

`Progress` draws a rich bar on a terminal and prints plain lines elsewhere (a pipe, a log file, or whenever the
``CI`` environment variable is set); design/progress.md says why rich. Lines that must not be lost (a resume, each
evaluation, an early stop, a failure, the final table) are printed above the bar, so they stay in the scroll-back.
While the bar is live, ``print`` from a callback goes through rich's console and lands above the bar too.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, TextIO

#: The phases a stage goes through; `Callback.on_phase` and ``{"type": "phase"}`` records name one of them.
PHASES = ("compiling", "stepping", "evaluating", "checkpointing", "done", "failed")
#: The phases whose start is reported too (`Callback.on_phase_start`, ``{"type": "phase_start"}`` records), before
#: they run: those that may take long. ``stepping`` starts only in place of one of them that did nothing.
STARTED_PHASES = ("compiling", "evaluating", "checkpointing")

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
#: How many seconds of recent steady stepping the displayed steps/s and ETA average over.
RECENT_S = 10.0


class CompileWatch:
    """Counts XLA backend compiles in this process through `jax.monitoring` (installed once, on first use)."""

    count = 0
    _installed = False

    @classmethod
    def _listener(cls, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            cls.count += 1

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            import jax

            jax.monitoring.register_event_duration_secs_listener(cls._listener)
            cls._installed = True


class PhaseClock:
    """Wall time per phase of one stage (this process's part of it, after a resume)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.compile_s = 0.0
        self.data_wait_s = 0.0
        self.stepping_s = 0.0  # chunks that did not compile, without their evaluations and checkpoints
        self.stepping_steps = 0
        self.loop_s = 0.0  # every chunk, compiling ones included, without evaluations and checkpoints
        self.eval_s = 0.0
        self.eval_compiles = 0  # compiles during evaluations: not the train loop's
        self.checkpoint_s = 0.0
        # (steps, seconds) of the steady chunks of about the last RECENT_S seconds: several host syncs, so a rate
        # read between two syncs (when dispatches return at once) is not too optimistic.
        self.recent: deque[tuple[int, float]] = deque()
        self.recent_steps = 0
        self.recent_s = 0.0
        self.span_s = 0.0  # the open stepping span (since the last phase event)
        self.span_steps = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def chunk(self, steps: int, wall_s: float, data_s: float, compiled: bool) -> None:
        """Account one dispatch: `wall_s` without evaluation/checkpoint time; `compiled`: XLA compiled in it."""
        self.data_wait_s += data_s
        self.loop_s += wall_s
        if not compiled:
            self.recent.append((steps, wall_s))
            self.recent_steps += steps
            self.recent_s += wall_s
            while len(self.recent) > 1 and self.recent_s - self.recent[0][1] > RECENT_S:
                old_steps, old_s = self.recent.popleft()
                self.recent_steps -= old_steps
                self.recent_s -= old_s
            self.stepping_s += wall_s
            self.stepping_steps += steps
            self.span_s += wall_s
            self.span_steps += steps

    def step_s(self) -> float | None:
        """Steady-state seconds per step: chunks that compiled are not averaged in."""
        return self.stepping_s / self.stepping_steps if self.stepping_steps else None

    def recent_step_s(self) -> float | None:
        """Seconds per step over the latest steady chunks (what the display's steps/s and ETA use)."""
        return self.recent_s / self.recent_steps if self.recent_steps else None

    def summary(self) -> dict[str, float]:
        """The ``time/...`` metrics (without the prefix): seconds, and the fraction of loop time spent on data."""
        out = {
            "compile_s": self.compile_s,
            "data_wait_frac": self.data_wait_s / self.loop_s if self.loop_s > 0 else 0.0,
            "checkpoint_s": self.checkpoint_s,
            "eval_s": self.eval_s,
            "elapsed_s": self.elapsed(),
        }
        step_s = self.step_s()
        if step_s is not None:
            out["step_s"] = step_s
        return out


def _top_level(path: str) -> str:
    """The top-level submodule of a weight path: ``.layers[1].weight`` -> ``layers[1]``, ``dense/kernel`` -> ``dense``.

    A list of submodules counts each element (an MLP's ``layers[0]``, ``layers[1]``) as its own top-level part.
    """
    from ..backends._model import parse_path

    try:
        steps = parse_path(path.lstrip("."))
    except Exception:  # another naming (Keras' "dense/kernel"): the first name
        return path.lstrip("./").split("/")[0].split(".")[0] or path
    if len(steps) > 1 and isinstance(steps[1], int):
        return f"{steps[0]}[{steps[1]}]"
    return str(steps[0])


def model_summary(weights: Mapping[str, Any], trainable: int | None = None) -> dict[str, Any]:
    """Parameter counts and bytes per top-level submodule and in all, from `ModelOp.weights()` (plain data), and
    `trainable` (`StepBackend.trainable_params`: how many the optimizer trains) when it is not all of them."""
    parts: dict[str, list[int]] = {}
    for path, array in weights.items():
        size = int(getattr(array, "size", 1))
        nbytes = int(getattr(array, "nbytes", 0))
        part = parts.setdefault(_top_level(str(path)), [0, 0])
        part[0] += size
        part[1] += nbytes
    out: dict[str, Any] = {
        "total_params": sum(p for p, _ in parts.values()),
        "total_bytes": sum(b for _, b in parts.values()),
        "submodules": [{"name": name, "params": p, "bytes": b} for name, (p, b) in parts.items()],
    }
    if trainable is not None:
        out["trainable_params"] = int(trainable)
    return out


#: What a sampler's final table calls the engine's metrics.
_SAMPLER_NAMES = {"train/loss": "train/potential_energy"}


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def format_model_summary(summary: Mapping[str, Any], limit: int = 12) -> list[str]:
    """The lines `Progress.model` prints: the totals, then up to `limit` submodules."""
    head = f"model: {summary['total_params']:,} parameters, {_bytes(int(summary['total_bytes']))}"
    if summary.get("trainable_params") is not None:
        n, total = int(summary["trainable_params"]), max(int(summary["total_params"]), 1)
        head += f"; trainable: {n:,} ({100 * n / total:.2g}% of the model's)"
    subs = list(summary.get("submodules", ()))
    lines = [head]
    width = max((len(s["name"]) for s in subs[:limit]), default=0)
    for s in subs[:limit]:
        lines.append(f"  {s['name']:<{width}}  {s['params']:>12,}  {_bytes(int(s['bytes']))}")
    if len(subs) > limit:
        lines.append(f"  ... and {len(subs) - limit} more submodules")
    return lines


def plain_output(stream: TextIO) -> bool:
    """Whether to print plain lines rather than draw a bar: not a terminal, or ``CI`` set (and not ``0``/``false``)."""
    ci = os.environ.get("CI", "").strip().lower()
    if ci not in ("", "0", "false", "no"):
        return True
    return not bool(getattr(stream, "isatty", lambda: False)())


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    whole = round(max(seconds, 0.0))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _num(value: Any) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def format_metrics(metrics: Mapping[str, Any], prefix: str = "") -> str:
    """``loss 0.3125 accuracy 0.9`` (a `prefix` is taken off names that carry it)."""
    return " ".join(f"{k.removeprefix(prefix)} {_num(v)}" for k, v in metrics.items())


class Progress:
    """The progress display of one stage (see the module docstring).

    Args:
        stage: The stage name, at the start of every line.
        total: The stage's `max_steps`.
        start: The step the stage starts (or resumes) at.
        enabled: ``False`` prints nothing at all (``TrainingLoop.progress``).
        stream: Where to write; default standard error.
        batch_size: Records per step, for examples/s.
        samples: A sampler's stage (`Backend.samples`): one step is one draw of every chain, so the line shows
            draws/s (per chain) and the sampler's own fields (`chains`), with no epoch, loss or examples/s; the
            final table names the mean potential energy as such and leaves out the learning rate.
    """

    def __init__(
        self,
        stage: str,
        total: int,
        start: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        batch_size: int | None = None,
        samples: bool = False,
    ) -> None:
        self.stage = stage
        self.samples = samples
        self.total = total
        self.start_step = start
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.plain = plain_output(self.stream)
        self.batch_size = batch_size
        self.every = max(1, total // 10)
        self.last_print = start
        self.step = start
        self.epoch = 0
        self.loss: float | None = None
        self.val: dict[str, float] = {}
        self.step_s: float | None = None
        self.phase = "compiling"
        self.compiled_once = False
        self.compile_announced = False
        self.last_draw = 0.0
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._bar_width = 24
        self._task: Any = None
        #: A sampler's per-chain state for the line (``step -> text``, or ``None`` with one chain); the engine sets
        #: it from the backend's ``progress_chains``.
        self.chains: Any = None
        if enabled and not self.plain:
            self._start_bar()

    # Drawing -----------------------------------------------------------------------------------------------
    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress
        from rich.table import Column

        console = Console(file=self.stream)
        self._bar_width = 24 if console.width >= 120 else 10
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True)),
            BarColumn(bar_width=self._bar_width),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            TextColumn("{task.fields[info]}", markup=False, table_column=Column(no_wrap=True)),
            TimeElapsedColumn(table_column=Column(no_wrap=True)),
            TextColumn("ETA {task.fields[eta]}", table_column=Column(no_wrap=True)),
            console=console,
            redirect_stdout=True,
            redirect_stderr=True,
            refresh_per_second=5,
        )
        self._task = self._bar.add_task(self.stage, total=self.total, completed=self.start_step, **self._fields())
        self._bar.start()

    def _eta(self) -> float | None:
        if self.step >= self.total:
            return 0.0
        return (self.total - self.step) * self.step_s if self.step_s is not None else None

    def _fields(self, epoch: int | None = None, step: int | None = None) -> dict[str, str]:
        parts = [] if self.samples else [f"epoch {self.epoch if epoch is None else epoch}"]
        if self.loss is not None and not self.samples:
            parts.append(f"loss {_num(self.loss)}")
        chains = self.chains(self.step if step is None else step) if self.chains is not None else None
        if chains:
            parts.append(chains)
        if self.val:
            parts.append("val " + format_metrics(self.val, "validate/"))
        if self.step_s:
            rate = 1.0 / self.step_s
            parts.append(f"{_rate(rate)} {'draws' if self.samples else 'steps'}/s")
            if self.batch_size:
                parts.append(f"{_rate(rate * self.batch_size)} ex/s")
        if self.phase != "stepping":
            parts.append(f"[{self.phase}]")
        info = " | ".join(parts)
        if self._bar is not None:  # the info gives way on a narrow terminal; the step counter and the ETA stay
            counter = 2 * len(str(self.total)) + 1
            fixed = len(self.stage) + self._bar_width + counter + len("0:00:00") + len("ETA 0:00:00") + 6
            room = max(self._bar.console.width - fixed, 8)
            if len(info) > room:
                info = info[: room - 1] + "…"
        return {"info": info, "eta": _clock(self._eta())}

    def line(self, text: str) -> None:
        """Print `text` on a line of its own (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.step, **self._fields())

    # Events ------------------------------------------------------------------------------------------------
    def resumed(self, step: int, source: str | None) -> None:
        self.step = self.last_print = step
        where = f" from {source}" if source else ""
        self.line(f"{self.stage}: resumed at step {step}{where}")
        self._refresh()

    def model(self, summary: Mapping[str, Any]) -> None:
        """Print the model summary (`model_summary`) at the start of the stage."""
        for text in format_model_summary(summary):
            self.line(f"{self.stage}: {text}" if not text.startswith(" ") else text)

    def phase_started(self, phase: str, step: int, epoch: int) -> None:
        """A phase starts (`STARTED_PHASES`, or ``stepping`` again): the bar shows it (``[compiling]``) while it
        runs. Off a terminal, the stage's first compile and each evaluation get a line as they start, so a log
        says what a long silence is; a checkpoint does not (saves are frequent, and usually short)."""
        self.phase = phase
        if not self.enabled:
            return
        if self._bar is not None:
            self._refresh()
        elif phase == "compiling" and not self.compile_announced:
            self.compile_announced = True
            self.line(f"{self.stage}: step {step} | compiling")
        elif phase == "evaluating":
            self.line(f"{self.stage}: step {step} epoch {epoch} | evaluating")

    def compiled(self, seconds: float) -> None:
        """A dispatch compiled: the first time, say how long it took (later, small compiles are only counted)."""
        if not self.compiled_once:
            self.compiled_once = True
            self.line(
                f"{self.stage}: compiled in {seconds:.2f} s (not counted in {'draws' if self.samples else 'steps'}/s)"
            )

    def update(self, step: int, epoch: int, loss: float | None, step_s: float | None) -> None:
        """After a dispatch: the step reached, its epoch, the latest logged train loss, steady seconds per step.

        The bar redraws (at most 10 times a second); plain lines come from `logged`, when a step's loss is known.
        """
        if not self.enabled:
            return
        self.step, self.epoch, self.step_s = step, epoch, step_s
        if loss is not None:
            self.loss = loss
        self.phase = "stepping"
        if self._bar is not None:
            now = time.perf_counter()
            if now - self.last_draw >= 0.1 or step >= self.total:  # the fields change at most 10 times a second
                self.last_draw = now
                self._refresh()

    def logged(self, step: int, epoch: int, loss: float | None) -> None:
        """A train record was written: `loss` is the mean over the window ending at `step`, the latest there is.

        Off a terminal this prints the progress line of `step` (every tenth of the stage, and at its end), so the
        line's loss is that step's: the engine writes a log window's record once its values are on the host,
        which it reads anyway for the record, so the display adds no wait for the device.
        """
        if not self.enabled:
            return
        self.loss = loss
        if step > self.step:  # written before `update` of its chunk (a log step that evaluates next): show them as one
            self.step, self.epoch = step, epoch
        if self._bar is not None:
            self._refresh()
        elif step - self.last_print >= self.every or step >= self.total:
            self.last_print = step
            info = self._fields(epoch, step)
            elapsed = _clock(time.perf_counter() - self.t0)
            self.line(f"{self.stage}: step {step}/{self.total} {info['info']} | elapsed {elapsed} ETA {info['eta']}")

    def evaluated(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        self.val = dict(metrics)
        self.line(f"{self.stage}: step {step} epoch {epoch} | validate {format_metrics(metrics, 'validate/')}")
        self._refresh()

    def close(self, status: str | None = None, summary: Mapping[str, Any] | None = None) -> None:
        """Stop the bar and print the final status line and table (``summary``: the stage's final metrics)."""
        if self._bar is not None:
            self._refresh()
            self._bar.stop()
            self._bar = None
        if not self.enabled or status is None:
            return
        elapsed = _clock(time.perf_counter() - self.t0)
        where = f"at step {self.step}/{self.total} after {elapsed}"
        reason = status.removeprefix("stopped: ")
        if status == reason:
            self.line(f"{self.stage}: {status} {where}")
        elif reason in ("SIGINT", "SIGTERM"):
            self.line(f"{self.stage}: interrupted by {reason} {where}")
        else:
            self.line(f"{self.stage}: stopped early {where}: {reason}")
        if summary:
            self._table(summary)

    def _table(self, summary: Mapping[str, Any]) -> None:
        if self.samples:  # a sampler's "loss" is the mean potential energy; it has no learning rate
            summary = {_SAMPLER_NAMES.get(k, k): v for k, v in summary.items() if k != "train/lr"}
        rows = [(k, _num(v)) for k, v in summary.items()]
        if self.plain or not self.enabled:
            width = max(len(k) for k, _ in rows)
            for k, v in rows:
                self.line(f"  {k:<{width}}  {v}")
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{self.stage}: final metrics")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in rows:
            table.add_row(k, v)
        Console(file=self.stream).print(table)
