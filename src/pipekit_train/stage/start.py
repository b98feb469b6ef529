"""Where a stage's model starts: fresh, carried over, converted from another backend, or transferred.

The core decides; the backend only builds (`Backend.build`) and, with the ``transfer`` capability, fills a fresh
model from the previous one (`Backend.transfer`). The same rules hold for every backend:

* no previous model (a first stage), or ``transfer: {type: Transfer}`` without paths: **fresh**;
* the previous stage's model, of this stage's backend and architecture: **carried** over whole;
* a model of another backend goes through its registered converter first (**converted**), or is refused;
* ``transfer:`` with paths: a fresh model with those sub-trees copied from the previous one (**transferred**).

A backend without the ``weights`` capability (a sampler) always starts from its own `build`: it takes its initial
point from the previous stage in `Backend.start`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pipekit import ConfigError

from ..backends._convert import convert_model, converted_architecture, find_converter, refuse_foreign

if TYPE_CHECKING:
    from ..backends._contract import Backend
    from ..backends._model import ModelOp
    from .loop import TrainerCarryState, TrainingLoop
    from .preflight import StagePlan

__all__ = ["Route", "route", "starting_model"]

Route = Literal["fresh", "carried", "converted", "transferred"]


def route(loop: TrainingLoop, incoming: TrainerCarryState | None, stage: str, backend: Backend) -> Route:
    """How the stage's model starts (see the module docstring); refuses a hand-off the rules do not allow.

    Needs no weights: pre-flight calls it with the model the previous stage will hand over.
    """
    previous = incoming.model if incoming is not None else None
    if previous is None or "weights" not in backend.capabilities:
        return "fresh"
    if loop.transfer is not None and not loop.transfer.paths:
        return "fresh"
    converted = previous.backend != backend.name
    if converted and find_converter(previous, backend.name) is None:
        raise refuse_foreign(previous, backend.name, stage)
    if loop.transfer is not None:
        if "transfer" not in backend.capabilities:
            from ..backends._registry import able_to

            raise ConfigError(
                f"stage {stage!r}: backend {loop.backend!r} cannot assemble a model by paths (TrainingLoop.transfer "
                f"{loop.transfer!r}); carry the whole model, start fresh with `transfer: {{type: Transfer}}`, or "
                f"train this stage with a backend that can: {able_to('transfer', besides=backend.name)}"
            )
        return "transferred"
    if converted:
        produces = converted_architecture(previous, backend.name)
        if produces is not None and produces != loop.model_op:
            raise ConfigError(
                f"stage {stage!r} trains {loop.model_op!r} but the previous stage's {previous!r} converts to "
                f"{produces!r}; say which weights to carry over with `transfer:` (for example "
                "`transfer: {type: Transfer, paths: {encoder: encoder}}`, or `transfer: {type: Transfer}` to start "
                "fresh)"
            )
        return "converted"
    if previous == loop.model_op:
        return "carried"
    raise ConfigError(
        f"stage {stage!r} trains {loop.model_op!r} but the previous stage produced {previous!r}; "
        "say which weights to carry over with `transfer:` (for example "
        "`transfer: {type: Transfer, paths: {encoder: encoder}}`, or `transfer: {type: Transfer}` to start fresh)"
    )


def starting_model(plan: StagePlan, incoming: TrainerCarryState | None) -> ModelOp:
    """The bound model the stage of `plan` starts from, by the route pre-flight chose (`StagePlan.route`; nothing is
    routed again): the fresh model pre-flight built (`StagePlan.fresh`) or one built now, the previous stage's model
    (converted through its registered converter when it is of another backend), or a fresh model with the
    `Transfer`'s parts copied from it. The backend builds at most once and transfers at most once here."""
    loop, backend, stage = plan.loop, plan.backend, plan.stage

    def built() -> ModelOp:
        return plan.fresh if plan.fresh is not None else backend.build(loop)

    if plan.route == "fresh":
        return built()
    assert incoming is not None and incoming.model is not None
    previous: Any = incoming.model
    if previous.backend != backend.name:
        previous = convert_model(previous, backend.name)
    if plan.route == "transferred":  # `route` allows it only with the transfer capability
        assert loop.transfer is not None
        return backend.transfer(loop.transfer, previous, built())
    if previous != loop.model_op:  # a converter that produced another architecture
        raise ConfigError(
            f"stage {stage!r} trains {loop.model_op!r} but converting the previous stage's model gave {previous!r}; "
            "say which weights to carry over with `transfer:`"
        )
    return previous  # type: ignore[no-any-return]
