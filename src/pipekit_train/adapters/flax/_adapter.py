"""The Flax backend's contract functions (`check`, `build`, `transfer`, `start`, `info`) and its `StepBackend`.

`start` takes the bound model's `FlaxState` into a `FlaxBackend`, which holds the params, the other variables,
the optax state and the EMA as arrays between the compiled steps of `_steps`; the backend-neutral engine decides
when to log, validate, checkpoint and stop, exactly as for Equinox.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import jax
import numpy as np

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import StepBackend
from pipekit_train.backends.kit import (
    LearningRateLog,
    build_optimizer,
    check_input_and_target_keys,
    check_loss_fits,
    refresh_hyperparams,
    restart_schedule,
    set_lr_scale,
)
from pipekit_train.scale import compute_dtype, mesh_plan

from ._model import FlaxModel, FlaxState
from ._steps import Layout, Spec, bound_train_chunk, eval_batch, sharded_train_chunk, static_arg
from ._tree import apply_transfer

_OPTIMIZERS: dict[Any, Any] = {}


def _optimizer(loop: Any) -> Any:
    """One optax object per configuration (its numbers live in the state): the compiled step is reused."""
    from pipekit import canonical

    key = (canonical(loop.optimizer_config), loop.max_steps, loop.grad_clip_norm, loop.accum)
    opt = _OPTIMIZERS.get(key)
    if opt is None:
        opt = _OPTIMIZERS[key] = build_optimizer(
            loop.optimizer_config, max_steps=loop.max_steps, grad_clip_norm=loop.grad_clip_norm, accum=loop.accum
        )
    return opt


def _copy(leaves: Any) -> list[jax.Array]:
    """Fresh device copies: the step donates its state, and must never delete arrays someone else holds."""
    return list(jax.device_put(list(leaves), may_alias=False))


class FlaxBackend(StepBackend):
    """The `StepBackend` of the Flax adapter: params, other variables, optimizer state and EMA as arrays."""

    _segment_start = 0  # the step a new schedule segment began at (`schedule_segment`)

    def __init__(self, loop: Any, state: FlaxState, base_key: jax.Array) -> None:
        self.loop = loop
        self.model_op = loop.model_op
        # Data parallel (`TrainingLoop.mesh`): None trains on the default device; else the state lives replicated.
        self.plan = mesh_plan(loop)
        self.optimizer = _optimizer(loop)
        self._lr_log = LearningRateLog()  # what `learning_rate` logs, read from the state's leaves
        self._bound: dict[int, Any] = {}  # the unsharded chunk by length (`bound_train_chunk`)
        ema = loop.ema_settings
        self.ema_callback = ema
        # the decay may be a `Schedule` (read at the traced step inside the compiled step): a static argument
        self.ema_config = (ema.decay, bool(ema.warmup)) if ema is not None else None
        p_leaves, p_def = jax.tree.flatten(state.params)
        r_leaves, r_def = jax.tree.flatten(state.rest)
        rng_leaves, rng_def = jax.tree.flatten(state.rngs)
        self.graphdef, self.defs = state.graphdef, (p_def, r_def, rng_def)
        params = _copy(p_leaves)
        o_leaves, o_def = jax.tree.flatten(self.optimizer.init(params))
        self.layout = static_arg(Layout(state.graphdef, p_def, r_def, rng_def, o_def))
        self.compute = compute_dtype(loop.precision)  # mixed precision: None trains in float32
        prefix = getattr(loop.loss, "aux_prefix", "loss/")
        self.spec = static_arg(Spec(loop.loss, loop.input_key, loop.target_key, prefix, self.compute))
        self.rngs = rng_leaves  # reseeded from (seed, step) inside every step: never part of the saved state
        # The optimizer state is kept as its leaves (`Layout.opt_state` rebuilds it inside the step).
        self.state: tuple[list[Any], list[Any], list[Any], list[Any]] = (
            params,
            _copy(r_leaves),
            o_leaves,
            _copy(params) if ema is not None else [],
        )
        self._place()
        self.base_key = base_key

    def _place(self) -> None:
        """Put the state (and the RNG streams' state) on the stage's mesh, replicated; nothing without a mesh."""
        if self.plan is not None:
            self.state = jax.device_put(self.state, self.plan.replicated)
            self.rngs = jax.device_put(self.rngs, self.plan.replicated)

    # StepBackend -------------------------------------------------------------------------------------------
    def resident_data(self) -> bool:
        """Whether `train_window` can take device-resident data: on one device (no mesh), yes."""
        return self.plan is None

    def train_window(self, window: Any, n: int, step: int) -> Any:
        """`train` for device-resident data: `window` (a `DeviceWindow`) is sliced inside the compiled chunk."""
        return self._chunk(window, step, n)

    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> Any:
        n = len(batches)
        batch = batches[0] if n == 1 else {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        if self.plan is not None:
            fn = sharded_train_chunk(
                self.plan, layout=self.layout, spec=self.spec, optimizer=self.optimizer, n=n, ema_config=self.ema_config
            )
            before = self.state[2]
            self.state, metrics = fn(self.state, self.rngs, batch, np.int32(step), self.base_key)
            self._lr_log.stepped(before, self.state[2])
            return metrics
        return self._chunk(batch, step, n)

    def _chunk(self, batch: Any, step: int, n: int) -> Any:
        """`n` steps through the compiled chunk (one device); `batch` is stacked batches or a `DeviceWindow`. The
        chunk's static configuration is bound once per length (`bound_train_chunk`): a call passes arrays only."""
        fn = self._bound.get(n)
        if fn is None:
            fn = self._bound[n] = bound_train_chunk(
                layout=self.layout, spec=self.spec, optimizer=self.optimizer, n=n, ema_config=self.ema_config
            )
        before = self.state[2]
        self.state, metrics = fn(self.state, self.rngs, batch, np.int32(step), self.base_key)
        self._lr_log.stepped(before, self.state[2])
        return metrics

    def _params(self, use_ema: bool) -> list[Any]:
        return self.state[3] if (use_ema and self.ema_config is not None) else self.state[0]

    def evaluate(self, batch: dict[str, np.ndarray]) -> Any:
        use_ema = self.ema_callback is not None and self.ema_callback.evaluate_with_ema
        return eval_batch(self._params(use_ema), self.state[1], self.rngs, batch, layout=self.layout, spec=self.spec)

    def bound_model(self) -> FlaxModel:
        use_ema = self.ema_callback is not None and self.ema_callback.return_ema
        state = FlaxState(
            self.graphdef,
            jax.tree.unflatten(self.defs[0], _copy(self._params(use_ema))),
            jax.tree.unflatten(self.defs[1], _copy(self.state[1])),
            jax.tree.unflatten(self.defs[2], self.rngs),
        )
        bound: FlaxModel = self.model_op.bind(state, check=False)
        return bound

    def _load(self, params: Any, rest: Any, opt_state: Any = None, ema: Any = None) -> None:
        old = self.state
        params, rest = list(params), list(rest)
        for what, new, cur in (("params", params, old[0]), ("other variables", rest, old[1])):
            if len(new) != len(cur) or any(np.shape(a) != np.shape(b) for a, b in zip(new, cur)):
                raise ShapeError(f"the new {what} have other shapes than the ones being trained")
        p = _copy(params)
        e = _copy(ema if ema is not None else p) if self.ema_config is not None else []
        o = self._opt_leaves(opt_state) if opt_state is not None else old[2]
        self.state = (p, _copy(rest), o, e)
        self._place()

    def set_model(self, model_op: Any) -> None:
        module = model_op.module
        if not isinstance(module, FlaxState):
            raise ShapeError(f"set_model: expected a bound FlaxModel, got {model_op!r}")
        self._load(jax.tree.leaves(module.params), jax.tree.leaves(module.rest))

    def optimizer_state(self) -> Any:
        """The optimizer state the stage ends with (`TrainerCarryState.opt_state`)."""
        return self._opt_tree()

    def _opt_tree(self, leaves: list[Any] | None = None) -> Any:
        """The optimizer state as optax's tree (the stage keeps its leaves)."""
        return jax.tree.unflatten(self.layout.value.opt_state, self.state[2] if leaves is None else leaves)

    def _opt_leaves(self, tree: Any) -> list[Any]:
        """The leaves of an optimizer state of this stage's structure (a checkpoint's, a callback's change)."""
        leaves = jax.tree.leaves(tree)
        expected = self.layout.value.opt_state.num_leaves
        if len(leaves) != expected:
            raise ShapeError(f"the optimizer state has {len(leaves)} arrays, this stage's optimizer {expected}")
        return list(leaves)

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this run."""
        return {
            "num_params": int(sum(int(np.size(a)) for a in self.state[0])),
            "precision": self.compute or "float32",
        }

    def get_lr_scale(self) -> float:
        return self._lr_log.scale(self.state[2], self.layout.value.opt_state)

    def set_lr_scale(self, value: float) -> None:
        p, r, o, e = self.state
        self.state = (p, r, self._opt_leaves(set_lr_scale(self._opt_tree(o), value)), e)
        self._place()

    def learning_rate(self, step: int) -> float:
        step -= self._segment_start  # a new schedule segment (an extension) counts from its start
        loop = self.loop
        leaves, treedef = self.state[2], self.layout.value.opt_state
        return self._lr_log.rate(loop.optimizer_config, loop.max_steps, step, leaves, treedef)

    def schedule_segment(self, start: int, restart: bool) -> None:
        """The learning-rate schedule counts from `start` (a stage extended with ``new_segment``); with `restart`
        the optimizer state's schedule count goes back to 0 (the first start; a resumed one has it saved)."""
        self._segment_start = start
        if restart:
            p, r, o, e = self.state
            self.state = (p, r, self._opt_leaves(restart_schedule(self._opt_tree(o))), e)
            self._place()

    # Checkpointing -----------------------------------------------------------------------------------------
    def state_tree(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: params, other variables (BatchNorm statistics), optimizer state, and the
        EMA with the `EMA` callback. The RNG streams are not saved: every step reseeds them from ``(seed, step)``."""
        params, rest, opt_leaves, ema = self.state
        tree = {"params": list(params), "rest": list(rest), "opt_state": self._opt_tree(opt_leaves)}
        if self.ema_config is not None:
            tree["ema"] = list(ema)
        return tree

    def load_state_tree(self, tree: Mapping[str, Any]) -> None:
        # The optimizer's numbers (`Hyperparams`) are this configuration's, not the checkpoint's (`--force-resume`).
        opt_state = refresh_hyperparams(tree["opt_state"], self.optimizer.init(list(tree["params"])))
        self._load(tree["params"], tree["rest"], opt_state, tree.get("ema"))

    def weights_tree(self) -> dict[str, Any]:
        """The model's variables: what a warm start (`init_from`) copies."""
        return {"params": list(self.state[0]), "rest": list(self.state[1])}

    def load_weights_tree(self, tree: Mapping[str, Any]) -> None:
        """Replace the weights only; the optimizer state stays, and the EMA restarts from the params."""
        self._load(tree["params"], tree["rest"])


# The stage ---------------------------------------------------------------------------------------------------
def _keys(seed: int) -> tuple[Any, Any]:
    init_key, step_key = jax.random.split(jax.random.key(seed))
    return init_key, step_key


def build(loop: Any) -> Any:
    """`loop.model_op` bound to a fresh `FlaxState`, from the first half of ``split(key(seed))``."""
    init_key, _ = _keys(loop.seed)
    return loop.model_op.bind(loop.model_op.build(init_key), check=False)


def transfer(spec: Any, previous: Any, fresh: Any) -> Any:
    """`fresh` with the sub-trees `spec` names copied from `previous` (both bound Flax models)."""
    return fresh.bind(apply_transfer(spec, previous.module, fresh.module), check=False)


def check(loop: Any, incoming: Any, stage: str) -> None:
    """Refuse what this backend cannot do, and data/model/loss mismatches, before anything is compiled."""
    if loop.task is not None:
        raise ConfigError(
            f"stage {stage!r}: backend 'flax' cannot honour TrainingLoop.task (tasks are Equinox-native); give a "
            "`loss` instead"
        )
    if not isinstance(loop.model_op, FlaxModel):
        raise ConfigError(f"stage {stage!r}: backend 'flax' trains FlaxModel operators, got {loop.model_op!r}")
    _optimizer(loop)  # refuses optimizer_config keys, before anything is built
    check_loss_fits(loop, check_input_and_target_keys(loop))


def start(loop: Any, model: Any, incoming: Any) -> FlaxBackend:
    """The stage's `FlaxBackend`, holding `model`'s state; the steps' key is the second half of
    ``split(key(seed))``."""
    _, step_key = _keys(loop.seed)
    return FlaxBackend(loop, model.module, step_key)


def info() -> dict[str, Any]:
    return {
        "backend": "flax",
        "flax": flax.__version__,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
    }
