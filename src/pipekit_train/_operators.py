"""Every operator type of the training core, registered by importing the modules that define them.

This module is the ``pipekit.operators`` entry point of pipekit-train: the YAML loader imports it (and every other
installed plugin's) before it looks up any ``type:`` name. Backends register their model operators through entry
points of their own.
"""

from __future__ import annotations

from . import (
    callbacks,  # noqa: F401
    checkpoint,  # noqa: F401
    data,  # noqa: F401
)
from .backends import _model as _models  # noqa: F401
from .losses import (
    _builtin,  # noqa: F401
    _composite,  # noqa: F401
    _tokens,  # noqa: F401
)
from .provenance import _register  # noqa: F401
from .stage import loop  # noqa: F401
from .sweep import _sweep  # noqa: F401
from .tracking import (
    _experiment,  # noqa: F401
    _token_metrics,  # noqa: F401
    _writers,  # noqa: F401
)
