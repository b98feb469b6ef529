"""Data: `TrainingDataset` (a source, whole-batch transforms and a checkpointable batch iterator on Grain), the
sources (`ArraySource`, `NpzSource`, `NpySource`, `CsvSource`, `TextSource` for text files, `DataFile` for a
model's named values, `RandomAccessSource` for your own Grain data source, registered datasets) and the transforms
(`Standardize` is fitted on the training split). See ``docs/datasets.md`` and ``docs/sequences.md``."""

from ._csv import CsvSource as CsvSource
from ._datafile import DataFile as DataFile
from ._dataset import TrainingDataset as TrainingDataset
from ._grain import RandomAccessSource as RandomAccessSource
from ._iterator import BatchIterator as BatchIterator
from ._layout import Flatten as Flatten
from ._layout import Rename as Rename
from ._layout import Reshape as Reshape
from ._layout import Select as Select
from ._noise import GaussianNoise as GaussianNoise
from ._noise import MaskInputs as MaskInputs
from ._noise import MaskTokens as MaskTokens
from ._noise import RandomTransform as RandomTransform
from ._numeric import Cast as Cast
from ._numeric import Normalize as Normalize
from ._numeric import OneHot as OneHot
from ._sources import ArraySource as ArraySource
from ._sources import NpySource as NpySource
from ._sources import NpzSource as NpzSource
from ._sources import RegisteredSource as RegisteredSource
from ._sources import Source as Source
from ._sources import register_dataset as register_dataset
from ._standardize import Standardize as Standardize
from ._text import TextSource as TextSource
from ._transforms import Transform as Transform
