"""`RegisterModel`: the callback that stores a stage's trained model in a `LocalModelRegistry` when it ends and
records where, in the stage's artifact."""

from __future__ import annotations

from ..callbacks._base import Callback, TrainContext
from ._model_registry import LocalModelRegistry

__all__ = ["RegisterModel"]


class RegisterModel(Callback):
    """At the end of a run, store the trained model in a `LocalModelRegistry` and record where.

    Sets the stage artifact's ``model_registry_uri`` (``pipekit-model:sha256:<hex>?root=<registry dir>``: the
    content address plus where this registry keeps it) and ``trained_model_hash`` (``sha256:<hex>``, the same as
    ``model.weights_hash()``).

    Args:
        registry: The registry folder. Default: ``$PIPEKIT_MODEL_REGISTRY``, else ``./runs/models``.
    """

    registry: str | None = None

    def fingerprint(self) -> None:
        """Not part of a resume's fingerprint: it changes what is recorded, not what is trained."""
        return None

    def on_train_end(self, ctx: TrainContext) -> None:
        registry = LocalModelRegistry(self.registry)
        uri = registry.put(ctx.model)
        ctx.artifact_fields["model_registry_uri"] = registry.locator(uri)
        ctx.artifact_fields["trained_model_hash"] = uri.split(":", 1)[1]
