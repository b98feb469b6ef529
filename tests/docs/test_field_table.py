"""docs/yaml.md's `TrainingLoop` field table is generated from the code: this test checks it, and running this
file rewrites it.

Types and defaults come from the class's fields, meanings from its docstring's ``Attributes:`` section
(`pipekit._schema.field_table`; the same table ``pipekit-train describe TrainingLoop --markdown`` prints). After
adding or changing a field (and its line in the docstring), regenerate the table with::

    .venv/bin/python tests/docs/test_field_table.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

YAML_MD = Path(__file__).resolve().parents[2] / "docs" / "yaml.md"
REGENERATE = ".venv/bin/python tests/docs/test_field_table.py"
#: The heading the table sits under, then a blank line, then the table's rows.
_TABLE = re.compile(r"(^## `TrainingLoop` fields\n\n)((?:\|.*\n)+)", re.M)


def generated_table() -> str:
    from pipekit_train.cli._schema import markdown_table

    return markdown_table("TrainingLoop") + "\n"


def test_the_training_loop_field_table_is_the_generated_one() -> None:
    text = YAML_MD.read_text(encoding="utf-8")
    match = _TABLE.search(text)
    assert match, "docs/yaml.md has no table under '## `TrainingLoop` fields'"
    in_docs, in_code = match.group(2), generated_table()
    docs_fields = [row.split("|")[1].strip() for row in in_docs.splitlines()[2:]]
    code_fields = [row.split("|")[1].strip() for row in in_code.splitlines()[2:]]
    assert in_docs == in_code, (
        f"docs/yaml.md's TrainingLoop field table differs from the code (fields only in the docs: "
        f"{sorted(set(docs_fields) - set(code_fields))}, only in the code: "
        f"{sorted(set(code_fields) - set(docs_fields))}); document the field in TrainingLoop's docstring "
        f"(Attributes:) and regenerate the table with: {REGENERATE}"
    )


def test_every_field_has_a_meaning() -> None:
    rows = generated_table().splitlines()[2:]
    empty = [row.split("|")[1].strip() for row in rows if not row.rstrip(" |").rsplit("|", 1)[-1].strip()]
    assert not empty, f"TrainingLoop fields without a line in its docstring's Attributes: section: {empty}"


def main() -> int:
    text = YAML_MD.read_text(encoding="utf-8")
    match = _TABLE.search(text)
    if match is None:
        print("docs/yaml.md has no table under '## `TrainingLoop` fields'", file=sys.stderr)
        return 1
    new = text[: match.start(2)] + generated_table() + text[match.end(2) :]
    if new != text:
        YAML_MD.write_text(new, encoding="utf-8")
        print("docs/yaml.md: rewrote the TrainingLoop field table")
    else:
        print("docs/yaml.md: the TrainingLoop field table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
