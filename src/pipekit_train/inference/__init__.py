"""Using a trained model: `evaluate` and `predict` on a dataset, `export_model` (`jax.export` with a provenance
sidecar), `export_file` (a model's own formats, e.g. a posterior as ArviZ netCDF) and `compare` (models by a
criterion such as PSIS-LOO, recorded as evaluations). See ``docs/metrics.md`` and ``docs/provenance.md``."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._compare import compare as compare
    from ._draws import predict_draws as predict_draws
    from ._evaluate import Evaluation as Evaluation
    from ._evaluate import evaluate as evaluate
    from ._evaluate import predict as predict
    from ._export import ExportError as ExportError
    from ._export import InputSpec as InputSpec
    from ._export import artifact_input_spec as artifact_input_spec
    from ._export import export_model as export_model
    from ._export import inference_function as inference_function
    from ._export import sidecar_path as sidecar_path
    from ._formats import export_file as export_file
    from ._formats import provenance_attrs as provenance_attrs

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
