"""The guides cite only files that exist: every `path` in backquotes under one of the repository's folders
(``src/``, ``tests/``, ``benchmarks/``, ``examples/``, ``design/``, ``adapters/``, ``docs/``) names a file or folder of
the repository, and a ``tests/...py::test_name`` names a test that the file defines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
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
        if not target.exists() or (
            test and not re.search(rf"^\s*def {re.escape(test)}\(", target.read_text(encoding="utf-8"), re.M)
        ):
            missing.append(ref)
    assert not missing, f"{page.relative_to(ROOT)} cites files or tests that do not exist: {missing}"
