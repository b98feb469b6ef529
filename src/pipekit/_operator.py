"""`Operator`, `StatefulOperator` and `CarryState`: the values a pipeline is made of."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import sys
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from . import _registry
from ._errors import ConfigError, PipekitError
from ._types import check_field

field = dataclasses.field

_HINTS: dict[type, dict[str, Any]] = {}

#: True inside `deferred_validation`: operators check each field's type but not the fields together (`validate`).
_DEFER_VALIDATE: contextvars.ContextVar[bool] = contextvars.ContextVar("pipekit_defer_validate", default=False)


@contextlib.contextmanager
def deferred_validation() -> Iterator[None]:
    """Operators built inside check each field's type but skip `Operator.validate` (the fields together).

    For several edits that are only consistent together (``--set model_op=... --set backend=...``): make them all
    inside, then rebuild the edited operators outside (`dataclasses.replace(op)`), which checks them once.
    """
    token = _DEFER_VALIDATE.set(True)
    try:
        yield
    finally:
        _DEFER_VALIDATE.reset(token)


def field_hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of `cls`'s fields; a hint that cannot be resolved counts as `Any`."""
    cached = _HINTS.get(cls)
    if cached is not None:
        return cached
    hints: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        ann = f.type
        if isinstance(ann, str):
            owner = next((k for k in cls.__mro__ if f.name in k.__dict__.get("__annotations__", {})), cls)
            module = sys.modules.get(owner.__module__)
            namespace = dict(vars(module)) if module else {}
            namespace.update(_registry._REGISTRY)
            try:
                ann = eval(ann, namespace, dict(vars(owner)))
            except Exception:
                ann = Any
        hints[f.name] = ann
    _HINTS[cls] = hints
    return hints


def canonical(value: Any) -> Any:
    """A hashable, order-stable stand-in for `value`: what operators compare and hash their fields by (mappings by
    sorted key, sequences element by element, arrays by dtype, shape and bytes). Use it to key a cache by an
    operator field's value (an ``optimizer_config`` dict, a factory's kwargs).

    Example:
        >>> canonical({"b": [1, 2], "a": 1.0}) == canonical({"a": 1.0, "b": (1, 2)})
        True
    """
    if isinstance(value, Operator):
        return value
    if isinstance(value, Mapping):
        return ("__map__", tuple(sorted(((repr(k), canonical(v)) for k, v in value.items()))))
    if isinstance(value, (list, tuple)):
        return ("__seq__", tuple(canonical(v) for v in value))
    if hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "tobytes"):
        digest = hashlib.sha256(value.tobytes()).hexdigest()
        return ("__array__", str(value.dtype), tuple(value.shape), digest)
    if isinstance(value, float) and value != value:
        return ("__nan__",)
    try:
        hash(value)
    except TypeError:
        return ("__id__", id(value))
    return value


def _filling_init(cls: type[Operator], init: Any) -> Any:
    """`cls`'s dataclass ``__init__`` after `Operator.fill_fields` (for a class that overrides the hook)."""

    @functools.wraps(init)
    def __init__(self: Operator, **kwargs: Any) -> None:
        init(self, **cls.fill_fields(kwargs))

    return __init__


class FrozenOperatorError(PipekitError, dataclasses.FrozenInstanceError):
    """An attribute of an operator was assigned or deleted: operators are frozen (`Operator.frozen_message` says
    what to do instead). A `dataclasses.FrozenInstanceError` too, as the assignment to any frozen dataclass."""


def _frozen_setattr(self: Operator, name: str, value: Any) -> None:
    raise FrozenOperatorError(type(self).frozen_message(name))


def _frozen_delattr(self: Operator, name: str) -> None:
    raise FrozenOperatorError(type(self).frozen_message(name))


@typing.dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field,))
class Operator:
    """A frozen, typed, keyword-constructed configuration value that can be applied to a carrier.

    Subclasses declare fields as annotated class attributes with defaults, exactly like a dataclass; the
    subclass is made a frozen, keyword-only dataclass and registered under its class name (or the `name=`
    class keyword). Pass ``register=False`` for abstract bases. Override `validate` to check fields together;
    field types are checked from the annotations before it runs. Override `fill_fields` for defaults that depend
    on which fields a call passes.

    Example:
        >>> import pipekit
        >>> class Times(pipekit.Operator):
        ...     factor: float = 1.0
        ...     def __call__(self, x):
        ...         return x * self.factor
        >>> Times(factor=3)(2)
        6.0
        >>> Times(factor=3)
        Times(factor=3.0)
        >>> Times(factor=3) == Times(factor=3.0)
        True
    """

    _pipekit_name: ClassVar[str | None] = None
    #: Whether instances can be written to YAML. Operators holding in-memory arrays say no.
    _yaml_serializable: ClassVar[bool] = True

    def __init_subclass__(cls, *, name: str | None = None, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)(cls)
        # The dataclass's own refusal reads "cannot assign to field 'x'": say whose and what to do instead.
        type.__setattr__(cls, "__setattr__", _frozen_setattr)
        type.__setattr__(cls, "__delattr__", _frozen_delattr)
        if cls.fill_fields.__func__ is not Operator.fill_fields.__func__:  # type: ignore[attr-defined]
            setattr(cls, "__init__", _filling_init(cls, cls.__init__))  # noqa: B010  # the dataclass's own
        cls._pipekit_name = None
        if register:
            reg_name = name or cls.__name__
            _registry.register(reg_name, cls)
            cls._pipekit_name = reg_name

    def __post_init__(self) -> None:
        cls = type(self)
        hints = field_hints(cls)
        owner = cls._pipekit_name or cls.__name__
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            new = check_field(owner, f.name, value, hints.get(f.name, Any))
            if new is not value:
                object.__setattr__(self, f.name, new)
        if not _DEFER_VALIDATE.get():
            self.validate()

    @classmethod
    def fill_fields(cls, given: dict[str, Any]) -> dict[str, Any]:
        """The keywords the dataclass ``__init__`` receives, from those a call passed (`given`); by default `given`.

        The hook for defaults that depend on the call, such as `TrainingLoop`'s ``preset`` filling the fields a
        call leaves out: only the construction sees which keywords were passed (afterwards a field set to its
        default and a field left out are the same value). A class that overrides it gets an ``__init__`` that
        calls it before the generated one, so a Python call, the YAML loader and `replace` all go through it.
        """
        return given

    def validate(self) -> None:
        """Check the fields together; raise `ConfigError` naming the field, the rule and the value."""

    def __call__(self, carrier: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is not applicable to a carrier")

    def python_only(self) -> tuple[str, str] | None:
        """For an operator standing for a Python object that has no YAML form (a loss given as a plain function):
        ``(the object's name, what to write instead)``. `pipekit.dumps` refuses the operator with both; a record
        (``strict=False``) and a resume fingerprint name it by the first, as ``"<name> (Python object, not written
        to YAML)"``. ``None``, the default: the operator is its fields."""
        return None

    # Value semantics -------------------------------------------------------------------------------------
    def _key(self) -> tuple[Any, ...]:
        return (type(self), *(canonical(getattr(self, f.name)) for f in dataclasses.fields(self)))  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return bool(self._key() == other._key())  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.non_default_fields().items()]
        return f"{type(self).__name__}({', '.join(parts)})"

    def non_default_fields(self) -> dict[str, Any]:
        """The fields whose values differ from their defaults, in declaration order."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                out[f.name] = value
                continue
            if canonical(value) != canonical(default) or type(value) is not type(default):
                out[f.name] = value
        return out

    @classmethod
    def frozen_message(cls, name: str) -> str:
        """The one-line error for code that assigns (or deletes) attribute `name` of an operator of this type."""
        owner = cls._pipekit_name or cls.__name__
        if name in {f.name for f in dataclasses.fields(cls)}:  # type: ignore[arg-type]
            return (
                f"{owner}.{name} cannot be assigned: an operator is frozen (its fields are its whole configuration); "
                f"make a changed copy with .replace({name}=...)"
            )
        return (
            f"{owner} cannot hold a new attribute {name!r}: an operator is frozen (its fields are its whole "
            "configuration, and it has no other state)"
        )

    def replace(self, **changes: Any) -> typing.Self:
        """A copy with some fields changed (the operator itself never changes)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        if unknown:
            raise ConfigError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def example(cls) -> typing.Self:
        """A representative instance, used by the registry-wide YAML round-trip test.

        Operators with required fields override this; the default builds one from the defaults.
        """
        return cls()


class StatefulOperator(Operator, register=False):
    """An operator that threads a carry-state: ``_apply(carrier, state) -> (carrier, state)``."""

    def initial_state(self) -> CarryState | None:
        """The state a run starts from; ``None`` lets the operator build its own on first use."""
        return None

    def _apply(self, carrier: Any, state: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def __call__(self, carrier: Any) -> Any:
        return self._apply(carrier, self.initial_state())[0]

    def run(self) -> Any:
        """Run an operator that needs no input, returning its output carrier."""
        return self._apply(None, self.initial_state())[0]


class CarryState:
    """State that changes while a pipeline runs; subclasses round-trip through `to_dict` / `from_dict`.

    The fields are the parameters of the subclass's ``__init__``. Subclasses whose values are not plain
    data (arrays, keys) override `to_dict` / `from_dict` to encode them.

    Example:
        >>> class Counter(CarryState):
        ...     def __init__(self, count: int = 0) -> None:
        ...         self.count = count
        >>> Counter.from_dict(Counter(count=3).to_dict()).count
        3
    """

    @classmethod
    def _field_names(cls) -> list[str]:
        import inspect

        params = inspect.signature(cls.__init__).parameters
        return [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD]

    def to_dict(self) -> dict[str, Any]:
        """The state as a dict of its ``__init__`` parameters."""
        return {name: getattr(self, name) for name in self._field_names()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> typing.Self:
        """Rebuild a state from `to_dict`'s output; unknown keys are an error naming them."""
        names = cls._field_names()
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ConfigError(f"{cls.__name__}.from_dict got unknown key(s) {unknown}; expected {names}")
        return cls(**data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return bool(canonical(self.to_dict()) == canonical(other.to_dict()))  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]
