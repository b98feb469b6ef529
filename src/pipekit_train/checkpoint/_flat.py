"""The flat layout: one checkpoint as four plain files, written by pipekit alone (no Orbax), one atomic rename.

A single-process run saves its state in this layout by default (``Checkpoint.layout: auto``); several processes
save with Orbax, which coordinates their writes. A step directory in the flat layout::

    <step>/
      state.bin            every leaf's raw bytes, C order, each at an offset aligned to 64 bytes
      data_iter.json       the data position
      meta.json            the record: format, layout, per-leaf path/shape/dtype/offset/nbytes/sha256, the data
                           position's sha256, the caller's meta, and the record's own sha256
      commit_success.txt   the commit marker, written last

Everything is written into a temporary directory beside the step directories (``.pipekit-tmp-<step>-...``), the
files and that directory synced, then it is renamed to ``<step>`` and the parent fsynced (by the checkpointer's
manifest write, which fsyncs that directory anyway): a crash at any moment leaves either no ``<step>`` or a
complete one. A step directory is committed when it has its marker; a file of it
missing later is damage (named by the reader), not an uncommitted save. A step that retention drops is renamed
aside as a spare (`retire`), which the next save renames to its temporary name and overwrites in place; other
deletions unlink ``commit_success.txt`` first (`_layout._delete_step`), so a half-deleted step reads as uncommitted.
Reading never unpickles: leaves are `numpy.frombuffer` slices of ``state.bin`` checked against their sha256 before
they are used. ``design/checkpoints.md`` has the argument and the figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._kill_point import at_save

LEAVES = "state.bin"
DATA_ITER = "data_iter.json"
RECORD = "meta.json"
ALIGN = 64
TMP_MARK = ".pipekit-tmp-"
SPARE_MARK = ".pipekit-spare-"
_COMMIT = "commit_success.txt"
_FILES = frozenset((LEAVES, DATA_ITER, RECORD, _COMMIT))
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_datasync = getattr(os, "fdatasync", os.fsync)  # the data and the size, not the times (macOS has only fsync)


def is_flat(step_dir: Path) -> bool:
    """Whether a step directory is in the flat layout: files only, where Orbax's has one folder per item."""
    return not (step_dir / "state").is_dir()


def _host_bytes(leaf: Any) -> memoryview:
    """A leaf's bytes in C order, without a copy when it is already contiguous."""
    host = np.ascontiguousarray(np.asarray(leaf))
    return memoryview(host.reshape(-1).view(np.uint8).data)


def plan_offsets(records: Iterable[dict[str, Any]], sizes: Iterable[int]) -> int:
    """Give every leaf record its ``offset`` and ``nbytes`` (from `sizes`) in ``state.bin``; return the file's
    size."""
    offset = 0
    for rec, nbytes in zip(records, sizes, strict=True):
        offset = -(-offset // ALIGN) * ALIGN
        rec["offset"], rec["nbytes"] = offset, nbytes
        offset += nbytes
    return offset


def leaf_paths(path: Iterable[Any]) -> list[list[Any]]:
    """A leaf's path as JSON: ``["i", 0]`` for a sequence index (restored as a list), ``["k", name]`` otherwise."""
    out: list[list[Any]] = []
    for key in path:
        if hasattr(key, "idx"):
            out.append(["i", int(key.idx)])
        else:
            for attr in ("key", "name"):
                if hasattr(key, attr):
                    out.append(["k", str(getattr(key, attr))])
                    break
            else:
                out.append(["k", str(key)])
    return out


def write_flat(
    directory: Path,
    step: int,
    hosts: list[Any],
    records: list[dict[str, Any]],
    size: int,
    data_iter: bytes,
    record: bytes,
    *,
    spare: Path | None = None,
) -> dict[str, list[Any]]:
    """Write and commit step `step` (`data_iter` and `record` are their files' JSON, encoded); return the manifest's
    ``files`` map (``[size, sha256]``, or ``[size, None]`` for ``state.bin``, whose bytes the per-leaf digests in
    the record already pin).

    `spare` is a dropped step's directory that `retire` set aside: its files are overwritten in place instead of
    a directory and four files being created here and four files unlinked at the drop.

    The parent's fsync, which makes the commit's rename durable, is the caller's: the checkpointer's manifest
    write fsyncs `directory` right after (one journal commit for both renames), before anything is dropped.
    """
    final = directory / str(step)
    tmp = directory / f"{TMP_MARK}{step}-{os.getpid()}-{secrets.token_hex(3)}"
    files: dict[str, list[Any]] = {}
    reuse = False
    if spare is not None:
        try:
            os.rename(spare, tmp)
            reuse = True
        except OSError:  # gone (another checkpointer here cleared it as stale): start afresh
            shutil.rmtree(spare, ignore_errors=True)
    try:
        if not reuse:
            tmp.mkdir()
        with _overwrite(tmp / LEAVES) as f:
            at = 0
            for rec, host in zip(records, hosts, strict=True):
                if rec["offset"] > at:
                    f.write(b"\0" * (rec["offset"] - at))
                f.write(_host_bytes(host))
                at = rec["offset"] + rec["nbytes"]
        at_save(step)  # `pipekit-train check-resume` kills here: the arrays written, nothing committed
        assert at == size, (at, size)
        files[LEAVES] = [size, None]
        for name, body in ((DATA_ITER, data_iter), (RECORD, record)):
            with _overwrite(tmp / name) as f:
                f.write(body)
            files[name] = [len(body), hashlib.sha256(body).hexdigest()]
        files[_COMMIT] = [0, _EMPTY_SHA256]
        if not reuse:  # a spare has its marker, and its names were made durable when it was first written
            (tmp / _COMMIT).write_bytes(b"")  # its name is the marker; the directory's fsync makes it durable
            fsync_dir(tmp)
        os.rename(tmp, final)  # the commit; durable once the caller fsyncs `directory`
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


@contextlib.contextmanager
def _overwrite(path: Path) -> Iterator[Any]:
    """A file written from its start, keeping the blocks it has, then cut where the new content ends and synced.

    A spare's file rewritten at its old size is changed in place: no blocks are freed or allocated, so `fdatasync`
    (the data and the size, not the times) has no metadata to commit.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)  # the umask applies
    with os.fdopen(fd, "wb") as f:
        old = os.fstat(fd).st_size
        yield f
        f.flush()
        if old > f.tell():
            f.truncate()
        _datasync(fd)


def retire(step_dir: Path) -> Path | None:
    """Take a committed flat step out of the directory in one rename, as a spare for the next `write_flat`.

    The rename uncommits it at once (its new name is no step's). Returns the spare's path, or ``None`` when
    `step_dir` holds anything but a flat step's four files or cannot be renamed (the caller deletes it instead),
    or when the rename could not be made durable (the spare is then removed).
    """
    spare = step_dir.parent / f"{SPARE_MARK}{os.getpid()}-{secrets.token_hex(3)}"
    try:
        if set(os.listdir(step_dir)) != _FILES:
            return None
        os.rename(step_dir, spare)
    except OSError:
        return None
    try:  # durable before a save overwrites the spare's files: a crash must not find them under the old step's name
        fsync_dir(step_dir.parent)
    except OSError:  # not known to be durable: never overwritten, removed
        shutil.rmtree(spare, ignore_errors=True)
        return None
    return spare


def read_leaves(step_dir: Path, records: dict[str, Any]) -> tuple[dict[str, np.ndarray], list[str], str | None]:
    """Every recorded leaf as a read-only NumPy array over the file's bytes, the names whose sha256 does not match,
    and a problem with the file as a whole (missing, wrong size), else ``None``."""
    import jax.numpy as jnp

    path = step_dir / LEAVES
    try:
        data = path.read_bytes()
    except OSError as e:
        return {}, [], f"cannot read {path}: {e.strerror or e}"
    end = max((r["offset"] + r["nbytes"] for r in records.values()), default=0)
    if len(data) != end:
        return {}, [], f"{path} has {len(data)} bytes, the record says {end}"
    out, bad = {}, []
    view = memoryview(data)
    for name, rec in records.items():
        chunk = view[rec["offset"] : rec["offset"] + rec["nbytes"]]
        if hashlib.sha256(chunk).hexdigest() != rec.get("sha256"):
            bad.append(name)
            continue
        out[name] = np.frombuffer(chunk, dtype=jnp.dtype(rec["dtype"])).reshape(rec["shape"])
    return out, bad, None


def empty_containers(tree: Any) -> list[list[Any]]:
    """The paths of the ``None`` values and empty dicts, lists and tuples in `tree` (no leaf records them, and a
    restore as saved gives them back, as Orbax does), each with its kind."""
    import jax

    def empty(x: Any) -> bool:
        return x is None or (isinstance(x, (dict, list, tuple)) and not x)

    kinds = {type(None): "none", dict: "dict"}
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=empty)[0]
    return [[leaf_paths(path), kinds.get(type(x), "list")] for path, x in flat if empty(x)]


def as_saved(records: dict[str, Any], arrays: dict[str, Any], empties: list[list[Any]]) -> Any:
    """The tree as saved: lists for sequence indices, dicts for keys and attributes (as Orbax restores them)."""
    root: dict[Any, Any] = {}
    places = [([tuple(p) for p in rec["path"]], arrays[name]) for name, rec in records.items()]
    made: dict[str, Any] = {"dict": dict, "list": list, "none": lambda: None}
    places += [([tuple(p) for p in path], made[kind]()) for path, kind in empties]
    for path, value in places:
        if not path:  # the whole tree is empty
            return value
        node = root
        *parents, (_, last) = path
        for _, key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: listify(v) for k, v in node.items()}
        if items and all(isinstance(k, int) for k in items):  # "i" parts carry ints, "k" parts strings
            return [items[i] for i in sorted(items)]
        return items

    return listify(root)


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` durable (what a rename, a create or an unlink there changed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
