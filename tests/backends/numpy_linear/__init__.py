"""``numpy-linear``: a complete pipekit-train backend in plain NumPy, the example to copy.

A linear regression model ``y = x @ w + b`` trained by SGD with momentum on the MSE loss. It implements exactly the
contract in ``adapters/README.md``: the model operator `NumpyLinear`, a `StepBackend` the engine drives (which
brings logging, validation, callbacks, checkpoints, exact resume and graceful stops), and the backend object
`backend` (`name`, `requires`, `extra`, `capabilities`, `check`, `build`, `start`, `info`, and `example_model` for the
conformance kit). Importing it registers the backend in this process, so

    PYTHONPATH=tests/backends pipekit-train run pipeline.yaml --import numpy_linear

trains any pipeline whose stages say ``backend: numpy-linear``. The module imports no JAX (the core it plugs into
still uses JAX for its own work: checkpoints, metric transfers). A packaged backend declares the entry point instead
(``[project.entry-points."pipekit_train.backends"] numpy-linear = "numpy_linear:backend"``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

import pipekit_train
from pipekit import ConfigError, ShapeError
from pipekit_train.backends import Backend, ModelOp, StepBackend

NAME = "numpy-linear"


class NumpyLinear(ModelOp):
    """``y = x @ w + b`` for inputs of ``in_size`` features; the weights are ``{"w": (in, out), "b": (out,)}``."""

    backend: ClassVar[str] = NAME
    in_size: int
    out_size: int = 1

    def validate(self) -> None:
        if self.in_size < 1 or self.out_size < 1:
            raise ConfigError(f"NumpyLinear: in_size and out_size must be > 0, got {self.in_size}, {self.out_size}")

    @classmethod
    def example(cls) -> NumpyLinear:  # what pipekit's registry-wide YAML tests build
        return cls(in_size=4)

    def build(self, key: Any) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(key)  # an int seed
        w = rng.normal(scale=self.in_size**-0.5, size=(self.in_size, self.out_size)).astype(np.float32)
        return {"w": w, "b": np.zeros(self.out_size, np.float32)}

    def check_bind(self, module: Any) -> None:
        shapes = {k: np.shape(v) for k, v in module.items()} if isinstance(module, dict) else None
        if shapes != {"w": (self.in_size, self.out_size), "b": (self.out_size,)}:
            raise ShapeError(
                f"{self!r} needs weights w: ({self.in_size}, {self.out_size}), b: ({self.out_size},); got {shapes}"
            )

    def weights(self) -> dict[str, np.ndarray]:
        module = self.require_module("weights")
        return {"w": np.asarray(module["w"]), "b": np.asarray(module["b"])}

    def with_weights(self, arrays: Any) -> NumpyLinear:
        return self.bind({k: np.array(arrays[k], np.float32) for k in ("w", "b")})

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> tuple[int, ...]:
        if tuple(shape) != (self.in_size,):
            raise ShapeError(f"{self!r} takes examples of shape ({self.in_size},), got {tuple(shape)}")
        return (self.out_size,)

    def __call__(self, x: Any) -> np.ndarray:
        module = self.require_module("__call__")
        return np.asarray(x, np.float32) @ module["w"] + module["b"]


class NumpyLinearBackend(StepBackend):
    """The `StepBackend`: the weights and the momentum buffers live here, as NumPy arrays, between steps."""

    def __init__(self, loop: Any, model: NumpyLinear, optimizer: dict[str, Any]) -> None:
        """`model` is the bound model the core chose for the stage (fresh, or the previous stage's weights)."""
        self.loop, self.model_op = loop, model
        self.momentum = optimizer["momentum"]
        self.optimizer, self.max_steps = optimizer, loop.max_steps
        self.params = {k: v.copy() for k, v in model.weights().items()}  # our own copies, never the caller's arrays
        self.velocity = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.lr_scale = 1.0
        # No per-step randomness here. A backend with dropout draws it from np.random.default_rng([seed, step]),
        # never from a generator that lives outside state_tree(), so a resumed run draws the same numbers.

    def _loss_and_grads(self, batch: dict[str, np.ndarray]) -> tuple[np.float32, dict[str, np.ndarray]]:
        x, y = (np.asarray(batch[k], np.float32) for k in (self.loop.input_key, self.loop.target_key))
        err = x @ self.params["w"] + self.params["b"] - y
        scale = np.float32(2.0 / err.size)
        return np.mean(np.square(err)), {"w": scale * (x.T @ err), "b": scale * err.sum(axis=0)}

    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> dict[str, Any]:
        losses = []
        for i, batch in enumerate(batches):
            loss, grads = self._loss_and_grads(batch)
            rate = np.float32(self.learning_rate(step + i))  # a function of the step: exact on resume
            for k, g in grads.items():  # heavy-ball momentum, as optax.sgd: v = m * v + g; p -= lr * v
                self.velocity[k] = self.momentum * self.velocity[k] + g
                self.params[k] = self.params[k] - rate * self.velocity[k]
            losses.append(loss)
        return {"loss": np.asarray(losses) if len(losses) > 1 else losses[0]}

    def evaluate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return {"loss": self._loss_and_grads(batch)[0]}

    def bound_model(self) -> NumpyLinear:
        return self.model_op.with_weights(self.params)  # with_weights copies

    def set_model(self, model_op: Any) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in model_op.weights().items()}

    def get_lr_scale(self) -> float:
        return self.lr_scale

    def set_lr_scale(self, value: float) -> None:
        self.lr_scale = float(value)

    def learning_rate(self, step: int) -> float:
        # The scheduled rate (`optimizer_config.schedule`, any kind) at `step`, times the run-time multiplier.
        from pipekit_train.backends.kit import learning_rate_at  # imports JAX: not at this module's import

        return learning_rate_at(self.optimizer, step, self.max_steps) * self.lr_scale

    def optimizer_state(self) -> dict[str, Any]:
        """Optional: what the next stage's user code sees as `TrainerCarryState.opt_state`."""
        return {"velocity": self.velocity}

    def state_tree(self) -> dict[str, Any]:
        return {"params": self.params, "velocity": self.velocity, "lr_scale": np.asarray(self.lr_scale)}

    def load_state_tree(self, tree: Any) -> None:  # the arrays may come back as another library's arrays
        self.load_weights_tree(tree)
        self.velocity = {k: np.array(v, np.float32) for k, v in tree["velocity"].items()}
        self.lr_scale = float(np.asarray(tree["lr_scale"]))

    def weights_tree(self) -> dict[str, Any]:
        return {"params": self.params}

    def load_weights_tree(self, tree: Any) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in tree["params"].items()}


def _optimizer(loop: Any) -> dict[str, Any]:
    """The optimizer settings this backend can honour; anything else is refused by name."""
    from pipekit_train.callbacks import EMA
    from pipekit_train.losses import MSE
    from pipekit_train.optim import resolve_optimizer_config

    if loop.task is not None or not isinstance(loop.loss, MSE) or loop.loss.reduction != "mean":
        raise ConfigError(f"backend {NAME!r} trains with loss MSE() only, got loss={loop.loss!r}, task={loop.task!r}")
    config = resolve_optimizer_config(loop.optimizer_config)
    unsupported = {
        "optimizer_config.name": config["name"] != "sgd",
        "optimizer_config.nesterov": config.get("nesterov", False),
        "optimizer_config.weight_decay": config.get("weight_decay", 0) != 0,
        "accum": loop.accum != 1,
        "grad_clip_norm": loop.grad_clip_norm is not None,
        "EMA": any(isinstance(cb, EMA) for cb in loop.callbacks),
    }
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(
            f"backend {NAME!r} supports plain SGD with momentum only; it cannot honour "
            f"{', '.join(bad)} (optimizer_config={loop.optimizer_config!r})"
        )
    return config


class NumpyLinearBackendSpec(Backend):
    """The backend object: what the training core calls (``adapters/README.md``), and nothing else."""

    name = NAME
    requires = ("numpy",)
    extra = None
    #: Models carry over whole to a next stage of this backend and warm-start from a checkpoint; no transfer by
    #: paths, recipes or scale settings.
    capabilities = frozenset({"weights", "init_from"})

    def check(self, loop: Any, incoming: Any, stage: str) -> None:
        """Pre-flight: the loss, the optimizer and the data's shapes against the model (nothing is built)."""
        _optimizer(loop)
        spec = loop.dataset.element_spec()
        model: NumpyLinear = loop.model_op
        roles = (("input", loop.input_key, (model.in_size,)), ("target", loop.target_key, (model.out_size,)))
        for role, key, want in roles:
            if key not in spec:
                raise ConfigError(f"stage {stage!r}: the {role} key {key!r} is not in the batches' keys {sorted(spec)}")
            if tuple(spec[key][0]) != want:
                raise ShapeError(
                    f"stage {stage!r} (backend {NAME!r}): {model!r} needs {role} {key!r} of shape {want} "
                    f"per example, the data has {tuple(spec[key][0])}"
                )

    def build(self, loop: Any) -> NumpyLinear:
        """Fresh weights from the seed."""
        model: NumpyLinear = loop.model_op
        return model.bind(model.build(loop.seed))

    def start(self, loop: Any, model: NumpyLinear, incoming: Any) -> NumpyLinearBackend:
        """The step backend over `model`'s weights (whether fresh or carried over, the core decided)."""
        return NumpyLinearBackend(loop, model, _optimizer(loop))

    def info(self) -> dict[str, Any]:
        return {"backend": NAME, "numpy": np.__version__}

    def example_model(self, in_size: int, out_size: int) -> NumpyLinear:
        """The conformance kit's model."""
        return NumpyLinear(in_size=in_size, out_size=out_size)


backend = NumpyLinearBackendSpec()
pipekit_train.register_backend(NAME, backend)
