"""The tests read nothing that other users of the machine, the developer's shell or home directory hold
(`tests/conftest.py`, `_private_machine_state`): Ray finds no cluster another process recorded in ``/tmp/ray``,
git, Keras and Matplotlib read no configuration under ``~``, and no ``$PIPEKIT_*``, ``$MLFLOW_*``, ``$RAY_*``,
``$JAX_*`` or ``$XLA_*`` variable of the shell reaches the code (the compilation cache they name is one the run
made). Checked in a subprocess, as the tests' own subprocesses see it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SEEN = """
import json, os, subprocess
import matplotlib
from ray._common.utils import get_ray_address_file
git = subprocess.run(["git", "config", "--show-origin", "--get-regexp", "."], capture_output=True, text=True)
print(json.dumps({
    "ray_address_file": get_ray_address_file(None),
    "matplotlib": matplotlib.get_configdir(),
    "keras": os.environ.get("KERAS_HOME"),
    "git": git.stdout,
    "from_the_shell": sorted(n for n in os.environ if n.startswith(("PIPEKIT_", "MLFLOW_", "JAX_", "XLA_"))),
}))
"""


def test_a_test_reads_no_shared_machine_state(tmp_path):
    pytest.importorskip("ray")
    out = subprocess.run([sys.executable, "-c", SEEN], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    private = os.path.dirname(os.environ["RAY_TMPDIR"])
    assert os.path.basename(private).startswith("pk-") and private != "/tmp"
    assert seen["ray_address_file"] == os.path.join(private, "ray", "ray", "ray_current_cluster")
    assert seen["matplotlib"] == os.path.join(private, "matplotlib")
    assert seen["keras"] == os.path.join(private, "keras")
    assert seen["git"] == ""  # no global or system configuration (tmp_path is not a repository)
    # Only what the tests set themselves: the per-test store and registry (`_isolated_run_dirs`), JAX on CPU, and
    # the run's own compilation cache, in a private directory of this run.
    assert seen["from_the_shell"] == [
        "JAX_COMPILATION_CACHE_DIR",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
        "JAX_PLATFORMS",
        "PIPEKIT_ARTIFACT_STORE",
        "PIPEKIT_MODEL_REGISTRY",
    ]
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert os.path.basename(os.path.dirname(cache)).startswith("pk-") and os.path.isdir(cache)
