"""What the supervised backends' pre-flight shares: the data keys a loop names, and its loss against the model's
predictions, both on abstract shapes (nothing is built or compiled). Equinox, Keras and Lightning call these from
their `check`; a sampler's data rules are its own."""

from __future__ import annotations

from typing import Any

from pipekit import ConfigError, ShapeError, suggestion

__all__ = ["check_input_and_target_keys", "check_loss_fits"]


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

    from ..losses._losses import target_problem

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
