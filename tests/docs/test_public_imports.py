"""The docs, examples and docstrings teach the package's public names where they live: ``from pipekit_train import
X`` only for an ``X`` of ``pipekit_train.__all__``; every other name from its subpackage (``pipekit_train.losses``,
``.data``, ...). The top level still resolves the old names (``pipekit_train._MOVED``), so user code keeps working;
what we show is the subpackage."""

from __future__ import annotations

import re
from pathlib import Path

import pipekit_train

ROOT = Path(__file__).resolve().parents[2]
_FOLDERS = ("docs", "examples", "adapters", "src/pipekit_train")  # src: its docstrings are the API reference
FILES = [*sorted(p for d in _FOLDERS for p in (ROOT / d).rglob("*") if p.suffix in (".md", ".py")), ROOT / "README.md"]
#: ``from pipekit_train import a, b`` or ``(a,\n...  b)`` (a doctest continues with ``...``).
_IMPORT = re.compile(r"from pipekit_train import (\([^)]*\)|[^\n]*)")


def top_level_imports(text: str) -> list[str]:
    names = []
    for body in _IMPORT.findall(text):
        inner = re.sub(r"\n\s*(?:\.\.\.)?", " ", body.strip().strip("()"))
        names += [n.strip().split(" as ")[0] for n in inner.split(",") if n.strip()]
    return names


def test_the_scan_finds_imports() -> None:
    assert top_level_imports(">>> from pipekit_train import (A,\n...     B as C)\nfrom pipekit_train import D") == [
        "A",
        "B",
        "D",
    ]
    assert sum(len(top_level_imports(p.read_text(encoding="utf-8"))) for p in FILES) >= 10


def test_docs_and_examples_import_moved_names_from_their_subpackage() -> None:
    public = set(pipekit_train.__all__)
    wrong = {
        f"{p.relative_to(ROOT)}: {name} (from pipekit_train{pipekit_train._MOVED.get(name, '?')})"
        for p in FILES
        for name in top_level_imports(p.read_text(encoding="utf-8"))
        if name not in public and not name.startswith("__")
    }
    assert not wrong, f"import these from their subpackage: {sorted(wrong)}"
