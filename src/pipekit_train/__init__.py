"""pipekit-train: training as a pipeline operator for JAX.

`TrainingLoop` is a `pipekit.StatefulOperator`: put stages in a `pipekit.Sequential` and ``run()`` it, or write the
same pipeline as YAML and run ``pipekit-train run pipeline.yaml``.

Importing the package is cheap (no JAX): each public name below is imported from its module the first time it is
used. The top level holds what most programs need; every concept has its own subpackage with a facade:
`pipekit_train.losses`, `.data`, `.optim` (optimizer settings, schedules, recipes, lr-find), `.callbacks`,
`.checkpoint`, `.tracking` (writers, metrics, history), `.scale` (mesh, precision, processes), `.inference`
(evaluate, predict, export), `.provenance` (artifacts, store, model registry), `.backends` (the registry of
backends, converters), `.stage` (the loop, its runner and engine) and `.adapters` (one package per backend).
"""

from ._signals import stop_at_command_start as _stop_at_command_start

_stop_at_command_start()  # first: in the `pipekit-train` command a signal is one line from here on (`_signals`)

from typing import TYPE_CHECKING, Any  # noqa: E402

from ._lazy import attach as _attach  # noqa: E402

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pipekit import ConfigError as ConfigError
    from pipekit import PipekitError as PipekitError
    from pipekit import ShapeError as ShapeError

    from ._jsonio import DamagedFileError as DamagedFileError
    from ._warnings import PipekitTrainWarning as PipekitTrainWarning
    from .backends import BackendError as BackendError
    from .backends import available_backends as available_backends
    from .backends import register_backend as register_backend
    from .backends._model import ModelOp as ModelOp
    from .backends._model import Transfer as Transfer
    from .callbacks import Callback as Callback
    from .checkpoint import Checkpoint as Checkpoint
    from .checkpoint import CheckpointError as CheckpointError
    from .data import TrainingDataset as TrainingDataset
    from .inference import evaluate as evaluate
    from .inference import export_model as export_model
    from .inference import predict as predict
    from .losses import Loss as Loss
    from .provenance import ArtifactStoreError as ArtifactStoreError
    from .provenance import ModelRegistryError as ModelRegistryError
    from .provenance import load_model as load_model
    from .stage import NonFiniteLossError as NonFiniteLossError
    from .stage import NonFiniteWeightsError as NonFiniteWeightsError
    from .stage import RunSettings as RunSettings
    from .stage import TrainerCarryState as TrainerCarryState
    from .stage import TrainingInterrupted as TrainingInterrupted
    from .stage import TrainingLoop as TrainingLoop
    from .stage import TrainingResult as TrainingResult
    from .stage import run_settings as run_settings
    from .tracking import history as history

_getattr, __dir__, __all__ = _attach(__name__, __file__, globals())

#: Names the top level exported before the subpackages had facades: still found here (not listed in `__all__`
#: or `dir()`), each from its subpackage. New code imports them from there.
_MOVED = {
    "convert_model": ".backends",
    "register_converter": ".backends",
    "initialize_distributed": ".scale",
    "Evaluation": ".inference",
    "KL": ".losses",
    "MSE": ".losses",
    "NLL": ".losses",
    "Composite": ".losses",
    "CrossEntropy": ".losses",
    "LRFindResult": ".sweep",
    "lr_find": ".sweep",
    "MAE": ".tracking",
    "RMSE": ".tracking",
    "Accuracy": ".tracking",
    "ConfusionMatrix": ".tracking",
    "Metric": ".tracking",
    "PrecisionRecallF1": ".tracking",
    "TopKAccuracy": ".tracking",
    "preset_fields": ".stage",
    "register_preset": ".stage",
    "registered_presets": ".stage",
    "SAM": ".optim",
    "GradientRule": ".optim",
    "ParamGroup": ".optim",
    "Constant": ".optim",
    "Cosine": ".optim",
    "Exponential": ".optim",
    "Linear": ".optim",
    "Piecewise": ".optim",
    "Schedule": ".optim",
    "current_step": ".optim",
    "schedule_value": ".optim",
    "step_context": ".optim",
    "ConsoleWriter": ".tracking",
    "JsonLinesWriter": ".tracking",
    "MetricWriter": ".tracking",
    "MultiWriter": ".tracking",
    "NullWriter": ".tracking",
    "TensorBoardWriter": ".tracking",
    "read_jsonl": ".tracking",
    "EquinoxModel": ".adapters.equinox",
    "register_model": ".adapters.equinox",
    "build_optimizer": ".backends.kit",
    "EMA": ".callbacks",
    "EarlyStopping": ".callbacks",
    "LogToExperiment": ".tracking",
    "ReduceLROnPlateau": ".callbacks",
    "RegisterModel": ".provenance",
    "TrainContext": ".callbacks",
    "Average": ".checkpoint",
    "Best": ".checkpoint",
    "CheckpointCorruptedError": ".checkpoint",
    "Checkpointer": ".checkpoint",
    "CheckpointMismatchError": ".checkpoint",
    "CheckpointNotFoundError": ".checkpoint",
    "CheckpointSaveError": ".checkpoint",
    "Every": ".checkpoint",
    "Last": ".checkpoint",
    "average_checkpoints": ".checkpoint",
    "write_average": ".checkpoint",
    "ArraySource": ".data",
    "BatchIterator": ".data",
    "Cast": ".data",
    "Flatten": ".data",
    "GaussianNoise": ".data",
    "MaskInputs": ".data",
    "Normalize": ".data",
    "NpySource": ".data",
    "NpzSource": ".data",
    "OneHot": ".data",
    "RegisteredSource": ".data",
    "Rename": ".data",
    "Reshape": ".data",
    "Select": ".data",
    "Source": ".data",
    "Transform": ".data",
    "register_dataset": ".data",
    "ArtifactIntegrityError": ".provenance",
    "ArtifactStore": ".provenance",
    "LocalModelRegistry": ".provenance",
    "ModelIntegrityError": ".provenance",
    "ModelNotFoundError": ".provenance",
    "TrainingArtifact": ".provenance",
    "UnknownArtifactError": ".provenance",
}


def __getattr__(name: str) -> Any:
    package = _MOVED.get(name)
    if package is None:
        return _getattr(name)
    import importlib

    value = getattr(importlib.import_module(package, __name__), name)
    globals()[name] = value
    return value
