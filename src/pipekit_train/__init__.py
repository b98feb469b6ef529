"""pipekit-train: training as a pipeline operator for JAX.

`TrainingLoop` is a `pipekit.StatefulOperator`: put stages in a `pipekit.Sequential` and ``run()`` it, or write the
same pipeline as YAML and run ``pipekit-train run pipeline.yaml``.

Importing the package is cheap (no JAX): each public name below is imported from its module the first time it is
used. The concepts live in subpackages with their own facades: `pipekit_train.data`, `pipekit_train.callbacks`,
`pipekit_train.checkpoint`, `pipekit_train.provenance`, `pipekit_train.adapters` (one package per backend).
"""

from typing import TYPE_CHECKING

from ._lazy import attach as _attach

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pipekit import ConfigError as ConfigError
    from pipekit import PipekitError as PipekitError
    from pipekit import ShapeError as ShapeError

    from ._backends import BackendError as BackendError
    from ._backends import available_backends as available_backends
    from ._backends import register_backend as register_backend
    from ._convert import convert_model as convert_model
    from ._convert import register_converter as register_converter
    from ._distributed import initialize_distributed as initialize_distributed
    from ._engine import NonFiniteLossError as NonFiniteLossError
    from ._engine import NonFiniteWeightsError as NonFiniteWeightsError
    from ._evaluate import Evaluation as Evaluation
    from ._evaluate import evaluate as evaluate
    from ._evaluate import predict as predict
    from ._export import export_model as export_model
    from ._history import history as history
    from ._jsonio import DamagedFileError as DamagedFileError
    from ._loop import TrainerCarryState as TrainerCarryState
    from ._loop import TrainingLoop as TrainingLoop
    from ._loop import TrainingResult as TrainingResult
    from ._losses import KL as KL
    from ._losses import MSE as MSE
    from ._losses import NLL as NLL
    from ._losses import Composite as Composite
    from ._losses import CrossEntropy as CrossEntropy
    from ._losses import Loss as Loss
    from ._lr_find import LRFindResult as LRFindResult
    from ._lr_find import lr_find as lr_find
    from ._metrics import MAE as MAE
    from ._metrics import RMSE as RMSE
    from ._metrics import Accuracy as Accuracy
    from ._metrics import ConfusionMatrix as ConfusionMatrix
    from ._metrics import Metric as Metric
    from ._metrics import PrecisionRecallF1 as PrecisionRecallF1
    from ._metrics import TopKAccuracy as TopKAccuracy
    from ._models import ModelOp as ModelOp
    from ._models import Transfer as Transfer
    from ._presets import preset_fields as preset_fields
    from ._presets import register_preset as register_preset
    from ._presets import registered_presets as registered_presets
    from ._recipes import SAM as SAM
    from ._recipes import GradientRule as GradientRule
    from ._recipes import ParamGroup as ParamGroup
    from ._run import RunSettings as RunSettings
    from ._run import TrainingInterrupted as TrainingInterrupted
    from ._run import run_settings as run_settings
    from ._schedules import Constant as Constant
    from ._schedules import Cosine as Cosine
    from ._schedules import Exponential as Exponential
    from ._schedules import Linear as Linear
    from ._schedules import Piecewise as Piecewise
    from ._schedules import Schedule as Schedule
    from ._schedules import current_step as current_step
    from ._schedules import schedule_value as schedule_value
    from ._schedules import step_context as step_context
    from ._warnings import PipekitTrainWarning as PipekitTrainWarning
    from ._writers import ConsoleWriter as ConsoleWriter
    from ._writers import JsonLinesWriter as JsonLinesWriter
    from ._writers import MetricWriter as MetricWriter
    from ._writers import MultiWriter as MultiWriter
    from ._writers import NullWriter as NullWriter
    from ._writers import TensorBoardWriter as TensorBoardWriter
    from ._writers import read_jsonl as read_jsonl
    from .adapters.equinox import EquinoxModel as EquinoxModel
    from .adapters.equinox import register_model as register_model
    from .adapters.optax import build_optimizer as build_optimizer
    from .callbacks import EMA as EMA
    from .callbacks import Callback as Callback
    from .callbacks import EarlyStopping as EarlyStopping
    from .callbacks import LogToExperiment as LogToExperiment
    from .callbacks import ReduceLROnPlateau as ReduceLROnPlateau
    from .callbacks import RegisterModel as RegisterModel
    from .callbacks import TrainContext as TrainContext
    from .checkpoint import Average as Average
    from .checkpoint import Best as Best
    from .checkpoint import Checkpoint as Checkpoint
    from .checkpoint import CheckpointCorruptedError as CheckpointCorruptedError
    from .checkpoint import Checkpointer as Checkpointer
    from .checkpoint import CheckpointError as CheckpointError
    from .checkpoint import CheckpointMismatchError as CheckpointMismatchError
    from .checkpoint import CheckpointNotFoundError as CheckpointNotFoundError
    from .checkpoint import CheckpointSaveError as CheckpointSaveError
    from .checkpoint import Every as Every
    from .checkpoint import Last as Last
    from .checkpoint import average_checkpoints as average_checkpoints
    from .checkpoint import write_average as write_average
    from .data import ArraySource as ArraySource
    from .data import BatchIterator as BatchIterator
    from .data import Cast as Cast
    from .data import Flatten as Flatten
    from .data import GaussianNoise as GaussianNoise
    from .data import MaskInputs as MaskInputs
    from .data import Normalize as Normalize
    from .data import NpySource as NpySource
    from .data import NpzSource as NpzSource
    from .data import OneHot as OneHot
    from .data import RegisteredSource as RegisteredSource
    from .data import Rename as Rename
    from .data import Reshape as Reshape
    from .data import Select as Select
    from .data import Source as Source
    from .data import TrainingDataset as TrainingDataset
    from .data import Transform as Transform
    from .data import register_dataset as register_dataset
    from .provenance import ArtifactIntegrityError as ArtifactIntegrityError
    from .provenance import ArtifactStore as ArtifactStore
    from .provenance import ArtifactStoreError as ArtifactStoreError
    from .provenance import LocalModelRegistry as LocalModelRegistry
    from .provenance import ModelIntegrityError as ModelIntegrityError
    from .provenance import ModelNotFoundError as ModelNotFoundError
    from .provenance import ModelRegistryError as ModelRegistryError
    from .provenance import TrainingArtifact as TrainingArtifact
    from .provenance import UnknownArtifactError as UnknownArtifactError
    from .provenance import load_model as load_model

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
