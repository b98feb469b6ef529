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


UNREADABLE = (
    "{manifest} is unreadable (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
    "rebuilding the list from the checkpoints themselves"
)


@pytest.mark.parametrize("entry", ["pipekit-train", "module"])
def test_a_warning_prints_as_one_line_like_an_error_and_a_caller_recording_warnings_still_gets_it(tmp_path, entry):
    """In-process (a notebook, a test suite): the command formats its warnings as one line and leaves where they go
    alone, so a caller recording them (``catch_warnings(record=True)``, ``pytest.warns``) still gets them."""
    from pipekit_train.cli._checkpoints import main as checkpoints_main

    manifest = _damaged(tmp_path)
    command = main if entry == "pipekit-train" else checkpoints_main
    formatter = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert command(["runs", str(tmp_path)]) == 0
    assert warnings.formatwarning is formatter  # put back when the command returns
    assert [str(w.message) for w in caught] == [UNREADABLE.format(manifest=manifest)]
    with one_line_warnings():
        shown = warnings.formatwarning(caught[0].message, caught[0].category, caught[0].filename, caught[0].lineno)
    assert shown == f"pipekit-train: warning: {UNREADABLE.format(manifest=manifest)}\n"


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


def test_other_warnings_keep_pythons_format_and_a_message_of_several_lines_keeps_them():
    with one_line_warnings():
        other = warnings.formatwarning("from another package", DeprecationWarning, "lib.py", 3)
        ours = warnings.formatwarning(PipekitTrainWarning("changed:\n- a\n+ b"), PipekitTrainWarning, "x.py", 1)
    assert other.startswith("lib.py:3: DeprecationWarning: from another package")
    assert ours == "pipekit-train: warning: changed:\n- a\n+ b\n"
