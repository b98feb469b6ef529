"""The adapters sit below the core and beside each other (issue 40, "The house"): a module under
``src/pipekit_train/adapters/`` (``conformance/`` aside: it is the surface that runs stages) imports only public
names of other packages, nothing of the core's upper layers (stage, engine, checkpoint, provenance, cli, sweep), and
no backend package but its own. Every import counts: module-level, function-level and under ``TYPE_CHECKING``.

A backend package is one the ``pipekit_train.backends`` entry points of ``pyproject.toml`` name; another package
under ``adapters/`` is shared (``pipekit_train.adapters.bayes``: what the NumPyro-model backends share), and a
backend imports it by its public names like any other package's.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = ROOT / "src" / "pipekit_train" / "adapters"
#: The core's upper layers: an adapter is below them (the engine calls the adapter, never the reverse).
UPPER = ("stage", "engine", "checkpoint", "provenance", "cli", "sweep")
#: The surface that runs stages through the core, checked by its own rules (the layers of HELPERS/import-linter).
EXEMPT = {"conformance"}


def _backend_packages() -> set[str]:
    """``pipekit_train.adapters.<name>`` of every backend the ``pipekit_train.backends`` entry points name."""
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    out = set()
    for target in entry_points["pipekit_train.backends"].values():
        parts = target.split(":")[0].split(".")
        if parts[:2] == ["pipekit_train", "adapters"] and len(parts) > 2:
            out.add(".".join(parts[:3]))
    return out


BACKENDS = _backend_packages()


def _module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of the module at `path` and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _own_package(module: str) -> str:
    """The top-level adapter package `module` belongs to (``pipekit_train.adapters.<name>``); a module right
    under ``adapters/`` is its own."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 else module


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """``(line, absolute module, imported names)`` of every import in `source` (the module `module`), relative ones
    resolved; ``import a.b`` gives ``("a.b", [])``."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                absolute = ".".join([*base, node.module] if node.module else base)
            else:
                absolute = node.module or ""
            out.append((node.lineno, absolute, [alias.name for alias in node.names]))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What `source`, the module `module` under ``pipekit_train.adapters``, imports against the rules (empty:
    none), one ``line: rule: import`` each."""
    own = _own_package(module)
    bad = []
    for line, target, names in _imports(source, module, is_package):
        if target == own or target.startswith(own + "."):
            continue
        parts = target.split(".")
        if any(_private(p) for p in parts) or any(_private(n) for n in names):
            bad.append(f"{line}: private name: {target} {names}")
        if parts[0] == "pipekit_train" and len(parts) > 1 and parts[1] in UPPER:
            bad.append(f"{line}: the core's upper layer: {target}")
        # ``from pipekit_train.adapters import keras`` names a package as an attribute
        reached = [f"{target}.{n}" for n in names] if target == "pipekit_train.adapters" else [target]
        bad += [f"{line}: another backend: {t}" for t in reached if _own_package(t) in BACKENDS - {own}]
    return bad


FILES = sorted(p for p in ADAPTERS.rglob("*.py") if p.relative_to(ADAPTERS).parts[0] not in EXEMPT)


def test_the_backend_packages_are_found() -> None:
    assert {"pipekit_train.adapters.equinox", "pipekit_train.adapters.numpyro", "pipekit_train.adapters.blackjax"} <= (
        BACKENDS
    )
    assert len(FILES) > 40


def test_the_rules_catch_what_they_forbid() -> None:
    """The checker itself: each kind of import it must refuse, seen from a module of the ``numpyro`` backend."""
    module = "pipekit_train.adapters.numpyro._probe"
    cases = {
        "from ..blackjax import backend": "another backend",
        "from pipekit_train.adapters import blackjax": "another backend",
        "import pipekit_train.adapters.keras._model": "private name",
        "from pipekit_train.backends._contract import CONTRACT": "private name",
        "from pipekit_train.backends import _registry": "private name",
        "def f():\n    from pipekit_train.engine import Engine": "upper layer",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...stage import Stage": "upper layer",
        "from ..bayes._sampling import prepare": "private name",
        "from .. import _arviz": "private name",
    }
    for source, expected in cases.items():
        found = violations(source, module)
        assert any(expected in v for v in found), (source, found)
    allowed = (
        "from __future__ import annotations\nfrom ._mcmc import x\nfrom . import _svi\n"
        "from pipekit_train.adapters.bayes import NUTS\nfrom pipekit_train.backends.kit import stage_name\n"
        "import numpyro.infer as infer\n"
    )
    assert violations(allowed, module) == []
    assert violations("from .._ops import x", "pipekit_train.adapters.numpyro.sub", is_package=True) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ADAPTERS).as_posix())
def test_an_adapter_imports_public_names_below_it_and_no_other_backend(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8"), *_module_name(path)) == []
