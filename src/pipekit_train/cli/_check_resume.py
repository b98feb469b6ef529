"""``pipekit-train check-resume PIPELINE.yaml [--import M] [--kills N] [--steps S]``: does *this* pipeline resume
exactly?

It runs the pipeline once uninterrupted and once more as a chain of runs: the first is killed at a planned point,
each next one resumes (``run --resume auto``, the same command) and is killed at the next point, the last one
finishes. That is N + 2 runs of the pipeline. The kills are real signals a process sends itself
(``$PIPEKIT_RESUME_PROBE``, `pipekit_train.engine._probe`): a mix of SIGKILL and SIGTERM, one SIGKILL inside a
checkpoint write (the arrays written, nothing committed), and one in the last stage of a `Sequential`.

Every run writes a trace: after each dispatched chunk, digests of the state tree leaf by leaf (weights, optimizer
state with the learning-rate scale, EMA, a sampler's key), the data position, each callback's checkpointed state,
the chunk's per-step metrics and the learning rate, and each callback's Python attributes that are plain data.
Each run of the chain is compared, step by step, with the uninterrupted run: per kill point the report says
``bitwise`` or names the first state that differs and the stage and step. A callback whose Python attributes differ
from the uninterrupted run's (state it keeps outside `ctx.state_of`, which the checkpoint does not hold) is named as
the probable cause, with the step from which they differ. Exit 0 when every kill point is bitwise, 1 otherwise (2
for a mistake in what was asked).

This module plans the kills and drives the runs; the comparison of their traces and histories is
`_check_resume_compare`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._check_resume_compare import Verdict, compare, history_difference, read_trace
from ._common import EXIT_OK, UsageError, guarded, run_commands

__all__ = ["KillPoint", "add_check_resume_commands", "compare", "history_difference", "main", "plan_kills"]

EXIT_DIFFERS = 1


@dataclass(frozen=True)
class StageInfo:
    """A training stage as the check sees it: its name, step budget, checkpoint cadence (``None``: none) and
    validation cadence (``None``: no validation)."""

    name: str
    steps: int
    every: int | None
    evals: int | None = None

    def between_evaluations(self, near: int) -> int | None:
        """The step nearest `near` after a first validation pass and off the validation cadence (``None``: none):
        a stop there is where a stop that evaluates, unlike the uninterrupted run, would show."""
        if not self.evals:
            return None
        steps = [s for s in range(self.evals + 1, self.steps) if s % self.evals]
        return min(steps, key=lambda s: (abs(s - near), s)) if steps else None


@dataclass(frozen=True)
class KillPoint:
    """Where one run of the chain is stopped: after the chunk of `stage` that reaches `step`, or in its save."""

    stage: str
    step: int
    signal: str
    during_save: bool = False

    def describe(self) -> str:
        where = f"the checkpoint save of step {self.step}" if self.during_save else f"step {self.step}"
        return f"{self.signal} {'during' if self.during_save else 'at'} {where} of stage {self.stage!r}"

    def spec(self) -> dict[str, Any]:
        return {"stage": self.stage, "step": self.step, "signal": self.signal, "during_save": self.during_save}


def plan_kills(stages: Sequence[StageInfo], kills: int) -> list[KillPoint]:
    """`kills` points in run order, spread evenly over all the stages' steps: SIGTERM and SIGKILL alternating, the
    first one in a checkpointing stage a SIGKILL during the save of a checkpoint step, (with several stages) at
    least one in the last stage, and (when a stage validates) at least one SIGTERM between two of its validation
    passes, a point the others may miss.

    Example:
        >>> plan = plan_kills([StageInfo("fit", 12, 4), StageInfo("tune", 8, 4)], 3)
        >>> [(k.stage, k.step, k.signal, k.during_save) for k in plan]
        [('fit', 8, 'SIGKILL', True), ('fit', 10, 'SIGTERM', False), ('tune', 3, 'SIGKILL', False)]
        >>> [(k.step, k.signal) for k in plan_kills([StageInfo("fit", 12, 4)], 2)]
        [(8, 'SIGKILL'), (9, 'SIGTERM')]
        >>> [(k.step, k.signal) for k in plan_kills([StageInfo("fit", 12, 4, evals=4)], 1)]
        [(6, 'SIGTERM'), (8, 'SIGKILL')]
    """
    total = sum(s.steps for s in stages)
    places: list[tuple[int, int]] = []  # (stage index, step)
    for j in range(1, kills + 1):
        at = max(1, total * j // (kills + 1))
        for i, s in enumerate(stages):
            if at <= s.steps:
                places.append((i, min(max(at, 1), max(s.steps - 1, 1))))
                break
            at -= s.steps
    if len(stages) > 1 and all(i < len(stages) - 1 for i, _ in places):
        last = stages[-1]
        places[-1] = (len(stages) - 1, max(1, last.steps // 2))
    saving = next((n for n, (i, _) in enumerate(places) if stages[i].every), None)
    points: list[KillPoint] = []
    others = 0
    for n, (i, step) in enumerate(places):
        stage = stages[i]
        if n == saving and stage.every:
            # A checkpoint step with one committed before it, when there is one: the resume then continues from it.
            below = [m for m in range(stage.every, stage.steps, stage.every)]
            below = [m for m in below if m >= 2 * stage.every] or below
            step = min(below, key=lambda m: abs(m - step)) if below else stage.steps
            points.append(KillPoint(stage.name, step, "SIGKILL", during_save=True))
            continue
        points.append(KillPoint(stage.name, step, "SIGTERM" if others % 2 == 0 else "SIGKILL"))
        others += 1
    points = _with_a_stop_between_evaluations(stages, points)
    order = {s.name: i for i, s in enumerate(stages)}
    out: list[KillPoint] = []
    steps = {s.name: s.steps for s in stages}
    for p in points:  # in run order, each after the one before (moved a step on when it can be, else left out)
        if out and (order[p.stage], p.step) <= (order[out[-1].stage], out[-1].step):
            if p.during_save or p.stage != out[-1].stage or out[-1].step + 1 >= steps[p.stage]:
                continue
            p = KillPoint(p.stage, out[-1].step + 1, p.signal)
        out.append(p)
    return out


def _with_a_stop_between_evaluations(stages: Sequence[StageInfo], points: list[KillPoint]) -> list[KillPoint]:
    """`points` with a SIGTERM between two validation passes of a validating stage: the first SIGTERM of such a
    stage moved there, else the first such stage's first non-save point made one, else one more point."""
    by_name = {s.name: s for s in stages}

    def between(p: KillPoint) -> bool:
        stage = by_name[p.stage]
        return bool(stage.evals) and p.step > stage.evals and p.step % stage.evals != 0  # type: ignore[operator]

    if any(p.signal == "SIGTERM" and not p.during_save and between(p) for p in points):
        return points
    candidates = [p for p in points if not p.during_save and by_name[p.stage].evals]
    pick = next((p for p in candidates if p.signal == "SIGTERM"), candidates[0] if candidates else None)
    if pick is not None:
        step = by_name[pick.stage].between_evaluations(pick.step)
        if step is not None:
            return [KillPoint(p.stage, step, "SIGTERM") if p is pick else p for p in points]
    for stage in stages:  # no point lies in a validating stage that can take one: one more point
        step = stage.between_evaluations(stage.evals * 3 // 2 if stage.evals else 0)
        if step is not None:
            order = {s.name: i for i, s in enumerate(stages)}
            added = KillPoint(stage.name, step, "SIGTERM")
            return sorted([*points, added], key=lambda p: (order[p.stage], p.step))
    return points


# Running the pipeline ---------------------------------------------------------------------------------------


def _stage_paths(op: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(--set path, TrainingLoop)`` of every training stage of `op`, in run order."""
    from ..stage.loop import TrainingLoop

    if isinstance(op, TrainingLoop):
        return [(path, op)]
    stages = getattr(op, "stages", None)
    if isinstance(stages, (list, tuple)):
        return [item for i, s in enumerate(stages) for item in _stage_paths(s, (*path, "stages", str(i)))]
    return []


def _field(path: tuple[str, ...], name: str) -> str:
    return ".".join((*path, name))


class _Runner:
    """Runs ``pipekit-train run`` in subprocesses with the probe set; one trace file per run."""

    def __init__(self, args: argparse.Namespace, work: Path, sets: list[str]) -> None:
        self.args = args
        self.work = work
        self.sets = sets
        self.runs = 0

    def run(self, name: str, run_dir: Path, resume: bool, kill: KillPoint | None) -> subprocess.CompletedProcess[str]:
        trace = self.work / f"trace-{name}.jsonl"
        probe: dict[str, Any] = {"trace": str(trace)}
        if kill is not None:
            probe["kill"] = kill.spec()
        from ..engine._probe import ENV_VAR

        command = [sys.executable, "-m", "pipekit_train.cli", "run", self.args.pipeline, "--run-dir", str(run_dir)]
        command += ["--no-store", *(["--resume", "auto"] if resume else [])]
        for module in self.args.imports or []:
            command += ["--import", module]
        for text in self.sets:
            command += ["--set", text]
        self.runs += 1
        env = {**os.environ, ENV_VAR: json.dumps(probe)}
        return subprocess.run(command, env=env, capture_output=True, text=True, check=False)


def _tail(out: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (out.stderr or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {out.returncode}"


def _expected_exit(kill: KillPoint) -> int:
    return -signal.SIGKILL if kill.signal == "SIGKILL" else 128 + int(signal.Signals[kill.signal])


def cmd_check_resume(args: argparse.Namespace) -> int:
    """Run the pipeline uninterrupted and as a killed-and-resumed chain; report per kill point."""
    from ._imports import import_modules, requested_imports
    from ._main import _load_pipeline

    if args.kills < 1:
        raise UsageError(f"--kills must be at least 1, got {args.kills}")
    if args.steps is not None and args.steps < 2:
        raise UsageError(f"--steps must be at least 2 (a kill needs a step before the end), got {args.steps}")
    import_modules(requested_imports(args.imports))
    op = _load_pipeline(args.pipeline, args.set or [])
    found = _stage_paths(op)
    if not found:
        raise UsageError(f"{args.pipeline}: has no TrainingLoop stage to check")
    sets = list(args.set or [])
    if args.steps is not None:  # like --set <stage>.max_steps=S for every training stage
        sets += [f"{_field(path, 'max_steps')}={args.steps}" for path, _ in found]
        op = _load_pipeline(args.pipeline, sets)
        found = _stage_paths(op)
    stages = []
    for i, (_, loop) in enumerate(found):
        settings = loop.checkpoint_settings
        evals = int(loop.eval_every_n_steps) if loop.val_dataset is not None else None
        every = settings.every_n_steps if settings else None
        stages.append(StageInfo(loop.name or f"stage{i}", int(loop.max_steps), every, evals))
    if not any(s.every for s in stages):
        raise UsageError(
            f"{args.pipeline}: no stage has a Checkpoint callback, so nothing can be resumed; add "
            "callbacks: [{type: Checkpoint, every_n_steps: N}] to the stages to check"
        )
    kills = plan_kills(stages, args.kills)
    keep = args.work_dir is not None
    work = Path(args.work_dir) if keep else Path(tempfile.mkdtemp(prefix="pipekit-check-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    explicit = [(path, loop) for path, loop in found if loop.checkpoint_dir]
    try:
        return _check(args, stages, kills, work, sets, explicit)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _check(
    args: argparse.Namespace,
    stages: list[StageInfo],
    kills: list[KillPoint],
    work: Path,
    sets: list[str],
    explicit: list[tuple[tuple[str, ...], Any]],
) -> int:
    def with_dirs(name: str) -> list[str]:  # a stage's own checkpoint_dir: one per chain, never shared
        return sets + [
            f"{_field(p, 'checkpoint_dir')}={work / name / 'ckpt' / str(i)}" for i, (p, _) in enumerate(explicit)
        ]

    shown = ", ".join(f"{s.name}: {s.steps} steps" for s in stages)
    fewer = f" (of {args.kills} asked: the stages have too few steps for more)" if len(kills) < args.kills else ""
    if len(kills) > args.kills:
        fewer = f" ({args.kills} asked, and a SIGTERM between two validation passes)"
    print(
        f"check-resume {args.pipeline}: {len(stages)} stage(s) ({shown}); {len(kills)} kill(s){fewer}, "
        f"{len(kills) + 2} runs"
    )
    reference = _Runner(args, work, with_dirs("reference"))
    out = reference.run("reference", work / "reference", False, None)
    if out.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed ({_tail(out)}); nothing to compare")
    ref_records, _ = read_trace(work / "trace-reference.jsonl")
    ref = {(r["stage"], r["step"]): r for r in ref_records}
    print(f"  uninterrupted run: {len(ref_records)} step records")
    chain = _Runner(args, work, with_dirs("chain"))
    verdicts: list[Verdict] = []
    problems: list[str] = []
    seen: set[tuple[str, int]] = set()
    previous_fired: dict[str, Any] | None = None  # the kill record of the run before (its actual step)
    for n in range(len(kills) + 1):
        kill = kills[n] if n < len(kills) else None
        out = chain.run(str(n), work / "chain", n > 0, kill)
        records, fired = read_trace(work / f"trace-{n}.jsonl")
        seen.update((r["stage"], r["step"]) for r in records)
        label = "fresh start" if n == 0 else f"kill {n}: {_fired(kills[n - 1], previous_fired)}"
        verdicts.append(compare(label, records, ref))
        verdicts[-1].fresh = n == 0
        if kill is not None:
            if not fired:
                problems.append(f"kill {n + 1} ({kill.describe()}) never happened: the run {_ended(out)}")
            elif out.returncode != _expected_exit(kill):
                problems.append(
                    f"kill {n + 1} ({kill.describe()}): the run ended with exit {out.returncode}, not the signal"
                )
        elif out.returncode != 0:
            problems.append(f"the last resumed run failed: {_tail(out)}")
        previous_fired = fired[0] if fired else None
        if kill is not None and not fired:
            break
    missing = [key for key in ref if key not in seen]
    if missing and not problems:
        problems.append(
            f"the chain never ran stage {missing[0][0]!r} step {missing[0][1]} ({len(missing)} records missing)"
        )
    for v in verdicts:
        print(v.line())
    logged = None if problems else history_difference(work / "reference", work / "chain")
    if not problems:
        print(f"  logged history: {logged or 'bitwise (train, validate and test records of every stage)'}")
    for p in problems:
        print(f"  problem: {p}")
    print(
        "compared after every chunk: the state tree leaf by leaf (weights, optimizer state with the learning-rate "
        "scale, EMA, a sampler's key), the data position, each callback's saved state, the per-step metrics and the "
        "learning rate; callbacks' Python attributes (plain data) name a cause. The per-step RNG key derives from "
        "the seed and the step. At the end, the logged history (metrics.jsonl, as `pipekit-train history` reads it)."
    )
    bad = [v for v in verdicts if v.differs is not None]
    if bad or problems or logged:
        also = ", the logged history differs" if logged else ""
        print(f"result: NOT bitwise ({len(bad)} of {len(verdicts)} runs differ{also}, {len(problems)} problem(s))")
        return EXIT_DIFFERS
    print(f"result: bitwise at all {len(kills)} kill points")
    return EXIT_OK


def _fired(kill: KillPoint, fired: dict[str, Any] | None) -> str:
    if fired is None or kill.during_save:
        return kill.describe()
    return f"{kill.signal} at step {fired['step']} of stage {kill.stage!r}"


def _ended(out: subprocess.CompletedProcess[str]) -> str:
    return "finished" if out.returncode == 0 else f"ended with exit {out.returncode} ({_tail(out)})"


def add_check_resume_commands(sub: Any) -> None:
    """Add ``check-resume`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "check-resume",
        help="check that a pipeline resumes bitwise after kills (N + 2 runs)",
        description=(
            "Run the pipeline uninterrupted, then as a chain of runs killed at N points (SIGKILL and SIGTERM, one "
            "during a checkpoint save, one in the last stage) and resumed with --resume auto; report per kill point "
            "'bitwise' or the first state that differs and its step. Exit 0 only when all are bitwise."
        ),
    )
    p.add_argument("pipeline", metavar="PIPELINE.yaml")
    p.add_argument("--kills", type=int, default=3, metavar="N", help="kill points (default 3)")
    p.add_argument(
        "--steps", type=int, metavar="S", help="run every training stage for S steps (like --set <stage>.max_steps=S)"
    )
    p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override a field, as for run")
    p.add_argument("--work-dir", metavar="DIR", help="keep the runs and traces in DIR (default: a temporary folder)")
    from ._imports import add_import_flag

    add_import_flag(p)
    p.set_defaults(func=guarded("check-resume", cmd_check_resume))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``check-resume`` with `argv` (the `pipekit-train` command line holds it too)."""
    return run_commands(add_check_resume_commands, argv, description="Check that a pipeline resumes exactly.")
