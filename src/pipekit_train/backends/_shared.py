"""What the supervised backends share: the registry of model factories by name (`FactoryRegistry`, one per
backend), and the pre-flight rules for the data keys a loop names and its loss against the model's predictions, both
on abstract shapes (nothing is built or compiled). Equinox, Keras and Lightning use these; a sampler's data rules
and its registry of NumPyro models are its own."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from pipekit import ConfigError, ShapeError, suggestion

__all__ = [
    "cnn_feature_size",
    "BUILTIN_FACTORIES",
    "MISSING",
    "FactoryRegistry",
    "check_input_and_target_keys",
    "check_loss_fits",
    "check_model_size",
    "memory_limit",
    "resolve_path",
    "stage_name",
    "user_line",
]

#: The factories every supervised backend ships, with the same kwargs and structure (``encoder``, ``decoder``,
#: ``head``), so a model moves between backends (`pipekit_train.backends.convert_model`) and `Transfer` paths read
#: the same on each.
BUILTIN_FACTORIES = ("mlp", "cnn", "autoencoder", "classifier")


def cnn_feature_size(image_size: int, channels: list[int]) -> int:
    """The side of the built-in ``cnn``'s last feature map (each conv+pool stage halves it), or a `ConfigError` when
    `image_size` is too small for that many stages: the zoo's one rule that needs more than a signature."""
    final = int(image_size) >> len(channels)  # // 2 ** len(channels)
    if final < 1:
        raise ConfigError(
            f"cnn: image_size={image_size} is too small for {len(channels)} conv+pool stages (channels={channels}); "
            f"it must be at least {2 ** len(channels)}"
        )
    return final


class FactoryRegistry:
    """One backend's model factories by name: what its model operator's ``factory`` field names.

    Args:
        owner: The model operator's name, for errors (``"KerasModel"``).
        what: What a factory is called in errors (``"Keras model factory"``).
        builtins: The module that registers the built-in factories; imported on the first lookup (so reading a
            pipeline file imports no framework).
        leading: How many leading factory parameters are not kwargs (Equinox's ``key``: 1).
        check: ``check(name, fn)`` run on registration, raising `ConfigError` for a factory of the wrong shape
            (default: it must be callable).
    """

    def __init__(
        self,
        owner: str,
        what: str,
        builtins: str,
        *,
        leading: int = 0,
        check: Callable[[str, Callable[..., Any]], None] | None = None,
    ) -> None:
        self.owner, self.what, self.leading = owner, what, leading
        self._builtins = builtins
        self._check = check
        self._factories: dict[str, Callable[..., Any]] = {}
        self._loaded = False

    def _all(self) -> dict[str, Callable[..., Any]]:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self._builtins)
        return self._factories

    def register(self, name: str, register_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A decorator registering ``fn`` under `name`; `register_name` is the public function, for errors.

        The same function again (or one of the same module and name, a module imported twice) is a no-op;
        another under a taken name is a `ConfigError`.
        """

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if self._check is not None:
                self._check(name, fn)
            elif not callable(fn):
                raise ConfigError(f"{register_name}({name!r}): expected a function, got {fn!r}")
            old = self._factories.get(name)
            if old is not None and old is not fn and _origin(old) != _origin(fn):
                raise ConfigError(
                    f"{self.what} {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
                    "choose another name"
                )
            self._factories[name] = fn
            return fn

        return decorator

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._all())

    def get(self, name: str) -> Callable[..., Any]:
        """The factory `name`, or a `ConfigError` naming the operator's field and the closest registered names."""
        fn = self._all().get(name)
        if fn is None:
            names = self.names()
            raise ConfigError(
                f"{self.owner}.factory {name!r} is not a registered {self.what}{suggestion(name, names)}; "
                f"registered: {', '.join(names)}"
            )
        return fn

    def check_kwargs(self, name: str, kwargs: dict[str, Any]) -> None:
        """Refuse an unknown factory, or `kwargs` it cannot take or lacks; a built-in's ``activation`` is checked."""
        from ._model import check_activation, check_factory_kwargs

        params = list(inspect.signature(self.get(name)).parameters.values())[self.leading :]
        check_factory_kwargs(self.owner, name, params, kwargs)
        if "activation" in kwargs and name in BUILTIN_FACTORIES:
            check_activation(kwargs["activation"])


def _origin(fn: Callable[..., Any]) -> tuple[str, str]:
    return (fn.__module__, fn.__qualname__)


#: What a `resolve_path` ``child`` hook returns for a name the node does not have.
MISSING: Any = object()


def resolve_path(
    root: Any,
    steps: Sequence[str | int],
    path: str,
    role: str,
    *,
    child: Callable[[Any, str], Any],
    names: Callable[[Any], list[str]],
    sequence: tuple[type, ...] = (list, tuple),
    noun: str = "sub-layer",
) -> Any:
    """The node of `root` at `steps` (`pipekit_train.Transfer`'s parsed `path`): the walk every backend shares.

    ``child(node, name)`` is the named child, or `MISSING`; ``names(node)`` the names it has (for the error); an int
    step indexes a node of a `sequence` type. A step that is not there is one `ConfigError` naming the path, the
    `role` (``"source"`` / ``"target"``), where the walk stopped, the closest names and all of them.
    """
    node = root
    for i, step in enumerate(steps):
        where = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[:i]).lstrip(".") or "<root>"
        if isinstance(step, int):
            indexable = isinstance(node, sequence)  # a bool: `node` stays `Any` for the checker
            if not indexable or step >= len(node):
                size = f"of length {len(node)}" if indexable else type(node).__name__
                raise ConfigError(f"Transfer: path {path!r} not found in the {role} model: {where} is {size}")
            node = node[step]
            continue
        value = child(node, step)
        if value is MISSING:
            have = names(node)
            raise ConfigError(
                f"Transfer: path {path!r} not found in the {role} model: {type(node).__name__} at {where} has "
                f"no {noun} {step!r}{suggestion(step, have)}; it has: {', '.join(have) or f'no {noun}s'}"
            )
        node = value
    return node


def check_input_and_target_keys(loop: Any) -> dict[str, Any]:
    """The dataset's element spec, after refusing an `input_key` / `target_key` its batches do not have."""
    spec: dict[str, Any] = loop.dataset.element_spec()
    for role, key in (("input_key", loop.input_key), ("target_key", loop.target_key)):
        if key not in spec:
            raise ConfigError(
                f"TrainingLoop.{role} is {key!r} but the dataset's batches have keys {sorted(spec)}"
                f"{suggestion(key, spec)}"
            )
    return spec


def check_loss_fits(loop: Any, spec: dict[str, Any]) -> None:
    """Refuse a loss that cannot compare the model's predictions for a batch (`ModelOp.check_input`, abstractly)
    with the targets: first the loss's declared target contract (`Loss.targets`), then the loss itself traced on
    abstract shapes (`jax.eval_shape`, nothing runs). An exception raised in a user's own loss code is reported as
    that exception at the user's line, not as a shape mismatch."""
    import jax

    from ..losses._composite import target_problem

    shape, dtype = spec[loop.input_key]
    out = loop.model_op.check_input(tuple(shape), dtype)
    target_shape, target_dtype = spec[loop.target_key]
    batch = loop.batch_size
    # jax.ShapeDtypeStruct is untyped here (no-untyped-call)
    predicted = jax.tree.map(lambda o: jax.ShapeDtypeStruct((batch, *o.shape), o.dtype), out)  # type: ignore[no-untyped-call]
    target = jax.ShapeDtypeStruct((batch, *target_shape), target_dtype)  # type: ignore[no-untyped-call]
    loss = loop.loss
    found = target_problem(loss, predicted, target) if out is not None else None
    if found is not None:
        which, problem = found
        raise ConfigError(f"loss {which!r} cannot train on TrainingLoop.target_key {loop.target_key!r}: {problem}")
    try:
        jax.eval_shape(lambda p, t: loss(p, t), predicted, target)
    except Exception as e:
        shown = f"{predicted.shape} ({predicted.dtype})" if hasattr(predicted, "shape") else str(predicted)
        line = user_line(e)
        if line is not None and not _is_shape_error(e):
            raise ConfigError(
                f"loss {loss!r} raised {type(e).__name__} at {line}: {_first_line(e)} (an error in the loss's code, "
                "not in the data; --debug shows the traceback)"
            ) from e
        at = f" (at {line})" if line is not None else ""
        raise ShapeError(
            f"loss {loss!r} cannot compare the model's predictions of shape {shown} with targets "
            f"{loop.target_key!r} of shape {target.shape} ({target.dtype}): {_first_line(e)}{at}"
        ) from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


#: Packages whose frames are not the user's: ours, JAX's and the libraries under it.
_NOT_USER = ("pipekit_train", "pipekit", "jax", "jaxlib", "numpy", "equinox", "optax", "keras", "torch", "contextlib")


def user_line(e: BaseException) -> str | None:
    """``file:line`` of the last frame of `e`'s traceback outside pipekit, JAX and the frameworks (the user's
    code), or ``None`` when every frame is theirs."""
    import os
    import sys
    import traceback

    roots = []
    for name in _NOT_USER:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            roots.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    found = None
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<frozen") or any(path.startswith(r) for r in roots):
            continue
        found = frame
    if found is None:
        return None
    here = os.getcwd() + os.sep
    shown = os.path.relpath(found.filename) if os.path.abspath(found.filename).startswith(here) else found.filename
    return f"{shown}:{found.lineno}"


def _is_shape_error(e: BaseException) -> bool:
    """A shape or dtype mismatch (ours, or JAX's broadcasting and dot rules), not a bug in the loss's code."""
    if isinstance(e, ShapeError):
        return True
    text = str(e).lower()
    return isinstance(e, (TypeError, ValueError)) and ("shape" in text or "broadcast" in text)


def stage_name(loop: Any, incoming: Any) -> str:
    """The name of stage `loop` after `incoming` (the previous stage's carry-state, or ``None``): its `name`, else
    ``stage<index>``, as the stage runner calls it (for a backend's messages in `start`)."""
    return loop.name or f"stage{incoming.stage_index if incoming is not None else 0}"


def memory_limit() -> tuple[int, str] | None:
    """The memory this process can use at most, in bytes, and where that figure comes from; ``None`` if unknown.

    The physical memory (``os.sysconf``), or the container's limit (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) where that is lower.
    """
    found: list[tuple[int, str]] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):  # no such sysconf name here
        found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < 2**62:
            found.append((int(text), f"the container's memory limit ({path})"))
    return min(found) if found else None


def check_model_size(n_params: int, n_bytes: int, stage: str, model: object, device_bytes: int | None = None) -> None:
    """Refuse a model whose weights alone exceed the memory there is (before anything is allocated).

    Args:
        n_params: The number of parameters (from the architecture's abstract shapes).
        n_bytes: Their size in bytes.
        stage: The stage's name, for the message.
        model: The model operator, for the message.
        device_bytes: The accelerator's memory, when the backend knows it (``None`` on CPU: the host's counts).
    """
    limit = (device_bytes, "the device's memory") if device_bytes else memory_limit()
    if limit is None or n_bytes <= limit[0]:
        return
    raise ConfigError(
        f"stage {stage!r}: {model!r} has {n_params:,} parameters ({_gib(n_bytes)} of weights alone; training "
        f"needs about 4 times that with gradients and Adam's moments) but {limit[1]} is {_gib(limit[0])}; "
        "choose smaller sizes (model_op.kwargs)"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
