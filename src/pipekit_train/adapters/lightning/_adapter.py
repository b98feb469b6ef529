"""The Lightning backend's contract functions (`check`, `build`, `transfer`, `start`, `info`), its
`StepBackend`, and `build_lightning_module`.

`start` takes over the torch module in a `TorchBackend`: the backend-neutral `Engine` decides when to log,
validate, checkpoint and stop, exactly as for Equinox. A step is plain torch (forward, the mapped loss,
``backward``, a ``torch.optim`` update) in torch's deterministic mode with a fixed number of threads, the dropout
generator seeded from ``(seed, step)``: a stopped run resumes bitwise.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from pipekit import ConfigError, ShapeError
from pipekit_train.backends import StepBackend
from pipekit_train.backends.kit import check_input_and_target_keys, check_loss_fits, ema_decay, fixed_value

from ._losses import split, to_torch_loss
from ._model import TorchModel
from ._optimizers import TorchOptimizer, check_torch_optimizer_config, schedule_table
from ._tree import apply_transfer, copy_module, to_numpy, to_tensor

__all__ = ["TorchBackend", "build", "build_lightning_module", "check", "info", "start", "threads", "transfer"]


def threads() -> int:
    """The intra-op thread count a stage runs with: ``PIPEKIT_TORCH_THREADS`` (default 1).

    Bitwise reproducibility holds for the same count: a resumed run must use the one the first run used.
    """
    raw = os.environ.get("PIPEKIT_TORCH_THREADS", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"PIPEKIT_TORCH_THREADS must be an int >= 1, got {raw!r}")
    return n


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms and a fixed thread count for the block; the global generator and the
    previous settings restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads())
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.set_num_threads(before[1])


def _step_seed(seed: int, step: int) -> int:
    """The torch seed of loop step `step`: a function of ``(seed, step)`` only, so chunking and resume agree."""
    return (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class TorchBackend(StepBackend):
    """The `StepBackend` of the Lightning adapter: a torch module trained in place by a `TorchOptimizer`."""

    def fuses_steps(self) -> bool:
        """Torch steps one at a time in Python: `steps_per_call: auto` means one step per call here."""
        return False

    def running(self) -> contextlib.AbstractContextManager[None]:
        """The engine trains inside torch's deterministic mode with the stage's thread count."""
        return deterministic()

    def optimizer_state(self) -> Any:
        """The optimizer's state arrays the stage ends with (`TrainerCarryState.opt_state`)."""
        return self.optimizer.state_arrays()

    def summary(self) -> dict[str, Any]:
        """What the artifact's ``backend_info`` records of this run."""
        return {"num_params": int(sum(p.numel() for p in self.params))}

    def __init__(self, loop: Any, module: nn.Module) -> None:

        self.loop = loop
        self.model_op = loop.model_op
        self.module = module
        module.train()
        self.tensors = list(module.state_dict().values())  # share storage with the parameters and buffers
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = TorchOptimizer(
            loop.optimizer_config,
            self.params,
            max_steps=loop.max_steps,
            grad_clip_norm=loop.grad_clip_norm,
            accum=loop.accum,
        )
        assert loop.loss is not None  # check refused a loop without one
        self.loss_fn = to_torch_loss(loop.loss)
        self.aux_prefix = getattr(loop.loss, "aux_prefix", "loss/")
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.ema_callback = loop.ema_settings
        self.ema = [p.detach().clone() for p in self.params] if self.ema_callback is not None else []

    # StepBackend -------------------------------------------------------------------------------------------
    def _forward(self, batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = to_tensor(batch[self.loop.input_key], self.dtype)
        y = to_tensor(batch[self.loop.target_key], self.dtype)
        total, aux = split(self.loss_fn(self.module(x), y))
        metrics = {"loss": total}
        for name, value in aux.items():
            metrics[f"{self.aux_prefix}{name}"] = value
        return total, metrics

    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> Any:
        records: list[dict[str, torch.Tensor]] = []
        for i, batch in enumerate(batches):
            s = step + i
            torch.manual_seed(_step_seed(self.loop.seed, s))
            total, metrics = self._forward(batch)
            total.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step(s)
            if self.ema:
                self._update_ema(s)
            records.append({k: v.detach() for k, v in metrics.items()})
        if len(records) == 1:
            return {k: v.numpy() for k, v in records[0].items()}
        return {k: torch.stack([r[k] for r in records]).numpy() for k in records[0]}

    def _update_ema(self, step: int) -> None:
        cb = self.ema_callback
        assert cb is not None
        decay = fixed_value(cb.decay, "EMA.decay")
        d = ema_decay(decay, cb.warmup, step)
        with torch.no_grad():
            for e, p in zip(self.ema, self.params):
                e.mul_(d).add_(p, alpha=1.0 - d)

    @contextlib.contextmanager
    def _with_ema(self, use: bool) -> Iterator[None]:
        if not (use and self.ema):
            yield
            return
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, e in zip(self.params, self.ema):
                p.copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    def evaluate(self, batch: dict[str, np.ndarray]) -> Any:
        use_ema = self.ema_callback is not None and self.ema_callback.evaluate_with_ema
        self.module.eval()
        try:
            with torch.no_grad(), self._with_ema(use_ema):
                _, metrics = self._forward(batch)
        finally:
            self.module.train()
        return {k: v.numpy() for k, v in metrics.items()}

    def bound_model(self) -> TorchModel:
        use_ema = self.ema_callback is not None and self.ema_callback.return_ema
        with self._with_ema(use_ema):
            module = copy_module(self.module)
        bound: TorchModel = self.model_op.bind(module.eval(), check=False)
        return bound

    def set_model(self, model_op: Any) -> None:
        module = getattr(model_op, "module", None)
        if not isinstance(module, nn.Module):
            raise ShapeError(f"set_model: expected a bound TorchModel, got {model_op!r}")
        self._load_weights([to_numpy(v) for v in module.state_dict().values()])

    def _load_weights(self, arrays: Any) -> None:
        arrays = list(arrays)
        if len(arrays) != len(self.tensors) or any(
            tuple(np.shape(a)) != tuple(t.shape) for a, t in zip(arrays, self.tensors)
        ):
            raise ShapeError("the new weights have other shapes than the ones being trained")
        with torch.no_grad():
            for t, a in zip(self.tensors, arrays):
                t.copy_(torch.from_numpy(np.array(a, copy=True)))
            for e, p in zip(self.ema, self.params):
                e.copy_(p)

    def get_lr_scale(self) -> float:
        return float(self.optimizer.scale)

    def set_lr_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"set_lr_scale: value must be a finite float >= 0, got {value!r}")
        self.optimizer.scale = float(np.float32(value))

    def learning_rate(self, step: int) -> float:
        return self.optimizer.lr_at(step) * self.get_lr_scale()

    def schedule_segment(self, start: int, restart: bool) -> None:
        """The learning-rate schedule counts from `start` (a stage extended with ``new_segment``). The rate is
        looked up by loop step, so there is no count in the optimizer's state to set back (`restart`)."""
        self.optimizer.segment_start = start

    # Checkpointing -----------------------------------------------------------------------------------------
    def state_tree(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: the ``state_dict``, the optimizer's state and scale, the EMA, and the
        gradient accumulated so far when ``accum > 1``."""
        tree: dict[str, Any] = {
            "weights": [to_numpy(t) for t in self.tensors],
            "optimizer": self.optimizer.state_arrays(),
        }
        if self.ema:
            tree["ema"] = [to_numpy(e) for e in self.ema]
        if self.optimizer.accum > 1:
            tree["grad_accum"] = self.optimizer.grads()
        return tree

    def load_state_tree(self, tree: Mapping[str, Any]) -> None:
        self._load_weights(tree["weights"])
        self.optimizer.load_state_arrays(tree["optimizer"])
        if self.ema and "ema" in tree:
            with torch.no_grad():
                for e, a in zip(self.ema, tree["ema"]):
                    e.copy_(torch.from_numpy(np.array(a, copy=True)))
        if "grad_accum" in tree:
            self.optimizer.load_grads(tree["grad_accum"])

    def weights_tree(self) -> dict[str, Any]:
        """The ``state_dict`` arrays: what a warm start (`init_from`) copies."""
        return {"weights": [to_numpy(t) for t in self.tensors]}

    def load_weights_tree(self, tree: Mapping[str, Any]) -> None:
        self._load_weights(tree["weights"])


# The stage ---------------------------------------------------------------------------------------------------
def build(loop: Any) -> Any:
    """`loop.model_op` bound to a fresh torch module (``build(seed)``, in deterministic mode)."""
    with deterministic():
        return loop.model_op.bind(loop.model_op.build(loop.seed), check=False)


def transfer(spec: Any, previous: Any, fresh: Any) -> Any:
    """`fresh` with the sub-modules `spec` names copied from `previous` (both bound torch models)."""
    with deterministic():
        return fresh.bind(apply_transfer(spec, previous.module, fresh.module), check=False)


def check(loop: Any, incoming: Any, stage: str) -> None:
    """Refuse what this backend cannot do, and data/model/loss mismatches, before anything trains."""
    if loop.task is not None:
        raise ConfigError(
            "backend 'lightning' cannot honour TrainingLoop.task (tasks are Equinox-native); give a `loss` instead"
        )
    if not isinstance(loop.model_op, TorchModel):
        raise ConfigError(f"backend 'lightning' trains TorchModel operators, got {loop.model_op!r}")
    if loop.loss is None:
        raise ConfigError("backend 'lightning' needs TrainingLoop.loss (a pipekit Loss with a torch mapping)")
    to_torch_loss(loop.loss)  # refuses a loss without a torch mapping
    if getattr(loop.loss, "reduction", None) == "none":
        raise ConfigError(f"backend 'lightning': loss {loop.loss!r} does not reduce to a scalar (reduction='none')")
    spec = check_input_and_target_keys(loop)
    check_torch_optimizer_config(loop.optimizer_config)

    check_loss_fits(loop, spec)


def start(loop: Any, model: Any, incoming: Any) -> TorchBackend:
    """The stage's `TorchBackend` over a copy of `model`'s module (the caller's module is never trained in place)."""
    with deterministic():
        return TorchBackend(loop, copy_module(model.module))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def info() -> dict[str, Any]:
    return {
        "backend": "lightning",
        "torch": torch.__version__,
        "lightning": _version("pytorch-lightning") or _version("lightning"),
        "threads": threads(),
        "deterministic": True,
        "devices": ["cpu"],
    }


# A LightningModule for Trainer.fit -----------------------------------------------------------------------------
def build_lightning_module(
    loss: Any,
    model_op: TorchModel,
    optimizer_config: Mapping[str, Any] | None = None,
    *,
    max_steps: int = 1000,
    input_key: str = "x",
    target_key: str = "y",
    seed: int = 0,
) -> Any:
    """A ``pytorch_lightning.LightningModule`` training `model_op` with the pipekit `loss`, for ``Trainer.fit``.

    The module is `model_op`'s bound module (copied) or, unbound, a fresh one built from `seed`. Batches are
    dicts with `input_key` and `target_key` (a Grain `TrainingDataset`'s) or ``(x, y)`` pairs (a torch
    ``DataLoader``'s). ``configure_optimizers`` builds the plain ``torch.optim`` optimizer of `optimizer_config`
    (AdamW/Adam/SGD/RMSprop with the biases in a group without weight decay) and a per-step ``LambdaLR`` with
    the pipekit schedule; clipping and accumulation are the ``Trainer``'s (``gradient_clip_val``,
    ``accumulate_grad_batches``). The ``lightning`` backend itself does not use it: it runs its own step.
    """
    import pytorch_lightning as pl

    module = copy_module(model_op.module) if model_op.module is not None else model_op.build(seed)
    torch_loss = to_torch_loss(loss)
    aux_prefix = getattr(loss, "aux_prefix", "loss/")
    config = dict(optimizer_config or {})

    class PipekitLightningModule(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(self, x: torch.Tensor) -> Any:
            return self.model(x)

        def _batch(self, batch: Any) -> tuple[Any, Any]:
            if isinstance(batch, Mapping):
                return batch[input_key], batch[target_key]
            return batch[0], batch[1]

        def _step(self, batch: Any, prefix: str) -> torch.Tensor:
            x, y = self._batch(batch)
            total, aux = split(torch_loss(self.model(x), y))
            self.log(f"{prefix}loss", total, prog_bar=False)
            for name, value in aux.items():
                self.log(f"{prefix}{aux_prefix}{name}", value)
            return total  # type: ignore[no-any-return]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._step(batch, "train/")

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._step(batch, "validate/")

        def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._step(batch, "test/")

        def configure_optimizers(self) -> Any:
            return _plain_torch_optimizer(config, self.model, max_steps)

    return PipekitLightningModule()


#: The name the issue's seed gives it.
_build_lightning_module = build_lightning_module


def _plain_torch_optimizer(config: Mapping[str, Any], model: nn.Module, max_steps: int) -> Any:
    cfg = check_torch_optimizer_config(config)
    decay = float(cfg.get("weight_decay") or 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in params if cfg.get("decay_biases") or p.ndim > 1]
    kept = [p for p in params if p.ndim <= 1 and not cfg.get("decay_biases")]
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decayed, decay), (kept, 0.0)) if ps]
    lr = float(cfg["lr"])
    name = cfg["name"]
    opt: torch.optim.Optimizer
    if name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(cfg["b1"], cfg["b2"]), eps=cfg["eps"])
    elif name == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=(cfg["b1"], cfg["b2"]), eps=cfg["eps"])
    elif name == "sgd":
        m = float(cfg["momentum"])
        opt = torch.optim.SGD(groups, lr=lr, momentum=m, nesterov=bool(cfg["nesterov"]) and m > 0)
    else:
        opt = torch.optim.RMSprop(groups, lr=lr, alpha=cfg["b2"], eps=cfg["eps"], momentum=float(cfg["momentum"]))
    table = schedule_table(config, max_steps) / lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(table[min(s, len(table) - 1)]))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
