"""`history`: the metrics runs logged (their ``metrics.jsonl``), as plain data, a table, and a plot.

A run directory holds one folder per stage (``stage0``, or the stage's ``name``), each with the ``metrics.jsonl``
that `JsonLinesWriter` appended to. `history` reads them into plain dicts and lists::

    {run_dir: {stage: {context: {metric: {"steps": [10, 20, ...], "values": [0.9, 0.7, ...]}}}}}

with ``context`` one of ``"train"``, ``"validate"``, ``"test"`` (in that order; other contexts a writer chose
follow). Only numeric values of ``"metrics"`` records are kept; a nested value becomes a dotted name (``a.b``).
A resumed run appends to the same file and logs again from its checkpoint's step: the later records replace the
earlier ones from that step on, and the records a stage wrote at the step a signal stopped it (marked
``"interrupted": true``, off the logging cadence) go once the resumed run logs on, so each series reads like the
uninterrupted run's.

Nothing here imports JAX (nor NumPy); `plot_history` imports matplotlib (the ``plot`` extra) when it is called.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

from pipekit import PipekitError, suggestion

from ._writers import RESERVED_KEYS, read_jsonl

__all__ = ["HistoryError", "Series", "format_table", "history", "metric_mode", "plot_history", "summary"]

METRICS_FILE = "metrics.jsonl"
CONTEXTS = ("train", "validate", "test")
#: Contexts `plot_history` draws (test metrics are one point at the end of a stage: they are in the table).
PLOTTED_CONTEXTS = ("train", "validate")

_MSG_MATPLOTLIB = (
    "plotting the history needs the 'matplotlib' package, which is not installed; "
    "install the extra: pip install 'pipekit-train[plot]'"
)


class HistoryError(PipekitError):
    """A run's history cannot be read or shown: no such run, no metrics, an unknown metric name."""


class Series(TypedDict):
    """One metric of one context of one stage: the steps it was logged at and its values there."""

    steps: list[int]
    values: list[float]


#: ``{run_dir: {stage: {context: {metric: Series}}}}``.
History = dict[str, dict[str, dict[str, dict[str, Series]]]]


# Reading ---------------------------------------------------------------------------------------------------
def _numbers(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric entries of a record's values, nested dicts flattened to dotted names (bools are not numbers)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_numbers(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _read_stage(path: Path) -> dict[str, dict[str, Series]]:
    """``{context: {metric: Series}}`` of one ``metrics.jsonl``; a resume's records replace the ones they redo."""
    try:
        records = read_jsonl(path)
    except ValueError as e:
        raise HistoryError(str(e)) from None
    by_context: dict[str, list[tuple[int, dict[str, float], bool]]] = {}
    for record in records:
        if not isinstance(record, dict) or record.get("type") != "metrics":
            continue
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        context = str(record.get("context", "train"))
        values = _numbers({k: v for k, v in record.items() if k not in RESERVED_KEYS})
        rows = by_context.setdefault(context, [])
        while rows and (rows[-1][0] >= step or rows[-1][2]):  # logged again from an earlier step: a resumed run;
            rows.pop()  # or the off-cadence point of a signal's stop, which the resumed run logs on from
        rows.append((step, values, record.get("interrupted") is True))
    ordered = [c for c in CONTEXTS if c in by_context] + sorted(c for c in by_context if c not in CONTEXTS)
    out: dict[str, dict[str, Series]] = {}
    for context in ordered:
        series: dict[str, Series] = {}
        for step, values, _ in by_context[context]:
            for name, value in values.items():
                s = series.setdefault(name, {"steps": [], "values": []})
                s["steps"].append(step)
                s["values"].append(value)
        out[context] = series
    return out


def _first_time(path: Path) -> float:
    """When a stage's metrics file was started (its first record's ``time``), for ordering stages."""
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        match = re.search(r'"time":\s*([0-9.eE+-]+)', first)
        return float(match.group(1)) if match else math.inf
    except (OSError, ValueError):
        return math.inf


def _stage_files(run_dir: str) -> list[tuple[str, Path]]:
    """``[(stage, metrics file)]`` of a run directory (or of a stage directory, or of a metrics file itself)."""
    where = Path(run_dir)
    if where.is_file():
        return [(where.parent.name or str(where), where)]
    if not where.is_dir():
        raise HistoryError(f"{run_dir}: no such run directory")
    if (where / METRICS_FILE).is_file():  # a stage's own folder
        return [(where.name, where / METRICS_FILE)]
    stages = [(d.name, d / METRICS_FILE) for d in where.iterdir() if (d / METRICS_FILE).is_file()]
    if not stages:
        raise HistoryError(
            f"{run_dir} holds no {METRICS_FILE} (neither in it nor in a stage folder under it); is it a run "
            "directory written with a JsonLinesWriter?"
        )
    return sorted(stages, key=lambda s: (_first_time(s[1]), s[0]))


def _known_names(hist: History) -> list[str]:
    names: set[str] = set()
    for stages in hist.values():
        for contexts in stages.values():
            for context, series in contexts.items():
                for name in series:
                    names.update((name, f"{context}/{name}"))
    return sorted(names)


def _matches(wanted: str, context: str, name: str) -> bool:
    return wanted in (name, f"{context}/{name}")


def history(
    run_dirs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], metrics: Sequence[str] | None = None
) -> History:
    """The metrics the runs in `run_dirs` logged, as plain data (see the module docstring for the shape).

    Args:
        run_dirs: Run directories (a stage's folder, or a ``metrics.jsonl`` file, also works), or one of them.
        metrics: Keep only these metrics: a bare name (``"loss"``, in every context) or a context and a name
            (``"validate/accuracy"``). A name no run logged is an error that suggests the closest ones.

    Example:
        >>> import json, os, tempfile
        >>> run = tempfile.mkdtemp()
        >>> os.mkdir(os.path.join(run, "stage0"))
        >>> with open(os.path.join(run, "stage0", "metrics.jsonl"), "w") as f:
        ...     for step, loss in [(10, 0.9), (20, 0.5)]:
        ...         _ = f.write(json.dumps({"type": "metrics", "context": "train", "step": step, "loss": loss}) + "\\n")
        >>> history(run)[run]["stage0"]["train"]["loss"]
        {'steps': [10, 20], 'values': [0.9, 0.5]}
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    keys = list(dict.fromkeys(os.fspath(d) for d in run_dirs))
    if not keys:
        raise HistoryError("history needs at least one run directory")
    hist: History = {key: {stage: _read_stage(path) for stage, path in _stage_files(key)} for key in keys}
    if metrics is None:
        return hist
    wanted = list(dict.fromkeys(metrics))
    known = _known_names(hist)
    for name in wanted:
        if name not in known:
            shown = ", ".join(known) if known else "none"
            raise HistoryError(f"no run logged a metric {name!r}{suggestion(name, known)}; logged metrics: {shown}")
    return {
        run: {
            stage: {
                context: {n: s for n, s in series.items() if any(_matches(w, context, n) for w in wanted)}
                for context, series in contexts.items()
            }
            for stage, contexts in stages.items()
        }
        for run, stages in hist.items()
    }


# The table -------------------------------------------------------------------------------------------------
_HIGHER = ("acc", "accuracy", "f1", "precision", "recall", "auc", "auroc", "r2", "iou", "dice", "map", "ap")
_LOWER = ("loss", "error", "err", "mae", "mse", "rmse", "nll", "kl", "perplexity", "ppl", "cost")


def metric_mode(name: str) -> Literal["min", "max"] | None:
    """Which way a metric is better, judged from its name: ``"min"`` (losses, errors), ``"max"`` (accuracy, F1,
    top-k), or ``None`` when the name does not say (a learning rate, a time)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.rsplit("/", 1)[-1].lower()) if w]
    if any(w in _LOWER for w in words):
        return "min"
    if any(w in _HIGHER or re.fullmatch(r"top\d*", w) for w in words):
        return "max"
    return None


def summary(hist: History) -> list[dict[str, Any]]:
    """One row per run, stage and metric: ``{"run", "stage", "metric", "points", "last", "last_step", "best",
    "best_step"}`` (``best`` is ``None`` when the metric's name does not say which way is better)."""
    rows: list[dict[str, Any]] = []
    for run, stages in hist.items():
        for stage, contexts in stages.items():
            for context, series in contexts.items():
                for name, s in series.items():
                    if not s["steps"]:
                        continue
                    mode = metric_mode(name)
                    finite = [(v, t) for t, v in zip(s["steps"], s["values"]) if math.isfinite(v)]
                    best: tuple[float, int] | None = None
                    if mode is not None and finite:
                        pick = min if mode == "min" else max
                        value, step = pick(finite, key=lambda p: p[0])  # the first step that reached it
                        best = (value, step)
                    rows.append(
                        {
                            "run": run,
                            "stage": stage,
                            "metric": f"{context}/{name}",
                            "points": len(s["steps"]),
                            "last": s["values"][-1],
                            "last_step": s["steps"][-1],
                            "best": None if best is None else best[0],
                            "best_step": None if best is None else best[1],
                        }
                    )
    return rows


def _num(value: float) -> str:
    return f"{value:.4g}"


def format_table(hist: History) -> str:
    """A compact text table: per run, stage and metric, the last value and the best one, with their steps."""
    rows = summary(hist)
    if not rows:
        return "no metrics logged"
    header = ["RUN", "STAGE", "METRIC", "POINTS", "LAST", "BEST"]
    cells = [
        [
            r["run"],
            r["stage"],
            r["metric"],
            str(r["points"]),
            f"{_num(r['last'])} @{r['last_step']}",
            "-" if r["best"] is None else f"{_num(r['best'])} @{r['best_step']}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *cells]]
    return "\n".join(lines)


# The plot --------------------------------------------------------------------------------------------------
def _labels(runs: Sequence[str]) -> dict[str, str]:
    """Short names for runs: their folder names when those differ, else the paths as given."""
    names = [Path(r).name or r for r in runs]
    return dict(zip(runs, names)) if len(set(names)) == len(names) else {r: r for r in runs}


def plot_history(hist: History, path: str | os.PathLike[str], metrics: Sequence[str] | None = None) -> str:
    """Draw the train (solid) and validate (dashed) curves of every run and stage in `hist` into the image file
    `path` (the format follows its suffix: ``.png``, ``.svg``, ``.pdf``), one panel per metric; return the path.

    A panel whose positive values span more than a factor of 10 (a pretrain MSE of 0.015 next to a finetune
    cross-entropy of 1.8) has a logarithmic y axis, so each curve keeps its shape.

    Uses matplotlib's non-interactive Agg canvas directly (the global pyplot backend is left alone); needs the
    ``plot`` extra. `metrics` limits the panels, named as in `history`; default: every train/validate metric.
    """
    fig = history_figure(hist, metrics)
    out = os.fspath(path)
    parent = os.path.dirname(out)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(out)
    return out


def history_figure(hist: History, metrics: Sequence[str] | None = None) -> Any:
    """The matplotlib `Figure` `plot_history` saves: one panel (axes) per metric, titled with its name."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise HistoryError(_MSG_MATPLOTLIB) from None

    panels: list[str] = []  # metric names without their context: train and validate share a panel
    for stages in hist.values():
        for contexts in stages.values():
            for context in PLOTTED_CONTEXTS:
                for name in contexts.get(context, {}):
                    if (metrics is None or any(_matches(w, context, name) for w in metrics)) and name not in panels:
                        panels.append(name)
    if not panels:
        raise HistoryError(
            "nothing to plot: the runs logged no train or validate metrics"
            + (f" among {', '.join(metrics)}" if metrics else "")
        )
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.8 * cols, 3.4 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    labels = _labels(list(hist))
    colors = [f"C{i}" for i in range(10)]
    drawn: dict[str, list[float]] = {name: [] for name in panels}
    line = 0
    for run, stages in hist.items():
        for stage, contexts in stages.items():
            color = colors[line % len(colors)]
            line += 1
            label = labels[run] if len(stages) == 1 else f"{labels[run]}:{stage}"
            for ax, name in zip(axes, panels):
                for context, style in zip(PLOTTED_CONTEXTS, ("-", "--")):
                    s = contexts.get(context, {}).get(name)
                    if s is None or (metrics is not None and not any(_matches(w, context, name) for w in metrics)):
                        continue
                    marker = "o" if len(s["steps"]) < 3 else None
                    ax.plot(s["steps"], s["values"], style, color=color, marker=marker, label=f"{label} {context}")
                    drawn[name] += [v for v in s["values"] if math.isfinite(v)]
    for ax, name in zip(axes, panels):
        ax.set_title(name)
        ax.set_xlabel("step")
        values = drawn[name]
        if values and min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return fig
