"""Callbacks: the `Callback` base class and `TrainContext`, and the built-in controls (`EarlyStopping`,
`ReduceLROnPlateau`, `EMA`). See ``docs/callbacks.md``. (The callbacks that record a run elsewhere are with what
they record: `pipekit_train.tracking.LogToExperiment`, MLflow; `pipekit_train.provenance.RegisterModel`, the model
registry.)"""

from ._base import Callback as Callback
from ._base import TrainContext as TrainContext
from ._controls import EMA as EMA
from ._controls import EarlyStopping as EarlyStopping
from ._controls import ReduceLROnPlateau as ReduceLROnPlateau
