"""pipekit-train: training as a pipeline operator for JAX.

`TrainingLoop` is a `pipekit.StatefulOperator`: put stages in a `pipekit.Sequential` and ``run()`` it, or write the
same pipeline as YAML and run ``pipekit-train run pipeline.yaml``.
"""

from ._artifacts import TrainingArtifact as TrainingArtifact
from ._callbacks import Callback as Callback
from ._callbacks import TrainContext as TrainContext
from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import CheckpointCorruptedError as CheckpointCorruptedError
from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import CheckpointMismatchError as CheckpointMismatchError
from ._checkpoint import average_checkpoints as average_checkpoints
from ._checkpoint import write_average as write_average
from ._controls import EMA as EMA
from ._controls import EarlyStopping as EarlyStopping
from ._controls import ReduceLROnPlateau as ReduceLROnPlateau
from ._data import ArraySource as ArraySource
from ._data import BatchIterator as BatchIterator
from ._data import Cast as Cast
from ._data import Flatten as Flatten
from ._data import Normalize as Normalize
from ._data import NpySource as NpySource
from ._data import NpzSource as NpzSource
from ._data import OneHot as OneHot
from ._data import RegisteredSource as RegisteredSource
from ._data import Rename as Rename
from ._data import Reshape as Reshape
from ._data import Select as Select
from ._data import Source as Source
from ._data import TrainingDataset as TrainingDataset
from ._data import Transform as Transform
from ._data import register_dataset as register_dataset
from ._engine import NonFiniteLossError as NonFiniteLossError
from ._loop import TrainerCarryState as TrainerCarryState
from ._loop import TrainingLoop as TrainingLoop
from ._loop import TrainingResult as TrainingResult
from ._losses import KL as KL
from ._losses import MSE as MSE
from ._losses import NLL as NLL
from ._losses import Composite as Composite
from ._losses import CrossEntropy as CrossEntropy
from ._losses import Loss as Loss
from ._model_registry import LocalModelRegistry as LocalModelRegistry
from ._model_registry import ModelIntegrityError as ModelIntegrityError
from ._model_registry import load_model as load_model
from ._models import EquinoxModel as EquinoxModel
from ._models import ModelOp as ModelOp
from ._models import Transfer as Transfer
from ._models import register_model as register_model
from ._optim import build_optimizer as build_optimizer
from ._run import RunSettings as RunSettings
from ._run import TrainingInterrupted as TrainingInterrupted
from ._run import run_settings as run_settings
from ._selectors import Average as Average
from ._selectors import Best as Best
from ._selectors import Every as Every
from ._selectors import Last as Last
from ._store import ArtifactStore as ArtifactStore
from ._tracking import LogToExperiment as LogToExperiment
from ._tracking import RegisterModel as RegisterModel
from ._warnings import PipekitTrainWarning as PipekitTrainWarning
from ._writers import ConsoleWriter as ConsoleWriter
from ._writers import JsonLinesWriter as JsonLinesWriter
from ._writers import MetricWriter as MetricWriter
from ._writers import MultiWriter as MultiWriter
from ._writers import NullWriter as NullWriter
from ._writers import TensorBoardWriter as TensorBoardWriter
from ._writers import read_jsonl as read_jsonl

__version__ = "0.1.0"
