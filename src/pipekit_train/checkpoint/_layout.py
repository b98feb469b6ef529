"""The checkpoint directory on disk: the state a save holds and its digests, commit markers, deletion, I/O retries
and the notes of a failed write. The manifest beside the steps is ``_manifest.py``."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .._trees import path_name
from ._errors import CheckpointError
from ._flat import DATA_ITER, LEAVES, RECORD, SPARE_MARK, TMP_MARK, empty_containers, is_flat, leaf_paths

logger = logging.getLogger("pipekit_train.checkpoint")

FORMAT = 1
_ITEMS = ("state", "data_iter", "meta")
_COMMIT = "commit_success.txt"  # Orbax writes it into the step directory and into each item directory
_STEP_METADATA = "_CHECKPOINT_METADATA"
_TMP = ".orbax-checkpoint-tmp"  # Orbax's temporary step directories; the flat layout's start with TMP_MARK
_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE, errno.EIO}
_T = TypeVar("_T")

# State preparation and digests ---------------------------------------------------------------------------------
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="pipekit-digest")
    return _POOL


class _Plan(NamedTuple):
    """What a save does with every leaf of one tree structure, worked out once (`_plan_state`)."""

    names: list[str]  # each leaf's path name
    records: list[dict[str, Any]]  # each leaf's path, shape and dtype (and PRNG implementation)
    actions: list[int]  # how `_prepare_state` copies each leaf
    nbytes: list[int]  # each leaf's size in bytes as written
    empty: list[list[Any]]  # the None values and empty containers (a flat checkpoint's record keeps them)


class HeldState(NamedTuple):
    """One save's state, flattened: the leaves are this save's own (copies or views nothing will change).

    `Checkpointer.hold` returns one; `Checkpointer.save` takes it as its `state`.
    """

    treedef: Any
    leaves: list[Any]
    records: dict[str, dict[str, Any]]  # leaf name -> its record (this save's copy: digests are added to it)
    nbytes: list[int]
    empty: list[list[Any]]

    def tree(self) -> Any:
        """The held state as a tree of the original structure (PRNG keys as their key data)."""
        import jax

        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)


_PLANS: dict[Any, _Plan] = {}
_COPY, _KEY, _HOST, _REPLICATED, _CPU, _KEY_CPU = range(6)  # what `_prepare_state` does with each leaf


def _prepare_state(state: Any) -> HeldState:
    """The leaves to write (PRNG keys as key data), flattened, and the per-leaf records: path, shape, dtype (sha256
    comes later, in the background).

    What to do with each leaf is worked out once per tree structure (`_plan_state`) and cached: a periodic save
    of the same state then costs the training thread one flatten, one `device_put` and a few dict copies, and the
    writer never walks the tree again.
    """
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(state)
    # The plan is keyed by what the records say (structure, shapes, dtypes) and where the first leaf lives. Where
    # the others live only picks the cheaper copy (a view or a device copy), and any copy `_prepare_state` makes
    # of a leaf is right wherever it lives; so a sharding per leaf (microseconds each, at every save, while the
    # device waits) is not looked up.
    signature: tuple[Any, ...] | None
    try:
        signature = (treedef, getattr(leaves[0], "sharding", None) if leaves else None)
        signature += tuple((type(x), x.shape, x.dtype) for x in leaves)
        plan = _PLANS.get(signature)
    except (AttributeError, TypeError):  # not an array, or unhashable (refused by _plan_state with its name)
        plan, signature = None, None
    if plan is None:
        plan = _plan_state(state)
        if signature is not None:
            if len(_PLANS) >= 16:
                _PLANS.clear()
            _PLANS[signature] = plan
    names, records, actions = plan.names, plan.records, plan.actions
    datas: list[Any] = []
    fresh: set[int] = set()  # leaves that are this snapshot's own already (views of CPU buffers, key data copies)
    for leaf, action in zip(leaves, actions, strict=True):
        if action in (_KEY, _KEY_CPU):
            leaf = _key_data(leaf)
        if action == _CPU:  # on the host already: a view of the buffer, no copy (see below)
            leaf = np.asarray(leaf)
        elif action == _KEY_CPU:  # key data is a new (small) array: one memcpy
            leaf = np.array(leaf, copy=True)
        elif action != _HOST and (action == _REPLICATED or not leaf.is_fully_addressable):
            leaf = _replicated_copy(leaf, names[len(datas)])
        if action in (_CPU, _KEY_CPU):
            fresh.add(len(datas))
        datas.append(leaf)
    # A snapshot that nothing can change once `save` returns, though the caller donates its buffers to the next
    # step. JAX arrays on the CPU are held as NumPy views of their buffers, copy-free: a buffer with a view
    # outstanding is never donated (XLA allocates that one step's outputs afresh and leaves it as it is), so the
    # view holds the step's bytes until the writer drops it; the training thread pays microseconds, not a copy of
    # the whole state (20-40 ms for the benchmark's compute-bound model). Other JAX arrays are copied on their
    # device by one `device_put` for all of them (the background thread moves them to the host); NumPy arrays,
    # which their owner may overwrite, are copied here.
    on_device = [i for i, x in enumerate(datas) if isinstance(x, jax.Array)]
    copies = [x if isinstance(x, jax.Array) or i in fresh else np.array(x, copy=True) for i, x in enumerate(datas)]
    if on_device:
        for i, copy in zip(on_device, jax.device_put([datas[i] for i in on_device], may_alias=False)):
            copies[i] = copy
    return HeldState(treedef, copies, {n: dict(r) for n, r in zip(names, records)}, plan.nbytes, plan.empty)


def _key_data(key: Any) -> Any:
    """`jax.random.key_data` of a key array, without a primitive's dispatch where the key holds its data (about
    100 microseconds of the device's wait at a save)."""
    import jax

    base = getattr(key, "_base_array", None)  # what key_data returns for a concrete key (jax/_src/prng.py)
    return base if isinstance(base, jax.Array) else jax.random.key_data(key)


def _replicated_copy(leaf: Any, name: str) -> np.ndarray:
    """This process's copy of a leaf replicated on every process (a multi-process run)."""
    if not leaf.is_fully_replicated:
        raise CheckpointError(
            f"Checkpointer.save: state leaf {name!r} is split across processes; only arrays replicated "
            "on every process are saved in a multi-process run (remove mesh.shard_params)"
        )
    return np.asarray(leaf)


def _plan_state(state: Any) -> _Plan:
    """Check every leaf of `state` and say, per leaf, its name, its record and what `_prepare_state` does."""
    import jax
    import jax.numpy as jnp

    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise CheckpointError("Checkpointer.save: state has no array leaves")
    names, records, actions, nbytes = [], [], [], []
    for path, leaf in flat:
        name = path_name(path)
        rec: dict[str, Any] = {"path": leaf_paths(path)}
        action = _HOST
        if isinstance(leaf, jax.Array):
            one_cpu_process = jax.process_count() == 1 and all(d.platform == "cpu" for d in leaf.devices())
            action = _CPU if one_cpu_process else _COPY
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                rec["prng_impl"] = str(jax.random.key_impl(leaf))
                action = _KEY_CPU if one_cpu_process else _KEY
                leaf = jax.random.key_data(leaf)
            if not leaf.is_fully_addressable:
                leaf = _replicated_copy(leaf, name)
        elif not isinstance(leaf, (np.ndarray, np.generic)):
            raise CheckpointError(
                f"Checkpointer.save: state leaf {name!r} is a {type(leaf).__name__}; checkpoint state leaves must be "
                f"arrays (wrap scalars: jnp.asarray({leaf!r:.40}))"
            )
        if np.dtype(leaf.dtype).kind == "O":
            raise CheckpointError(f"Checkpointer.save: state leaf {name!r} is an array of Python objects")
        names.append(name)
        rec.update(shape=list(np.shape(leaf)), dtype=str(leaf.dtype))
        records.append(rec)
        actions.append(action)
        nbytes.append(int(leaf.nbytes))
    if len(set(names)) != len(names):
        raise CheckpointError(f"Checkpointer.save: state has leaves with the same path name: {names}")
    return _Plan(names, records, actions, nbytes, empty_containers(state))


def _host_leaves(leaves: list[Any]) -> list[Any]:
    """`leaves` with the addressable JAX arrays as NumPy arrays (one transfer for all of them).

    Orbax writes NumPy leaves in about half the time of JAX arrays of the same bytes (no replica slicing, no
    transfer threads, no ``_sharding`` file; 27 against 51 ms for a 19-leaf tree of 19k floats here), and the
    leaf digests need the host bytes anyway. In a multi-process run the leaves are left as `_prepare_state` made
    them (Orbax coordinates the processes' writes); leaves that span processes would stay JAX arrays in any case.
    """
    import jax

    if jax.process_count() > 1:
        return leaves
    out = list(leaves)
    local = [i for i, x in enumerate(out) if isinstance(x, jax.Array) and x.is_fully_addressable]
    for i, host in zip(local, jax.device_get([out[i] for i in local])):
        out[i] = np.asarray(host)
    return out


def _add_digests(records: dict[str, Any], hosts: list[Any]) -> None:
    """Record the sha256 of every leaf's bytes (`hosts` in the order `_prepare_state` listed the records)."""
    arrays = [np.asarray(x) for x in hosts]
    total = sum(a.nbytes for a in arrays)
    digests = _pool().map(_leaf_digest, arrays) if total > 1 << 20 else map(_leaf_digest, arrays)
    for rec, digest in zip(records.values(), digests, strict=True):
        rec["sha256"] = digest


def _leaf_digest(host: np.ndarray) -> str:
    data = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    return hashlib.sha256(data.data).hexdigest()


def _json_digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_digests(step_dir: Path) -> dict[str, list[Any]]:
    """``{relative path: [size, sha256]}`` of every file in a committed step directory."""
    out = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        out[path.relative_to(step_dir).as_posix()] = [path.stat().st_size, _file_digest(path)]
    return out


# Disk layout: commit markers, deletion ----------------------------------------------------------------------
def _uncommitted_reason(step_dir: Path) -> str | None:
    """``None`` when `step_dir` is a committed checkpoint (either layout), else what is missing."""
    if not step_dir.is_dir():
        return "no such directory"
    if is_flat(step_dir):  # the flat layout (`_flat`): renamed into place whole, with its marker
        required: tuple[str, ...] = (_COMMIT,)
    else:
        required = (_COMMIT, _STEP_METADATA, *(f"{item}/{_COMMIT}" for item in _ITEMS))
    for rel in required:
        if not (step_dir / rel).is_file():
            return f"missing {rel}"
    return None


def _uncommitted_after(directory: Path, latest: int | None) -> list[tuple[Path, str]]:
    """Step directories newer than the committed step `latest` that never committed (a crash during their save, or a
    commit marker deleted), oldest first, each with what is missing."""
    if not directory.is_dir():
        return []
    found = []
    for child in sorted(directory.iterdir(), key=lambda p: (len(p.name), p.name)):
        if child.name.isdigit() and (latest is None or int(child.name) > latest):
            reason = _uncommitted_reason(child)
            if reason is not None:
                found.append((child, reason))
    return found


def _never_committed(step_dir: Path, reason: str, instead: str) -> str:
    """The one message for a newer step that is skipped because it never committed (resume, ``restore('latest')``)."""
    return f"the checkpoint of step {step_dir.name} in {step_dir.parent} never committed ({reason}); {instead}"


def _pending(directory: Path) -> str:
    """A note listing interrupted (uncommitted) step directories, for error messages."""
    if not directory.is_dir():
        return " (the directory does not exist)"
    names = sorted(p.name for p in directory.iterdir() if _is_tmp(p.name) or p.name.isdigit())
    stale = [n for n in names if _is_tmp(n) or _uncommitted_reason(directory / n) is not None]
    return f" (uncommitted: {stale})" if stale else ""


def _is_tmp(name: str) -> bool:
    """Whether a directory entry is a save in progress (or one a killed process left), of either layout."""
    return _TMP in name or name.startswith(TMP_MARK)


def _remove_stale_tmp(directory: Path) -> None:
    """Remove the temporary directories of saves a killed process left behind (either layout's) and its spares
    (`_flat.retire`); never a step."""
    if directory.is_dir():
        for child in directory.iterdir():
            if _is_tmp(child.name) or child.name.startswith(SPARE_MARK):
                shutil.rmtree(child, ignore_errors=True)


def _delete_step(step_dir: Path) -> None:
    """Uncommit first (one unlink), then remove: a crash midway leaves an ignored, uncommitted directory."""
    (step_dir / _COMMIT).unlink(missing_ok=True)
    for name in (LEAVES, DATA_ITER, RECORD):  # a flat step's files: no directory walk (see `_flat`)
        with contextlib.suppress(OSError):
            os.unlink(step_dir / name)
    try:
        os.rmdir(step_dir)
    except OSError:  # the orbax layout, or files someone else put there
        shutil.rmtree(step_dir, ignore_errors=False)


def _with_io_retry(fn: Callable[[], _T], *, attempts: int = 3, backoff: float = 0.1) -> _T:
    """Call `fn`, retrying an `OSError` with a transient errno (EAGAIN, EBUSY, EIO, ...) with backoff."""
    for attempt in range(attempts):
        try:
            return fn()
        except OSError as e:
            if e.errno not in _TRANSIENT_ERRNOS or attempt == attempts - 1:
                raise
            logger.warning("transient I/O error (%s); retry %d of %d", e, attempt + 1, attempts - 1)
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def _short(e: BaseException) -> str:
    """The first line of an Orbax / TensorStore error, without the long spec it appends."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split(" [tensorstore_spec=", 1)[0].split(" [source locations=", 1)[0]
    if len(text) <= 240:
        return text
    head = text.split(": ", 1)[0][:60]
    return f"{head}: ... {text[-170:]}"  # the cause ("No space left on device") comes last


_FULL_TEXTS = ("No space left on device", "os_error_code='28'", "File too large", "os_error_code='27'")


def _space_note(directory: Path, e: BaseException) -> str:
    """For a save that failed because the disk (or the file-size limit) is full: how much room is left there.

    ``""`` for any other failure. ENOSPC and EFBIG are found on the exception chain (the flat writer) or in the text
    Orbax / TensorStore turn them into (``os_error_code='28'``).
    """
    chain: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    codes = {x.errno for x in chain if isinstance(x, OSError)}
    text = " ".join(str(x) for x in chain)
    too_large = errno.EFBIG in codes or "File too large" in text or "os_error_code='27'" in text
    if not (codes & {errno.ENOSPC, errno.EFBIG, errno.EDQUOT} or any(t in text for t in _FULL_TEXTS)):
        return ""
    where = directory
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        free = f"{_size(shutil.disk_usage(where).free)} free on the file system of {where}"
    except OSError as err:
        free = f"the free space of {where} cannot be read ({err.strerror})"
    if too_large:
        return f" ({free}; a file outgrew this process's file-size limit, 'ulimit -f')"
    return f" ({free})"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    scaled, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while scaled >= 1024 and len(units) > 1:
        scaled, units = scaled / 1024, units[1:]
    return f"{scaled:.1f} {units[0]}"


# Argument checks ---------------------------------------------------------------------------------------------
def _check_step(where: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"{where}: step must be a non-negative int, got {step!r}")
    return int(step)


def _check_json(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise CheckpointError(f"Checkpointer.save: {name} must be a dict of JSON data, got {type(value).__name__}")

    def walk(v: Any, path: str) -> None:
        if v is None or isinstance(v, (bool, int, float, str)):
            return
        if isinstance(v, Mapping):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"Checkpointer.save: {path} has a non-string key {k!r} (JSON keys are str)")
                walk(item, f"{path}[{k!r}]")
            return
        if isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")
            return
        raise CheckpointError(
            f"Checkpointer.save: {path} is a {type(v).__name__}; {name} must be JSON data "
            "(dict, list, str, int, float, bool, None)"
        )

    walk(value, name)


def _optional(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    value = meta.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise CheckpointError(f"Checkpointer.save: meta[{key!r}] must be {kind.__name__} or None, got {value!r}")
    return value
