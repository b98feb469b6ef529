"""The operator algebra: fields, values, Sequential, built-ins."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError, Operator, Sequential, ShapeError, StatefulOperator, field


class Affine(Operator, register=False):
    scale: float = 1.0
    shift: float = 0.0
    tags: tuple[str, ...] = ()
    options: dict[str, int] = field(default_factory=dict)

    def __call__(self, x):
        return x * self.scale + self.shift


class CountCalls(StatefulOperator, register=False):
    def _apply(self, carrier, state):
        state = (state or 0) + 1
        return carrier, state


def test_fields_are_typed_frozen_and_keyword_only():
    op = Affine(scale=2, tags=["a", "b"])
    assert op.scale == 2.0 and isinstance(op.scale, float)
    assert op.tags == ("a", "b")  # a list becomes a tuple where the hint says tuple
    with pytest.raises(AttributeError):
        op.scale = 3.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Affine(2.0)  # type: ignore[misc]


def test_assigning_to_an_operator_says_whose_field_and_what_to_do():
    import dataclasses

    from pipekit import PipekitError

    op = Affine(scale=2)
    with pytest.raises(PipekitError, match=r"^Affine.scale cannot be assigned: .* frozen .*replace\(scale="):
        op.scale = 3.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"^Affine cannot hold a new attribute 'cache'"):
        op.cache = {}  # type: ignore[attr-defined]
    with pytest.raises(PipekitError, match=r"^Affine.shift cannot be assigned"):
        del op.shift
    assert op == Affine(scale=2)


def test_wrong_type_names_field_rule_and_value():
    with pytest.raises(ConfigError, match=r"Affine\.scale must be float, got 'big'"):
        Affine(scale="big")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Affine\.tags\[1\] must be str"):
        Affine(tags=("a", 3))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"must be float, got True"):
        Affine(scale=True)


def test_equality_hash_and_repr_are_by_value():
    a = Affine(scale=2.0, options={"k": 1, "j": 2})
    b = Affine(scale=2, options={"j": 2, "k": 1})
    assert a == b and hash(a) == hash(b)
    assert a != Affine(scale=3.0)
    assert repr(Affine(shift=1.5)) == "Affine(shift=1.5)"
    assert {a, b} == {a}


def test_replace_returns_a_new_value():
    a = Affine(scale=2.0)
    b = a.replace(shift=1.0)
    assert (a.shift, b.shift, b.scale) == (0.0, 1.0, 2.0)
    with pytest.raises(ConfigError, match="no field"):
        a.replace(shfit=1.0)


class Mirrored(Operator, register=False):
    """``shift`` defaults to ``scale`` when a call leaves it out: a default that depends on the call."""

    scale: float = 1.0
    shift: float = 0.0

    @classmethod
    def fill_fields(cls, given):
        return {"shift": given.get("scale", 1.0), **given}


def test_fill_fields_sees_the_keywords_a_call_passes():
    assert Mirrored(scale=3.0).shift == 3.0
    assert Mirrored(scale=3.0, shift=0.0).shift == 0.0  # passed, even as the default: kept
    assert Mirrored(scale=2.0).replace(scale=5.0).shift == 2.0  # `replace` passes every field
    assert MirroredChild(scale=4.0).shift == 4.0  # a subclass keeps its parent's hook (YAML: tests/recipes)
    with pytest.raises(ConfigError, match=r"Mirrored\.scale must be float, got 'x'"):
        Mirrored(scale="x")  # the filled keywords are checked like any others
    assert "__init__" not in vars(Affine) or not hasattr(Affine.__init__, "__wrapped__")  # no hook, no wrapper
    assert Mirrored.__init__.__wrapped__.__qualname__.endswith("__init__")  # the dataclass's own, called after it


class MirroredChild(Mirrored, register=False):
    pass


def test_sequential_threads_carrier_and_state():
    pipe = Sequential([Affine(scale=2.0), CountCalls(), Sequential([CountCalls(), Affine(shift=1.0)])])
    carrier, state = pipe._apply(3.0, None)
    assert carrier == 7.0
    assert state == 2  # both stateful stages saw the state the previous one returned
    assert pipe(3.0) == 7.0


def test_sequential_needs_stages():
    with pytest.raises(ConfigError, match="at least one"):
        Sequential([])


def test_carry_state_round_trip():
    class S(pipekit.CarryState):
        def __init__(self, step: int = 0, metrics: dict | None = None) -> None:
            self.step = step
            self.metrics = metrics or {}

    s = S(step=4, metrics={"loss": 0.5})
    assert S.from_dict(s.to_dict()) == s
    with pytest.raises(ConfigError, match="unknown key"):
        S.from_dict({"stepp": 1})


def test_assert_shape_names_leaf_expected_and_actual():
    tree = {"image": np.zeros((8, 28, 28)), "label": np.zeros((8,), np.int32)}
    ok = pipekit.AssertShape(shapes={"image": (None, 28, 28)}, dtypes={"label": "int32"})
    assert ok(tree) is tree
    with pytest.raises(ShapeError, match=r"leaf 'image' should have shape \(None, 32, 32\), got \(8, 28, 28\)"):
        pipekit.AssertShape(shapes={"image": (None, 32, 32)})(tree)
    with pytest.raises(ShapeError, match=r"should have dtype float32, got int32"):
        pipekit.AssertShape(dtypes={"label": "float32"})(tree)
    with pytest.raises(ShapeError, match=r"no array leaf 'imag'.*did you mean 'image'"):
        pipekit.AssertShape(shapes={"imag": (1,)})(tree)


def test_tap_unknown_sink_suggests():
    with pytest.raises(ConfigError, match=r"'prnt' is not a registered sink \(did you mean 'print'\?\)"):
        pipekit.Tap(sink="prnt")(1)


def test_import_pipekit_does_not_import_jax():
    # Counted, never timed: a fresh process imports pipekit and lists what else got imported.
    code = (
        "import sys, pipekit; heavy = {'jax', 'jaxlib', 'equinox', 'optax', 'grain', 'orbax'}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
