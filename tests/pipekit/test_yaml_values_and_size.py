"""`pipekit._yaml.load_value` (what `--set` reads values with) and the file size check before reading."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

import pipekit
from pipekit import ConfigError
from pipekit._yaml import MAX_NODES, load_value


def _bomb(levels: int = 7, width: int = 10) -> str:
    """An alias bomb that expands to `width ** levels` nodes (10**7 by default) from a few hundred characters."""
    lines = ["a0: &a0 [x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join(f'*a{i - 1}' for _ in range(width))}]")
    return "{" + ", ".join(lines) + "}"


def test_plain_values_and_operators_are_built_as_in_a_file():
    assert load_value("3") == 3 and load_value("1e-3") == 0.001 and load_value("[64, 64]") == [64, 64]
    assert load_value("{name: sgd, lr: 0.1}") == {"name": "sgd", "lr": 0.1}
    assert load_value("") is None and load_value("null") is None and load_value("'x'") == "x"
    op = load_value("{type: Tap, sink: print}")
    assert isinstance(op, pipekit.Operator) and type(op).__name__ == "Tap" and op.sink == "print"
    with pytest.raises(ConfigError, match=r"^--set x:1:\d+: unknown operator type 'Nope'"):
        load_value("{type: Nope}", source="--set x")


@pytest.mark.parametrize(
    "text,message",
    [
        ("&a [*a]", "nests deeper than"),
        ("!!set {a, b}", "tag 'tag:yaml.org,2002:set' is not allowed"),
        ("!!binary aGVsbG8=", "tag 'tag:yaml.org,2002:binary' is not allowed"),
        ("{<<: {a: 1}, b: 2}", "merge keys"),
        ("!!python/object/apply:os.system [echo hi]", "is not allowed"),
        ("[1, 2", "YAML syntax error"),
        ("{a: 1, a: 2}", "duplicate key 'a'"),
    ],
    ids=["recursive-alias", "set", "binary", "merge-key", "python-tag", "syntax", "duplicate-key"],
)
def test_values_obey_the_file_rules(text: str, message: str):
    with pytest.raises(ConfigError, match=message) as info:
        load_value(text, source="--set task")
    assert str(info.value).startswith("--set task")


def test_an_alias_bomb_value_is_refused_quickly():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=f"more than {MAX_NODES} nodes"):
        load_value(_bomb(), source="--set task")
    assert time.perf_counter() - start < 5


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path: Path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(200 * 1024 * 1024)  # sparse: 200 MB of size, no disk used
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"big.yaml: file is 209715200 bytes, larger than"):
            pipekit.load(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 * 1024 * 1024


def test_a_file_without_a_size_is_read_only_up_to_the_limit(tmp_path: Path, monkeypatch):
    """A pipe (or a /proc file) reports size 0: the read itself is bounded."""
    monkeypatch.setattr("pipekit._yaml.MAX_BYTES", 1000)
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    sent: list[int] = []

    def write() -> None:
        try:  # the reader stops at the limit: the pipe breaks in a write or in the close's flush
            with open(fifo, "wb") as f:
                for _ in range(100):
                    f.write(b"#" * 100 + b"\n")
                    sent.append(101)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=write)
    writer.start()
    with pytest.raises(ConfigError, match="larger than 1000 bytes"):
        pipekit.load(fifo)
    writer.join(timeout=10)


def test_unreadable_files_are_one_clear_error(tmp_path: Path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"type: Tap\nsink: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 19"):
        pipekit.load(bad)
    with pytest.raises(ConfigError, match="is a directory"):
        pipekit.load(tmp_path)
    with pytest.raises(ConfigError, match="pipeline file not found"):
        pipekit.load(tmp_path / "nope.yaml")
