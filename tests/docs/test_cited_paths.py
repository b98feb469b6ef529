"""The guides cite only files that exist: every `path` in backquotes under one of the repository's folders
(``src/``, ``tests/``, ``benchmarks/``, ``examples/``, ``design/``, ``adapters/``, ``docs/``) names a file or folder of
the repository, and a ``tests/...py::test_name`` names a test that the file defines. The design notes and the
adapter kit's README count too, and there a short path into the package (``stage/driver.py``,
``checkpoint/_layout.py``, ``adapters/equinox/_steps.py``, ``pipekit/_yaml.py``: a subpackage of ``src/pipekit_train``
or the algebra, then a module) must name a module that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "design").rglob("*.md"),
        ROOT / "README.md",
        ROOT / "adapters" / "README.md",
    ]
)
PACKAGE = ROOT / "src" / "pipekit_train"
_SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
#: ``stage/driver.py`` or ``engine/_loop.py:Engine.run``: a module of a subpackage (or of the algebra), in backquotes.
_SHORT = re.compile(rf"`((?:pipekit|{'|'.join(_SUBPACKAGES)})/[\w/]+\.py)(?::[\w.]+)?`")
_CITED = re.compile(r"`((?:src|tests|benchmarks|examples|design|adapters|docs)/[\w./-]+(?:::\w+)?)`")


def cited(text: str) -> list[str]:
    return sorted(set(_CITED.findall(text)))


def test_the_guides_cite_repository_files() -> None:
    assert sum(len(cited(p.read_text(encoding="utf-8"))) for p in PAGES) >= 10


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_cited_file_exists(page: Path) -> None:
    missing = []
    for ref in cited(page.read_text(encoding="utf-8")):
        path, _, test = ref.partition("::")
        target = ROOT / path.rstrip("/")
        if "*" in path or "<" in path:
            continue
        if (path.startswith("adapters/") and not (ROOT / path).exists()) and (PACKAGE / path).exists():
            continue  # adapters/equinox/_steps.py: the package's adapters, not the kit's folder
        if not target.exists() or (
            test and not re.search(rf"^\s*def {re.escape(test)}\(", target.read_text(encoding="utf-8"), re.M)
        ):
            missing.append(ref)
    for short in sorted(set(_SHORT.findall(page.read_text(encoding="utf-8")))):
        base = ROOT / "src" if short.startswith("pipekit/") else PACKAGE
        if not (base / short).exists() and not (ROOT / short).exists() and short not in missing:
            missing.append(short)
    assert not missing, f"{page.relative_to(ROOT)} cites files or tests that do not exist: {missing}"
