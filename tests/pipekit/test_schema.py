"""The JSON Schema of pipeline files, `describe`, and the docs' `TrainingLoop` field table: all from the code."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import yaml

import pipekit
from pipekit import ConfigError, Operator
from pipekit._schema import field_docs, field_table, fields_of, summary

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(ROOT.glob("examples/**/*.yaml"))
ALL_TYPES = sorted(pipekit.registered().items())


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-3`` as a float as pipekit does (YAML 1.1 wants a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _plain(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(pipekit.schema())


def _messages(errors: Any) -> list[str]:
    """Every message in an error tree (a `oneOf` error holds each alternative's errors in `context`)."""
    out: list[str] = []
    for e in errors:
        out.append(e.message)
        out += _messages(e.context)
    return out


def _loop() -> dict[str, Any]:
    return {
        "type": "TrainingLoop",
        "model_op": {"type": "EquinoxModel", "factory": "mlp", "kwargs": {"in_size": 4, "out_size": 1}},
        "dataset": {"type": "TrainingDataset", "source": {"type": "NpzSource", "path": "train.npz"}},
        "loss": {"type": "MSE"},
        "max_steps": 20,
    }


# The schema is a valid JSON Schema and accepts what pipekit reads -----------------------------------------------
def test_the_schema_is_a_valid_draft_2020_12_schema():
    doc = pipekit.schema()
    jsonschema.Draft202012Validator.check_schema(doc)
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    json.dumps(doc, allow_nan=False)  # plain JSON: no NaN, no Python objects
    assert doc["properties"]["type"]["enum"] == sorted(pipekit.registered())


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_every_example_file_validates(path: Path, validator: jsonschema.Draft202012Validator, monkeypatch):
    if path.parent.name == "houses":  # its README loads the custom loss with --import house_loss
        monkeypatch.syspath_prepend(str(path.parent))
        importlib.import_module("house_loss")
        validator = jsonschema.Draft202012Validator(pipekit.schema())
    errors = list(validator.iter_errors(_plain(path.read_text(encoding="utf-8"))))
    assert not errors, jsonschema.exceptions.best_match(errors).message


def test_there_are_examples_to_validate():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("name,cls", ALL_TYPES, ids=[n for n, _ in ALL_TYPES])
def test_every_registered_operator_example_validates(name, cls, validator):
    """What `pipekit.dumps` writes for each registered type is valid: a new operator is covered once registered."""
    if not cls._yaml_serializable:
        pytest.skip(f"{name} holds in-memory data and cannot be written to YAML")
    errors = list(validator.iter_errors(_plain(pipekit.dumps(cls.example()))))
    assert not errors, jsonschema.exceptions.best_match(errors).message


def test_a_file_pipekit_loads_is_valid(validator):
    text = "pipekit: 1\ntype: Sequential\nstages:\n- type: Tap\n- {type: AssertShape, shapes: {x: [null, 3]}}\n"
    pipekit.loads(text)
    assert validator.is_valid(_plain(text))


# ... and refuses what pipekit refuses ---------------------------------------------------------------------------
def test_a_misspelled_field_is_rejected(validator):
    assert validator.is_valid(_loop())
    doc = {**_loop(), "max_step": 10}
    assert not validator.is_valid(doc)
    assert any("'max_step' was unexpected" in m for m in _messages(validator.iter_errors(doc)))


def test_a_misspelled_field_of_a_nested_operator_is_rejected(validator):
    doc = {"type": "Sequential", "stages": [{**_loop(), "loss": {"type": "MSE", "reductoin": "sum"}}]}
    assert not validator.is_valid(doc)
    assert any("'reductoin' was unexpected" in m for m in _messages(validator.iter_errors(doc)))


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("max_steps", "ten", "is not of type 'integer'"),
        ("max_steps", 1.5, "is not of type 'integer'"),
        ("progress", "yes", "is not of type 'boolean'"),
        ("grad_clip_norm", "big", "is not of type 'number', 'null'"),
        ("resume", "always", "is not one of ['never', 'auto']"),
        ("callbacks", {"type": "EMA"}, "is not of type 'array'"),
        ("loss", {"type": "Checkpoint"}, "is not valid under any of the given schemas"),
    ],
)
def test_a_wrong_type_is_rejected(validator, field, value, expected):
    doc = {**_loop(), field: value}
    assert not validator.is_valid(doc)
    assert any(expected in m for m in _messages(validator.iter_errors(doc)))


def test_unknown_types_missing_fields_and_other_versions_are_rejected(validator):
    assert not validator.is_valid({**_loop(), "type": "TrainingLop"})
    assert not validator.is_valid({"type": "TrainingLoop", "loss": {"type": "MSE"}})  # model_op, dataset
    assert not validator.is_valid({"max_steps": 3})  # no type
    assert validator.is_valid({"pipekit": 1, **_loop()})
    assert not validator.is_valid({"pipekit": 2, **_loop()})
    nested = {"type": "Sequential", "stages": [{"pipekit": 1, "type": "Tap"}]}  # the version key is top-level only
    assert not validator.is_valid(nested)
    assert validator.is_valid({"pipekit": 1, "type": "Sequential", "stages": [{"type": "Tap"}]})
    with pytest.raises(ConfigError, match="no field 'pipekit'"):
        pipekit.loads(yaml.safe_dump(nested))


# What the schema says about each field ---------------------------------------------------------------------------
def test_operator_fields_take_any_registered_operator_of_their_class():
    doc = pipekit.schema()
    loss = doc["$defs"]["TrainingLoop"]["properties"]["loss"]
    assert loss["anyOf"][1] == {"type": "null"}
    kind = doc["$defs"][loss["anyOf"][0]["$ref"].removeprefix("#/$defs/")]
    from pipekit_train import Loss

    losses = sorted(n for n, c in pipekit.registered().items() if issubclass(c, Loss))
    assert {"MSE", "CrossEntropy", "Composite"} <= set(losses)
    assert kind["oneOf"] == [{"$ref": f"#/$defs/{n}"} for n in losses]
    stages = doc["$defs"]["Sequential"]["properties"]["stages"]
    anything = doc["$defs"][stages["items"]["$ref"].removeprefix("#/$defs/")]
    assert len(anything["oneOf"]) == len(pipekit.registered())


def test_the_training_loop_definition_mirrors_the_class():
    loop = pipekit.schema()["$defs"]["TrainingLoop"]
    assert loop["additionalProperties"] is False
    assert loop["required"] == ["type", "model_op", "dataset"]
    props = loop["properties"]
    assert props["type"] == {"const": "TrainingLoop"}
    assert props["max_steps"]["type"] == "integer" and props["max_steps"]["default"] == 10000
    assert props["max_steps"]["description"].startswith("Optimizer steps")  # from TrainingLoop's Attributes
    assert props["optimizer_config"]["default"] == {"name": "adamw", "lr": 0.0003}
    assert props["resume"]["enum"] == ["never", "auto"] and props["resume"]["default"] == "never"
    assert props["callbacks"]["type"] == "array" and props["callbacks"]["default"] == []
    assert loop["description"] == summary(pipekit_train_loop())


def pipekit_train_loop() -> type[Operator]:
    from pipekit_train import TrainingLoop

    return TrainingLoop


def test_descriptions_come_from_the_docstring():
    doc = pipekit.schema()["$defs"]
    checkpoint = doc["Checkpoint"]
    assert checkpoint["description"].startswith("When to checkpoint and what to keep")
    assert checkpoint["properties"]["every_n_steps"]["description"] == (
        "Save at every multiple of this many optimizer steps."
    )
    assert checkpoint["properties"]["keep"]["default"] == [{"type": "Best", "k": 3}, {"type": "Last"}]
    assert "`Source`" in doc["TrainingDataset"]["properties"]["source"]["description"]


class _Documented(Operator, register=False):
    """A test operator.

    More prose that is not the summary.

    Args:
        count: How many,
            on two lines.
        ratio (float): A ``ratio``.

    Example:
        not: a field
    """

    count: int
    ratio: float | None = 0.5
    mode: Literal["a", "b"] = "a"
    sizes: tuple[int, ...] = (1, 2)
    pair: tuple[float, str] = (1.0, "x")
    table: dict[str, int] = pipekit.field(default_factory=dict)
    names: list[str] = pipekit.field(default_factory=list)
    anything: Any = None
    flag: bool = False
    stage: Operator | None = None


def test_hints_become_json_types():
    props = pipekit.schema({"Documented": _Documented})["$defs"]["Documented"]["properties"]
    assert props["count"] == {"type": "integer", "description": "How many, on two lines."}
    assert props["ratio"] == {"type": ["number", "null"], "description": "A `ratio`.", "default": 0.5}
    assert props["mode"] == {"enum": ["a", "b"], "default": "a"}
    assert props["sizes"] == {"type": "array", "items": {"type": "integer"}, "default": [1, 2]}
    assert props["pair"] == {
        "type": "array",
        "prefixItems": [{"type": "number"}, {"type": "string"}],
        "minItems": 2,
        "items": False,
        "default": [1.0, "x"],
    }
    assert props["table"] == {"type": "object", "additionalProperties": {"type": "integer"}, "default": {}}
    assert props["names"] == {"type": "array", "items": {"type": "string"}, "default": []}
    assert props["anything"] == {"default": None}
    assert props["flag"] == {"type": "boolean", "default": False}
    assert props["stage"] == {"anyOf": [{"$ref": "#/$defs/any.Operator"}, {"type": "null"}], "default": None}


def test_fields_summary_and_table_of_a_documented_class():
    assert summary(_Documented) == "A test operator."
    assert field_docs(_Documented) == {"count": "How many, on two lines.", "ratio": "A `ratio`."}
    infos = {i.name: i for i in fields_of(_Documented)}
    assert infos["count"].required and not infos["ratio"].required
    assert infos["ratio"].meaning == "A `ratio`."
    table = field_table(_Documented, {"flag": "a | b"}).splitlines()
    assert table[:3] == [
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
        "| `count` | `int` | required | How many, on two lines. |",
    ]
    assert '| `mode` | `"a" or "b"` | `a` |  |' in table
    assert "| `pair` | `[float, str]` | `[1.0, x]` |  |" in table
    assert "| `flag` | `bool` | `false` | a \\| b |" in table


# describe ------------------------------------------------------------------------------------------------------
def test_describe_lists_the_fields_with_types_and_defaults():
    text = pipekit.describe("TrainingLoop")
    assert text.startswith("TrainingLoop  (pipekit_train.stage.loop.TrainingLoop)")
    assert summary(pipekit_train_loop()) in text
    assert re.search(r"^max_steps +int +10000\b", text, re.M)
    assert re.search(r"^model_op +ModelOp +required\b", text, re.M)
    assert re.search(r"^resume +\"never\" or \"auto\" +never\b", text, re.M)
    assert re.search(r"^  Loss: .*\bMSE\b", text, re.M)  # which types the operator fields take
    assert pipekit.describe(pipekit_train_loop()) == text


def test_describe_shows_documented_meanings_and_kinds():
    text = pipekit.describe("Checkpoint")
    assert re.search(r"^every_n_steps +int +500 +Save at every multiple", text, re.M)
    kind = pipekit.describe("Loss")
    assert "Not registered as a type of its own" in kind and "MSE" in kind


#: The operators this project ships (others registered by test modules collected before this one are not ours).
OWN_TYPES = [(n, c) for n, c in ALL_TYPES if c.__module__.split(".")[0] in ("pipekit", "pipekit_train")]


@pytest.mark.parametrize("name,cls", OWN_TYPES, ids=[n for n, _ in OWN_TYPES])
def test_every_registered_operator_documents_every_field(name, cls):
    """`pipekit-train describe NAME` has a meaning for every field (EMA's column was empty): each field is in an
    ``Args:`` / ``Attributes:`` section of the class's docstring or a base's (`Callback.order` for every callback)."""
    undocumented = [info.name for info in fields_of(cls) if not info.meaning]
    assert not undocumented, f"{name}: document {undocumented} in its docstring's Args: section"


def test_describe_an_unknown_name_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown operator type 'TrainingLop' \(did you mean 'TrainingLoop'"):
        pipekit.describe("TrainingLop")
    with pytest.raises(ConfigError, match="expects an operator type"):
        pipekit.describe(int)  # type: ignore[arg-type]


def test_the_schema_module_imports_no_jax():
    code = "import sys, pipekit._schema; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The docs' field table is the code's -----------------------------------------------------------------------------
def _table_rows(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.strip().splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row.strip()[1:-1])] for row in rows]
    assert cells[0][:3] == ["field", "type", "default"], cells[0]
    return cells[2:]


def test_the_docs_training_loop_field_table_matches_the_code():
    """docs/yaml.md's table lists exactly TrainingLoop's fields, in order, with the code's types and defaults.

    The meanings are the docs' own. To refresh the rest after changing the class, print
    ``pipekit._schema.field_table(pipekit_train.TrainingLoop)`` and keep the docs' meanings.
    """
    text = (ROOT / "docs" / "yaml.md").read_text(encoding="utf-8")
    match = re.search(r"^## `TrainingLoop` fields\n\n((?:\|.*\n)+)", text, re.M)
    assert match, "docs/yaml.md has no table under '## `TrainingLoop` fields'"
    docs = [row[:3] for row in _table_rows(match.group(1))]
    code = [row[:3] for row in _table_rows(field_table(pipekit_train_loop()))]
    assert [r[0] for r in docs] == [r[0] for r in code], "field names or order differ from TrainingLoop's"
    assert docs == code
    assert all(meaning for *_, meaning in _table_rows(match.group(1))), "every field needs a meaning"


def test_the_field_table_renders_defaults_as_yaml():
    rows = {r[0]: r for r in _table_rows(field_table(pipekit_train_loop()))}
    assert rows["`max_steps`"][1:3] == ["`int`", "`10000`"]
    assert rows["`optimizer_config`"][2] == "`{name: adamw, lr: 0.0003}`"
    assert rows["`model_op`"][2] == "required"
    assert rows["`loss`"][1:3] == ["`Loss or null`", "`null`"]
    assert rows["`callbacks`"][1:3] == ["`list of Callback`", "`[]`"]


def test_import_pipekit_leaves_editor_help_and_entry_points_for_later() -> None:
    """``import pipekit`` imports neither the schema module nor ``importlib.metadata`` (issue 45: they made it cost
    more than ``import numpy``); both come on first use. A fresh process: the modules a process has imported are
    the point."""
    import subprocess
    import sys

    code = (
        "import sys, pipekit; before = [m for m in ('pipekit._schema', 'importlib.metadata') if m in sys.modules]; "
        "pipekit.describe; print(before, 'pipekit._schema' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[] True"
