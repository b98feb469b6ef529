"""Data: `TrainingDataset` (a source, whole-batch transforms and a checkpointable batch iterator on Grain), the
sources (`ArraySource`, `NpzSource`, `NpySource`, `CsvSource`, `RandomAccessSource` for your own Grain data source,
registered datasets) and the transforms (`Standardize` is fitted on the training split). See ``docs/datasets.md``."""

from ._csv import CsvSource as CsvSource
from ._dataset import BatchIterator as BatchIterator
from ._dataset import TrainingDataset as TrainingDataset
from ._grain import RandomAccessSource as RandomAccessSource
from ._sources import ArraySource as ArraySource
from ._sources import NpySource as NpySource
from ._sources import NpzSource as NpzSource
from ._sources import RegisteredSource as RegisteredSource
from ._sources import Source as Source
from ._sources import register_dataset as register_dataset
from ._standardize import Standardize as Standardize
from ._transforms import Cast as Cast
from ._transforms import Flatten as Flatten
from ._transforms import GaussianNoise as GaussianNoise
from ._transforms import MaskInputs as MaskInputs
from ._transforms import Normalize as Normalize
from ._transforms import OneHot as OneHot
from ._transforms import RandomTransform as RandomTransform
from ._transforms import Rename as Rename
from ._transforms import Reshape as Reshape
from ._transforms import Select as Select
from ._transforms import Transform as Transform
