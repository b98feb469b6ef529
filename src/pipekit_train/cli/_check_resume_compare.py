"""How ``pipekit-train check-resume`` compares the runs: each run's trace read back, compared record by record with
the uninterrupted run's (`compare`: ``bitwise``, or the first state that differs and a probable cause), and the
logged histories of the two run directories (`history_difference`).

A trace (``$PIPEKIT_RESUME_PROBE``, `pipekit_train.engine._probe`) holds, after each dispatched chunk, digests of
the state tree leaf by leaf, the data position, each callback's checkpointed state and its plain-data Python
attributes, the chunk's per-step metrics and the learning rate; a line with ``kill`` records where the run was
killed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Verdict", "compare", "history_difference", "read_trace"]

#: How the parts of a backend's state tree are named in the report.
_PART_NAMES = {
    "params": "weights",
    "opt_state": "optimizer state",
    "ema": "EMA weights",
    "consts": "non-trained arrays",
}


def read_trace(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(records, kills)`` of one run's trace file (empty when the run traced nothing)."""
    if not path.exists():
        return [], []
    records: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        (kills if "kill" in item else records).append(item)
    return records, kills


def _state_differences(record: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What of the trained state differs between two records of the same stage and step (empty: bitwise)."""
    out = []
    for part in sorted(set(record["state"]) | set(ref["state"])):
        mine, theirs = record["state"].get(part, {}), ref["state"].get(part, {})
        if mine != theirs:
            leaf = next((k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)), "")
            name = _PART_NAMES.get(part, f"state {part!r}")
            out.append(f"{name} ({part}/{leaf})" if leaf and leaf != "." else name)
    if record["data"] != ref["data"]:
        out.append("data position")
    for key in sorted(set(record["callbacks"]) | set(ref["callbacks"])):
        mine_cb, theirs_cb = record["callbacks"].get(key, {}), ref["callbacks"].get(key, {})
        if mine_cb.get("saved") != theirs_cb.get("saved"):
            out.append(f"callback {key!r} saved state")
    if record["metrics"] != ref["metrics"]:
        keys = sorted(
            k for k in set(record["metrics"]) | set(ref["metrics"]) if record["metrics"].get(k) != ref["metrics"].get(k)
        )
        out.append(f"metrics ({', '.join(keys)})")
    if record["lr"] != ref["lr"]:
        out.append("learning rate")
    return out


def _attribute_differences(record: dict[str, Any], ref: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """``(callback key, attribute names)`` whose Python attributes differ from the reference's at this step."""
    out = []
    for key, theirs in ref["callbacks"].items():
        mine = record["callbacks"].get(key, {}).get("attrs", {})
        names = sorted(n for n in set(mine) | set(theirs.get("attrs", {})) if mine.get(n) != theirs["attrs"].get(n))
        if names:
            out.append((key, names))
    return out


@dataclass
class Verdict:
    """One segment of the chain compared with the reference: bitwise, or what differs first."""

    label: str
    fresh: bool = False
    steps: int = 0
    resumed_from: tuple[str, int] | None = None
    differs: str | None = None
    cause: str | None = None
    note: str | None = None

    def line(self) -> str:
        where = ""
        if self.resumed_from and not self.fresh:
            stage, step = self.resumed_from
            where = (
                f", resumed at step {step} of {stage!r}" if step else f", {stage!r} started over (nothing committed)"
            )
        head = f"  {self.label}{where}: "
        if self.differs is None:
            text = head + f"bitwise ({self.steps} step records compared)"
            return text + (f"; note: {self.note}" if self.note else "")
        return head + self.differs + (f"; probable cause: {self.cause}" if self.cause else "")


def compare(label: str, records: list[dict[str, Any]], reference: dict[tuple[str, int], dict[str, Any]]) -> Verdict:
    """Compare one run's trace `records` with the uninterrupted run's, record by record in the order they ran."""
    verdict = Verdict(label)
    if records:
        verdict.resumed_from = (records[0]["stage"], records[0]["first"])
    first_attr: tuple[int, str, list[str], int] | None = None
    for n, record in enumerate(records):
        key = (record["stage"], record["step"])
        ref = reference.get(key)
        if ref is None:
            verdict.differs = (
                f"differs at stage {key[0]!r} step {key[1]}: the uninterrupted run ended no chunk there "
                "(the resumed run dispatched other chunks)"
            )
            return verdict
        if first_attr is None:
            for cb, names in _attribute_differences(record, ref):
                first_attr = (n, cb, names, record["step"])
                break
        diffs = _state_differences(record, ref)
        verdict.steps += 1
        if diffs:
            verdict.differs = f"differs at stage {key[0]!r} step {key[1]}: {', '.join(diffs)}"
            if first_attr is not None:
                _, cb, names, step = first_attr
                verdict.cause = (
                    f"callback {cb!r}: its Python attribute(s) {', '.join(names)} differ from the uninterrupted run "
                    f"from step {step} on, and its saved state (ctx.state_of) does not hold them"
                )
            return verdict
    if first_attr is not None:
        _, cb, names, step = first_attr
        verdict.note = (
            f"callback {cb!r}'s Python attribute(s) {', '.join(names)} differ from step {step} on, but nothing "
            "compared changed"
        )
    return verdict


def history_difference(reference: Path, chain: Path) -> str | None:
    """What first differs between the logged histories of two run directories (``None``: they are bitwise equal):
    every stage's train, validate and test series as `pipekit_train.tracking.history` reads them (a resumed run's
    records replace the ones it logs again, the records a signal's stop showed are dropped); timings are not
    compared."""
    from ..tracking._history import history

    def read(run_dir: Path) -> dict[str, Any]:
        found = history(str(run_dir)) if run_dir.is_dir() else {}
        stages = next(iter(found.values()), {})
        return {st: {c: v for c, v in ctx.items() if c != "time"} for st, ctx in stages.items()}

    want, got = read(reference), read(chain)
    for stage in sorted(set(want) | set(got), key=lambda st: (st not in want, st)):
        for context in sorted(set(want.get(stage, {})) | set(got.get(stage, {}))):
            a, b = want.get(stage, {}).get(context, {}), got.get(stage, {}).get(context, {})
            for metric in sorted(set(a) | set(b)):
                sa, sb = a.get(metric), b.get(metric)
                if sa == sb:
                    continue
                if sa is None or sb is None:
                    return f"differs: stage {stage!r} logged {context}/{metric} in one run only"
                pairs = list(zip(sa["steps"], sa["values"]))
                other = list(zip(sb["steps"], sb["values"]))
                at = next((x for x, y in zip(pairs, other) if x != y), None)
                where = f"at step {at[0]}" if at is not None else f"in its steps ({len(pairs)} vs {len(other)})"
                return f"differs: stage {stage!r} {context}/{metric} {where}"
    return None
