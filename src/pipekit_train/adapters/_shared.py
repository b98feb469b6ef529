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
    with the targets, naming both shapes and the loss's own first line."""
    import jax

    shape, dtype = spec[loop.input_key]
    out = loop.model_op.check_input(tuple(shape), dtype)
    target_shape, target_dtype = spec[loop.target_key]
    batch = loop.batch_size
    # jax.ShapeDtypeStruct is untyped here (no-untyped-call)
    predicted = jax.tree.map(lambda o: jax.ShapeDtypeStruct((batch, *o.shape), o.dtype), out)  # type: ignore[no-untyped-call]
    target = jax.ShapeDtypeStruct((batch, *target_shape), target_dtype)  # type: ignore[no-untyped-call]
    loss = loop.loss
    try:
        jax.eval_shape(lambda p, t: loss(p, t), predicted, target)
    except Exception as e:
        shown = f"{predicted.shape} ({predicted.dtype})" if hasattr(predicted, "shape") else str(predicted)
        raise ShapeError(
            f"loss {loss!r} cannot compare the model's predictions of shape {shown} with targets "
            f"{loop.target_key!r} of shape {target.shape} ({target.dtype}): {str(e).splitlines()[0]}"
        ) from None
