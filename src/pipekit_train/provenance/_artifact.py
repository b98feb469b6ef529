"""`TrainingArtifact`: the provenance record of one training stage, and the helpers that fill it in.

An artifact says what was trained (the pipeline YAML and its hash), on what (the dataset hash), with what (the
backend, the dependency versions, the devices, the git state of the code), by whom it was tracked (the
experiment-tracker run id), what came out (the model-registry URI and the weights hash, the final metrics) and how
the run ended. It is plain data: `to_dict` / `from_dict` round-trip through JSON, and `ArtifactStore` keeps them.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata
import json
import platform
import re
import subprocess
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipekit import ConfigError

__all__ = [
    "TrainingArtifact",
    "collect_deps_lock",
    "git_state",
    "new_artifact_id",
    "new_run_id",
    "pipeline_hash",
    "utc_now",
]

#: The lock files `collect_deps_lock` looks for, in order of preference.
LOCK_FILES = ("requirements.lock", "uv.lock")


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string (``2026-05-01T12:00:00.123456+00:00``)."""
    return _dt.datetime.now(_dt.UTC).isoformat()


def new_run_id() -> str:
    """A fresh run id: the UTC time to the second, then 8 random hex digits (``20260501T120000Z-1f2e3d4c``).

    Ids sort by start time and stay unique across machines.
    """
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


def new_artifact_id() -> str:
    """A fresh artifact id: 32 random hex digits (a uuid4)."""
    return uuid.uuid4().hex


def pipeline_hash(yaml_text: str) -> str:
    """The hash of a pipeline's YAML text: ``"sha256:<hex>"`` of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(yaml_text.encode("utf-8")).hexdigest()


_STATUS = re.compile(r"^(completed|failed|stopped: .+)$", re.DOTALL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingArtifact:
    """The provenance record of one training stage.

    Attributes:
        artifact_id: Unique id (uuid4 hex); the store finds an artifact by it or by a unique prefix of it.
        run_id: The run the stage belongs to (stages of one pipeline share it).
        stage: The stage name (``"stage0"``, …).
        parent_ids: The artifacts this stage started from (the previous stage, a pretraining run).
        training_pipeline_yaml: ``pipekit.dumps`` of the training loop.
        pipeline_hash: ``"sha256:<hex>"`` of `training_pipeline_yaml`; computed when left ``None``.
        dataset_hash: The training dataset's ``content_hash()``.
        backend: The backend name (``"equinox"``, …).
        backend_info: What the backend adapter reported (versions, compile counts, …).
        deps_lock: `collect_deps_lock`'s dict: lock-file text, distributions, Python and JAX versions, devices.
        tracker_run_id: The experiment-tracker run (MLflow run id), if one was attached.
        model_registry_uri: Where the trained weights are (``pipekit-model:sha256:<hex>``), if registered.
        trained_model_hash: The trained weights' hash (``ModelOp.weights_hash()``).
        started_at: ISO-8601 UTC start time.
        ended_at: ISO-8601 UTC end time (``None`` while running).
        final_metrics: The last metrics, by full name (``"train/loss"``, ``"validate/accuracy"``).
        seed: The master PRNG seed.
        git: `git_state` of the code: ``{"commit", "dirty", "diff_hash"}``, or ``None`` outside a repository.
        status: ``"completed"``, ``"stopped: <reason>"`` or ``"failed"``.
        run_dir: The stage's folder (metrics, checkpoints) when it ran, for finding its files; ``None`` if none.
        imports: The user modules imported before the pipeline was read (``--import``, ``$PIPEKIT_IMPORT``), in
            import order: ``{"module": name, "file": absolute path or None, "sha256": hex digest of the file or
            None}``. ``reproduce`` imports them again by name.
        forced_resume: What differed when a resume was forced past a changed configuration, else ``None``.
        model_summary: The trained model's size: ``{"total_params", "total_bytes", "submodules": [{"name",
            "params", "bytes"}, ...]}`` (per top-level submodule), or ``None`` (a record written before it existed,
            or a model without plain weights). Left out of `to_dict` when ``None``, so older records read and
            re-record byte for byte as they were.
        preset: The stage's `TrainingLoop.preset`: ``{"name", "fields"}``, the fields it filled as YAML data (with
            `training_pipeline_yaml`, which keeps ``preset:`` and the fields the file set, the whole resolved
            configuration), or ``None``. Left out of `to_dict` when ``None``, like `model_summary`.
        user: What callbacks put in ``ctx.artifact_fields`` under keys that are not artifact fields
            (``ctx.artifact_fields["dataset_version"] = "v3"``): JSON data by key, or ``None`` when there is none.
            Left out of `to_dict` when ``None``.
        data_statistics: What the stage's `Standardize` transforms were fitted to on its training split:
            ``{key: {"mean": [...], "std": [...]}}`` (one number per column), which ``evaluate``, ``predict`` and
            ``export`` apply again (and invert on the target), or ``None``. Left out of `to_dict` when ``None``.
        source_statistics: What the stage's training source was fitted to on its training split (a `CsvSource`:
            ``{"inputs", "features", "classes", "categories", "fill"}``: the input columns, the encoded feature
            names, the class labels in index order, each categorical column's categories, the values that fill a
            missing cell), which validation, ``evaluate`` and ``predict`` read new rows with (``predict`` writes the
            class names back), or ``None``. Left out of `to_dict` when ``None``.
        code: The code the run trained with, as `provenance._code.capture_code` recorded it: ``{"stored",
            "reason", "repo_root", "commit", "cwd", "patch", "files", "bytes", "cap_bytes"}``, whose digests name
            blobs in the store (``reproduce --restore-code`` rebuilds the tree from them), or ``None`` (recorded
            outside ``pipekit-train run``, or before it existed). Left out of `to_dict` when ``None``.
        fork: The lineage edge of a fork (``run --fork RUN_DIR@STEP``): ``{"run_dir", "stage", "step",
            "parent_artifact", "config_diff"}`` (the parent stage's artifact, also in `parent_ids` when it had one,
            and the unified diff of its recorded configuration against the fork's), or ``None``. Left out of
            `to_dict` when ``None``.
        restored: What `TrainingLoop.restore_best` returned instead of the last weights: ``{"from": "best",
            "step", "epoch", "monitor", "score", "last_step", "last_metrics"}`` (the restored checkpoint's step and
            score; the step the stage ended at and its metrics, which `final_metrics` no longer holds: they are the
            restored step's), or ``None``. Left out of `to_dict` when ``None``.
        sweep: The sweep trial the stage ran in: ``{"name", "trial", "params", "key"}`` (the sweep's name, the
            trial's number, its ``{field path: value}`` and its key), or ``None`` outside a sweep. Left out of
            `to_dict` when ``None``. ``artifacts query --sweep NAME`` finds a sweep's artifacts.
    """

    artifact_id: str = dataclasses.field(default_factory=new_artifact_id)
    run_id: str = ""
    stage: str = "stage0"
    parent_ids: tuple[str, ...] = ()
    training_pipeline_yaml: str = ""
    pipeline_hash: str | None = None
    dataset_hash: str | None = None
    backend: str = ""
    backend_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    deps_lock: dict[str, Any] = dataclasses.field(default_factory=dict)
    tracker_run_id: str | None = None
    model_registry_uri: str | None = None
    trained_model_hash: str | None = None
    started_at: str = dataclasses.field(default_factory=utc_now)
    ended_at: str | None = None
    final_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    git: dict[str, Any] | None = None
    status: str = "completed"
    run_dir: str | None = None
    imports: tuple[dict[str, Any], ...] = ()
    forced_resume: str | None = None
    model_summary: dict[str, Any] | None = None
    preset: dict[str, Any] | None = None
    user: dict[str, Any] | None = None
    data_statistics: dict[str, Any] | None = None
    source_statistics: dict[str, Any] | None = None
    code: dict[str, Any] | None = None
    fork: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    restored: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.artifact_id, str) or not re.fullmatch(r"[0-9a-zA-Z_-]+", self.artifact_id):
            raise ConfigError(
                f"TrainingArtifact.artifact_id must be a non-empty string of letters, digits, '-' or '_', "
                f"got {self.artifact_id!r}"
            )
        object.__setattr__(self, "parent_ids", tuple(self.parent_ids))
        if self.pipeline_hash is None and self.training_pipeline_yaml:
            object.__setattr__(self, "pipeline_hash", pipeline_hash(self.training_pipeline_yaml))
        if not _STATUS.match(self.status):
            raise ConfigError(
                f"TrainingArtifact.status must be 'completed', 'failed' or 'stopped: <reason>', got {self.status!r}"
            )
        for name in ("started_at", "ended_at"):
            value = getattr(self, name)
            if value is not None:
                try:
                    _dt.datetime.fromisoformat(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"TrainingArtifact.{name} must be an ISO-8601 time, got {value!r}") from None
        object.__setattr__(self, "final_metrics", {str(k): float(v) for k, v in self.final_metrics.items()})
        object.__setattr__(self, "imports", _checked_imports(self.imports))
        if self.user is not None:
            _check_user(self.user)
        if self.sweep is not None and not (isinstance(self.sweep, Mapping) and isinstance(self.sweep.get("name"), str)):
            raise ConfigError(f"TrainingArtifact.sweep must be a dict with a 'name', got {self.sweep!r}"[:300])
        if self.data_statistics is not None:  # plain JSON data: lists, as a record read back from the store holds
            object.__setattr__(
                self,
                "data_statistics",
                {
                    str(k): {n: [float(v) for v in s[n]] for n in ("mean", "std")}
                    for k, s in self.data_statistics.items()
                },
            )

    def __repr__(self) -> str:
        """One line: the id, where it ran, its status and its objective (`to_dict` and `show` have the rest).

        Example:
            >>> TrainingArtifact(artifact_id="a87ac53bb16a4f", run_id="r1", stage="finetune", backend="equinox",
            ...                  final_metrics={"time/step_s": 0.01, "validate/loss": 0.125, "train/loss": 0.1})
            TrainingArtifact(artifact_id='a87ac53bb16a4f', run_id='r1', stage='finetune', backend='equinox',
                             status='completed', validate/loss=0.125)
        """
        objective = "validate/loss" if "validate/loss" in self.final_metrics else "train/loss"
        shown = f", {objective}={self.final_metrics[objective]:.6g}" if objective in self.final_metrics else ""
        return (
            f"TrainingArtifact(artifact_id={self.artifact_id!r}, run_id={self.run_id!r}, stage={self.stage!r}, "
            f"backend={self.backend!r}, status={self.status!r}{shown})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The artifact as JSON-able data (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["parent_ids"] = list(self.parent_ids)
        out["imports"] = [dict(m) for m in self.imports]
        if self.model_summary is None:
            del out["model_summary"]  # optional: a record without one is the JSON it always was
        if self.preset is None:
            del out["preset"]
        if self.user is None:
            del out["user"]
        if self.data_statistics is None:
            del out["data_statistics"]
        if self.source_statistics is None:
            del out["source_statistics"]
        if self.code is None:
            del out["code"]
        if self.fork is None:
            del out["fork"]
        if self.sweep is None:
            del out["sweep"]
        if self.restored is None:
            del out["restored"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingArtifact:
        """Rebuild an artifact from `to_dict`'s output; unknown keys are an error naming them."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ConfigError(f"TrainingArtifact.from_dict got unknown key(s) {unknown}; expected {names}")
        kwargs = dict(data)
        if "parent_ids" in kwargs:
            kwargs["parent_ids"] = tuple(kwargs["parent_ids"] or ())
        return cls(**kwargs)

    def to_json(self) -> str:
        """`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainingArtifact:
        """The artifact `to_json` wrote."""
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> TrainingArtifact:
        """A copy with some fields changed (``pipeline_hash`` is recomputed when the YAML changes)."""
        if "training_pipeline_yaml" in changes and "pipeline_hash" not in changes:
            changes["pipeline_hash"] = None
        return dataclasses.replace(self, **changes)


def _check_user(user: Any) -> None:
    if not isinstance(user, Mapping) or not all(isinstance(k, str) for k in user):
        raise ConfigError(f"TrainingArtifact.user must be a dict with string keys, got {user!r}"[:300])
    try:
        json.dumps(user)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"TrainingArtifact.user must be JSON data: {e}") from None


_IMPORT_KEYS = ("module", "file", "sha256")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _checked_imports(value: Any) -> tuple[dict[str, Any], ...]:
    """`TrainingArtifact.imports` as a tuple of fresh ``{"module", "file", "sha256"}`` dicts, or a `ConfigError`."""
    rule = '{"module": dotted name, "file": path or None, "sha256": 64 lowercase hex digits or None}'
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"TrainingArtifact.imports must be a list of {rule}, got {value!r}")
    out = []
    for i, item in enumerate(value):
        ok = isinstance(item, Mapping) and sorted(item) == sorted(_IMPORT_KEYS)
        if ok:
            module, file, digest = item["module"], item["file"], item["sha256"]
            ok = (
                isinstance(module, str)
                and bool(module)
                and all(part.isidentifier() for part in module.split("."))
                and (file is None or (isinstance(file, str) and bool(file)))
                and (digest is None or (isinstance(digest, str) and bool(_SHA256.match(digest))))
            )
        if not ok:
            raise ConfigError(f"TrainingArtifact.imports[{i}] must be {rule}, got {item!r}")
        out.append({key: item[key] for key in _IMPORT_KEYS})
    return tuple(out)


# Dependencies ----------------------------------------------------------------------------------------------
def _find_lock(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        for name in LOCK_FILES:
            candidate = folder / name
            if candidate.is_file():
                return candidate
    return None


def _parse_requirements_lock(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*===?\s*([^\s;]+)", line)
        if match:
            out[_normalise(match.group(1))] = match.group(2)
    return out


def _parse_uv_lock(text: str) -> dict[str, str]:
    data = tomllib.loads(text)
    return {_normalise(p["name"]): str(p["version"]) for p in data.get("package", []) if "name" in p and "version" in p}


def _normalise(name: str) -> str:
    """A distribution name in PEP 503 normal form (``Foo_Bar`` → ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: The last scan of the installed distributions and the `_metadata_dirs` it was made under.
_INSTALLED: tuple[tuple[Any, ...], dict[str, str]] | None = None


def _installed() -> dict[str, str]:
    """The installed distributions, ``{name: version}``. Reading every distribution's metadata costs 0.2-0.3 s of
    CPU a stage (2 s the first time in a process), on the thread that overlaps the stage's sampling or training;
    the scan is kept for the process while the metadata directories on `sys.path` are the same (an install, upgrade
    or removal adds or renames a ``*.dist-info`` directory, so it scans again)."""
    global _INSTALLED
    key = _metadata_dirs()
    if _INSTALLED is not None and _INSTALLED[0] == key:
        return dict(_INSTALLED[1])
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(_normalise(name), dist.version)
    found = dict(sorted(out.items()))
    _INSTALLED = (key, found)
    return dict(found)


def _metadata_dirs() -> tuple[Any, ...]:
    """The ``*.dist-info`` and ``*.egg-info`` entries of every `sys.path` folder (a listing each: no file read)."""
    import os
    import sys

    entries = []
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:  # a zip file, a folder that does not exist
            continue
        entries.append((folder, tuple(sorted(n for n in names if n.endswith((".dist-info", ".egg-info"))))))
    return tuple(entries)


def collect_deps_lock(project_root: str | Path | None = None) -> dict[str, Any]:
    """What the code ran with: the lock file, the distributions, Python and JAX versions, and the devices.

    Looks for ``requirements.lock`` (then ``uv.lock``) in `project_root` (default: the working directory) and
    every folder above it. When found, its text is kept and its pins are the distributions; otherwise the
    distributions are the installed ones (from ``importlib.metadata``).

    Returns:
        ``{"lock_file": text or None, "lock_path": path or None, "distributions": {name: version},
        "python": "3.11.9", "jax": "0.10.2" or None, "devices": ["cpu:0 cpu", …]}``.
    """
    start = Path(project_root) if project_root is not None else Path.cwd()
    lock = _find_lock(start.resolve())
    text: str | None = None
    if lock is not None:
        text = lock.read_text(encoding="utf-8")
        distributions = _parse_uv_lock(text) if lock.name == "uv.lock" else _parse_requirements_lock(text)
    else:
        distributions = _installed()
    jax_version: str | None = None
    devices: list[str] = []
    try:
        import jax

        jax_version = jax.__version__
        devices = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
    except Exception:  # no JAX, or no backend could start: the record says so rather than failing the run
        pass
    return {
        "lock_file": text,
        "lock_path": str(lock) if lock is not None else None,
        "distributions": distributions,
        "python": platform.python_version(),
        "jax": jax_version,
        "devices": devices,
    }


# Git -------------------------------------------------------------------------------------------------------
def _git(path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(path), *args], capture_output=True, timeout=30, check=False)


def git_state(path: str | Path = ".") -> dict[str, Any] | None:
    """The git state of the code at `path`: ``{"commit", "dirty", "diff_hash"}``, or ``None`` outside a repository.

    ``dirty`` is whether tracked files differ from ``HEAD``; ``diff_hash`` is ``"sha256:<hex>"`` of
    ``git diff HEAD`` (``None`` when clean), so two runs on the same uncommitted change have the same hash.
    Untracked files are not covered. A repository without commits has ``commit: None``.
    """
    path = Path(path)
    try:
        inside = _git(path, "rev-parse", "--is-inside-work-tree")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if inside.returncode != 0 or inside.stdout.strip() != b"true":
        return None
    head = _git(path, "rev-parse", "--verify", "--quiet", "HEAD")
    if head.returncode != 0:
        return {"commit": None, "dirty": True, "diff_hash": None}
    diff = _git(path, "diff", "HEAD", "--no-color", "--no-ext-diff", "--binary")
    if diff.returncode != 0:
        return {"commit": head.stdout.decode().strip(), "dirty": None, "diff_hash": None}
    dirty = bool(diff.stdout)
    return {
        "commit": head.stdout.decode().strip(),
        "dirty": dirty,
        "diff_hash": "sha256:" + hashlib.sha256(diff.stdout).hexdigest() if dirty else None,
    }
