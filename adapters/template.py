"""Template for a backend adapter: copy it into your package, rename, and replace each TODO with your framework.

As it stands it is a working backend (``my-backend``: a linear model trained by SGD in NumPy, the same as
``tests/backends/numpy_linear``), so you can run the conformance kit first and keep it passing while you swap in
your framework one method at a time::

    PYTHONPATH=adapters python -m pipekit_train.adapters.conformance my-backend --import template

The contract is in ``adapters/README.md``: a backend is one object (`backend`, at the end of this file) with
``name``, ``requires``, ``extra``, ``capabilities``, ``check``, ``build``, ``start`` and ``info``; ``start`` returns
the `StepBackend` the engine drives. Keep this module cheap to import: import your framework inside the functions
and methods that use it (it is imported whenever a pipeline file is read), and list it in ``requires``. Register
the backend with an entry point in your ``pyproject.toml``::

    [project.entry-points."pipekit_train.backends"]
    my-backend = "my_package.adapter:backend"
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
from pipekit_train.backends import Backend, ModelOp, StepBackend

NAME = "my-backend"  # TODO: your backend's name (what `TrainingLoop.backend` says)


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
        module = self.require_module("weights")
        return {"w": np.asarray(module["w"]), "b": np.asarray(module["b"])}  # TODO: e.g. the state_dict as numpy

    def with_weights(self, arrays: Any) -> MyModel:
        """A copy bound to `arrays` (as `weights` returns them): how the model registry loads a model."""
        return self.bind({k: np.array(arrays[k], np.float32) for k in ("w", "b")})  # TODO: build, then load arrays

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """The output of one example as an object with ``.shape`` and ``.dtype``, without running the model
        (optional; `check` and the kit's `check_loss_fits` use it)."""
        import jax  # a shape and a dtype, nothing computed (any object with the two attributes will do)

        if tuple(shape) != (self.in_size,):
            raise ShapeError(f"{self!r} takes examples of shape ({self.in_size},), got {tuple(shape)}")
        return jax.ShapeDtypeStruct((self.out_size,), np.float32)

    def __call__(self, x: Any) -> Any:
        """Predictions for a batch."""
        module = self.require_module("__call__")
        return np.asarray(x, np.float32) @ module["w"] + module["b"]  # TODO: your framework's forward pass


class MyBackend(StepBackend):
    """The `StepBackend` the engine drives: it owns the weights and the optimizer state between steps."""

    def __init__(self, loop: Any, model: MyModel, optimizer: dict[str, Any]) -> None:
        """`model` is the bound model the core chose for the stage (fresh, or the previous stage's weights)."""
        self.loop, self.model_op = loop, model
        self.momentum = optimizer["momentum"]
        self.optimizer, self.max_steps = optimizer, loop.max_steps
        # TODO: your framework's model and optimizer. Copy the incoming weights: never update the caller's arrays.
        self.params = {k: v.copy() for k, v in model.weights().items()}
        self.velocity = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.lr_scale = 1.0  # ReduceLROnPlateau's multiplier; part of state_tree so it survives a resume
        # The EMA callback (the `ema` capability): its settings, and the average, a copy of the starting weights.
        self.ema_settings = loop.ema_settings
        self.ema = {k: v.copy() for k, v in self.params.items()} if self.ema_settings is not None else None

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
        for i, batch in enumerate(batches):
            loss, grads = self._loss_and_grads(batch)
            rate = np.float32(self.learning_rate(step + i))  # a function of the step: exact on resume
            for k, g in grads.items():  # TODO: your optimizer's step
                self.velocity[k] = self.momentum * self.velocity[k] + g
                self.params[k] = self.params[k] - rate * self.velocity[k]
            self._update_ema(step + i)
            losses.append(loss)
        return {"loss": np.asarray(losses) if len(losses) > 1 else losses[0]}

    def _update_ema(self, step: int) -> None:
        """After the optimizer step `step` (0-based): ``ema = d * ema + (1 - d) * params``, `d` the kit's rule."""
        if self.ema is None:
            return
        from pipekit_train.backends.kit import ema_decay, fixed_value

        d = ema_decay(fixed_value(self.ema_settings.decay, "EMA.decay"), self.ema_settings.warmup, step)
        for k, p in self.params.items():
            self.ema[k] = (d * self.ema[k] + (1.0 - d) * p).astype(np.float32)

    def _weights(self, use_ema: bool) -> dict[str, np.ndarray]:
        return self.ema if (use_ema and self.ema is not None) else self.params

    def evaluate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Metrics of one batch in inference mode, no gradients (with the EMA weights when the callback says so)."""
        params = self.params
        self.params = self._weights(self.ema_settings is not None and self.ema_settings.evaluate_with_ema)
        try:
            return {"loss": self._loss_and_grads(batch)[0]}  # TODO: a forward pass only (eval mode)
        finally:
            self.params = params

    def bound_model(self) -> MyModel:
        # A copy: later steps must not change what callers hold. With EMA(return_ema=True), the average.
        return self.model_op.with_weights(self._weights(self.ema_settings is not None and self.ema_settings.return_ema))

    def set_model(self, model_op: Any) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in model_op.weights().items()}
        if self.ema is not None:  # the average restarts from the new weights
            self.ema = {k: v.copy() for k, v in self.params.items()}

    def get_lr_scale(self) -> float:
        return self.lr_scale

    def set_lr_scale(self, value: float) -> None:
        self.lr_scale = float(value)

    def learning_rate(self, step: int) -> float:
        # The scheduled rate (`optimizer_config.schedule`, any kind) at `step`, times the run-time multiplier.
        from pipekit_train.backends.kit import learning_rate_at  # imports JAX: not at this module's import

        return learning_rate_at(self.optimizer, step, self.max_steps) * self.lr_scale

    def optimizer_state(self) -> dict[str, Any]:
        """Optional: the optimizer state the stage ends with (`TrainerCarryState.opt_state` for user code)."""
        return {"velocity": self.velocity}  # TODO: your optimizer state

    def summary(self) -> dict[str, Any]:
        """Optional: what the artifact's ``backend_info`` records of this run besides `info()`."""
        return {"num_params": int(sum(v.size for v in self.params.values()))}

    def state_tree(self) -> dict[str, Any]:
        """Every array a checkpoint needs to continue bitwise: a dict of (nested dicts of) arrays."""
        tree = {"params": self.params, "velocity": self.velocity, "lr_scale": np.asarray(self.lr_scale)}
        if self.ema is not None:
            tree["ema"] = self.ema  # the EMA callback's average resumes with the rest
        return tree

    def load_state_tree(self, tree: Any) -> None:
        self.load_weights_tree(tree)
        self.velocity = {k: np.array(v, np.float32) for k, v in tree["velocity"].items()}
        self.lr_scale = float(np.asarray(tree["lr_scale"]))
        if self.ema is not None:
            self.ema = {k: np.array(v, np.float32) for k, v in tree["ema"].items()}

    def weights_tree(self) -> dict[str, Any]:
        """The weights alone (keys of `state_tree`): what a warm start (`init_from`) copies."""
        return {"params": self.params}

    def load_weights_tree(self, tree: Any) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in tree["params"].items()}
        if self.ema is not None:  # a warm start: the average restarts from the new weights
            self.ema = {k: v.copy() for k, v in self.params.items()}


def _optimizer(loop: Any) -> dict[str, Any]:
    """The checked optimizer settings; refuse, naming the backend, whatever your framework cannot honour."""
    from pipekit_train.losses import MSE
    from pipekit_train.optim import resolve_optimizer_config

    if loop.task is not None or not isinstance(loop.loss, MSE) or loop.loss.reduction != "mean":
        raise ConfigError(f"backend {NAME!r} trains with loss MSE() only, got loss={loop.loss!r}")  # TODO
    config = resolve_optimizer_config(loop.optimizer_config)
    unsupported = {  # TODO: what your framework cannot honour
        "optimizer_config.name": config["name"] != "sgd",
        "optimizer_config.nesterov": config.get("nesterov", False),
        "optimizer_config.weight_decay": config.get("weight_decay", 0) != 0,
        "accum": loop.accum != 1,
        "grad_clip_norm": loop.grad_clip_norm is not None,
    }
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(f"backend {NAME!r} cannot honour {', '.join(bad)}")
    return config


class MyBackendSpec(Backend):
    """The backend object: everything the training core calls (``adapters/README.md``)."""

    name = NAME
    requires = ("numpy",)  # TODO: the packages your framework needs, e.g. ("torch",)
    extra = None  # an outside backend: None (a missing package's error then says `pip install <name of requires>`)
    #: TODO: what your backend honours (pipekit_train.backends.CAPABILITIES lists them all). "weights": models
    #: carry over to a next stage of this backend; pre-flight refuses whatever is not listed here.
    #: "ema": it honours the EMA callback (`_update_ema`, the ``ema`` key of `state_tree`).
    capabilities = frozenset({"weights", "init_from", "ema"})

    def check(self, loop: Any, incoming: Any, stage: str) -> None:
        """Every rule that needs no weights and no compiling: data keys and shapes, the loss, the optimizer."""
        _optimizer(loop)
        spec = loop.dataset.element_spec()
        for key in (loop.input_key, loop.target_key):
            if key not in spec:
                raise ConfigError(f"stage {stage!r}: {key!r} is not in the batches' keys {sorted(spec)}")
        model: MyModel = loop.model_op
        out = model.check_input(tuple(spec[loop.input_key][0]), spec[loop.input_key][1]).shape
        if out != tuple(spec[loop.target_key][0]):
            target = tuple(spec[loop.target_key][0])
            raise ShapeError(f"stage {stage!r}: {model!r} predicts {out} per example, the targets are {target}")

    def build(self, loop: Any) -> MyModel:
        """Fresh weights from `loop.seed`. The core calls it only when the stage starts fresh."""
        model: MyModel = loop.model_op
        return model.bind(model.build(loop.seed))

    def start(self, loop: Any, model: MyModel, incoming: Any) -> MyBackend:
        """The step backend over `model`, the bound model the core chose (fresh, or carried over whole)."""
        return MyBackend(loop, model, _optimizer(loop))

    def info(self) -> dict[str, Any]:
        """The framework and its version, recorded in every artifact."""
        return {"backend": NAME, "numpy": np.__version__}  # TODO: your framework's name and version, devices

    def example_model(self, in_size: int, out_size: int) -> MyModel:
        """A small model of ``in_size -> out_size``: what the conformance kit trains."""
        return MyModel(in_size=in_size, out_size=out_size)


backend = MyBackendSpec()
pipekit_train.register_backend(NAME, backend)  # TODO: drop this once your package declares the entry point
