"""The one import point of Keras: ``KERAS_BACKEND`` must say ``jax`` before Keras is first imported.

Keras reads ``KERAS_BACKEND`` once, at its first import. `import_keras` sets it to ``jax`` when it is unset and
refuses, with the wrong and the right way side by side, when it names another backend or when Keras was already
imported with one.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pipekit import ConfigError

__all__ = ["import_keras"]

_MSG_OTHER_BACKEND = """\
backend 'keras' runs Keras 3 on its JAX backend, but {what}.
Keras reads KERAS_BACKEND once, when it is first imported, so it must be 'jax' before then:

    KERAS_BACKEND=tensorflow pipekit-train run pipeline.yaml     # wrong: Keras would not run on JAX
    KERAS_BACKEND=jax pipekit-train run pipeline.yaml            # right (or leave it unset: it is set to jax)

In Python, set os.environ["KERAS_BACKEND"] = "jax" before anything imports keras."""


def import_keras() -> Any:
    """The `keras` module, on its JAX backend; a `pipekit.ConfigError` when another backend is chosen."""
    wanted = os.environ.get("KERAS_BACKEND")
    if wanted is None:
        os.environ["KERAS_BACKEND"] = "jax"
    elif wanted != "jax":
        raise ConfigError(_MSG_OTHER_BACKEND.format(what=f"KERAS_BACKEND is {wanted!r}"))
    already = "keras" in sys.modules
    import keras  # type: ignore[import-untyped]

    actual = keras.backend.backend()
    if actual != "jax":
        where = "Keras was imported before KERAS_BACKEND was set" if already else "its configuration says so"
        raise ConfigError(_MSG_OTHER_BACKEND.format(what=f"Keras runs on {actual!r} ({where})"))
    return keras
