"""pipekit: the operator algebra. Frozen, typed, YAML-serializable operators and `Sequential` pipelines.

This package does not import JAX; training lives in `pipekit_train`.
"""

from typing import TYPE_CHECKING

from ._builtins import AssertShape as AssertShape
from ._builtins import Tap as Tap
from ._builtins import array_leaves as array_leaves
from ._builtins import register_sink as register_sink
from ._errors import ConfigError as ConfigError
from ._errors import PipekitError as PipekitError
from ._errors import ShapeError as ShapeError
from ._errors import closest as closest
from ._errors import suggestion as suggestion
from ._operator import CarryState as CarryState
from ._operator import Operator as Operator
from ._operator import StatefulOperator as StatefulOperator
from ._operator import canonical as canonical
from ._operator import field as field
from ._overrides import apply_overrides as apply_overrides
from ._overrides import parse_override as parse_override
from ._registry import lookup as lookup
from ._registry import registered as registered
from ._sequential import Sequential as Sequential
from ._yaml import FORMAT_VERSION as FORMAT_VERSION
from ._yaml import dump as dump
from ._yaml import dumps as dumps
from ._yaml import load as load
from ._yaml import loads as loads

if TYPE_CHECKING:
    from ._schema import describe as describe
    from ._schema import schema as schema

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`describe` and `schema` (editor help, `pipekit._schema`) are imported on first use: most programs never
    ask for them, and `import pipekit` stays cheaper than `import numpy`."""
    if name in ("describe", "schema"):
        from . import _schema

        return getattr(_schema, name)
    raise AttributeError(f"module 'pipekit' has no attribute {name!r}")
