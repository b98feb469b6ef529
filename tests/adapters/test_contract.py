"""The adapter contract is one thing: the table in adapters/README.md, the `Backend` Protocol, `CONTRACT`, the
capabilities, the reference backend and the template all say the same, in public names only."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from pipekit_train.backends import CAPABILITIES, Backend, StepBackend, available_backends, get_backend
from pipekit_train.backends._contract import CONTRACT, STEP_CONTRACT

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "adapters" / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n## ", start + len(title))
    return README[start : end if end != -1 else None]


def _table_names(text: str) -> list[str]:
    """The first column's names of every markdown table row in `text` (``name`` or ``check(loop, ...)``)."""
    names = []
    for line in text.splitlines():
        match = re.match(r"\| `([a-z_]+)", line)
        if match:
            names.append(match.group(1))
    return names


def test_the_readme_and_the_contract_types_agree() -> None:
    """Section 3's member table is `Backend`'s members in the class's order; the StepBackend table is
    `StepBackend`'s; the capabilities table is `CAPABILITIES`; abstract members are marked required."""
    section = _section("## 3. The backend object")
    documented = _table_names(section.split("The capabilities:")[0].split("| member |")[1])
    assert documented == list(CONTRACT)
    assert list(CONTRACT) == [n for n in vars(Backend) if not n.startswith("_")]
    table = section.split("The capabilities:")[1].split("### The `StepBackend`")[0]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    listed = set(re.findall(r"`([a-z_]+)`", "\n".join(first_cells)))
    assert listed == set(CAPABILITIES), sorted(listed ^ set(CAPABILITIES))
    steps = section.split("### The `StepBackend`")[1]
    assert _table_names(steps.split("| `StepBackend` method |")[1].split("\n\n")[0]) == list(STEP_CONTRACT)
    for cls, text in ((Backend, section.split("### The `StepBackend`")[0]), (StepBackend, steps)):
        required = {m for m in re.findall(r"^\| `([a-z_]+)[^|]*\| required\.", text, re.M)}
        assert required == set(cls.__abstractmethods__), (cls.__name__, sorted(required ^ cls.__abstractmethods__))


def test_the_readme_lists_every_model_member_the_core_calls() -> None:
    """Section 2's table is every public member `ModelOp` defines (and ``__call__``), plus the `Operator`
    members a backend implements (`example`, `validate`); nothing else."""
    from pipekit import Operator
    from pipekit_train.backends import ModelOp

    section = _section("## 2. The model operator")
    documented = _table_names(section.split("| member | who |")[1].split("\n\n")[0])
    assert len(documented) == len(set(documented))
    own = {n for n in vars(ModelOp) if not n.startswith("_")} | {"__call__"}
    assert set(documented) == own | {"example", "validate"}, sorted(set(documented) ^ (own | {"example", "validate"}))
    assert {"example", "validate"} <= set(vars(Operator))


def test_the_readme_lists_the_kit() -> None:
    from pipekit_train.backends import kit

    section = _section("## 4. The adapter kit")
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section))
    assert set(kit.__all__) <= named, sorted(set(kit.__all__) - named)


@pytest.mark.parametrize("name", available_backends())
def test_every_installed_backend_is_one_object_of_the_contract(name: str) -> None:
    try:
        backend = get_backend(name)
    except Exception as e:  # a backend whose framework is not installed here
        pytest.skip(str(e))
    assert isinstance(backend, Backend)
    assert backend.name == name
    assert set(backend.capabilities) <= set(CAPABILITIES)
    if "transfer" in backend.capabilities:
        assert callable(getattr(backend, "transfer", None))
    for old in ("preflight", "run", "backend_info", "check_before_compile", "initial_module"):
        assert not hasattr(sys.modules[type(backend).__module__], old), f"{name}: {old} is not the contract"


def _public_names_only(path: Path) -> list[str]:
    """Imports of private pipekit modules (``pipekit_train._x``, ``pipekit_train.sub._x``) in the file at `path`."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        module = node.module if isinstance(node, ast.ImportFrom) else None
        if module and module.startswith("pipekit") and any(part.startswith("_") for part in module.split(".")):
            bad.append(module)
    return bad


def test_the_template_and_the_reference_backend_use_public_names_only() -> None:
    assert _public_names_only(ROOT / "adapters" / "template.py") == []
    assert _public_names_only(ROOT / "tests" / "backends" / "numpy_linear" / "__init__.py") == []
    assert "pipekit_train._" not in README


def test_the_reference_backend_implements_only_what_the_readme_documents() -> None:
    if str(ROOT / "tests" / "backends") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests" / "backends"))
    import numpy_linear

    members = {n for n in vars(type(numpy_linear.backend)) if not n.startswith("_")}
    assert members <= set(CONTRACT), sorted(members - set(CONTRACT))
    assert Backend.__abstractmethods__ <= members


def test_the_template_is_a_working_backend(tmp_path: Any) -> None:
    from pipekit_train.adapters.conformance import CHECKS

    sys.path.insert(0, str(ROOT / "adapters"))
    try:
        import template  # registers "my-backend"
    finally:
        sys.path.remove(str(ROOT / "adapters"))
    assert isinstance(template.backend, Backend)
    CHECKS["resumes_exactly"]("my-backend", tmp_path)
