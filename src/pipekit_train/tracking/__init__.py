"""Tracking a run: metric writers (console, JSON lines, TensorBoard), an experiment tracker (`LogToExperiment`:
MLflow), whole-split metrics, the progress display and the metric history. See ``docs/metrics.md``."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._experiment import LogToExperiment as LogToExperiment
    from ._history import history as history
    from ._metrics import MAE as MAE
    from ._metrics import RMSE as RMSE
    from ._metrics import Accuracy as Accuracy
    from ._metrics import ConfusionMatrix as ConfusionMatrix
    from ._metrics import Metric as Metric
    from ._metrics import PrecisionRecallF1 as PrecisionRecallF1
    from ._metrics import TopKAccuracy as TopKAccuracy
    from ._metrics import compute_metrics as compute_metrics
    from ._metrics import evaluate_metrics as evaluate_metrics
    from ._metrics import init_states as init_states
    from ._metrics import update_states as update_states
    from ._token_metrics import Perplexity as Perplexity
    from ._token_metrics import TokenAccuracy as TokenAccuracy
    from ._writers import ConsoleWriter as ConsoleWriter
    from ._writers import JsonLinesWriter as JsonLinesWriter
    from ._writers import MetricWriter as MetricWriter
    from ._writers import MultiWriter as MultiWriter
    from ._writers import NullWriter as NullWriter
    from ._writers import TensorBoardWriter as TensorBoardWriter
    from ._writers import read_jsonl as read_jsonl

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
