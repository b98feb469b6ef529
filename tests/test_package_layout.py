"""The package's shape: a small top level, few modules at the root, and no import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pipekit_train

SRC = Path(pipekit_train.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def test_the_top_level_is_small_and_the_old_names_still_resolve() -> None:
    assert len(pipekit_train.__all__) <= 30, pipekit_train.__all__
    assert pipekit_train.Linear is __import__("pipekit_train.optim", fromlist=["Linear"]).Linear
    assert "Linear" not in pipekit_train.__all__


def test_at_most_ten_modules_at_the_package_root() -> None:
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= 10, root


def _top_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The pipekit_train modules `name` imports when it is imported (not inside functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, block, [])
                    visit([n for n in inner if isinstance(n, ast.stmt)])
                    for handler in inner:
                        if isinstance(handler, ast.ExceptHandler):
                            visit(handler.body)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                if module and module.startswith("pipekit_train"):
                    # `from pkg import sub` depends on the submodule; `from pkg import name` on the package
                    subs = {f"{module}.{alias.name}" for alias in node.names} & known
                    found.update(subs or {module})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("pipekit_train"))

    visit(tree.body)
    return found


def test_the_module_graph_has_no_cycle() -> None:
    modules = _modules()
    known = set(modules)
    graph = {
        name: sorted(m for m in _top_level_imports(name, path, known) if m in modules and m != name)
        for name, path in modules.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            walk(name)


_ISOLATED = """
import importlib, sys
names = sys.argv[1:]
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "pipekit_train" or m.startswith(("pipekit_train.", "pipekit."))]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
raise SystemExit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own() -> None:
    """Each module imported first, with no pipekit module loaded before it (third-party packages stay loaded: this
    is about our import order, and one process keeps it to seconds)."""
    names = [n for n in _modules() if not n.endswith("__main__")]
    proc = subprocess.run([sys.executable, "-c", _ISOLATED, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_files_hold_one_idea() -> None:
    """At most three source files pass 500 lines, and each says in its docstring why it is one idea (issue 40)."""
    long = {}
    for path in sorted(SRC.parent.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            long[str(path.relative_to(SRC.parent))] = ast.get_docstring(ast.parse(text)) or ""
    assert len(long) <= 3, sorted(long)
    for path, docstring in long.items():
        assert "One idea" in docstring, f"{path} passes 500 lines: its docstring says why it is one idea"
