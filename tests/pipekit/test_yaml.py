"""YAML: round trips over the whole registry, located errors, and the security rules."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import pipekit
from pipekit import ConfigError

ALL_TYPES = sorted(pipekit.registered().items())


@pytest.mark.parametrize("name,cls", ALL_TYPES, ids=[n for n, _ in ALL_TYPES])
def test_round_trip_every_registered_operator(name, cls):
    """loads(dumps(op)) == op for every registered type; a new operator is covered once registered."""
    op = cls.example()
    if not cls._yaml_serializable:
        with pytest.raises(ConfigError, match="cannot be written to YAML"):
            pipekit.dumps(op)
        return
    text = pipekit.dumps(op)
    assert f"type: {name}" in text
    back = pipekit.loads(text)
    assert back == op
    assert type(back) is cls
    assert pipekit.dumps(back) == text


def test_registry_holds_the_builtins():
    names = dict(ALL_TYPES)
    assert {"Sequential", "Tap", "AssertShape"} <= set(names)


def test_only_non_default_fields_are_written_and_defaults_fill_in():
    text = pipekit.dumps(pipekit.Tap())
    assert text == "pipekit: 1\ntype: Tap\n"
    assert pipekit.loads("type: Tap") == pipekit.Tap()


def test_file_round_trip_and_errors_name_the_file(tmp_path: Path):
    path = tmp_path / "pipe.yaml"
    op = pipekit.Sequential([pipekit.Tap(), pipekit.AssertShape(shapes={"x": (1, 2)})])
    pipekit.dump(op, path)
    assert pipekit.load(path) == op
    path.write_text("pipekit: 1\ntype: Sequential\nstages:\n  - type: Tapp\n")
    with pytest.raises(ConfigError, match=rf"{path.name}:4:11: unknown operator type 'Tapp' \(did you mean 'Tap'\?\)"):
        pipekit.load(path)
    with pytest.raises(ConfigError, match="pipeline file not found"):
        pipekit.load(tmp_path / "missing.yaml")


def test_unknown_field_names_operator_field_allowed_and_closest():
    with pytest.raises(ConfigError) as info:
        pipekit.loads("type: AssertShape\nshape: {x: [1]}\n", source="p.yaml")
    msg = str(info.value)
    assert msg.startswith("p.yaml:2:1: AssertShape has no field 'shape' (did you mean 'shapes'?)")
    assert "allowed fields: shapes, dtypes" in msg


def test_wrong_type_names_field_expected_and_value_with_location():
    with pytest.raises(ConfigError, match=r"p.yaml:2:7: Tap.sink must be str, got 3"):
        pipekit.loads("type: Tap\nsink: 3\n", source="p.yaml")


def test_missing_type_and_bad_version():
    with pytest.raises(ConfigError, match="needs a 'type:' key"):
        pipekit.loads("sink: print\n")
    with pytest.raises(ConfigError, match="unsupported pipekit format version 99"):
        pipekit.loads("pipekit: 99\ntype: Tap\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        pipekit.loads("type: [Tap\n")
    with pytest.raises(ConfigError, match="empty"):
        pipekit.loads("")


# Security --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "doc",
    [
        '!!python/object/apply:os.system ["touch {marker}"]',
        'type: Tap\nsink: !!python/object/apply:os.system ["touch {marker}"]',
        'type: Sequential\nstages: [!!python/object/new:os.system ["touch {marker}"]]',
        "type: Tap\nsink: !!python/name:os.system",
        'type: Tap\nsink: !!binary "aGVsbG8="',
        "type: Tap\nsink: !custom thing",
    ],
)
def test_python_tags_are_refused_and_nothing_runs(tmp_path: Path, doc: str):
    marker = tmp_path / "pwned"
    with pytest.raises(ConfigError, match="(not allowed|operator type must be)"):
        pipekit.loads(doc.format(marker=marker))
    assert not marker.exists()


@pytest.mark.parametrize("dotted", ["os.system", "subprocess.Popen", "builtins.exec", "pipekit.Tap"])
def test_dotted_type_is_refused_before_import(dotted: str):
    import sys

    before = set(sys.modules)
    with pytest.raises(ConfigError, match="must be a registered name"):
        pipekit.loads(f"type: {dotted}\n")
    assert "subprocess" in before or "subprocess" not in sys.modules


def test_billion_laughs_is_refused_quickly():
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    doc = "type: AssertShape\nshapes:\n" + "\n".join("  " + line for line in lines) + "\n"
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="more than 100000 nodes"):
        pipekit.loads(doc)
    assert time.perf_counter() - start < 5  # refused long before the 9**9 expansion


def test_deep_nesting_is_refused():
    doc = "type: AssertShape\nshapes: " + "[" * 500 + "]" * 500 + "\n"
    with pytest.raises(ConfigError, match="nests deeper than"):
        pipekit.loads(doc)


def test_recursive_alias_is_refused():
    with pytest.raises(ConfigError, match="(nests deeper|more than)"):
        pipekit.loads("type: AssertShape\nshapes: &a {x: *a}\n")


def test_loader_never_imports_named_modules():
    env_before = dict(os.environ)
    with pytest.raises(ConfigError):
        pipekit.loads("type: os.environ.clear\n")
    assert dict(os.environ) == env_before


def test_scientific_notation_without_a_dot_is_a_float():
    shapes = pipekit.loads("type: AssertShape\nshapes: {x: [1]}\ndtypes: {x: '1e-3'}\n")
    assert shapes.dtypes == {"x": "1e-3"}  # quoted stays a string
    builder = pipekit._yaml._Builder("t")
    import yaml

    assert builder.plain(yaml.compose("{a: 1e-3, b: -2E+4, c: 1.5e-3, d: 1e3x}")) == {
        "a": 0.001,
        "b": -20000.0,
        "c": 0.0015,
        "d": "1e3x",
    }
