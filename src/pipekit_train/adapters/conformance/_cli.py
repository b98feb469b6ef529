"""The conformance check from the command line: ``pipekit-train validate`` and ``run`` of a two-stage YAML pipeline
in a fresh process (the backend found by its entry point or ``--import``) record what the same pipeline records in
this process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ._problem import _X, _Y, _problem, _run


def _backend_module(backend: str) -> tuple[str | None, str | None]:
    """What a fresh process needs to find `backend`: ``(module to import, folder to add to the path)``, or Nones
    for an installed entry point."""
    from ...backends._registry import ENTRY_POINT_GROUP, get_backend

    if backend in {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}:
        return None, None
    module = sys.modules[type(get_backend(backend)).__module__]
    path = Path(module.__file__ or ".").resolve()
    if path.stem == "__init__":
        path = path.parent
    for _ in module.__name__.split("."):
        path = path.parent
    return module.__name__, str(path)


def _cli_takes_import() -> bool:
    """Whether ``pipekit-train run`` has the ``--import MODULE`` option (else the subprocess imports it first)."""
    from pipekit_train.cli._main import build_parser

    try:
        _, unknown = build_parser().parse_known_args(["run", "p.yaml", "--import", "m"])
    except SystemExit:
        return False
    return not unknown


_CLI_SCRIPT = """\
import importlib, json, sys
spec = json.loads(sys.argv[1])
for name in spec["imports"]:
    importlib.import_module(name)
from pipekit_train.cli import main
for argv in spec["commands"]:
    code = main(argv)
    if code:
        raise SystemExit(code)
"""


def check_runs_a_yaml_pipeline_from_the_cli(backend: str, tmp: Path, *, fresh_process: bool = True) -> None:
    """``pipekit-train validate`` and ``run`` of a YAML pipeline in a fresh process: both stages recorded, with
    bitwise the weights of the same pipeline run in this process.

    ``fresh_process=False`` runs the same CLI commands through ``pipekit_train.cli.main`` in this process instead:
    for a test suite that proves the fresh process (the backend found by its entry point or ``--import``) on other
    backends and needs not pay a new interpreter, its imports and its compiles once more per backend.
    """
    import pipekit
    from pipekit_train import TrainingDataset
    from pipekit_train.data import NpzSource
    from pipekit_train.provenance import ArtifactStore

    np.savez(tmp / "data.npz", x=_X, y=_Y)
    data = TrainingDataset(source=NpzSource(path=str(tmp / "data.npz")))
    first = _problem(backend, dataset=data, val_dataset=None, name="first")
    pipeline = pipekit.Sequential([first, first.replace(name="second")])
    yaml_path, store = tmp / "pipeline.yaml", tmp / "cli.sqlite"
    yaml_path.write_text(pipekit.dumps(pipeline), encoding="utf-8")

    module, folder = _backend_module(backend)
    flags = ["--import", module] if module and _cli_takes_import() else []
    commands = [
        ["validate", str(yaml_path), *flags],
        ["run", str(yaml_path), "--run-dir", str(tmp / "cli-run"), "--store", str(store), *flags],
    ]
    shown = " && ".join("pipekit-train " + " ".join(c) for c in commands)
    if fresh_process:
        spec = {"imports": [module] if module and not flags else [], "commands": commands}
        env = dict(os.environ)
        if folder:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(
            [sys.executable, "-c", _CLI_SCRIPT, json.dumps(spec)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (
            f"{backend}: `{shown}` exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    else:
        from pipekit_train.cli import main as cli_main

        for argv in commands:
            code = cli_main(argv)
            assert code == 0, f"{backend}: `pipekit-train {' '.join(argv)}` (of `{shown}`) exited with {code}"
    with ArtifactStore(store) as s:
        stored = {a.stage: a for a in s.query()}
    assert sorted(stored) == ["first", "second"], f"{backend}: the CLI run recorded stages {sorted(stored)}"
    wrong = {stage: a.backend for stage, a in stored.items() if a.backend != backend}
    assert not wrong, f"{backend}: the CLI run's artifacts name other backends: {wrong}"
    _, here = _run(pipeline, tmp / "in-process")
    assert stored["second"].trained_model_hash == here.trained_model_hash, (
        f"{backend}: the YAML pipeline run by the CLI ends with weights {stored['second'].trained_model_hash}, "
        f"the same pipeline in this process with {here.trained_model_hash}"
    )
