"""The Equinox backend's contract methods (`check`, `build`, `transfer`, `start`, `info`) and its `StepBackend`.

`start` hands the engine the production path: the model is partitioned once, steps go through the cached, donating
`jax.jit` step of `_steps`, and the backend-neutral `Engine` decides when to log, validate, checkpoint and stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import equinox as eqx
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
    reset_anchor,
    restart_schedule,
    set_lr_scale,
    stage_name,
)
from pipekit_train.scale import compute_dtype, mesh_plan

from ._carry import carry_in, continue_optimizer_state
from ._lora import StageAdapters, check_lora, merge, start_adapters
from ._recipe_step import StepRecipe, frozen_count
from ._steps import (
    Layout,
    LossSpec,
    bound_train_chunk,
    combine,
    eval_batch,
    host_copy,
    partition,
    sharded_train_chunk,
    static_arg,
)
from ._tree import apply_transfer

_OPTIMIZERS: dict[Any, Any] = {}


def _optimizer(loop: Any) -> Any:
    """One optax object per distinct configuration. It compares equal to any other of the same structure (its
    numbers live in the optimizer state), so the compiled step is reused across stages, runs and sweeps."""
    from pipekit import canonical

    key = (canonical(loop.optimizer_config), loop.max_steps, loop.grad_clip_norm, loop.accum, loop.param_groups)
    opt = _OPTIMIZERS.get(key)
    if opt is None:
        opt = build_optimizer(
            loop.optimizer_config,
            max_steps=loop.max_steps,
            grad_clip_norm=loop.grad_clip_norm,
            accum=loop.accum,
            groups=loop.param_groups,
        )
        _OPTIMIZERS[key] = opt
    return opt


class EquinoxBackend(StepBackend):
    """The `StepBackend` of the Equinox adapter: holds the train state on the device between steps.

    The state is kept as flat leaf lists (see `Layout`); `params`, `opt_state`, `ema` and `consts` are views that
    rebuild the trees when something outside the step needs them (evaluation, checkpoints, callbacks).
    """

    _segment_start = 0  # the step a new schedule segment began at (`schedule_segment`)

    def __init__(
        self, loop: Any, model_op: Any, module: Any, base_key: jax.Array, init_key: jax.Array | None = None
    ) -> None:
        from pipekit_train.optim import lora_settings

        self.loop = loop
        # Data parallel (`_mesh`): None trains unsharded on the default device.
        self.plan = mesh_plan(loop)
        self.compute = compute_dtype(loop.precision)
        self._sharded: dict[int, Any] = {}
        self._bound: dict[int, Any] = {}  # (the unsharded chunk, the task's arrays) by length (`bound_train_chunk`)
        self.model_op = model_op
        self.optimizer = _optimizer(loop)
        self._lr_log = LearningRateLog()  # what `learning_rate` logs, read from the state's leaves
        # LoRA (`_lora`): the adapters are the trained params; the model they adapt is frozen in the consts.
        self.lora: StageAdapters | None = None
        trainable = None
        if loop.optimizer_config.get("lora") is not None:
            settings = lora_settings(loop.optimizer_config)
            assert settings is not None and init_key is not None
            module, trainable, self.lora = start_adapters(model_op, module, settings, init_key)
        params, consts, static = partition(module, trainable)
        # Donation deletes the arrays passed in: never hand the caller's own arrays to the step.
        params = host_copy(params)
        # Eagerly: each zeros leaf compiles once per shape for the process, so a second stage, a resumed run or a
        # sweep's next trial (another learning rate, which `inject_hyperparams` holds in the state) compiles
        # nothing; a jitted `init` would close over the new optimizer and compile again for every one.
        opt_state = self.optimizer.init(params)
        ema = loop.ema_settings
        self.ema_callback = ema
        self.ema_config = (ema.decay, ema.warmup) if ema is not None else None
        p_leaves, p_def = jax.tree.flatten(params)
        o_leaves, o_def = jax.tree.flatten(opt_state)
        c_leaves, c_def = jax.tree.flatten(consts)
        self._state = (p_leaves, o_leaves, host_copy(p_leaves) if ema is not None else [])
        self._consts = c_leaves
        if self.plan is not None:
            self._state = (self._place(p_leaves), self._place(o_leaves), self._place(self._state[2]))
            self._consts = self._place(c_leaves, replicate=True)
            p_sh, o_sh, e_sh = (tuple(x.sharding for x in leaves) for leaves in self._state)
            self._state_shardings = (p_sh, o_sh, e_sh)
        self.layout = static_arg(Layout(static=static, params=p_def, opt_state=o_def, ema=p_def, consts=c_def))
        self.base_key = base_key
        self.spec = static_arg(
            LossSpec(
                loss=loop.loss,
                task=loop.task,
                input_key=loop.input_key,
                target_key=loop.target_key,
                aux_prefix=getattr(loop.loss, "aux_prefix", "loss/"),
                recipe=step_recipe(loop, params),
            )
        )
        self.static_arg = static_arg(static)

    # Views of the flat state -------------------------------------------------------------------------------
    @property
    def params(self) -> Any:
        return jax.tree.unflatten(self.layout.value.params, self._state[0])

    @property
    def opt_state(self) -> Any:
        return jax.tree.unflatten(self.layout.value.opt_state, self._state[1])

    @property
    def ema(self) -> Any:
        return jax.tree.unflatten(self.layout.value.ema, self._state[2]) if self.ema_config is not None else None

    @property
    def consts(self) -> Any:
        return jax.tree.unflatten(self.layout.value.consts, self._consts)

    def _set(self, params: Any = None, opt_state: Any = None, ema: Any = None) -> None:
        p, o, e = self._state
        if params is not None:
            p = self._leaves_like(params, self.layout.value.params, "params")
        if opt_state is not None:
            o = self._leaves_like(opt_state, self.layout.value.opt_state, "opt_state")
        if ema is not None and self.ema_config is not None:
            e = self._leaves_like(ema, self.layout.value.params, "ema")
        self._state = (self._place(p), self._place(o), self._place(e))

    def _place(self, leaves: list[Any], replicate: bool = False) -> list[Any]:
        """`leaves` on the stage's mesh (replicated, or split for ``shard_params``); as they are without one."""
        if self.plan is None:
            return leaves
        if replicate:
            return [jax.device_put(x, self.plan.replicated) for x in leaves]
        return self.plan.put(leaves)

    @staticmethod
    def _leaves_like(tree: Any, treedef: Any, what: str) -> list[Any]:
        leaves, got = jax.tree.flatten(tree)
        if got != treedef:
            raise ShapeError(f"the new {what} tree has another structure than the one being trained")
        return leaves

    # StepBackend -------------------------------------------------------------------------------------------
    def optimizer_state(self) -> Any:
        """The optimizer state the stage ends with (`TrainerCarryState.opt_state`)."""
        return self.opt_state

    def trainable_params(self) -> int | None:
        """With LoRA, the adapters' parameter count; with frozen groups, the count of the others; else ``None``."""
        trained = int(sum(x.size for x in jax.tree.leaves(self.params)))
        if self.lora is not None:
            return trained
        frozen = frozen_count(self.loop, self.params)
        return trained - frozen if frozen else None

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this run: the model's parameter count, how many of them
        the optimizer trains (`trainable_params`: with LoRA, the adapters'; else all but frozen groups'), the
        precision, and the LoRA settings, targeted layers and the frozen base's weights digest."""
        total = int(sum(x.size for x in jax.tree.leaves(self.params)))
        info: dict[str, Any] = {}
        if self.lora is not None:  # the params are the adapters; the model they adapt is in the consts
            total = int(sum(x.size for x in jax.tree.leaves(eqx.filter(self.consts, eqx.is_inexact_array))))
            info["lora"] = self.lora.info
        trainable = self.trainable_params()
        return {
            "num_params": total,
            "trainable_params": total if trainable is None else trainable,
            "precision": self.compute or "float32",
            **info,
        }

    def resident_data(self) -> bool:
        """Whether `train_window` can take device-resident data: on one device (no mesh), yes."""
        return self.plan is None

    def train_window(self, window: Any, n: int, step: int) -> dict[str, Any]:
        """`train` for device-resident data: `window` (a `DeviceWindow`) is sliced inside the compiled chunk."""
        return self._chunk(window, step, n)

    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> dict[str, Any]:
        n = len(batches)
        # NumPy arrays go straight into the compiled call: its C++ dispatch path transfers them far faster than
        # a separate `jax.device_put` (measured: ~300 µs vs a few µs per small batch on CPU).
        batch = batches[0] if n == 1 else {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        if self.plan is not None:
            return self._train_sharded(batch, step, n)
        return self._chunk(batch, step, n)

    def _chunk(self, batch: Any, step: int, n: int) -> dict[str, Any]:
        """`n` steps through the unsharded compiled chunk; `batch` is stacked batches or a `DeviceWindow`.

        The chunk's static configuration is bound once per length (`bound_train_chunk`): a call passes arrays only.
        The jitted chunk takes NumPy arrays (the step, host batches) as they are."""
        bound = self._bound.get(n)
        if bound is None:
            loss_spec: LossSpec = self.spec.value
            fn = bound_train_chunk(
                layout=self.layout,
                spec=loss_spec.step_loss,
                optimizer=self.optimizer,
                n=n,
                ema_config=self.ema_config,
                compute=self.compute,
            )
            bound = self._bound[n] = (fn, loss_spec.task_arrays.leaves)
        fn, task_leaves = bound
        before = self._state[1]
        self._state, metrics = fn(self._state, self._consts, task_leaves, batch, np.int32(step), self.base_key)
        self._lr_log.stepped(before, self._state[1])
        return cast("dict[str, Any]", metrics)

    def _train_sharded(self, batch: dict[str, np.ndarray], step: int, n: int) -> dict[str, Any]:
        """`train` on the mesh: the global batch goes in as NumPy and the compiled call splits it over ``data``."""
        fn = self._sharded.get(n)
        if fn is None:
            fn = self._sharded[n] = sharded_train_chunk(
                self.plan,
                self._state_shardings,
                layout=self.layout,
                spec=self.spec,
                optimizer=self.optimizer,
                n=n,
                ema_config=self.ema_config,
                compute=self.compute,
            )
        loss_spec: LossSpec = self.spec.value
        assert self.plan is not None
        batch = self.plan.assemble(batch, stacked=n > 1)  # several processes: this process's rows → one global array
        before = self._state[1]
        self._state, metrics = fn(
            self._state, self._consts, loss_spec.task_arrays.leaves, batch, np.int32(step), self.base_key
        )
        self._lr_log.stepped(before, self._state[1])
        return cast("dict[str, Any]", metrics)

    def _weights(self, use_ema: bool) -> Any:
        return self.ema if (use_ema and self.ema_config is not None) else self.params

    def evaluate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        use_ema = self.ema_callback is not None and self.ema_callback.evaluate_with_ema
        return eval_batch(
            self._weights(use_ema),
            self.consts,
            cast("dict[str, jax.Array]", batch),  # jitted: NumPy arrays go in as they are
            self.base_key,
            static=self.static_arg,
            spec=self.spec,
        )

    def module(self, use_ema: bool | None = None) -> Any:
        """The model being trained (with LoRA: adapters attached, not merged)."""
        if use_ema is None:
            use_ema = self.ema_callback is not None and self.ema_callback.return_ema
        return combine(self._weights(use_ema), self.consts, self.layout.value.static)

    def bound_model(self) -> Any:
        """The stage's model; with LoRA, the adapters merged into the weights (a model of the stage's
        architecture: what the registry stores, `export` writes and the next stage starts from)."""
        if self.lora is not None:
            return self.model_op.bind(host_copy(merge(self.module())))
        return self.model_op.bind(host_copy(self.module()))

    def set_model(self, model_op: Any) -> None:
        if self.lora is not None:
            raise ConfigError(
                "a LoRA stage (optimizer_config.lora) trains adapters on a frozen model: its weights cannot be "
                "replaced by a whole model (a callback's ctx.set_model); train without lora to do that"
            )
        params, consts, _ = partition(model_op.module)
        params = host_copy(params)
        self._set(params=params, ema=host_copy(params))
        self._consts = self._place(self._leaves_like(consts, self.layout.value.consts, "consts"), replicate=True)

    def get_lr_scale(self) -> float:
        return self._lr_log.scale(self._state[1], self.layout.value.opt_state)

    def set_lr_scale(self, value: float) -> None:
        self._set(opt_state=set_lr_scale(self.opt_state, value))

    def learning_rate(self, step: int) -> float:
        step -= self._segment_start  # a new schedule segment (an extension) counts from its start
        loop = self.loop
        leaves, treedef = self._state[1], self.layout.value.opt_state
        return self._lr_log.rate(loop.optimizer_config, loop.max_steps, step, leaves, treedef)

    def schedule_segment(self, start: int, restart: bool) -> None:
        """The learning-rate schedule counts from `start` (a stage extended with ``new_segment``); with `restart`
        the optimizer state's schedule count goes back to 0 (the first start; a resumed one has it saved)."""
        self._segment_start = start
        if restart:
            self._set(opt_state=restart_schedule(self.opt_state))

    # Checkpointing -----------------------------------------------------------------------------------------
    def state_tree(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: parameters, non-trained arrays, optimizer state.

        With LoRA the parameters are the adapters, and the frozen model is not saved: ``base`` holds the sha256
        of its weights (the bytes of `ModelOp.weights_hash`), which a resume checks against the model it starts
        from (the same route rebuilds it bit for bit).
        """
        tree = {"params": self.params, "opt_state": self.opt_state}
        if self.lora is not None:
            tree["base"] = self.lora.digest
        else:
            tree["consts"] = self.consts
        if self.ema_config is not None:
            tree["ema"] = self.ema
        return tree

    def load_state_tree(self, tree: Mapping[str, Any]) -> None:
        if self.lora is not None:
            self.lora.check_base(tree["base"])
        # The optimizer's numbers (`Hyperparams`) are this configuration's, not the checkpoint's (`--force-resume`).
        opt_state = refresh_hyperparams(tree["opt_state"], self.optimizer.init(tree["params"]))
        self._set(params=tree["params"], opt_state=opt_state, ema=tree.get("ema"))
        if self.lora is None:
            self._consts = self._place(self._leaves_like(tree["consts"], self.layout.value.consts, "consts"), True)

    def weights_tree(self) -> dict[str, Any]:
        """The model's weights, what a warm start (`init_from`) copies: parameters and non-trained arrays (with
        LoRA, the adapters alone)."""
        if self.lora is not None:
            return {"params": self.params}
        return {"params": self.params, "consts": self.consts}

    def load_weights_tree(self, tree: Mapping[str, Any]) -> None:
        """Replace the weights only; the optimizer state stays, and EMA weights restart from the parameters.

        L2-SP anchors (`ParamGroup.l2sp`) move to the new weights: the stage starts from them.
        """
        params = host_copy(tree["params"])
        # Separate copies: the step donates every buffer of its state, and one buffer cannot be donated twice.
        self._set(params=params, ema=host_copy(params))
        if any(g.l2sp for g in self.loop.param_groups):
            self._set(opt_state=reset_anchor(self.opt_state, self.optimizer.init(host_copy(params))))
        if "consts" in tree:  # not with LoRA: the frozen model is the stage's own
            self._consts = self._place(self._leaves_like(tree["consts"], self.layout.value.consts, "consts"), True)


def step_recipe(loop: Any, params: Any) -> StepRecipe | None:
    """The static recipe part of the step (`SAM`, diagnostics per group), or ``None`` when the loop uses none."""
    from pipekit_train.backends.kit import group_labels, param_path
    from pipekit_train.optim import SAM

    if loop.gradient is None and not loop.diagnostics:
        return None
    sam = None
    if isinstance(loop.gradient, SAM):
        sam = (float(loop.gradient.rho), bool(loop.gradient.adaptive), float(loop.gradient.eps))
    elif loop.gradient is not None:
        raise ConfigError(f"backend 'equinox' has no step for TrainingLoop.gradient {loop.gradient!r}; it knows SAM")
    groups: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())
    if loop.diagnostics and loop.param_groups:
        paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        groups = (tuple(g.label for g in loop.param_groups), tuple(group_labels(paths, loop.param_groups)))
    return StepRecipe(sam=sam, diagnostics=loop.diagnostics, groups=groups)


def check_param_groups(loop: Any, module: Any) -> None:
    """Refuse a group pattern that matches no trained parameter (naming the model's parameter paths)."""
    from pipekit_train.backends.kit import group_labels, param_path

    if not loop.param_groups:
        return
    # The abstract module (`jax.ShapeDtypeStruct` leaves) works too: what counts is the dtype.
    params = eqx.filter(module, lambda x: hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    group_labels(paths, loop.param_groups)


def check_size(loop: Any, stage: str) -> None:
    """The weights' size from the architecture's abstract shapes (nothing allocated) against the memory there is."""
    from pipekit_train.backends.kit import check_model_size

    from ._tree import abstract

    leaves = [x for x in jax.tree_util.tree_leaves(abstract(loop.model_op)) if hasattr(x, "shape")]
    n_params = sum(int(np.prod(x.shape, dtype=object)) for x in leaves)
    n_bytes = sum(int(np.prod(x.shape, dtype=object)) * np.dtype(x.dtype).itemsize for x in leaves)
    stats = jax.local_devices()[0].memory_stats() or {}
    check_model_size(n_params, n_bytes, stage, loop.model_op, device_bytes=stats.get("bytes_limit"))


def check(loop: Any, incoming: Any, stage: str) -> None:
    """Refuse data/model/loss mismatches with named shapes before anything is compiled or built.

    Works on the architecture alone (`jax.eval_shape` of the model's `build`), so it runs before any weights
    exist; a `transfer` cannot change shapes (it refuses mismatched sub-trees itself).
    """
    if loop.model_op.module is None:
        check_size(loop, stage)
    if loop.optimizer_config.get("lora") is not None:
        check_lora(loop, stage)
    if loop.param_groups:
        from ._tree import abstract

        check_param_groups(loop, loop.model_op.module if loop.model_op.module is not None else abstract(loop.model_op))
    if loop.task is None:
        check_loss_fits(loop, check_input_and_target_keys(loop))
        return
    from ._primitives import check_task
    from ._tree import abstract

    model = loop.model_op.module if loop.model_op.module is not None else abstract(loop.model_op)
    abstract_batch = {
        k: jax.ShapeDtypeStruct((loop.batch_size, *s), d)  # type: ignore[no-untyped-call]
        for k, (s, d) in loop.dataset.element_spec().items()
    }
    check_task(loop.task, model, abstract_batch)


def _split_seed(seed: Any) -> tuple[Any, Any]:
    init_key, step_key = jax.random.split(jax.random.key(seed))
    return init_key, step_key


_split_seed_jit = jax.jit(_split_seed)


def stage_keys(seed: int) -> tuple[Any, Any]:
    """``split(key(seed))`` unpacked: (the model's init key, the steps' key), as one small compiled program
    (eagerly, the seeding, the split and the unpacking compile three; this compiles once per process). A seed
    outside int32 takes the eager path, where `jax.random.key` folds its 64 bits (same keys either way)."""
    return _split_seed_jit(seed) if -(2**31) <= seed < 2**31 else _split_seed(seed)


def build(loop: Any) -> Any:
    """`loop.model_op` bound to fresh weights: ``build`` with the first half of ``split(key(seed))`` (the second
    half is the steps' key), exactly as a hand-written Equinox loop does."""
    init_key, _ = stage_keys(loop.seed)
    return loop.model_op.bind(loop.model_op.build(init_key))


def transfer(spec: Any, previous: Any, fresh: Any) -> Any:
    """`fresh` with the sub-trees `spec` names copied from `previous` (both bound Equinox models)."""
    return fresh.bind(apply_transfer(spec, previous.module, fresh.module))


def start(loop: Any, model: Any, incoming: Any) -> EquinoxBackend:
    """The stage's `EquinoxBackend` holding `model`'s weights; `TrainingLoop.carry` applied from `incoming`."""
    init_key, step_key = stage_keys(loop.seed)
    stage = stage_name(loop, incoming)
    module, carried_opt_state = carry_in(loop, incoming, model.module, stage)  # `TrainingLoop.carry`
    backend = EquinoxBackend(loop, loop.model_op, module, step_key, init_key)
    if carried_opt_state is not None:
        continue_optimizer_state(backend, carried_opt_state, stage)
    return backend


def info() -> dict[str, Any]:
    return {
        "backend": "equinox",
        "equinox": eqx.__version__,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
    }
