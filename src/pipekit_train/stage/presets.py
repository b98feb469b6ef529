"""Presets: named sets of `TrainingLoop` fields (``preset: finetune-small``) that fill what a file leaves unset.

A preset never overrides a field the file (or the Python call) sets, even to that field's default. The YAML a
loop dumps keeps ``preset:`` and only the fields whose values differ from what the preset (or, for the fields it
does not set, the default) would give, so ``dumps(loads(text))`` is the file's own short form and loads back to
an equal loop. The artifact records the preset's name and the fields it filled (`preset_record`).

Registered presets cannot change: registering a name again with other fields is an error, so a dumped file means
the same loop for as long as the process runs. ``docs/recipes.md`` lists the built-ins and their contents.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipekit import ConfigError, suggestion

if TYPE_CHECKING:
    from .loop import TrainingLoop

__all__ = ["preset_fields", "preset_record", "register_preset", "registered_presets"]

#: Fields a preset cannot set: what the stage trains, on what, and the preset itself.
_NOT_PRESETTABLE = ("model_op", "dataset", "preset")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")

_PRESETS: dict[str, dict[str, Any]] = {}
_DESCRIPTIONS: dict[str, str] = {}
_builtins_loaded = False


def _ensure_builtins() -> None:
    """Register the built-in presets once, on first use (they need `TrainingLoop`, which imports this module)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        _register_builtins()


def _typed_canonical(value: Any) -> Any:
    """`pipekit.canonical`, with the value's type: a preset's ``1`` and a file's ``1.0`` differ."""
    from pipekit import canonical

    return (type(value), canonical(value))


def register_preset(name: str, fields: Mapping[str, Any], *, description: str = "") -> None:
    """Register `fields` as the preset `name`, for ``TrainingLoop(preset=name)`` and ``preset: name`` in YAML.

    Each key is a `TrainingLoop` field (not ``model_op``, ``dataset`` or ``preset``); each value is checked and
    converted as the field would check it (``max_steps: 1000``, ``loss: MSE()``, ``param_groups: [ParamGroup(...)]``).
    Registering the same fields under the same name again is a no-op; other fields under a taken name are an error.

    Args:
        name: Letters, digits, ``-`` and ``_`` (``finetune-small``).
        fields: ``{field: value}``.
        description: One line saying when to use it (`registered_presets` returns it).

    Example:
        >>> from pipekit_train.losses import MSE
        >>> register_preset("doc-quick-ae", {"loss": MSE(), "target_key": "x", "max_steps": 200})
        >>> preset_fields("doc-quick-ae")["max_steps"]
        200
    """
    from pipekit._operator import field_hints
    from pipekit._types import check_field

    from .loop import TrainingLoop

    _ensure_builtins()
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"register_preset: name must be letters, digits, '-' or '_' (like 'finetune-small'), got {name!r}"
        )
    if not isinstance(fields, Mapping):
        raise ConfigError(f"register_preset({name!r}): fields must be a mapping of TrainingLoop fields, got {fields!r}")
    known = [f.name for f in dataclasses.fields(TrainingLoop) if f.name not in _NOT_PRESETTABLE]
    hints = field_hints(TrainingLoop)
    checked: dict[str, Any] = {}
    for key, value in fields.items():
        if key in _NOT_PRESETTABLE:
            raise ConfigError(
                f"register_preset({name!r}): a preset cannot set {key!r} (it sets how a stage trains, not what it "
                f"trains); allowed fields: {', '.join(known)}"
            )
        if key not in known:
            raise ConfigError(
                f"register_preset({name!r}): TrainingLoop has no field {key!r}{suggestion(str(key), known)}; "
                f"allowed fields: {', '.join(known)}"
            )
        checked[key] = check_field(f"preset {name!r}: TrainingLoop", key, value, hints.get(key, Any))
    old = _PRESETS.get(name)
    if old is not None and _typed_canonical(old) != _typed_canonical(checked):
        raise ConfigError(
            f"register_preset: preset {name!r} is already registered with other fields ({sorted(old)}); "
            "a preset cannot change once registered (a dumped file would change meaning): choose another name"
        )
    _PRESETS[name] = checked
    _DESCRIPTIONS[name] = description


def registered_presets() -> dict[str, str]:
    """``{name: description}`` of every registered preset, sorted by name."""
    _ensure_builtins()
    return {name: _DESCRIPTIONS[name] for name in sorted(_PRESETS)}


def preset_fields(name: str) -> dict[str, Any]:
    """A copy of the fields of the preset `name`, or a `ConfigError` naming the closest registered presets."""
    _ensure_builtins()
    if not isinstance(name, str):
        raise ConfigError(f"TrainingLoop.preset must be a preset name (a string) or null, got {name!r}")
    fields = _PRESETS.get(name)
    if fields is None:
        raise ConfigError(
            f"TrainingLoop.preset {name!r} is not a registered preset{suggestion(name, _PRESETS)}; registered "
            f"presets: {', '.join(sorted(_PRESETS))} (add one with pipekit_train.stage.register_preset)"
        )
    return dict(fields)


def fill_from_preset(given: dict[str, Any]) -> dict[str, Any]:
    """`TrainingLoop.fill_fields`: the fields of ``given["preset"]`` (if any) for every field `given` leaves out."""
    name = given.get("preset")
    if name is None:
        return given
    return {**{k: v for k, v in preset_fields(name).items() if k not in given}, **given}


def explicit_fields(loop: TrainingLoop, non_default: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `loop` a file must spell out: those that differ from what its preset (else the default) gives.

    `non_default` is `Operator.non_default_fields` of the loop; without a preset it is the answer.
    """
    if loop.preset is None:
        return dict(non_default)
    filled = preset_fields(loop.preset)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(loop):
        value = getattr(loop, f.name)
        if f.name in filled:
            if _typed_canonical(value) != _typed_canonical(filled[f.name]):
                out[f.name] = value
        elif f.name in non_default:
            out[f.name] = value
    return out


def replace_with_preset(loop: TrainingLoop, changes: Mapping[str, Any]) -> TrainingLoop:
    """``loop.replace(preset=other, ...)``: the fields the old preset filled are filled again by the new one."""
    kwargs = {**explicit_fields(loop, loop.non_default_fields()), **changes}
    for f in dataclasses.fields(loop):  # required fields equal to nothing a default could give
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs.setdefault(f.name, getattr(loop, f.name))
    return type(loop)(**kwargs)


def preset_record(loop: TrainingLoop) -> dict[str, Any] | None:
    """What an artifact records of `loop`'s preset: ``{"name", "fields"}``, the values it filled as YAML data."""
    if loop.preset is None:
        return None
    from pipekit._yaml import to_plain

    filled = preset_fields(loop.preset)
    used = {
        k: to_plain(getattr(loop, k), k, strict=False)
        for k, v in filled.items()
        if _typed_canonical(getattr(loop, k)) == _typed_canonical(v)
    }
    return {"name": loop.preset, "fields": used}


def _register_builtins() -> None:
    from ..losses._builtin import MSE
    from ..optim._recipes import ParamGroup

    register_preset(
        "pretrain-autoencoder",
        {
            "loss": MSE(),
            "target_key": "x",
            "optimizer_config": {
                "name": "adamw",
                "lr": 3e-3,
                "weight_decay": 1e-4,
                "schedule": "warmup_cosine",
                "warmup_steps": 100,
            },
            "max_steps": 3000,
            "batch_size": 64,
            "log_every_n_steps": 250,
        },
        description="reconstruct the input (MSE against x), adamw 3e-3 with 100 warm-up steps and cosine decay",
    )
    finetune_optimizer = {
        "name": "adamw",
        "lr": 3e-3,
        "weight_decay": 1e-4,
        "schedule": "warmup_cosine",
        "warmup_steps": 50,
    }
    register_preset(
        "finetune-small",
        {
            "optimizer_config": finetune_optimizer,
            "param_groups": (ParamGroup(pattern="encoder.*", l2sp=10.0, name="encoder"),),
            "max_steps": 1000,
            "batch_size": 32,
            "eval_every_n_steps": 250,
            "log_every_n_steps": 100,
        },
        description="a pretrained encoder and a new head on few labels: adamw 3e-3, L2-SP 10 toward the encoder",
    )
    register_preset(
        "linear-probe",
        {
            "optimizer_config": finetune_optimizer,
            "param_groups": (ParamGroup(pattern="encoder.*", frozen=True, name="encoder"),),
            "max_steps": 1000,
            "batch_size": 32,
            "eval_every_n_steps": 250,
            "log_every_n_steps": 100,
        },
        description="the encoder frozen, only the head trains: how good are the features as they are?",
    )
