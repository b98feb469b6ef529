"""Reading one checkpoint back (either layout): leaf digests, the data position and the repair of a restored tree."""

from __future__ import annotations

import functools
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._trees import flatten, path_name
from ._errors import CheckpointCorruptedError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from ._flat import DATA_ITER, LEAVES, RECORD, as_saved, is_flat, read_leaves
from ._layout import (
    FORMAT,
    _file_digest,
    _json_digest,
    _leaf_digest,
    _short,
    _uncommitted_reason,
)

#: Only the optimizer's numbers (`backends._optax_numbers.Hyperparams`) are missing: a checkpoint of an older version.
_MSG_BEFORE_HYPERPARAMS = (
    "it was written before the optimizer's numbers (learning rate, betas, schedule) moved into the optimizer "
    "state: resume it with the pipekit-train that wrote it, or start a new run from its weights with init_from"
)


# Restore internals -------------------------------------------------------------------------------------------
def _restore_step(
    directory: Path, step: int, abstract_state: Any, files: dict[str, list[Any]] | None
) -> tuple[Any, dict[str, Any], Any]:
    step_dir = directory / str(step)
    reason = _uncommitted_reason(step_dir)
    if reason is not None:
        raise CheckpointNotFoundError(f"step {step} in {directory} is not a committed checkpoint ({reason})")
    if is_flat(step_dir):
        return _restore_flat(step_dir, step, abstract_state, files)
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
        record = _read_record(reader, step_dir, step, files)
        target, finish = _restore_plan(abstract_state, record["leaves"], step_dir)
        failure = None
        try:
            out = reader.restore(
                step_dir,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data_iter=ocp.args.JsonRestore()),
            )
        except Exception as e:
            failure = _short(e)  # kept as text: the exception's frames would keep Orbax's coroutines alive
        if failure is not None:
            _collect_orbax_leftovers()
            raise _corrupted(step_dir, step, files, "state", f"Orbax could not read it: {failure}")
        state, data_iter = out.state, out.data_iter
        recorded = record["leaves"]
        bad = [p for p, x in flatten(state) if _leaf_digest(np.asarray(x)) != recorded.get(p, {}).get("sha256")]
        if bad:
            raise _corrupted(step_dir, step, files, "state", f"leaf checksum mismatch at {bad}")
        if _json_digest(data_iter) != record["data_iter_sha256"]:
            raise _corrupted(step_dir, step, files, "data_iter", "data_iter checksum mismatch")
    return finish(state), data_iter, record["user"]


def _read_record(reader: Any, step_dir: Path, step: int, files: dict[str, list[Any]] | None) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    failure = None
    try:
        record = reader.restore(step_dir, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
        failure = _short(e)
    if failure is not None:
        _collect_orbax_leftovers()
        raise _corrupted(step_dir, step, files, "meta", f"cannot read its meta item: {failure}")
    return _check_record(record, step_dir, step, files)


def _restore_flat(
    step_dir: Path, step: int, abstract_state: Any, files: dict[str, list[Any]] | None
) -> tuple[Any, dict[str, Any], Any]:
    """`_restore_step` for the flat layout (`_flat`): plain reads, no Orbax, no unpickling."""
    record = _check_record(_read_json_item(step_dir, step, files, RECORD, "meta"), step_dir, step, files)
    recorded = record["leaves"]
    target, finish = _restore_plan(abstract_state, recorded, step_dir)
    arrays, bad, problem = read_leaves(step_dir, recorded)
    if problem is not None:
        raise _corrupted(step_dir, step, files, "state", problem)
    if bad:
        raise _corrupted(step_dir, step, files, "state", f"leaf checksum mismatch at {bad}")
    data_iter = _read_json_item(step_dir, step, files, DATA_ITER, "data_iter")
    if _json_digest(data_iter) != record["data_iter_sha256"]:
        raise _corrupted(step_dir, step, files, "data_iter", "data_iter checksum mismatch")
    if target is None:
        state = as_saved(recorded, arrays, record.get("empty", []))
    else:
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        out = []
        for (path, struct), template in zip(flat, jax.tree_util.tree_leaves(abstract_state), strict=True):
            host = arrays[path_name(path)]
            if not is_committed(template):
                out.append(jax.device_put(host))  # where the template's uncommitted array is: the default device
            elif (sharding := getattr(struct, "sharding", None)) is not None:
                out.append(jax.device_put(host, sharding))
            else:
                out.append(np.array(host))
        state = jax.tree_util.tree_unflatten(treedef, out)
    return finish(state), data_iter, record["user"]


def is_committed(template: Any) -> bool:
    """Whether a restored leaf goes to `template`'s sharding: not when `template` is an array that is not committed
    to its device (a fresh state's, on one device), which the restored leaf then is not either.

    A jitted call compiles one program for uncommitted arguments and another for committed ones (the committed
    program's arguments carry their sharding), so a state restored committed from an uncommitted template
    compiled every step program of a stage again in a process that had compiled them for the fresh state (a
    finished stage read back, a resume in the same process). Placed on the default device, it is the same
    array as before, in the same place.
    """
    import jax

    return not isinstance(template, jax.Array) or template.committed


def _read_json_item(step_dir: Path, step: int, files: dict[str, list[Any]] | None, name: str, item: str) -> Any:
    path = step_dir / name
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise _corrupted(step_dir, step, files, item, f"cannot read its {item} item: {e}") from None


def _check_record(record: Any, step_dir: Path, step: int, files: dict[str, list[Any]] | None) -> dict[str, Any]:
    """`record` checked: a pipekit record, of this format, matching its own digest."""
    if not isinstance(record, dict) or "record_sha256" not in record:
        raise _corrupted(step_dir, step, files, "meta", "its meta item is not a pipekit checkpoint record")
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"{step_dir} has checkpoint format {record.get('format')!r}; this pipekit-train reads format {FORMAT}"
        )
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    if _json_digest(body) != record["record_sha256"]:
        raise _corrupted(step_dir, step, files, "meta", "meta checksum mismatch")
    return record


def _restore_plan(abstract_state: Any, leaves: dict[str, Any], step_dir: Path) -> tuple[Any, Callable[[Any], Any]]:
    """The tree Orbax restores into (saved shapes and dtypes) and the function that finishes the result."""
    import jax.numpy as jnp

    if abstract_state is None:

        def finish_as_saved(state: Any) -> Any:
            flat, treedef = jax.tree_util.tree_flatten_with_path(state)
            out = []
            for path, leaf in flat:
                if isinstance(leaf, np.ndarray):  # Orbax gives NumPy arrays when the `_sharding` file is gone
                    leaf = _on_device(leaf)
                impl = leaves.get(path_name(path), {}).get("prng_impl")
                out.append(jax.random.wrap_key_data(leaf, impl=impl) if impl else leaf)
            return jax.tree_util.tree_unflatten(treedef, out)

        return None, finish_as_saved

    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    names = [path_name(p) for p, _ in flat]
    problems = []
    missing = [n for n in names if n not in leaves]
    extra = sorted(set(leaves) - set(names))
    if missing:
        problems.append(f"not in the checkpoint: {missing}")
        if not extra and all("hyper" in n.split("/") for n in missing):
            problems.append(_MSG_BEFORE_HYPERPARAMS)
    if extra:
        problems.append(f"in the checkpoint but not in abstract_state: {extra}")
    targets: list[jax.ShapeDtypeStruct | None] = []
    posts: list[Callable[[Any], Any] | None] = []
    for name, (_, leaf) in zip(names, flat):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise CheckpointMismatchError(
                f"abstract_state leaf {name!r} is a {type(leaf).__name__}; expected an array or jax.ShapeDtypeStruct"
            )
        rec = leaves.get(name)
        if rec is None:
            targets.append(None)
            posts.append(None)
            continue
        is_key = jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        shape = tuple(leaf.shape)
        if is_key:
            if "prng_impl" not in rec:
                problems.append(f"{name!r} is a PRNG key in abstract_state but {rec['dtype']} data in the checkpoint")
                continue
            key_struct = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)  # type: ignore[no-untyped-call]
            shape = tuple(jax.eval_shape(jax.random.key_data, key_struct).shape)
        if shape != tuple(rec["shape"]):
            problems.append(f"shape of {name!r}: checkpoint {tuple(rec['shape'])}, abstract_state {tuple(leaf.shape)}")
            continue
        sharding = getattr(leaf, "sharding", None)
        targets.append(jax.ShapeDtypeStruct(shape, jnp.dtype(rec["dtype"]), sharding=sharding))  # type: ignore[no-untyped-call]
        if is_key:
            posts.append(functools.partial(_wrap_key_data, impl=rec["prng_impl"]))
        elif jnp.dtype(leaf.dtype) != jnp.dtype(rec["dtype"]):
            posts.append(functools.partial(_astype, dtype=leaf.dtype))
        else:
            posts.append(None)
    if problems:
        raise CheckpointMismatchError(f"{step_dir} does not match abstract_state: " + "; ".join(problems))

    def finish(state: Any) -> Any:
        # Leaves saved from the host come back as NumPy arrays when the template gives no sharding: JAX arrays,
        # as for leaves saved from a device.
        restored = [_on_device(x) if isinstance(x, np.ndarray) else x for x in jax.tree_util.tree_leaves(state)]
        return jax.tree_util.tree_unflatten(treedef, [f(x) if f else x for f, x in zip(posts, restored)])

    return jax.tree_util.tree_unflatten(treedef, targets), finish


def _on_device(leaf: np.ndarray) -> Any:
    """A JAX array copy of a NumPy leaf on the default device. ``jnp.asarray`` compiled a conversion program per
    leaf shape and dtype: six for a small MLP's state, each time a process restored a state as saved (a warm
    start); a `device_put` compiles nothing and canonicalises the dtype the same way."""
    return jax.device_put(leaf, may_alias=False)


def _wrap_key_data(data: Any, *, impl: str) -> Any:
    return jax.random.wrap_key_data(data, impl=impl)


def _astype(x: Any, *, dtype: Any) -> Any:
    return x.astype(dtype)


def _is_orbax_leftover(unraisable: Any) -> bool:
    """An error Orbax's abandoned reads raise when they are collected after a failed restore (already reported)."""
    exc, obj = unraisable.exc_value, unraisable.object
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    code = getattr(obj, "cr_code", None)  # a coroutine of Orbax's that failed with the restore
    return code is not None and "orbax" in code.co_filename


def _collect_orbax_leftovers() -> None:
    """After a failed Orbax restore, collect its abandoned reads now, without Python printing their errors (they
    would come out later as tracebacks around the one-line error that reports the damage)."""
    previous = sys.unraisablehook

    def quiet(unraisable: Any) -> None:
        if not _is_orbax_leftover(unraisable):
            previous(unraisable)

    sys.unraisablehook = quiet
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous


def _corrupted(step_dir: Path, step: int, files: dict[str, list[Any]] | None, item: str, detail: str) -> Exception:
    """A `CheckpointCorruptedError` naming the damaged files, found by comparing them with their commit digests."""
    damaged: list[str] = []
    if files:
        for rel, (size, digest) in sorted(files.items()):
            path = step_dir / rel
            try:
                if path.stat().st_size != size:
                    damaged.append(f"{path} (size {path.stat().st_size}, {size} when committed)")
                elif digest is None:  # the flat layout's state.bin: its bytes are pinned by the leaf digests
                    if item == "state" and "leaf checksum" in detail:
                        damaged.append(f"{path} (contents changed since commit)")
                elif _file_digest(path) != digest:
                    damaged.append(f"{path} (contents changed since commit)")
            except OSError:
                damaged.append(f"{path} (missing)")
    if damaged:
        where = "damaged file(s): " + ", ".join(damaged)
        names = [d.split(" (", 1)[0] for d in damaged]
    else:
        if is_flat(step_dir):  # the flat layout: one file per item
            item = {"state": LEAVES, "data_iter": DATA_ITER, "meta": RECORD}.get(item, item)
        where = f"in {step_dir / item}" + ("" if files else " (no file digests recorded for this checkpoint)")
        names = [str(step_dir / item)]
    remedy = (
        f"use another step: delete {step_dir} and `--resume auto` continues from the checkpoint before it, or "
        "restore, average or init_from an earlier step"
    )
    return CheckpointCorruptedError(
        f"checkpoint step {step} is corrupted: {detail}; {where}; {remedy}", step=step, files=names
    )
