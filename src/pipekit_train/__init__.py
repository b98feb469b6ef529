"""pipekit-train: training as a pipeline operator for JAX."""

from ._warnings import PipekitTrainWarning as PipekitTrainWarning

__version__ = "0.1.0"
