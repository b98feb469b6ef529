"""Shared data for the Bayesian backend tests: a conjugate normal problem with an analytic posterior."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests import _forked

pytest.importorskip("numpyro")

N = 50
Y = np.random.default_rng(0).normal(1.5, 1.0, size=N).astype(np.float32)
#: Prior Normal(0, 1), noise sd 1: the posterior of mu is Normal(sum(y) / (1 + n), (1 + n) ** -0.5).
POST_MEAN = float(Y.astype(np.float64).sum() / (1 + N))
POST_SD = float((1 + N) ** -0.5)


def stage_model(run_dir: Path, stage: str) -> Any:
    """The trained model a finished stage recorded in its ``final.json`` (a relative registry root made absolute)."""
    from pipekit_train import load_model

    uri = json.loads((run_dir / stage / "final.json").read_text())["model_uri"]
    if "root=" in uri and not uri.split("root=", 1)[1].startswith("/"):
        uri = uri.split("?", 1)[0] + "?root=" + str(run_dir / uri.split("root=", 1)[1])
    return load_model(uri)


# Eight schools (Rubin 1981): the effects and standard errors every test of it uses.
SIGMA = np.array([15, 10, 16, 11, 9, 11, 10, 18], np.float32)
Y8 = np.array([28, 8, -3, 7, -1, 1, 18, 12], np.float32)


# SIGKILL and resume, through the CLI ------------------------------------------------------------------------
def committed_steps(ckpt_dir: Path) -> list[int]:
    """The steps whose checkpoint directory Orbax has committed (``commit_success.txt`` written)."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and (ckpt_dir / n / "commit_success.txt").exists())


def cli_run_killed_after(work: Path, run_dir: Path, stage: str, step: int, resume: bool, env: dict[str, str]) -> None:
    """Run ``pipekit-train run p.yaml`` (``--resume auto`` when `resume`) and have it SIGKILL itself once its
    checkpoint of `step` is committed and before the next one is: right after the chunk that follows `step`,
    before that chunk's checkpoint hook. The kill is the resume probe's (``$PIPEKIT_RESUME_PROBE``, what
    ``pipekit-train check-resume`` places), so where it lands does not depend on the machine's speed: polling the
    directory for the commit raced the next save, which under ``Last(n=1)`` drops the step a few ms later."""
    args = [sys.executable, "-m", "pipekit_train.cli", "run", "p.yaml", "--run-dir", str(run_dir), "--no-store"]
    args += ["--resume", "auto"] if resume else []
    probe = {
        "trace": str(work / f"trace-{step}.jsonl"),
        "kill": {"stage": stage, "step": step + 1, "signal": "SIGKILL"},
    }
    err = work / f"kill-{step}.err"
    with open(err, "wb") as stderr:
        proc = _forked.run(
            args,
            cwd=work,
            env={**env, "PIPEKIT_RESUME_PROBE": json.dumps(probe)},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            timeout=300,
        )
    assert proc.returncode == -signal.SIGKILL, f"the run ended ({proc.returncode}) without its kill:\n{err.read_text()}"
    assert max(committed_steps(run_dir / stage / "checkpoints"), default=None) == step, err.read_text()


def subprocess_env(cache_dir: Path) -> dict[str, str]:
    """CPU, no inherited XLA flags, and a persistent compilation cache shared by the killed processes (a loaded
    program is the compiled one, bit for bit; it halves the second process's time)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return env


def kill_in_warmup_and_in_sampling_then_resume(
    work: Path,
    yaml_text: str,
    stage: str,
    warm_kill: int,
    sample_kill: int,
    num_warmup: int,
    total: int,
    xla_cache_env: dict[str, str] | None = None,
) -> Any:
    """SIGKILL a CLI run after its warm-up checkpoint `warm_kill`, resume it with ``--resume auto`` and SIGKILL it
    again after its sampling checkpoint `sample_kill`, then resume it in this process to the end (the same code
    path as ``--resume auto``). Returns the resumed run's trained model (its posterior). The two processes share
    the run's persistent XLA cache when `xla_cache_env` (the ``xla_cache_env`` fixture) is given, else one of their
    own."""
    import pipekit
    from pipekit_train import run_settings

    (work / "p.yaml").write_text(yaml_text)
    run_dir = work / "killed"
    env = subprocess_env(work / "xla-cache")
    env.update(xla_cache_env or {})
    ckpt_dir = run_dir / stage / "checkpoints"
    cli_run_killed_after(work, run_dir, stage, warm_kill, False, env)
    kept = committed_steps(ckpt_dir)  # what --resume auto restores: the latest
    assert kept and max(kept) < num_warmup, f"the first kill landed after warm-up: checkpoints {kept}"
    cli_run_killed_after(work, run_dir, stage, sample_kill, True, env)
    kept = committed_steps(ckpt_dir)
    assert num_warmup < max(kept) < total, f"the second kill did not land during sampling: checkpoints {kept}"
    assert not (run_dir / stage / "final.json").exists()
    # Each kill landed after its checkpoint and the manifest were written: the resume repairs nothing (a repair
    # would warn, and a warning of ours fails the test).
    with run_settings(run_dir=str(run_dir), store=False, resume="auto"):
        model, artifact = pipekit.loads(yaml_text).run()
    assert artifact.backend_info["steps"] == total
    return model
