"""The resume probe: a trace of a stage's state after every dispatch, and kills placed at exact steps.

`pipekit-train check-resume` (`cli._check_resume`) runs a pipeline in subprocesses with
``$PIPEKIT_RESUME_PROBE`` set to a JSON object:

- ``"trace"``: a file each engine appends one JSON line to after every dispatched chunk (``stage``, ``step``, and
  digests of what a resume must restore: every part of the backend's state tree (``params``, ``opt_state``,
  ``ema``, a sampler's key ...) leaf by leaf, the data position, each callback's checkpointed state and the digest
  of each of its Python attributes, the chunk's per-step metrics and the learning rate);
- ``"kill"`` (optional): ``{"stage": NAME, "step": S, "signal": "SIGKILL" | "SIGTERM", "during_save": bool}``:
  the process signals itself after the first chunk of stage NAME that ends at a step >= S, before that step's
  checkpoint hook; with ``during_save`` it SIGKILLs itself inside the checkpoint write of step S (after the arrays
  of the step are written, before the commit), on whichever thread writes it.

Unset (every ordinary run) the engine reads the variable once per stage and does nothing else: no digest, no
device-to-host copy, one ``None`` test per chunk; the checkpoint writers test one module global.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ENV_VAR", "Probe", "attribute_digests", "from_env"]

#: The environment variable `check-resume` sets; documented in docs/reliability.md.
ENV_VAR = "PIPEKIT_RESUME_PROBE"


def from_env(stage: str) -> Probe | None:
    """The probe of stage `stage` when ``$PIPEKIT_RESUME_PROBE`` is set, else ``None``; arms (or disarms) the kill
    inside a checkpoint write (`pipekit_train.checkpoint._kill_point`)."""
    from ..checkpoint._kill_point import arm

    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    spec = json.loads(raw)
    kill = spec.get("kill") if isinstance(spec.get("kill"), dict) else None
    if kill is not None and kill.get("stage") != stage:
        kill = None
    arm(int(kill["step"]) if kill is not None and kill.get("during_save") else None, str(spec["trace"]))
    return Probe(str(spec["trace"]), stage, kill if kill is not None and not kill.get("during_save") else None)


class Probe:
    """Writes the trace of one stage and fires its kill (see the module docstring)."""

    def __init__(self, trace: str, stage: str, kill: Mapping[str, Any] | None) -> None:
        self.trace = trace
        self.stage = stage
        self.kill = kill

    def after_chunk(self, engine: Any, first: int, metrics: Mapping[str, Any], data_state: Any) -> None:
        """Record the state after the chunk that ended at ``engine.step``; then the kill, when this is its point."""
        backend, step = engine.backend, engine.step
        keys = list(engine.callback_states)
        record = {
            "stage": self.stage,
            "step": step,
            "first": first,
            "pid": os.getpid(),
            "state": {part: tree_digests(tree) for part, tree in backend.state_tree().items()},
            "data": _digest(_canonical(data_state)),
            "callbacks": {
                key: {"saved": _digest(_canonical(engine.callback_states[key])), "attrs": attribute_digests(cb)}
                for key, cb in zip(keys, engine.callbacks)
            },
            "metrics": {k: _array_digest(v) for k, v in sorted(metrics.items())},
            "lr": _digest(repr(float(backend.learning_rate(step)))),
        }
        _append(self.trace, record)
        if self.kill is not None and step >= int(self.kill["step"]):
            name = str(self.kill["signal"])
            self.kill = None
            _append(self.trace, {"kill": name, "during_save": False, "step": step, "pid": os.getpid()})
            os.kill(os.getpid(), getattr(signal, name))


def tree_digests(tree: Any) -> dict[str, str]:
    """``{leaf path: digest of its dtype, shape and bytes}`` of a PyTree of arrays (typed keys by their data)."""
    import jax
    import jax.numpy as jnp

    from .._trees import path_name

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[path_name(path) or "."] = _array_digest(leaf)
    return out


def attribute_digests(callback: Any) -> dict[str, str]:
    """``{attribute: digest}`` of a callback's Python attributes that are plain data (numbers, strings, arrays and
    lists, tuples and dicts of them); others (objects, functions, clients) are not compared and left out."""
    out = {}
    for name, value in sorted(vars(callback).items()):
        plain = _plain(value, 0)
        if plain is not _SKIP:
            out[name] = _digest(json.dumps(plain, sort_keys=True, default=str))
    return out


_SKIP = object()


def _plain(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if depth > 4:
        return _SKIP
    if isinstance(value, (list, tuple)):
        items = [_plain(v, depth + 1) for v in value[:10_000]]
        return _SKIP if any(i is _SKIP for i in items) else items
    if isinstance(value, dict):
        pairs = {str(k): _plain(v, depth + 1) for k, v in list(value.items())[:10_000]}
        return _SKIP if any(v is _SKIP for v in pairs.values()) else pairs
    if isinstance(value, np.generic) or (hasattr(value, "dtype") and hasattr(value, "shape")):
        try:
            return _array_digest(value)
        except Exception:  # an array-like that cannot be read to the host: not compared
            return _SKIP
    return _SKIP


def _array_digest(value: Any) -> str:
    array = np.ascontiguousarray(np.asarray(value))
    h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.tobytes())
    return h.hexdigest()[:16]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _append(path: str, record: Mapping[str, Any]) -> None:
    """One line, written with one `os.write` on an ``O_APPEND`` descriptor: a kill never leaves half a line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)
