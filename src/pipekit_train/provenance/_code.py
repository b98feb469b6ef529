"""The code a run trained with, kept in the artifact store: the uncommitted patch, the ``--import``ed modules and the
pipeline file, content-addressed (``"sha256:<hex>"`` of the bytes), so a thousand runs of one edit store it once.

`capture_code` takes the snapshot when ``pipekit-train run`` starts (before training, so an edit made while it
trains is not mistaken for the code that trained). Its `CodeSnapshot.record` becomes `TrainingArtifact.code`;
its `CodeSnapshot.blobs` go into the store's ``blobs`` table in the same transaction as the artifact.
``pipekit-train reproduce ID --restore-code`` (`pipekit_train.cli._restore`) rebuilds that code in a temporary
git worktree and retrains there.

Above a size cap (`DEFAULT_CAP_BYTES`, or ``$PIPEKIT_CODE_CAP_BYTES``) nothing is stored: the run still trains
and its artifact says ``"stored": false`` and why (the digests are still recorded, so a diff still shows a change).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from pipekit import ConfigError

__all__ = ["CAP_ENV_VAR", "DEFAULT_CAP_BYTES", "CodeSnapshot", "blob_digest", "capture_code", "code_cap"]

CAP_ENV_VAR = "PIPEKIT_CODE_CAP_BYTES"
#: The most bytes of code (patch + modules + pipeline file) one run stores; above it nothing is stored.
DEFAULT_CAP_BYTES = 10 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class CodeSnapshot:
    """What `capture_code` took: `record` (JSON data for `TrainingArtifact.code`) and `blobs` (digest to bytes)."""

    record: dict[str, Any]
    blobs: dict[str, bytes]


def blob_digest(data: bytes) -> str:
    """``"sha256:<hex>"`` of `data`: a blob's key in the store."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def code_cap() -> int:
    """The size cap in bytes: ``$PIPEKIT_CODE_CAP_BYTES`` (a non-negative integer), else `DEFAULT_CAP_BYTES`."""
    raw = os.environ.get(CAP_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_CAP_BYTES
    try:
        cap = int(raw)
    except ValueError:
        cap = -1
    if cap < 0:
        raise ConfigError(
            f"${CAP_ENV_VAR} must be a number of bytes (a non-negative integer, e.g. 10485760 for 10 MB), got {raw!r}"
        )
    return cap


def _git(path: str | Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(path), *args], capture_output=True, timeout=60, check=False)


def _repo(cwd: Path) -> tuple[Path | None, str | None]:
    """(the repository's top folder, its HEAD commit) for `cwd`; ``(None, None)`` outside a repository."""
    try:
        top = _git(cwd, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if top.returncode != 0:
        return None, None
    root = Path(top.stdout.decode().strip()).resolve()
    head = _git(cwd, "rev-parse", "--verify", "--quiet", "HEAD")
    return root, (head.stdout.decode().strip() if head.returncode == 0 else None)


def _inside(path: Path, root: Path | None) -> str | None:
    """`path` relative to `root` (POSIX), or ``None`` when it is not inside it."""
    if root is None:
        return None
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None


def _import_root(module: str, file: Path) -> Path:
    """The folder on ``sys.path`` that `module` was found in (``/x`` for ``a.b`` at ``/x/a/b.py`` or
    ``/x/a/b/__init__.py``)."""
    depth = module.count(".") + (1 if file.name == "__init__.py" else 0)
    folder = file.resolve().parent
    for _ in range(depth):
        folder = folder.parent
    return folder


def capture_code(
    pipeline_file: str | None,
    imports: Sequence[dict[str, Any]],
    cwd: str | Path | None = None,
    *,
    say: TextIO | None = None,
) -> CodeSnapshot:
    """The code a run is about to train with: the tracked changes against ``HEAD`` (``git diff HEAD --binary``, as
    ``git apply`` takes it), each imported module's file and the pipeline file.

    Returns a `CodeSnapshot` whose record is ``{"stored", "reason", "repo_root", "commit", "cwd", "patch",
    "files": [{"role": "import" | "pipeline", "module", "path", "repo_path", "import_root", "sha256"}], "bytes",
    "cap_bytes"}`` (paths in the repository are relative to it, POSIX; ``patch`` is the patch's digest or
    ``None`` when the tree is clean). Past the cap (`code_cap`) the blobs are empty, ``stored`` is false, and one
    warning line goes to `say` (default: standard error).
    """
    here = Path(cwd if cwd is not None else os.getcwd()).resolve()
    root, commit = _repo(here)
    blobs: dict[str, bytes] = {}
    patch_digest = None
    if root is not None and commit is not None:
        diff = _git(root, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--full-index")
        if diff.returncode == 0 and diff.stdout:
            patch_digest = blob_digest(diff.stdout)
            blobs[patch_digest] = diff.stdout
    files: list[dict[str, Any]] = []
    wanted: list[tuple[str, str | None, Path]] = [
        ("import", m["module"], Path(m["file"])) for m in imports if m.get("file")
    ]
    if pipeline_file:
        wanted.append(("pipeline", None, Path(pipeline_file)))
    for role, module, path in wanted:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # gone since it was imported (a built-in, a zip import): nothing to keep
        digest = blob_digest(data)
        blobs[digest] = data
        import_root = _import_root(module, path) if module else None
        files.append(
            {
                "role": role,
                "module": module,
                "path": str(path.resolve()),
                "repo_path": _inside(path, root),
                "import_root": (_inside(import_root, root) if import_root else None),
                "sha256": digest,
            }
        )
    size = sum(len(b) for b in blobs.values())
    cap = code_cap()
    record: dict[str, Any] = {
        "stored": True,
        "reason": None,
        "repo_root": str(root) if root else None,
        "commit": commit,
        "cwd": _inside(here, root),
        "patch": patch_digest,
        "files": files,
        "bytes": size,
        "cap_bytes": cap,
    }
    if size > cap:
        record["stored"] = False
        record["reason"] = (
            f"the code (patch, imported modules, pipeline file) is {size} bytes, over the {cap}-byte cap "
            f"(${CAP_ENV_VAR})"
        )
        print(
            f"pipekit-train: warning: {record['reason']}; it is not stored (the run trains and its artifact records "
            f"why), so 'reproduce --restore-code' cannot rebuild it. Raise ${CAP_ENV_VAR} to store it",
            file=say or sys.stderr,
        )
        blobs = {}
    return CodeSnapshot(record=record, blobs=blobs)
