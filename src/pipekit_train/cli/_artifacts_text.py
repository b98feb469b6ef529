"""How the ``pipekit-train artifacts`` commands show artifacts as text: the listing table, one artifact, a
lineage tree, the diff of two, metrics in reading order.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..provenance._artifact import TrainingArtifact


def _short_time(iso: str | None) -> str:
    if not iso:
        return "-"
    t = _dt.datetime.fromisoformat(iso)
    if t.tzinfo is not None:
        t = t.astimezone(_dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


_CONTEXT_ORDER = {"validate": 0, "test": 1, "train": 2}


def metric_order(final_metrics: dict[str, Any]) -> list[str]:
    """The names of `final_metrics`, the objective first: ``validate/loss`` when the stage validated, else
    ``train/loss``; then validation, test and training values, each context's loss first (a loss's own terms,
    ``validate/loss/MSE_0``, after the rest of their context; ``train/lr`` last of them), then anything else, and
    ``time/...`` last.

    Example:
        >>> metric_order({"time/compile_s": 1.0, "test/mae": 0.3, "train/lr": 0.01, "train/loss": 0.2})
        ['train/loss', 'test/mae', 'train/lr', 'time/compile_s']
    """
    objective = "validate/loss" if "validate/loss" in final_metrics else "train/loss"

    def rank(name: str) -> tuple[int, int, int, int, int, str]:
        context, _, key = name.partition("/")
        timing = context == "time"
        return (
            name != objective,
            timing,
            _CONTEXT_ORDER.get(context, 3),
            key != "loss",
            ("/" in key) + 2 * (name == "train/lr"),
            name,
        )

    return sorted(final_metrics, key=rank)


def _key_metrics(artifact: TrainingArtifact, n: int = 3) -> str:
    """The short view's metrics: the objective and the next ones by `metric_order`, never timing."""
    names = [k for k in metric_order(artifact.final_metrics) if not k.startswith("time/")][:n]
    return " ".join(f"{k}={_num(artifact.final_metrics[k])}" for k in names)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _listing(artifacts: Sequence[TrainingArtifact]) -> str:
    header = ["ID", "STARTED (UTC)", "RUN", "STAGE", "BACKEND", "STATUS", "METRICS"]
    rows = [
        [a.artifact_id[:12], _short_time(a.started_at), a.run_id, a.stage, a.backend, a.status, _key_metrics(a)]
        for a in artifacts
    ]
    return _table(rows, header)


def _git_text(git: dict[str, Any] | None) -> str:
    if not git:
        return "not a git repository"
    commit = (git.get("commit") or "no commit")[:12]
    if git.get("dirty"):
        return f"{commit} + uncommitted changes (diff {git.get('diff_hash') or '?'})"
    return f"{commit} (clean)"


def _show(a: TrainingArtifact) -> str:
    deps = a.deps_lock or {}
    dists = deps.get("distributions") or {}
    lock = deps.get("lock_path") or ("lock file recorded" if deps.get("lock_file") else "installed distributions")
    lines = [
        f"artifact   {a.artifact_id}",
        f"run        {a.run_id}   stage {a.stage}",
        f"status     {a.status}",
        f"time       {_short_time(a.started_at)} -> {_short_time(a.ended_at)} UTC",
        f"backend    {a.backend}",
        f"pipeline   {a.pipeline_hash or '-'}",
        f"dataset    {a.dataset_hash or '-'}",
        f"model      {a.model_registry_uri or '-'}",
        f"weights    {a.trained_model_hash or '-'}",
        f"tracker    {a.tracker_run_id or '-'}",
        f"seed       {a.seed if a.seed is not None else '-'}",
        f"code       {_git_text(a.git)}",
        f"parents    {', '.join(a.parent_ids) or '-'}",
        f"deps       python {deps.get('python', '?')}, jax {deps.get('jax') or '?'}, "
        f"{len(dists)} distributions ({lock})",
        f"devices    {', '.join(deps.get('devices') or []) or '-'}",
    ]
    info = a.backend_info or {}
    if info.get("trainable_params") is not None and info.get("trainable_params") != info.get("num_params"):
        lora = info.get("lora") or {}
        how = f"; LoRA rank {lora['rank']} on {', '.join(lora['targets'])}"[:200] if lora else ""
        lines.append(f"params     {info.get('num_params', 0):,}, trainable {info['trainable_params']:,}{how}")
    changes = info.get("topology_changes")
    if changes:  # elastic resumes: the device and process counts the stage trained on, and where they changed
        from ..checkpoint._elastic import history_text

        lines.append(f"topology   {history_text(changes)}")
    imports = [_import_text(m) for m in a.imports] or ["-"]
    lines.append(f"imports    {imports[0]}")
    lines += [f"           {text}" for text in imports[1:]]
    if a.run_dir:
        lines.append(f"files      {a.run_dir}")
    fitted = a.source_statistics or {}
    if fitted.get("classes"):  # a CsvSource's class_labels, fitted on the training split
        lines.append(f"classes    {', '.join(str(c) for c in fitted['classes'])}"[:300])
    if isinstance(fitted.get("tokenizer"), dict):  # a TextSource's trained BPE: its setting and the text's digest
        tok = fitted["tokenizer"]
        lines.append(f"tokenizer  {tok.get('setting')}, sha256 {str(tok.get('sha256'))[:12]}")
    if fitted.get("features"):
        lines.append(f"features   {len(fitted['features'])}: {', '.join(fitted['features'])}"[:300])
    if a.user:
        lines.append("user")  # what callbacks put in ctx.artifact_fields
        width = max(len(k) for k in a.user)
        lines += [f"  {k.ljust(width)}  {json.dumps(v, sort_keys=True)[:200]}" for k, v in a.user.items()]
    if a.restored:  # restore_best: the metrics below are that step's; the last step's are kept beside them
        r = a.restored
        monitor = f", {r.get('monitor')} {_num(r['score'])}" if r.get("score") is not None else ""
        lines.append(f"restored   the best checkpoint, step {r.get('step')}{monitor} (the stage ran to step "
                     f"{r.get('last_step')}; the metrics are step {r.get('step')}'s)")  # fmt: skip
    if a.final_metrics:
        lines.append("metrics")
        width = max(len(k) for k in a.final_metrics)
        lines += [f"  {k.ljust(width)}  {_num(a.final_metrics[k])}" for k in metric_order(a.final_metrics)]
    if a.training_pipeline_yaml:
        lines.append("pipeline YAML")
        lines += ["  " + line for line in a.training_pipeline_yaml.rstrip("\n").splitlines()]
    return "\n".join(lines)


def _import_text(m: dict[str, Any]) -> str:
    """``my_models  /src/my_models.py  sha256 1f2e…``: one recorded ``--import``."""
    digest = f"sha256 {m['sha256']}" if m.get("sha256") else "no file digest"
    return f"{m['module']}  {m.get('file') or '(no file)'}  {digest}"


def _lineage(root: TrainingArtifact, lineage: dict[str, list[Any]]) -> str:
    def line(a: TrainingArtifact, mark: str = " ") -> str:
        when = _short_time(a.started_at)
        forked = f"  (fork of {a.fork['stage']}@{a.fork['step']})" if a.fork else ""
        return f"{mark} {a.artifact_id[:12]}  {a.stage:<10}  {a.status:<10}  {when}  {_key_metrics(a)}{forked}"

    out = ["ancestors (oldest first):"]
    out += [line(a) for a in reversed(lineage["ancestors"])] or ["  (none)"]
    out += [line(root, "*") + "   <- this artifact"]
    out += ["descendants (nearest first):"]
    out += [line(a) for a in lineage["descendants"]] or ["  (none)"]
    if lineage["missing"]:
        out.append("parents not in this store: " + ", ".join(lineage["missing"]))
    for a in [*reversed(lineage["ancestors"]), root, *lineage["descendants"]]:
        out += _fork_text(a)
    return "\n".join(out)


def _fork_text(a: TrainingArtifact) -> list[str]:
    """A fork's lineage edge: the parent run, stage, step and artifact, and the configuration diff."""
    if not a.fork:
        return []
    edge = a.fork
    parent = edge.get("parent_artifact")
    lines = [
        f"fork {a.artifact_id[:12]}: started from {edge['run_dir']}/{edge['stage']}@{edge['step']} "
        f"(artifact {parent[:12] if parent else 'not recorded: the parent had not finished'}); configuration diff:"
    ]
    diff = edge.get("config_diff") or ""
    lines += ["  " + d for d in diff.rstrip("\n").splitlines()] if diff else ["  (none)"]
    return lines


def _diff(d: dict[str, Any]) -> str:
    out = [f"a: {d['a']}", f"b: {d['b']}"]
    sections = ("pipeline", "dataset_hash", "backend", "deps", "code", "seed", "metrics", "imports")
    same = [k for k in sections if d.get(k) is None]
    if d["pipeline"]:
        out += ["pipeline:", *["  " + line for line in d["pipeline"].rstrip("\n").splitlines()]]
    for key in ("dataset_hash", "backend", "seed", "trained_model_hash"):
        if d.get(key):
            out.append(f"{key}: {d[key]['a']} -> {d[key]['b']}")
    if d["deps"]:
        deps = d["deps"]
        out.append("deps:")
        out += [f"  + {k}=={v}" for k, v in deps["added"].items()]
        out += [f"  - {k}=={v}" for k, v in deps["removed"].items()]
        out += [f"  ~ {k} {va} -> {vb}" for k, (va, vb) in deps["changed"].items()]
        out += [f"  {k}: {deps[k][0]} -> {deps[k][1]}" for k in ("python", "jax", "devices") if k in deps]
    if d["code"]:
        out.append(f"code: {_git_text(d['code']['a'])} -> {_git_text(d['code']['b'])}")
    if d["metrics"]:
        out.append("metrics:")
        width = max(len(k) for k in d["metrics"])
        out += [f"  {k.ljust(width)}  {_num(va)} -> {_num(vb)}" for k, (va, vb) in d["metrics"].items()]
    if d.get("imports"):
        imports = d["imports"]
        out.append("imports:")
        out += [f"  + {_import_text(m)}" for m in imports["added"].values()]
        out += [f"  - {_import_text(m)}" for m in imports["removed"].values()]
        out += [f"  ~ {k} sha256 {va} -> {vb}" for k, (va, vb) in imports["changed"].items()]
    if same:
        out.append("same: " + ", ".join(same))
    return "\n".join(out)
