"""Warnings of pipekit-train print as one line on standard error, ``pipekit-train: warning: ...``, like errors
(`cli._common.one_line_warnings`): no Python ``file:line: Category:`` header with an internal path, no source line."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from pipekit_train import PipekitTrainWarning
from pipekit_train.cli import main
from pipekit_train.cli._common import one_line_warnings


def _damaged(root: Path) -> Path:
    """A run directory whose one checkpoint manifest is not JSON: listing it warns and goes on."""
    (root / "run" / "fit" / "checkpoints").mkdir(parents=True)
    manifest = root / "run" / "fit" / "checkpoints" / "manifest.json"
    manifest.write_text("{not json")
    return manifest


def test_a_warning_prints_as_one_line_like_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    manifest = _damaged(tmp_path)
    shown_before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # as a user's interpreter shows them (pytest's settings would raise it)
        assert main(["runs", str(tmp_path)]) == 0
    assert warnings.showwarning is shown_before  # put back when the command returns
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"pipekit-train: warning: {manifest} is unreadable (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)); rebuilding the list from the checkpoints themselves"
    ]


def test_a_subcommand_run_as_a_module_prints_warnings_the_same_way(tmp_path, capsys):
    from pipekit_train.cli._checkpoints import main as checkpoints_main

    manifest = _damaged(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert checkpoints_main(["runs", str(tmp_path)]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"pipekit-train: warning: {manifest} is unreadable (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)); rebuilding the list from the checkpoints themselves"
    ]


def test_the_installed_command_prints_one_line_and_debug_keeps_pythons_format(tmp_path):
    """In a process of its own (as a user runs it): one line; with --debug, Python's format, which says where."""
    import os
    import subprocess
    import sys

    manifest = _damaged(tmp_path)
    for debug in ([], ["--debug"]):
        out = subprocess.run(
            [sys.executable, "-m", "pipekit_train.cli", "runs", str(tmp_path), *debug],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert out.returncode == 0, out.stderr
        if debug:
            assert "_checkpoints.py:" in out.stderr and f"PipekitTrainWarning: {manifest} is unreadable" in out.stderr
        else:
            assert out.stderr.splitlines() == [f"pipekit-train: warning: {manifest} is unreadable (Expecting property "
                                               "name enclosed in double quotes: line 1 column 2 (char 1)); rebuilding "
                                               "the list from the checkpoints themselves"]  # fmt: skip


def test_other_warnings_go_to_pythons_printer_and_a_message_of_several_lines_keeps_them(capsys):
    passed_on: list[tuple[str, type[Warning]]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *rest: passed_on.append((str(message), category))
        with one_line_warnings():
            warnings.warn("from another package", DeprecationWarning, stacklevel=1)
            warnings.warn("changed:\n- a\n+ b", PipekitTrainWarning, stacklevel=1)
    assert passed_on == [("from another package", DeprecationWarning)]
    assert capsys.readouterr().err == "pipekit-train: warning: changed:\n- a\n+ b\n"
