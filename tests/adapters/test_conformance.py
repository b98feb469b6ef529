"""Every installed backend adapter honours the adapter contract (adapters/README.md), checked by the kit.

"Installed" means declared in the ``pipekit_train.backends`` entry-point group: a test-only backend registered
in-process (``tests/backends/numpy_linear``, run by its own folder's tests) is left out even when its registration
leaks into this process.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from pipekit_train import available_backends
from pipekit_train.adapters.conformance import CHECKS, check_runs_a_yaml_pipeline_from_the_cli
from pipekit_train.backends._registry import ENTRY_POINT_GROUP

INSTALLED = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
BACKENDS = [name for name in available_backends() if name in INSTALLED]


def test_the_kit_has_every_documented_check():
    assert len(CHECKS) >= 10 and all(callable(check) for check in CHECKS.values())
    assert "equinox" in BACKENDS


#: Backends whose CLI check runs the CLI in this process: the fresh process (an entry point found, nothing imported
#: from this one) is proven here by equinox and by numpy-linear's ``--import``, and for flax, keras and lightning by a
#: fresh ``pipekit-train run`` subprocess of each in its own tests (the SIGKILL tests of
#: tests/adapters/flax/test_flax_backend.py and tests/adapters/lightning/test_lightning_backend.py, the four-device
#: run of tests/scale/test_keras_data_parallel.py), each backend found by its entry point there too. A fresh
#: interpreter here would pay that framework's import and compiles once more for nothing new (5 s each, issue 45);
#: what stays checked for these is that their YAML pipeline validates and runs through ``pipekit-train`` to bitwise
#: this process's weights.
CLI_IN_PROCESS = {"blackjax", "flax", "keras", "lightning", "numpyro-mcmc", "numpyro-svi"}


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize(
    "backend",
    # One xdist worker per backend (--dist loadgroup): its framework imported and its programs compiled once.
    [pytest.param(b, marks=pytest.mark.xdist_group(f"kit-{b}")) for b in BACKENDS],
)
def test_adapter_contract(backend, check, tmp_path):
    """Every backend passes the kit: samplers and variational fits its sampler variant (no skips)."""
    if check == "runs_a_yaml_pipeline_from_the_cli" and backend in CLI_IN_PROCESS:
        check_runs_a_yaml_pipeline_from_the_cli(backend, tmp_path, fresh_process=False)
    else:
        CHECKS[check](backend, tmp_path)
