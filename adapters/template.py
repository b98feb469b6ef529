"""Template for a backend adapter. Copy to src/pipekit_train/adapters/<name>.py and fill in the TODOs.

Then add the module to `_BACKEND_MODULES` / `_IMPLEMENTED_BACKENDS` in `pipekit_train/_loop.py` and run
``python -m pipekit_train.adapters.conformance <name>``. Import the framework inside functions, not at module
level, so `import pipekit_train` stays light and a missing extra gives a clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipekit_train._engine import AdapterResult, Engine


class TemplateBackend:
    """The engine's view of one framework: how to run steps, evaluate, and hand over weights."""

    def __init__(self, loop: Any, module: Any, seed: int) -> None:
        self.loop = loop
        self.module = module  # TODO: the framework's model, built from loop.model_op
        self.seed = seed
        self.lr_scale = 1.0

    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> dict[str, Any]:
        raise NotImplementedError("TODO: run len(batches) steps from `step`; return {'loss': ...}")

    def evaluate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        raise NotImplementedError("TODO: metrics of one batch, inference mode, no gradients")

    def bound_model(self) -> Any:
        return self.loop.model_op.bind(self.module)

    def set_model(self, model_op: Any) -> None:
        self.module = model_op.module

    def get_lr_scale(self) -> float:
        return self.lr_scale

    def set_lr_scale(self, value: float) -> None:
        self.lr_scale = value

    def learning_rate(self, step: int) -> float:
        return float(self.loop.optimizer_config.get("lr", 0.0)) * self.lr_scale

    def state_tree(self) -> dict[str, Any]:
        raise NotImplementedError("TODO: every array a checkpoint needs")

    def load_state_tree(self, tree: dict[str, Any]) -> None:
        raise NotImplementedError("TODO: the inverse of state_tree")


def run(loop: Any, incoming: Any, info: Any, hooks: Any = None) -> AdapterResult:
    """Train one stage (see adapters/README.md for the contract)."""
    import jax

    module = loop.model_op.build(jax.random.key(loop.seed))  # TODO: honour `incoming` and `loop.transfer`
    backend = TemplateBackend(loop, module, loop.seed)
    start, data_state, callback_states = hooks.restore(backend) if hooks is not None else (0, None, None)
    engine = Engine(
        loop, backend, stage=info.stage, run_id=info.run_id, stage_dir=info.stage_dir,
        start_step=start, data_state=data_state, callback_states=callback_states, hooks=hooks,
    )
    result = engine.run()
    result.backend_info = {"backend": loop.backend, "steps": result.step}
    return result
