"""Every ```python block in docs/*.md runs as written, in a fresh empty directory, with no hidden fixtures.

Each page's blocks run in order, in one namespace per page, with the page's own fresh temporary directory as the
working directory and none of pipekit's environment variables set (so runs, the artifact store and the model
registry go where a reader's would: ``./runs/...``). A block written as a doctest (``>>>`` prompts) runs as one
and its printed output is checked (with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``); any other python block runs as a
script. New pages are picked up by the glob.

Not run: ```bash / ```console blocks (they name the repository's example files and train on the digits for
minutes: ``make demo``; the commands and their one-line errors are covered by tests/cli/), and ```yaml / ```text
blocks, which are not programs.
"""

from __future__ import annotations

import doctest
import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_ENV = ("PIPEKIT_ARTIFACT_STORE", "PIPEKIT_MODEL_REGISTRY", "PIPEKIT_IMPORT", "PIPEKIT_DEBUG")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the block's first line, code)`` for each ```python block of a Markdown text."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def run_page(page: Path, namespace: dict[str, object]) -> None:
    """Run the python blocks of `page` in order in `namespace`; an `AssertionError` names the failing block."""
    name = str(page.relative_to(DOCS.parent))
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.FAIL_FAST)
    for lineno, code in python_blocks(page.read_text(encoding="utf-8")):
        where = f"{name}:{lineno}"
        if code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(code, namespace, where, name, lineno - 1)
            report: list[str] = []
            failed = runner.run(test, out=report.append, clear_globs=False).failed
            namespace.update(test.globs)  # a DocTest runs in a copy of the namespace: carry its names on
            assert not failed, f"the doctest block at {where} failed:\n" + "".join(report)
        else:
            exec(compile(code, where, "exec"), namespace)  # the page's own code, as a reader runs it


def test_the_docs_have_python_blocks() -> None:
    assert sum(len(python_blocks(p.read_text(encoding="utf-8"))) for p in PAGES) >= 20


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_python_blocks_run_as_written_in_a_fresh_directory(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not python_blocks(page.read_text(encoding="utf-8")):
        pytest.skip("no python blocks")
    monkeypatch.chdir(tmp_path)
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    run_page(page, {"__name__": f"docs_{page.stem}"})  # classes a page defines register under this module
