"""``pipekit-train reproduce ID --restore-code``: rebuild the code an artifact recorded and retrain with it.

The code is what ``pipekit-train run`` stored (`provenance._code`): the commit, the uncommitted patch, the imported
modules and the pipeline file. It is rebuilt in a temporary git worktree (``git worktree add --detach``; the user's
own tree and branch are never touched), the patch applied and the files written, and ``reproduce ID`` runs there in
a subprocess whose working directory and ``PYTHONPATH`` point into that tree. The worktree is removed afterwards,
whatever happened. The command exits 0 only when the retrained weights are bitwise equal to the recorded ones.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipekit_train.cli._common import EXIT_ERROR, EXIT_OK, CommandError, CommandFailed

__all__ = ["reproduce_restored"]


def _git(repo: str | Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=300, check=False)


def _code_of(chain: list[Any]) -> dict[str, Any]:
    """The one code record the stages of `chain` trained with; refused when it is missing, not stored, or differs."""
    target = chain[-1]
    code = target.code
    name = f"artifact {target.artifact_id[:12]}"
    if not code:
        raise CommandError(
            f"{name} recorded no code (it was trained outside 'pipekit-train run', or before code was stored); "
            "reproduce it without --restore-code"
        )
    if not code.get("stored"):
        raise CommandError(
            f"{name}: its code was not stored ({code.get('reason')}); reproduce it without --restore-code"
        )
    if not code.get("repo_root") or not code.get("commit"):
        raise CommandError(f"{name} was not trained inside a git repository with a commit; nothing to restore")

    def key(c: dict[str, Any]) -> tuple[Any, ...]:
        return (c.get("commit"), c.get("patch"), tuple(sorted(f["sha256"] for f in c.get("files", []))))

    for art in chain[:-1]:
        if art.code and key(art.code) != key(code):
            raise CommandError(
                f"{name}: its earlier stage {art.stage!r} (artifact {art.artifact_id[:12]}) trained with other code "
                f"(commit {art.code.get('commit', '?')[:12]}, patch {art.code.get('patch')}); one restored tree "
                "cannot rebuild both"
            )
    return dict(code)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _module_path(module: str, file: str) -> str:
    """Where `module` lives below its import root (``a/b.py``, or ``a/b/__init__.py`` for a package)."""
    parts = module.split(".")
    if os.path.basename(file) == "__init__.py":
        return "/".join([*parts, "__init__.py"])
    return "/".join([*parts[:-1], parts[-1] + ".py"])


def _restore(store: Any, code: dict[str, Any], tmp: Path) -> tuple[Path, Path, list[str]]:
    """Build the tree in `tmp`: (the worktree, the working directory to retrain in, the ``PYTHONPATH`` entries)."""
    repo, commit = code["repo_root"], code["commit"]
    if not os.path.isdir(repo) or _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise CommandError(
            f"the recorded repository {repo} is gone or no longer holds commit {commit[:12]}; fetch that commit "
            "there (or restore the repository) and try again"
        )
    tree = tmp / "tree"
    added = _git(repo, "worktree", "add", "--detach", str(tree), commit)
    if added.returncode != 0:
        raise CommandFailed(f"git worktree add {tree} {commit[:12]} failed: {' '.join(added.stderr.split())}")
    if code.get("patch"):
        patch = tmp / "changes.patch"
        patch.write_bytes(store.blob(code["patch"]))
        applied = _git(tree, "apply", "--binary", "--whitespace=nowarn", str(patch))
        if applied.returncode != 0:
            raise CommandFailed(
                f"the recorded patch {code['patch'][:19]}... does not apply to commit {commit[:12]}: "
                f"{' '.join(applied.stderr.split())}"
            )
    outside = tmp / "imports"
    paths: list[str] = []
    for f in code.get("files", []):
        data = store.blob(f["sha256"])
        if f.get("repo_path"):
            _write(tree / f["repo_path"], data)
            if f["role"] == "import" and f.get("import_root") is not None:
                paths.append(str(tree / f["import_root"]))
        elif f["role"] == "import":
            _write(outside / _module_path(f["module"], f["path"]), data)
            paths.append(str(outside))
        else:
            _write(tmp / "pipeline" / os.path.basename(f["path"]), data)
    cwd = tree / code["cwd"] if code.get("cwd") is not None else tmp
    # Entries of $PYTHONPATH inside the recorded repository point at the restored tree instead.
    root = Path(repo).resolve()
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if not entry:
            continue
        try:
            paths.append(str(tree / Path(entry).resolve().relative_to(root)))
        except ValueError:
            paths.append(entry)
    return tree, cwd, list(dict.fromkeys(paths))


def reproduce_restored(args: argparse.Namespace) -> int:
    """``reproduce ID --restore-code``: see the module docstring."""
    from pipekit_train._jsonio import read_json
    from pipekit_train.provenance._artifact import new_run_id
    from pipekit_train.provenance._store import ArtifactStore

    store = ArtifactStore(args.store)
    target = store.get(args.artifact)
    chain = [target]
    while chain[0].parent_ids:
        chain.insert(0, store.get(chain[0].parent_ids[0]))
    code = _code_of(chain)
    run_dir = os.path.abspath(args.run_dir or os.path.join("runs", new_run_id()))
    tmp = Path(tempfile.mkdtemp(prefix="pipekit-restore-"))
    repo = code["repo_root"]
    try:
        tree, cwd, paths = _restore(store, code, tmp)
        patch = f" + uncommitted patch {code['patch'][:19]}..." if code.get("patch") else ""
        print(
            f"restored commit {code['commit'][:12]}{patch} + {len(code.get('files', []))} file(s) in a temporary "
            f"worktree {tree}",
            flush=True,
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        command = [sys.executable, "-m", "pipekit_train.cli", "reproduce", target.artifact_id]
        command += ["--store", str(store.path), "--run-dir", run_dir]
        for name in args.imports or ():
            command += ["--import", name]
        done = subprocess.run(command, cwd=cwd, env=env, check=False)
        if done.returncode != 0:
            raise CommandFailed(f"retraining in the restored tree {tree} failed (exit {done.returncode})")
    finally:
        _git(repo, "worktree", "remove", "--force", str(tmp / "tree"))
        shutil.rmtree(tmp, ignore_errors=True)
        _git(repo, "worktree", "prune")
    again = read_json(os.path.join(run_dir, target.stage, "artifact.json"), what="the retrained stage's artifact")
    got, want = again.get("trained_model_hash"), target.trained_model_hash
    if got == want:
        print(f"restored code: match: the trained weights are bitwise equal to the recorded ones ({want})")
        return EXIT_OK
    print(f"restored code: differ: the trained weights hash to {got}, the recorded ones to {want}", file=sys.stderr)
    return EXIT_ERROR
