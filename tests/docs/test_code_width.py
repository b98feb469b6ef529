"""Code blocks in docs/*.md never scroll sideways at a laptop's width: every line of a fenced block of code
(```python, ```yaml, ```bash, or no language) is at most 100 characters, which fit beside the navigation
(mkdocs.yml: ``toc.integrate``, the arithmetic in its comment); terminal output (```text, ```console: one-line
errors and tables, as the program prints them) wraps on the page instead (docs/stylesheets/extra.css)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
WIDTH = 100
#: Blocks shown as a program prints them: they wrap (extra.css) rather than being cut to the width.
WRAPPED = ("text", "console")
_OPEN = re.compile(r"^\s*(```+|~~~+)\s*([\w-]*)")


def fenced_lines(text: str) -> list[tuple[int, str, str]]:
    """``(line number, language, line)`` of every line inside a fenced block of a Markdown text."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            found = _OPEN.match(line)
            if found:
                fence = (found.group(1), found.group(2) or "")
        elif line.strip() == fence[0]:
            fence = None
        else:
            out.append((number, fence[1], line))
    return out


def test_code_lines_fit_the_width():
    long = [
        f"{page.relative_to(ROOT)}:{number} ({len(line)} characters, ```{language})"
        for page in sorted(DOCS.rglob("*.md"))
        for number, language, line in fenced_lines(page.read_text(encoding="utf-8"))
        if language not in WRAPPED and len(line) > WIDTH
    ]
    assert not long, f"code lines over {WIDTH} characters (wrap them, or mark output as ```text):\n" + "\n".join(long)


def test_the_site_is_laid_out_for_that_width_and_wraps_terminal_output():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert "toc.integrate" in config["theme"]["features"]  # one sidebar: the width the comment works out
    assert "stylesheets/extra.css" in config["extra_css"]
    highlight = next(e for e in config["markdown_extensions"] if isinstance(e, dict) and "pymdownx.highlight" in e)
    assert highlight["pymdownx.highlight"]["pygments_lang_class"] is True  # blocks carry `language-text` for the CSS
    css = (DOCS / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rule = re.search(r"([^{}]*)\{([^{}]*white-space:\s*pre-wrap[^{}]*)\}", css)
    assert rule is not None, css
    assert all(f".language-{language} pre > code" in rule.group(1) for language in WRAPPED), rule.group(1)


def test_the_parser_sees_a_long_line_of_code_and_leaves_output_alone():
    text = "x\n```python\n" + "a" * 101 + "\n```\n```text\n" + "b" * 300 + "\n```\n````\n```\n````\n"
    assert [(n, lang, len(line)) for n, lang, line in fenced_lines(text)] == [(3, "python", 101), (6, "text", 300),
                                                                              (9, "", 3)]  # fmt: skip
