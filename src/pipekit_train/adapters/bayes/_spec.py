"""`SamplerBackendSpec`: what the sampler backends' objects (``numpyro-mcmc``, ``blackjax``) share, the members of
the contract that follow from "one loop step is one iteration of every chain, the kernel is the task". Cheap to
import: no framework."""

from __future__ import annotations

from typing import Any

from pipekit_train.backends import LazyBackend

from ._kernels import NUTS

__all__ = ["SamplerBackendSpec"]


class SamplerBackendSpec(LazyBackend):
    """A `LazyBackend` whose stage is sampled by a kernel (`NUTS`, `HMC`, `MALA`) given as `TrainingLoop.task`."""

    #: The posterior-predictive mean over the draws is a JAX function of the inputs (`NumpyroModel.inference_function`).
    capabilities: frozenset[str] = frozenset({"export"})
    #: A stage draws from the posterior: no batches, and its output speaks of draws (`Backend.samples`).
    samples: bool = True

    def extended_fields(self, loop: Any, steps: int) -> dict[str, Any]:
        """A longer stage samples `steps` more iterations: the kernel's ``num_samples`` grows (when it is set)."""
        return {"task": loop.task.extended(steps, loop.name or "stage")}

    def example_fields(self) -> dict[str, Any]:
        """The conformance kit's loop fields for a sampler: NUTS as the task (5 warm-up iterations), no loss."""
        return {"loss": None, "task": NUTS(num_warmup=5, max_tree_depth=4), "val_dataset": None}
