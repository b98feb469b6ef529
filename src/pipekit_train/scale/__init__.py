"""Scale: the device mesh (`TrainingLoop.mesh`), mixed precision, and several `jax.distributed` processes. See
``docs/scale.md``."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._distributed import initialize_distributed as initialize_distributed
    from ._distributed import is_primary as is_primary
    from ._distributed import process_count as process_count
    from ._distributed import process_index as process_index
    from ._mesh import MeshPlan as MeshPlan
    from ._mesh import describe as describe
    from ._mesh import mesh_plan as mesh_plan
    from ._precision import cast_floating as cast_floating
    from ._precision import compute_dtype as compute_dtype

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
