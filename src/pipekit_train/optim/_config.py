"""`optimizer_config`: the flat mapping every backend reads its optimizer from, checked and with defaults filled in.

`resolve_optimizer_config` is the one reading of the keys (names, rules, which keys apply to which optimizer and
schedule); each backend maps the result onto its framework (the JAX backends through
`pipekit_train.backends._optax`). ``design/optimizers.md`` has the keys and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from pipekit import ConfigError, suggestion

from ._lora import resolve_lora

__all__ = ["check_optimizer_config", "check_schedule", "resolve_optimizer_config", "schedule_numbers"]

# Keys each optimizer takes, with their defaults (optax's defaults where optax has one).
_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-4, "decay_biases": False},
    "adam": {"b1": 0.9, "b2": 0.999, "eps": 1e-8},
    "sgd": {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "decay_biases": False},
    "lion": {"b1": 0.9, "b2": 0.99, "weight_decay": 1e-3, "decay_biases": False},
    # b2 is rmsprop's squared-gradient decay (PyTorch's alpha): the same moving average as Adam's b2.
    "rmsprop": {"b2": 0.9, "eps": 1e-8, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "decay_biases": False},
}
# Keys each schedule takes; None means "derived from max_steps / lr when the optimizer is built".
_SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {"warmup_steps": 0},
    "warmup_cosine": {"warmup_steps": 0, "decay_steps": None, "end_lr": 0.0},
    "onecycle": {"warmup_steps": None, "decay_steps": None, "end_lr": None},
    "exponential": {"warmup_steps": 0, "decay_steps": None, "decay_rate": 0.1, "end_lr": None},
}
_COMMON: dict[str, Any] = {"name": "adamw", "lr": 1e-3, "schedule": "constant"}
# ``lora`` (a mapping, `_lora`) applies to every optimizer and schedule; absent, it is absent from the result.
_ALL_KEYS: list[str] = list(
    dict.fromkeys(
        [*_COMMON, *(k for d in _OPTIMIZERS.values() for k in d), *(k for d in _SCHEDULES.values() for k in d), "lora"]
    )
)

# Names other libraries use for a key: an unknown key with one of these names suggests the key it means.
_ALIASES: dict[str, str] = {
    "learning_rate": "lr",
    "optimizer": "name",
    "type": "name",
    "lr_schedule": "schedule",
    "scheduler": "schedule",
    "warmup": "warmup_steps",
    "beta1": "b1",
    "beta2": "b2",
    "epsilon": "eps",
    "wd": "weight_decay",
    "min_lr": "end_lr",
}

# (kind, rule text, predicate)
_RULES: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "lr": ("float", "a float > 0", lambda v: v > 0),
    "weight_decay": ("float", "a float >= 0", lambda v: v >= 0),
    "b1": ("float", "a float in [0, 1)", lambda v: 0 <= v < 1),
    "b2": ("float", "a float in [0, 1)", lambda v: 0 <= v < 1),
    "eps": ("float", "a float > 0", lambda v: v > 0),
    "momentum": ("float", "a float in [0, 1)", lambda v: 0 <= v < 1),
    "nesterov": ("bool", "true or false", lambda v: True),
    "decay_biases": ("bool", "true or false", lambda v: True),
    "warmup_steps": ("int", "an int >= 0", lambda v: v >= 0),
    "decay_steps": ("int", "an int >= 1", lambda v: v >= 1),
    "end_lr": ("float", "a float >= 0", lambda v: v >= 0),
    "decay_rate": ("float", "a float > 0", lambda v: v > 0),
}


def _check_value(key: str, value: Any) -> Any:
    kind, rule, ok = _RULES[key]
    bad = f"optimizer_config.{key} must be {rule}, got {value!r}"
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(bad)
        return value
    if isinstance(value, str):
        hint = " (YAML reads 1e-3 as text; write 1.0e-3)" if kind == "float" else ""
        raise ConfigError(f"{bad}, a string{hint}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(bad)
    if kind == "int":
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(bad)
        value = int(value)
    else:
        value = float(value)
    if not (math.isfinite(value) and ok(value)):
        raise ConfigError(bad)
    return value


def resolve_optimizer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check `config` and fill in the defaults; the keys of the result are exactly those that apply.

    Keys derived when the optimizer is built (``decay_steps`` from ``max_steps``, ...) are ``None`` in the result,
    and a resolved config resolves to itself, so a backend may resolve what it was given, and pass either on.

    Example:
        >>> cfg = resolve_optimizer_config({"name": "sgd", "schedule": "warmup_cosine", "warmup_steps": 5})
        >>> cfg["decay_steps"] is None and resolve_optimizer_config(cfg) == cfg
        True
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"optimizer_config must be a mapping, got {type(config).__name__}")
    for key in config:
        if key not in _ALL_KEYS:
            raise ConfigError(
                f"unknown optimizer_config key {key!r}"
                f"{f' (did you mean {_ALIASES[key]!r}?)' if key in _ALIASES else suggestion(key, _ALL_KEYS)}; "
                f"allowed keys: {', '.join(_ALL_KEYS)}"
            )
    name = config.get("name", _COMMON["name"])
    if name not in _OPTIMIZERS:
        raise ConfigError(
            f"optimizer_config.name must be one of {', '.join(_OPTIMIZERS)}, got {name!r}"
            f"{suggestion(name, list(_OPTIMIZERS))}"
        )
    schedule = config.get("schedule", _COMMON["schedule"])
    if schedule not in _SCHEDULES:
        raise ConfigError(
            f"optimizer_config.schedule must be one of {', '.join(_SCHEDULES)}, got {schedule!r}"
            f"{suggestion(schedule, list(_SCHEDULES))}"
        )
    allowed = {**_OPTIMIZERS[name], **_SCHEDULES[schedule]}
    for key in config:
        if key in _COMMON or key in allowed or key == "lora":
            continue
        if key in {k for d in _OPTIMIZERS.values() for k in d}:
            users = [n for n, d in _OPTIMIZERS.items() if key in d]
            extra = " (use name: adamw for decoupled weight decay)" if name == "adam" and key == "weight_decay" else ""
            raise ConfigError(
                f"optimizer_config.{key} does not apply to name={name!r}{extra}; {name} takes "
                f"{', '.join(_OPTIMIZERS[name]) or 'no extra keys'}; {key} applies to {', '.join(users)}"
            )
        users = [n for n, d in _SCHEDULES.items() if key in d]
        raise ConfigError(
            f"optimizer_config.{key} does not apply to schedule={schedule!r}; {schedule} takes "
            f"{', '.join(_SCHEDULES[schedule])}; {key} applies to {', '.join(users)}"
        )
    out: dict[str, Any] = {"name": name, "schedule": schedule, "lr": _check_value("lr", config.get("lr", 1e-3))}
    for key, default in allowed.items():
        derived = default is None and config.get(key) is None  # left to the build (a resolved config says so)
        out[key] = default if key not in config or derived else _check_value(key, config[key])
    if config.get("lora") is not None:
        out["lora"] = resolve_lora(config["lora"])
    if out.get("nesterov") and not out.get("momentum"):
        raise ConfigError(f"optimizer_config.nesterov: true needs momentum > 0, got momentum={out['momentum']!r}")
    if schedule == "onecycle" and out["end_lr"] is not None and out["end_lr"] <= 0:
        raise ConfigError(f"optimizer_config.end_lr must be a float > 0 for schedule 'onecycle', got {out['end_lr']!r}")
    return out


def check_schedule(cfg: Mapping[str, Any], max_steps: int) -> tuple[int, int | None]:
    """``(decay_steps, warmup_steps)`` of a resolved config for a stage of `max_steps`, or a `ConfigError`.

    ``decay_steps`` defaults to `max_steps`; ``onecycle``'s warm-up defaults to 30% of it.
    """
    kind = cfg["schedule"]
    decay_steps: int = cfg.get("decay_steps") or max_steps
    given = cfg.get("decay_steps")
    source = f"decay_steps={decay_steps}" if given else f"decay_steps defaults to max_steps={max_steps}"
    warmup: int | None = cfg.get("warmup_steps")
    if kind == "onecycle":
        warmup = round(0.3 * decay_steps) if warmup is None else warmup
        if not 0 < warmup < decay_steps:
            raise ConfigError(
                f"optimizer_config.warmup_steps must be in (0, {decay_steps}) for schedule 'onecycle' ({source}), "
                f"got {warmup}"
            )
    elif kind == "warmup_cosine" and (warmup or 0) >= decay_steps:
        raise ConfigError(
            f"optimizer_config.warmup_steps must be < {decay_steps} for schedule 'warmup_cosine' ({source}), "
            f"got {warmup}; lower warmup_steps or raise max_steps"
        )
    elif warmup and warmup > max_steps:
        raise ConfigError(
            f"optimizer_config.warmup_steps ({warmup}) is more than max_steps ({max_steps}): the stage would end "
            "before the learning rate reached lr; lower warmup_steps or raise max_steps"
        )
    return decay_steps, warmup


def schedule_numbers(cfg: Mapping[str, Any], max_steps: int) -> dict[str, Any]:
    """The numbers of a config's learning-rate schedule for a stage of `max_steps` (checked first). `cfg` is
    resolved here (`resolve_optimizer_config` is idempotent), so a raw ``optimizer_config`` and a resolved one give
    the same numbers.

    These are values, not structure: the JAX backends carry them in the optimizer state, so a stage with another
    ``lr``, warm-up or horizon runs the same compiled step. Keys by schedule:

    - every schedule but onecycle: ``lr``, ``warmup`` (steps of the linear warm-up from 0; 0 for none);
    - ``warmup_cosine``: ``decay_steps`` (the total length, warm-up included) and ``alpha`` (``end_lr / lr``);
    - ``exponential``: ``decay_steps``, ``decay_rate`` and ``bound``, the floor (decay) or ceiling (growth) the
      rate is clipped to: ``end_lr``, or 0 / infinity when there is none (a clip that never acts);
    - ``onecycle``: ``lr``, ``peak_at`` (the step of the peak), ``end_at`` (``decay_steps``) and ``final_div``
      (``end = lr / 25 / final_div``), as ``optax.cosine_onecycle_schedule`` computes them.

    Example:
        >>> schedule_numbers(resolve_optimizer_config({"schedule": "warmup_cosine", "warmup_steps": 5}), 100)
        {'lr': 0.001, 'warmup': 5, 'decay_steps': 100, 'alpha': 0.0}
    """
    cfg = resolve_optimizer_config(cfg)
    decay_steps, warmup = check_schedule(cfg, max_steps)
    lr, kind = float(cfg["lr"]), cfg["schedule"]
    if kind == "onecycle":
        assert warmup is not None
        final_div = 1e4 if cfg["end_lr"] is None else (lr / 25.0) / cfg["end_lr"]
        # optax places the peak at int(pct_start * steps); with pct_start = warmup / steps that can round down.
        return {"lr": lr, "peak_at": int(warmup / decay_steps * decay_steps), "end_at": decay_steps,
                "final_div": final_div}  # fmt: skip
    out: dict[str, Any] = {"lr": lr, "warmup": warmup or 0}
    if kind == "warmup_cosine":
        out.update(decay_steps=decay_steps, alpha=cfg["end_lr"] / lr)
    elif kind == "exponential":
        rate, end = cfg["decay_rate"], cfg["end_lr"]
        out.update(
            decay_steps=decay_steps, decay_rate=rate, bound=end if end is not None else (0.0 if rate < 1 else math.inf)
        )
    return out


def check_optimizer_config(config: Mapping[str, Any], max_steps: int | None = None) -> None:
    """Raise `pipekit.ConfigError` if `config` would not build; with `max_steps`, check the schedule against it."""
    cfg = resolve_optimizer_config(config)
    if max_steps is not None:
        check_schedule(cfg, max_steps)
