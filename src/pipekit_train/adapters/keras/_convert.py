"""The converter functions the Keras package re-exports (`register_converter`, `convert_model`, ...).

The built-in converters (every factory of the zoo, in all six directions among Equinox, Keras and Lightning) are
registered by `pipekit_train.backends._zoo`, which this package imports.
"""

from __future__ import annotations

from ...backends import _zoo as _zoo  # registers the built-in converters (imports no framework)
from ...backends._convert import (
    convert_model,
    find_converter,
    refuse_foreign,
    register_converter,
    registered_converters,
)

__all__ = ["convert_model", "find_converter", "refuse_foreign", "register_converter", "registered_converters"]
