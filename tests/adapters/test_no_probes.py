"""The core calls the contract's methods; it never probes a backend object for what it has (issue 40: the optional
members used to be read with ``getattr``). No module of the core (everything under ``src/pipekit_train`` but the
backend packages) calls ``getattr``/``hasattr`` with the name of a member of `Backend`, `StepBackend` or `ModelOp`:
an optional member has a default on the type, so there is nothing to probe."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipekit_train.backends import Backend, ModelOp, StepBackend

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "pipekit_train"
BACKEND_PACKAGES = (
    "adapters/equinox",
    "adapters/keras",
    "adapters/flax",
    "adapters/lightning",
    "adapters/numpyro",
    "adapters/blackjax",
    "adapters/bayes",
)
MEMBERS = {n for cls in (Backend, StepBackend, ModelOp) for n in vars(cls) if not n.startswith("_")} - {"backend"}
CORE = sorted(p for p in PACKAGE.rglob("*.py") if not str(p.relative_to(PACKAGE)).startswith(BACKEND_PACKAGES))


def probes(source: str) -> list[str]:
    """``line: getattr(x, "name")`` for each getattr/hasattr naming a contract member in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in MEMBERS
        ):
            out.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return out


def test_the_rule_catches_a_probe() -> None:
    assert probes("x = getattr(step_backend, 'summary', None)") == ["1: getattr(..., 'summary')"]
    assert probes("hasattr(b, 'transfer')") == ["1: hasattr(..., 'transfer')"]
    assert probes("getattr(args, 'steps')") == []


@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(PACKAGE)) for p in CORE])
def test_the_core_never_probes_a_backend(path: Path) -> None:
    assert probes(path.read_text(encoding="utf-8")) == []
