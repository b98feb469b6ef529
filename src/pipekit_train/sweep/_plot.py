"""``pipekit-train sweep FILE --plot sweep.png``: the objective against each parameter, and every trial's
validation curve of the objective's metric on one axis (matplotlib's Agg canvas; the ``plot`` extra)."""

from __future__ import annotations

import os
from typing import Any

from pipekit import ConfigError

from ._report import SweepResult


def _curves(trial: dict[str, Any], context: str, name: str) -> tuple[list[int], list[float]]:
    """The trial's logged `context`/`name` values over its stages, steps continuing from one stage to the next."""
    from ..tracking._history import history

    steps: list[int] = []
    values: list[float] = []
    if not trial.get("run_dir") or not os.path.isdir(trial["run_dir"]):
        return steps, values
    offset = 0
    for stage in history(trial["run_dir"])[trial["run_dir"]].values():
        series = stage.get(context, {}).get(name)
        if series:
            steps += [offset + s for s in series["steps"]]
            values += list(series["values"])
            offset = steps[-1]
    return steps, values


def plot_sweep(result: SweepResult, metric: str, path: str) -> str:
    """Draw `result` into the image file `path` (format from its suffix); return the path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'pipekit-train[plot]'") from None
    params = list(dict.fromkeys(p for t in result.trials for p in t["params"]))
    panels = len(params) + 1
    fig = Figure(figsize=(4.2 * panels, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    done = [t for t in result.trials if t["objective"] is not None]
    colors = {"completed": "tab:blue", "pruned": "tab:orange", "failed": "tab:red", "running": "tab:gray"}
    for ax, param in zip(axes, params, strict=False):
        xs = [t["params"].get(param) for t in done]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
        if not numeric:  # a choice of names: one position per value
            labels = list(dict.fromkeys(str(x) for x in xs))
            ax.set_xticks(range(len(labels)), labels)
            xs = [labels.index(str(x)) for x in xs]
        elif xs and min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        for state in colors:
            pts = [(x, t["objective"]) for x, t in zip(xs, done, strict=True) if t["state"] == state]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=colors[state], label=state, zorder=3)
        if result.best is not None and param in result.best["params"] and numeric:
            ax.scatter(
                [result.best["params"][param]],
                [result.best["objective"]],
                s=160,
                facecolors="none",
                edgecolors="black",
                label="best",
                zorder=4,
            )
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} against {param}", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[-1]
    context, name = metric.split("/", 1)
    for t in result.trials:
        steps, values = _curves(t, context, name)
        if steps:
            shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in t["params"].items())
            style = "--" if t["state"] == "pruned" else "-"
            ax.plot(steps, values, style, marker=".", label=f"{t['number']}: {shown}")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} of every trial (dashed: pruned)", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=6)
    out = os.fspath(path)
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out)
    return out


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
