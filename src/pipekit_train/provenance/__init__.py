"""Provenance: the `TrainingArtifact` recorded per stage, the SQLite `ArtifactStore` with lineage queries, the
content-addressed model registry (and `RegisterModel`, the callback that stores a stage's model in it) and
`reproduce`. See ``docs/provenance.md``."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._artifact import TrainingArtifact as TrainingArtifact
    from ._errors import ArtifactIntegrityError as ArtifactIntegrityError
    from ._errors import ArtifactStoreError as ArtifactStoreError
    from ._errors import UnknownArtifactError as UnknownArtifactError
    from ._model_registry import LocalModelRegistry as LocalModelRegistry
    from ._model_registry import ModelIntegrityError as ModelIntegrityError
    from ._model_registry import ModelNotFoundError as ModelNotFoundError
    from ._model_registry import ModelRegistryError as ModelRegistryError
    from ._model_registry import load_model as load_model
    from ._register import RegisterModel as RegisterModel
    from ._store import ArtifactStore as ArtifactStore

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
