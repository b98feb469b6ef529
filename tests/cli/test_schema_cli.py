"""``pipekit-train describe TYPE`` and ``pipekit-train schema [-o FILE]``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

import pipekit
from pipekit_train.cli._common import run_commands
from pipekit_train.cli._schema import add_schema_commands, main


def _cli(*argv: str) -> int:
    """Run a command through a parser of our own, as `pipekit-train`'s parser will hold these commands."""
    parser = argparse.ArgumentParser(prog="pipekit-train")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_schema_commands(sub)
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def test_describe_training_loop_shows_max_steps_and_its_default(capsys):
    assert _cli("describe", "TrainingLoop") == 0
    out = capsys.readouterr().out
    assert out.startswith("TrainingLoop  (pipekit_train.stage.loop.TrainingLoop)")
    assert re.search(r"^max_steps +int +10000\b", out, re.M)
    assert re.search(r"^dataset +TrainingDataset +required\b", out, re.M)


def test_describe_a_documented_type_shows_the_meanings(capsys):
    assert main(["describe", "Checkpoint"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^every_n_steps +int +500 +Save at every multiple of this many\b", out, re.M)
    assert re.search(r"^layout +\"auto\" or \"flat\" or \"orbax\" +auto +How a checkpoint is written", out, re.M)


def test_describe_a_typo_suggests_the_right_name_in_one_line(capsys):
    assert _cli("describe", "TrainingLop") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("pipekit-train describe: error: unknown operator type 'TrainingLop'")
    assert "(did you mean 'TrainingLoop'" in lines[0]


def test_describe_a_kind_lists_its_types(capsys):
    assert run_commands(add_schema_commands, ["describe", "Callback"]) == 0
    out = capsys.readouterr().out
    assert "Not registered as a type of its own" in out
    assert all(name in out for name in ("Checkpoint", "EarlyStopping", "EMA"))


def test_schema_writes_the_json_schema_to_a_file(tmp_path: Path, capsys):
    target = tmp_path / "pipekit.schema.json"
    assert _cli("schema", "-o", str(target)) == 0
    written = json.loads(target.read_text(encoding="utf-8"))
    assert written == json.loads(json.dumps(pipekit.schema()))
    assert written["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "TrainingLoop" in written["$defs"]
    out = capsys.readouterr().out
    assert out.strip() == f"wrote the JSON Schema of {len(pipekit.registered())} operator types to {target}"
    assert not list(tmp_path.glob("*.tmp"))


def test_schema_prints_json_to_stdout(capsys):
    assert main(["schema"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["properties"]["type"]["enum"] == sorted(pipekit.registered())


def test_schema_into_a_missing_folder_is_one_line(tmp_path: Path, capsys):
    assert main(["schema", "-o", str(tmp_path / "no" / "such" / "dir" / "s.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("pipekit-train schema: error: -o ") and "cannot write the schema" in err[0]


def test_describe_imports_the_modules_named_by_import(tmp_path: Path, capsys, monkeypatch):
    (tmp_path / "schema_cli_plugin.py").write_text(
        "import pipekit\n\n\n"
        "class SchemaCliHuber(pipekit.Operator):\n"
        '    """A Huber loss, for the test.\n\n    Args:\n        delta: where the loss turns linear.\n    """\n\n'
        "    delta: float = 1.0\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # The module and the type it registers are forgotten after this test.
    monkeypatch.setattr("pipekit._registry._REGISTRY", dict(pipekit._registry._REGISTRY))
    monkeypatch.setitem(sys.modules, "schema_cli_plugin", None)  # undone by removing the module
    del sys.modules["schema_cli_plugin"]
    assert main(["describe", "SchemaCliHuber", "--import", "schema_cli_plugin"]) == 0
    assert re.search(r"^delta +float +1\.0 +where the loss turns linear\.", capsys.readouterr().out, re.M)
    assert main(["schema", "--import", "schema_cli_plugin"]) == 0
    assert "SchemaCliHuber" in json.loads(capsys.readouterr().out)["$defs"]


def test_describe_needs_a_type(capsys):
    assert main(["describe"]) == 2
    assert "TYPE" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["describe", "schema"])
def test_help_explains_the_command(command, capsys):
    assert main([command, "--help"]) == 0
    assert "--import MODULE" in capsys.readouterr().out
