"""docs/backends.md's table of the Equinox backend's built-in model factories is generated from the registry: this
test checks it, and running this file rewrites it (after adding a factory or changing its arguments)::

    .venv/bin/python tests/docs/test_factory_table.py
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

BACKENDS_MD = Path(__file__).resolve().parents[2] / "docs" / "backends.md"
REGENERATE = ".venv/bin/python tests/docs/test_factory_table.py"
_TABLE = re.compile(r"(^## The Equinox backend's model factories\n\n(?:[^|\n].*\n|\n)*?)((?:\|.*\n)+)", re.M)


def generated_table() -> str:
    """``| factory | kwargs | what it builds |`` for every factory registered by the Equinox backend itself."""
    from pipekit_train.adapters.equinox._model import FACTORIES

    rows = ["| factory | kwargs | what it builds |", "| --- | --- | --- |"]
    for name in FACTORIES.names():
        fn = FACTORIES.get(name)
        if not fn.__module__.startswith("pipekit_train.adapters.equinox."):
            continue  # registered by a user or a test, not built in
        params = list(inspect.signature(fn).parameters.values())[1:]  # the first is `key`
        kwargs = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params)
        summary = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split()).replace("``", "`").replace("|", "\\|")
        rows.append(f"| `{name}` | `{kwargs}` | {summary} |")
    return "\n".join(rows) + "\n"


def test_the_equinox_factory_table_is_the_generated_one() -> None:
    match = _TABLE.search(BACKENDS_MD.read_text(encoding="utf-8"))
    assert match, "docs/backends.md has no table under '## The Equinox backend's model factories'"
    assert match.group(2) == generated_table(), (
        "docs/backends.md's table of Equinox model factories differs from the registry; regenerate it with: "
        + REGENERATE
    )


def test_the_table_lists_every_built_in_factory_with_its_arguments() -> None:
    table = generated_table()
    for name in ("mlp", "cnn", "autoencoder", "classifier"):
        assert f"| `{name}` |" in table
    assert "in_size, out_size, width_size=64, depth=2, activation='relu'" in table


def test_the_flax_backend_builds_every_factory_of_the_table_with_its_kwargs() -> None:
    """docs/backends.md says the table's factories are built in on Flax with the same kwargs: the registries agree."""
    from pipekit_train.adapters.equinox._model import FACTORIES as EQUINOX
    from pipekit_train.adapters.flax._model import FACTORIES as FLAX

    def builtin(registry: object, package: str) -> dict[str, list[tuple[str, object]]]:
        out = {}
        for name in registry.names():  # type: ignore[attr-defined]
            fn = registry.get(name)  # type: ignore[attr-defined]
            if fn.__module__.startswith(package):
                out[name] = [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]
        return out

    assert builtin(FLAX, "pipekit_train.adapters.flax.") == builtin(EQUINOX, "pipekit_train.adapters.equinox.")


if __name__ == "__main__":
    text = BACKENDS_MD.read_text(encoding="utf-8")
    new, count = _TABLE.subn(lambda m: m.group(1) + generated_table(), text)
    if not count:
        sys.exit("docs/backends.md has no '## The Equinox backend's model factories' table to rewrite")
    BACKENDS_MD.write_text(new, encoding="utf-8")
