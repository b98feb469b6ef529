"""A Griffe extension for the API reference (docs/api.md): read a Google-style ``Example:`` section as examples.

Griffe's Google parser takes ``Examples:`` as a section of doctests (rendered as code) but the singular
``Example:``, which the docstrings here use, as an admonition of Markdown text, where ``h["r1"]["loss"]`` reads
as a reference-style link. Loaded by mkdocs.yml (``extensions: [docs/api_griffe.py]``); not part of the site.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
