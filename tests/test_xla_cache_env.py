"""The run's persistent compilation cache (``_private_machine_state`` and ``xla_cache_env`` in tests/conftest.py).

The subprocess-heavy tests (kill and resume, the CLI, several processes or devices) are only as cheap as this cache
makes them: one process compiles a program, the next ones load it. This checks that it does, that the test processes
use it too, and that the directory is the one every xdist worker of the run shares: made by the process pytest was
started in, in its own private directory, not in a worker's.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

#: A program no other test compiles (the constant is new each run); prints its result and the cache hits and misses.
CHILD = """
import jax
import jax.numpy as jnp

x = jnp.float32(0.25)
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))  # from here on: the one program
value = jax.jit(lambda x: jnp.sin(x) * {constant} + 1.0)(x)
hits = events.count("/jax/compilation_cache/cache_hits")
misses = events.count("/jax/compilation_cache/cache_misses")
print(float(value), hits, misses)
"""


def test_a_second_process_loads_the_program_the_first_compiled(xla_cache_env: dict[str, str]) -> None:
    import jax

    cache = Path(xla_cache_env["JAX_COMPILATION_CACHE_DIR"])
    assert cache.is_dir() and cache.parent.name.startswith("pk-")
    assert jax.config.jax_compilation_cache_dir == str(cache)  # this test process's programs go there as well
    own_private = Path(os.environ["RAY_TMPDIR"]).parent
    # Under xdist: not in this worker's private directory but in the one of the process that started the workers.
    assert (cache.parent != own_private) == bool(os.environ.get("PYTEST_XDIST_WORKER"))
    code = CHILD.format(constant=f"{secrets.randbelow(10**6) + 2}.0")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **xla_cache_env)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        value, hits, misses = out.stdout.split()
        runs.append((value, int(hits), int(misses)))
    (first_value, first_hits, first_misses), (second_value, second_hits, second_misses) = runs
    assert first_misses >= 1 and first_hits == 0  # the first process compiled the program (and wrote it) ...
    assert second_hits >= 1 and second_misses == 0  # ... the second loaded it, compiling nothing
    assert second_value == first_value
