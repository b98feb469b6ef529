"""The Keras backend's contract functions (`check`, `build`, `transfer`, `start`, `info`) and its `StepBackend`.

`start` takes the model's state as arrays into a `KerasBackend`: the backend-neutral `Engine` decides when to log,
validate, checkpoint and stop, exactly as for Equinox.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import StepBackend
from pipekit_train.backends.kit import check_input_and_target_keys, check_loss_fits, learning_rate_at
from pipekit_train.scale import mesh_plan

from ._env import import_keras
from ._model import KerasModel, KerasState
from ._steps import program
from ._tree import apply_transfer

keras = import_keras()


def _copy(arrays: Any) -> list[jax.Array]:
    """Fresh device copies: the step donates its state, and must never delete arrays someone else holds."""
    return [jnp.array(a, copy=True) for a in arrays]


class KerasBackend(StepBackend):
    """The `StepBackend` of the Keras adapter: the model's variables, the optimizer's and the EMA, as arrays."""

    def __init__(self, loop: Any, state: KerasState, base_key: jax.Array) -> None:
        from pipekit_train.backends.kit import fixed_value

        self.loop = loop
        self.model_op = loop.model_op
        # Data parallel (`_mesh`): None trains unsharded; otherwise the state lives replicated on the mesh.
        self.plan = mesh_plan(loop)
        ema = loop.ema_settings
        self.ema_callback = ema
        ema_config = (fixed_value(ema.decay, "EMA.decay"), ema.warmup) if ema is not None else None
        self.program = program(loop, state.model, ema_config)
        self.model = state.model
        trainable = _copy(state.trainable)
        self.state = (
            trainable,
            _copy(state.non_trainable),
            self.program.initial_opt_vars(),
            _copy(trainable) if ema is not None else [],
        )
        self._place()
        self.base_key = base_key

    def _place(self) -> None:
        """Put the state on the stage's mesh, replicated (nothing without a mesh)."""
        if self.plan is not None:
            self.state = jax.device_put(self.state, self.plan.replicated)

    # StepBackend -------------------------------------------------------------------------------------------
    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> Any:
        n = len(batches)
        batch = batches[0] if n == 1 else {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        self.state, metrics = self.program.train(self.state, batch, np.int32(step), self.base_key, n, self.plan)
        return metrics

    def _trainable(self, use_ema: bool) -> list[jax.Array]:
        return self.state[3] if (use_ema and self.ema_callback is not None) else self.state[0]

    def evaluate(self, batch: dict[str, np.ndarray]) -> Any:
        use_ema = self.ema_callback is not None and self.ema_callback.evaluate_with_ema
        return self.program.evaluate(self._trainable(use_ema), self.state[1], batch)

    def bound_model(self) -> KerasModel:
        use_ema = self.ema_callback is not None and self.ema_callback.return_ema
        state = KerasState(self.model, _copy(self._trainable(use_ema)), _copy(self.state[1]))
        bound: KerasModel = self.model_op.bind(state, check=False)
        return bound

    def set_model(self, model_op: Any) -> None:
        module = model_op.module
        if not isinstance(module, KerasState):
            raise ShapeError(f"set_model: expected a bound KerasModel, got {model_op!r}")
        self._load(module.trainable, module.non_trainable)

    def _load(self, trainable: Any, non_trainable: Any, opt_vars: Any = None, ema: Any = None) -> None:
        old = self.state
        for what, new, cur in (("trainable", trainable, old[0]), ("non_trainable", non_trainable, old[1])):
            if len(new) != len(cur) or any(np.shape(a) != np.shape(b) for a, b in zip(new, cur)):
                raise ShapeError(f"the new {what} arrays have other shapes than the ones being trained")
        t = _copy(trainable)
        e = _copy(ema if ema is not None else t) if self.ema_callback is not None else []
        self.state = (t, _copy(non_trainable), _copy(opt_vars) if opt_vars is not None else old[2], e)
        self._place()

    def optimizer_state(self) -> Any:
        """The optimizer's variables the stage ends with (`TrainerCarryState.opt_state`)."""
        return list(self.state[2])

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this run."""
        return {"num_params": int(sum(int(np.size(a)) for a in self.state[0]))}

    def get_lr_scale(self) -> float:
        return float(self.state[2][self.program.scale_index])

    def set_lr_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"set_lr_scale: value must be a finite float >= 0, got {value!r}")
        opt_vars = list(self.state[2])
        opt_vars[self.program.scale_index] = jnp.asarray(value, jnp.float32)
        self.state = (self.state[0], self.state[1], opt_vars, self.state[3])
        self._place()

    def learning_rate(self, step: int) -> float:
        return learning_rate_at(self.loop.optimizer_config, step, self.loop.max_steps) * self.get_lr_scale()

    # Checkpointing -----------------------------------------------------------------------------------------
    def state_tree(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: the model's trainable and non-trainable variables, the optimizer's."""
        trainable, non_trainable, opt_vars, ema = self.state
        tree = {"trainable": list(trainable), "non_trainable": list(non_trainable), "optimizer": list(opt_vars)}
        if self.ema_callback is not None:
            tree["ema"] = list(ema)
        return tree

    def load_state_tree(self, tree: Mapping[str, Any]) -> None:
        self._load(tree["trainable"], tree["non_trainable"], tree["optimizer"], tree.get("ema"))

    def weights_tree(self) -> dict[str, Any]:
        """The model's variables: what a warm start (`init_from`) copies."""
        return {"trainable": list(self.state[0]), "non_trainable": list(self.state[1])}

    def load_weights_tree(self, tree: Mapping[str, Any]) -> None:
        self._load(tree["trainable"], tree["non_trainable"])


# The stage ---------------------------------------------------------------------------------------------------
def build(loop: Any) -> Any:
    """`loop.model_op` bound to a fresh `KerasState` (built from the first half of ``split(key(seed))``)."""
    init_key, _ = jax.random.split(jax.random.key(loop.seed))
    return loop.model_op.bind(loop.model_op.build(init_key), check=False)


def transfer(spec: Any, previous: Any, fresh: Any) -> Any:
    """`fresh` with the layers `spec` names copied from `previous` (both bound Keras models)."""
    return fresh.bind(apply_transfer(spec, previous.module, fresh.module), check=False)


def check(loop: Any, incoming: Any, stage: str) -> None:
    """Refuse what this backend cannot do, and data/model/loss mismatches, before anything is compiled."""
    if loop.task is not None:
        raise ConfigError(
            "backend 'keras' cannot honour TrainingLoop.task (tasks are Equinox-native); give a `loss` instead"
        )
    if not isinstance(loop.model_op, KerasModel):
        raise ConfigError(f"backend 'keras' trains KerasModel operators, got {loop.model_op!r}")
    spec = check_input_and_target_keys(loop)
    from ._optimizers import build_keras_optimizer

    build_keras_optimizer(  # refuses keys Keras cannot honour, before anything is built
        loop.optimizer_config, max_steps=loop.max_steps, grad_clip_norm=loop.grad_clip_norm, accum=loop.accum
    )
    check_loss_fits(loop, spec)


def start(loop: Any, model: Any, incoming: Any) -> KerasBackend:
    """The stage's `KerasBackend`, holding `model`'s state; the steps' key is the second half of
    ``split(key(seed))``."""
    _, step_key = jax.random.split(jax.random.key(loop.seed))
    return KerasBackend(loop, model.module, step_key)


def info() -> dict[str, Any]:
    return {
        "backend": "keras",
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
    }
