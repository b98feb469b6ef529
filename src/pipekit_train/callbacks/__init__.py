"""Callbacks: the `Callback` base class and `TrainContext`, the built-in controls (`EarlyStopping`,
`ReduceLROnPlateau`, `EMA`) and the trackers (`LogToExperiment`, `RegisterModel`). See ``docs/callbacks.md``."""

from ._base import Callback as Callback
from ._base import TrainContext as TrainContext
from ._controls import EMA as EMA
from ._controls import EarlyStopping as EarlyStopping
from ._controls import ReduceLROnPlateau as ReduceLROnPlateau
from ._trackers import LogToExperiment as LogToExperiment
from ._trackers import RegisterModel as RegisterModel
