"""Template for a backend adapter: copy it into your package, rename, and replace each TODO with your framework.

As it stands it is a working backend (``my-backend``: a linear model trained by SGD in NumPy, the same as
``tests/backends/numpy_linear``), so you can run the conformance kit first and keep it passing while you swap in
your framework one method at a time::

    PYTHONPATH=adapters python -m pipekit_train.adapters.conformance my-backend --import template

The contract is in ``adapters/README.md``. Keep this module cheap to import: import your framework inside the
functions and methods that use it (it is imported whenever a pipeline file is read), and list it in `REQUIRES`.
Register the backend with an entry point in your ``pyproject.toml``::

    [project.entry-points."pipekit_train.backends"]
    my-backend = "my_package.adapter"
    [project.entry-points."pipekit.operators"]
    my_package = "my_package.adapter"

or, for code that is not packaged, with the `register_backend` call at the end of this file (then run pipelines
with ``pipekit-train run pipeline.yaml --import my_package.adapter``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

import pipekit_train
from pipekit import ConfigError, ShapeError
from pipekit_train import ModelOp

NAME = "my-backend"  # TODO: your backend's name (what `TrainingLoop.backend` says)
REQUIRES = ("numpy",)  # TODO: the packages your framework needs, e.g. ("torch",); EXTRA = "..." if you have one


class MyModel(ModelOp):
    """The architecture as operator fields; the weights are bound separately (``op.bind(module)``)."""

    backend: ClassVar[str] = NAME
    in_size: int  # TODO: your architecture's fields (they are what YAML shows and what `==` compares)
    out_size: int = 1

    @classmethod
    def example(cls) -> MyModel:  # what pipekit's registry-wide YAML tests build
        return cls(in_size=4)

    def build(self, key: Any) -> Any:
        """A freshly initialised framework model; `key` is an int seed (`TrainingLoop.seed`)."""
        rng = np.random.default_rng(key)  # TODO: your framework's model, seeded from `key`
        w = rng.normal(scale=self.in_size**-0.5, size=(self.in_size, self.out_size)).astype(np.float32)
        return {"w": w, "b": np.zeros(self.out_size, np.float32)}

    def check_bind(self, module: Any) -> None:
        """Refuse a framework model that does not fit this architecture (optional)."""
        shapes = {k: np.shape(v) for k, v in module.items()} if isinstance(module, dict) else None
        if shapes != {"w": (self.in_size, self.out_size), "b": (self.out_size,)}:
            raise ShapeError(f"{self!r} cannot hold weights of shapes {shapes}")

    def weights(self) -> dict[str, np.ndarray]:
        """The bound weights as host NumPy arrays by name, in a fixed order (the registry stores and hashes them)."""
        module = self._bound("weights")
        return {"w": np.asarray(module["w"]), "b": np.asarray(module["b"])}  # TODO: e.g. the state_dict as numpy

    def with_weights(self, arrays: Any) -> MyModel:
        """A copy bound to `arrays` (as `weights` returns them): how the model registry loads a model."""
        return self.bind({k: np.array(arrays[k], np.float32) for k in ("w", "b")})  # TODO: build, then load arrays

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> tuple[int, ...]:
        """The output shape of one example, without running the model (optional; used by `preflight`)."""
        if tuple(shape) != (self.in_size,):
            raise ShapeError(f"{self!r} takes examples of shape ({self.in_size},), got {tuple(shape)}")
        return (self.out_size,)

    def __call__(self, x: Any) -> Any:
        """Predictions for a batch."""
        module = self._bound("__call__")
        return np.asarray(x, np.float32) @ module["w"] + module["b"]  # TODO: your framework's forward pass


class MyBackend:
    """The `StepBackend` the engine drives: it owns the weights and the optimizer state between steps."""

    def __init__(self, loop: Any, model: MyModel, optimizer: dict[str, Any]) -> None:
        self.loop, self.model_op = loop, model
        self.lr, self.momentum = optimizer["lr"], optimizer["momentum"]
        # TODO: your framework's model and optimizer. Copy the incoming weights: never update the caller's arrays.
        self.params = {k: v.copy() for k, v in model.weights().items()}
        self.velocity = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.lr_scale = 1.0  # ReduceLROnPlateau's multiplier; part of state_tree so it survives a resume

    def _loss_and_grads(self, batch: dict[str, np.ndarray]) -> tuple[Any, dict[str, np.ndarray]]:
        # TODO: your framework's forward pass, `loop.loss` (or the losses you support) and gradients. Randomness
        # (dropout) comes from (loop.seed, step), e.g. np.random.default_rng([seed, step]), never from a counter.
        x, y = (np.asarray(batch[k], np.float32) for k in (self.loop.input_key, self.loop.target_key))
        err = x @ self.params["w"] + self.params["b"] - y
        scale = np.float32(2.0 / err.size)
        return np.mean(np.square(err)), {"w": scale * (x.T @ err), "b": scale * err.sum(axis=0)}

    def train(self, batches: list[dict[str, np.ndarray]], step: int) -> dict[str, Any]:
        """``len(batches)`` optimizer steps from absolute step `step`; metrics with a leading axis when several."""
        losses = []
        for batch in batches:
            loss, grads = self._loss_and_grads(batch)
            for k, g in grads.items():  # TODO: your optimizer's step
                self.velocity[k] = self.momentum * self.velocity[k] + g
                self.params[k] = self.params[k] - np.float32(self.lr * self.lr_scale) * self.velocity[k]
            losses.append(loss)
        return {"loss": np.asarray(losses) if len(losses) > 1 else losses[0]}

    def evaluate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Metrics of one batch in inference mode, no gradients."""
        return {"loss": self._loss_and_grads(batch)[0]}  # TODO: a forward pass only (eval mode)

    def bound_model(self) -> MyModel:
        return self.model_op.with_weights(self.params)  # a copy: later steps must not change what callers hold

    def set_model(self, model_op: Any) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in model_op.weights().items()}

    def get_lr_scale(self) -> float:
        return self.lr_scale

    def set_lr_scale(self, value: float) -> None:
        self.lr_scale = float(value)

    def learning_rate(self, step: int) -> float:
        return self.lr * self.lr_scale  # TODO: your schedule at `step`, times the multiplier

    def state_tree(self) -> dict[str, Any]:
        """Every array a checkpoint needs to continue bitwise: a dict of (nested dicts of) arrays."""
        return {"params": self.params, "velocity": self.velocity, "lr_scale": np.asarray(self.lr_scale)}

    def load_state_tree(self, tree: Any) -> None:
        self.load_weights_tree(tree)
        self.velocity = {k: np.array(v, np.float32) for k, v in tree["velocity"].items()}
        self.lr_scale = float(np.asarray(tree["lr_scale"]))

    def weights_tree(self) -> dict[str, Any]:
        """The weights alone (keys of `state_tree`): what a warm start (`init_from`) copies."""
        return {"params": self.params}

    def load_weights_tree(self, tree: Any) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in tree["params"].items()}


def _optimizer(loop: Any) -> dict[str, Any]:
    """The checked optimizer settings; refuse, naming the backend, whatever your framework cannot honour."""
    from pipekit_train import EMA, MSE
    from pipekit_train.optim._config import resolve_optimizer_config

    if loop.task is not None or not isinstance(loop.loss, MSE) or loop.loss.reduction != "mean":
        raise ConfigError(f"backend {NAME!r} trains with loss MSE() only, got loss={loop.loss!r}")  # TODO
    config = resolve_optimizer_config(loop.optimizer_config)
    unsupported = {  # TODO: what your framework cannot honour
        "optimizer_config.name": config["name"] != "sgd",
        "optimizer_config.schedule": config["schedule"] != "constant" or config["warmup_steps"] != 0,
        "optimizer_config.nesterov": config.get("nesterov", False),
        "optimizer_config.weight_decay": config.get("weight_decay", 0) != 0,
        "accum": loop.accum != 1,
        "grad_clip_norm": loop.grad_clip_norm is not None,
        "EMA": any(isinstance(cb, EMA) for cb in loop.callbacks),
    }
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(f"backend {NAME!r} cannot honour {', '.join(bad)}")
    return config


def preflight(loop: Any, incoming: Any, stage: str) -> MyModel:
    """Every check that needs no training; return the bound model the stage starts from."""
    _optimizer(loop)
    spec = loop.dataset.element_spec()
    for key in (loop.input_key, loop.target_key):
        if key not in spec:
            raise ConfigError(f"stage {stage!r}: {key!r} is not in the batches' keys {sorted(spec)}")
    model: MyModel = loop.model_op
    out = model.check_input(tuple(spec[loop.input_key][0]), spec[loop.input_key][1])
    if out != tuple(spec[loop.target_key][0]):
        target = tuple(spec[loop.target_key][0])
        raise ShapeError(f"stage {stage!r}: {model!r} predicts {out} per example, the targets are {target}")
    previous = incoming.model if incoming is not None else None
    if previous is None or (loop.transfer is not None and not loop.transfer.paths):  # Transfer(): start fresh
        return model.bind(model.build(loop.seed))
    if getattr(previous, "backend", None) != NAME:
        raise ConfigError(f"stage {stage!r} (backend {NAME!r}) cannot start from {previous!r} of another backend")
    if loop.transfer is not None or previous != model:  # TODO: apply loop.transfer if your models have parts
        raise ConfigError(f"stage {stage!r}: {model!r} cannot start from {previous!r}: transfer: {{type: Transfer}}")
    return model.with_weights(previous.weights())  # the previous stage's weights, whole


def run(loop: Any, incoming: Any, info: Any, hooks: Any) -> Any:
    """Train one stage: the engine (`run_steps`) does the schedule, callbacks, checkpoints and resume."""
    from pipekit_train.adapters import run_steps

    backend = MyBackend(loop, preflight(loop, incoming, info.stage), _optimizer(loop))
    result = run_steps(loop, backend, info, hooks)
    result.opt_state = {"velocity": backend.velocity}  # TODO: your optimizer state (handed to the next stage)
    result.backend_info = {**backend_info(), "steps": result.step, "num_params": result.model.num_params()}
    return result


def backend_info() -> dict[str, Any]:
    """The framework and its version, recorded in every artifact."""
    return {"backend": NAME, "numpy": np.__version__}  # TODO: your framework's name and version, devices


def example_model(in_size: int, out_size: int) -> MyModel:
    """A small model of ``in_size -> out_size``: what the conformance kit trains."""
    return MyModel(in_size=in_size, out_size=out_size)


pipekit_train.register_backend(NAME, __name__)  # TODO: drop this once your package declares the entry point
