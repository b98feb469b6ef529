"""The fingerprint: what a checkpoint must have been written under for a resume to be exact, as plain data, and how a
resume compares it (`comparable`: a checkpoint cadence that shapes no chunk is no change; `_diff`: a refusal's
diff). An extension compares the finished stage's fingerprint with the one it recorded (`stage.recorded`)."""

from __future__ import annotations

import difflib
import json
import math
from typing import Any

#: Configuration that must not change between a checkpoint and the run resuming it.
_FINGERPRINT_FIELDS = (
    "model_op",
    "loss",
    "optimizer_config",
    "max_steps",
    "batch_size",
    "seed",
    "accum",
    "grad_clip_norm",
    "steps_per_call",
    "input_key",
    "target_key",
    "steps_per_epoch",
    "transfer",
    "task",
)


def fingerprint(loop: Any) -> dict[str, Any]:
    """What a checkpoint must have been written under for a resume to be exact, as plain data."""
    from pipekit._yaml import to_plain

    from ..optim._config import resolve_optimizer_config

    out = {name: to_plain(getattr(loop, name), name, strict=False) for name in _FINGERPRINT_FIELDS}
    # Defaults written out change nothing: compare the configuration with every default filled in.
    out["optimizer_config"] = resolve_optimizer_config(loop.optimizer_config)
    out["dataset_hash"] = loop.dataset.content_hash()
    out["dataset_shuffle"] = loop.dataset.shuffle
    out["dataset_drop_remainder"] = loop.dataset.drop_remainder
    # Validation feeds callbacks (early stopping, plateaus) and `Best` checkpoints: its data and cadence count.
    # It is read with what the training split's source fitted (a `TextSource`'s trained BPE, a `CsvSource`'s classes),
    # as the stage reads it, never with values fitted on the validation split itself.
    val = loop.val_dataset
    if val is not None and not val.source.fitted:
        val = val.with_source_statistics(loop.dataset.fitted().source.fitted_statistics(), "TrainingLoop.val_dataset")
    out["val_dataset_hash"] = val.content_hash() if val is not None else None
    out["eval_every_n_steps"] = loop.eval_every_n_steps if val is not None else None
    out["eval_batch_size"] = (loop.eval_batch_size or loop.batch_size) if val is not None else None
    callbacks: dict[str, list[Any]] = {}
    for cb in loop.callbacks:
        mark = cb.fingerprint()
        if mark is not None:
            callbacks.setdefault(type(cb).__name__, []).append(mark)
    out["callbacks"] = callbacks
    # The recipes (docs/recipes.md) change the result; written only when set, so other checkpoints keep theirs.
    # `diagnostics` only adds metrics and is left out.
    for name in ("gradient", "param_groups"):
        if getattr(loop, name, None):
            out[name] = to_plain(getattr(loop, name), name, strict=False)
    # The topology and the compute dtype change the floating-point result. Another precision is refused like any
    # other change; another device or process count alone is an elastic resume (`_elastic.without_topology`: the
    # data position is global). Only written when not the defaults, so checkpoints of one-device float32 runs keep
    # their fingerprint.
    from ..scale._mesh import describe
    from ..scale._precision import compute_dtype

    topology = describe(loop)
    if topology["num_devices"] > 1 or topology["shard_params"]:
        out["mesh"] = {"num_devices": topology["num_devices"], "shard_params": topology["shard_params"]}
        if topology["num_processes"] > 1:
            out["mesh"]["num_processes"] = topology["num_processes"]
    if compute_dtype(loop.precision) is not None:
        out["precision"] = compute_dtype(loop.precision)
    # Fused chunks end at checkpoint steps: the cadence may shape the compiled calls (`auto` fuses too). It is
    # recorded as it is; a resume compares it only where it shapes them (`comparable`).
    if loop.steps_per_call == "auto" or loop.steps_per_call > 1:
        checkpoint = loop.checkpoint_settings
        out["checkpoint_every"] = checkpoint.every_n_steps if checkpoint is not None else None
    return out


def cadence_shapes_chunks(loop: Any, every: int) -> bool:
    """Whether checkpoints every `every` steps change how the engine cuts `loop`'s steps into compiled calls
    (`stage.chunks`). They do not when every multiple of `every` before `max_steps` is a boundary anyway (`every`
    is a multiple of the log cadence, of the evaluation cadence with validation data, of `steps_per_epoch`, of an
    integer `steps_per_call` or of `max_steps`, or at least `max_steps`) and, with `auto`, the chunk size it
    resolves to does not move (`every` is a multiple of the other periods' common divisor and no shorter than the
    shortest of them)."""
    setting = loop.steps_per_call
    if setting != "auto" and int(setting) <= 1:
        return False
    periods = [loop.log_every_n_steps, loop.max_steps]
    if loop.val_dataset is not None:
        periods.append(loop.eval_every_n_steps)
    if loop.steps_per_epoch:
        periods.append(loop.steps_per_epoch)
    periods = [int(p) for p in periods if p]
    cuts = periods if setting == "auto" else [*periods, int(setting)]
    if not (every >= loop.max_steps or any(every % p == 0 for p in cuts)):
        return True
    return setting == "auto" and not (every % math.gcd(*periods) == 0 and every >= min(periods))


def comparable(recorded: dict[str, Any] | None, loop: Any) -> dict[str, Any]:
    """A fingerprint as a resume under `loop` compares it: a checkpoint cadence that shapes no chunk of `loop`
    (`cadence_shapes_chunks`) reads as `SHAPES_NO_CHUNK`, so a change between such cadences resumes into exactly
    the chunks the uninterrupted run with the new cadence makes, while any other change of it is refused."""
    out = dict(recorded or {})
    every = out.get("checkpoint_every")
    if isinstance(every, int) and not cadence_shapes_chunks(loop, every):
        out["checkpoint_every"] = SHAPES_NO_CHUNK
    return out


#: What `comparable` shows for a checkpoint cadence whose steps are chunk boundaries anyway (in a refusal's diff).
SHAPES_NO_CHUNK = "shapes no chunk (a multiple of a boundary)"


def _diff(saved: dict[str, Any], now: dict[str, Any], then: str = "checkpoint") -> str:
    """A unified diff of two fingerprints: `then` (what was saved) against ``this run``."""
    a = json.dumps(saved, indent=1, sort_keys=True).splitlines()
    b = json.dumps(now, indent=1, sort_keys=True).splitlines()
    return "\n".join(difflib.unified_diff(a, b, then, "this run", lineterm="", n=1))
