"""The map is the territory: design/overview.md's stage flow is what a run does.

A tiny two-stage run of `examples/digits/pretrain_finetune.yaml` (pretrain → finetune, a `Transfer` between them)
goes through ``pipekit-train run`` in this process, traced with `sys.setprofile` (and `threading.setprofile`, for
the checkpoint writer's thread). The test fails when

- the flow lists more than 15 hops or spans more than 12 files, or a hop is not a ``file.py:function`` that exists;
- a hop is not called, or the hops are first called out of the listed order;
- the run calls a function in a ``src/`` file that neither a hop nor the list of what the hops use names;
- the core calls into a backend's package other than through a member of the contract (`Backend`, `StepBackend`,
  `ModelOp`, an operator's ``validate``) or a `LazyBackend`'s module function of the same name.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pipekit import Operator
from pipekit_train.backends import Backend, ModelOp, StepBackend

#: One xdist worker (``--dist loadgroup``) for the module: the traced run (`traced`) is trained once, not once per
#: worker that draws one of its three tests.
pytestmark = pytest.mark.xdist_group("stage-flow")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
OVERVIEW = (ROOT / "design" / "overview.md").read_text(encoding="utf-8")
PIPELINE = ROOT / "examples" / "digits" / "pretrain_finetune.yaml"
SHORT = {  # two stages of 20 steps, evaluating and keeping checkpoints on the way
    f"stages.{i}.{field}": value
    for i in (0, 1)
    for field, value in {
        "max_steps": 20,
        "eval_every_n_steps": 10,
        "log_every_n_steps": 5,
        "optimizer_config.warmup_steps": 2,
    }.items()
} | {"stages.0.callbacks.0.every_n_steps": 10, "stages.1.param_groups.0.unfreeze_at": 5}

_HOP = re.compile(r"^\s*\d+\. `([\w/]+\.py):([\w.]+)`", re.M)
_USED = re.compile(r"`([\w/]+\.py)`")


def _section(title: str) -> str:
    start = OVERVIEW.index(title)
    end = OVERVIEW.find("\n### ", start + len(title))
    end2 = OVERVIEW.find("\n## ", start + len(title))
    ends = [e for e in (end, end2) if e != -1]
    return OVERVIEW[start : min(ends) if ends else None]


def _module_path(short: str) -> str:
    """``stage/driver.py`` → ``pipekit_train/stage/driver.py``; ``pipekit/_yaml.py`` stays (relative to src/)."""
    return short if short.startswith("pipekit/") else f"pipekit_train/{short}"


HOPS = [(_module_path(f), fn) for f, fn in _HOP.findall(_section("### The stage flow, hop by hop"))]
USED = {_module_path(f) for f in _USED.findall(_section("### What the hops use"))}


def test_the_flow_is_short_and_names_real_functions() -> None:
    assert 8 <= len(HOPS) <= 15, len(HOPS)
    files = {f for f, _ in HOPS}
    assert len(files) <= 12, sorted(files)
    for path, function in HOPS:
        text = (SRC / path).read_text(encoding="utf-8")
        assert re.search(rf"^\s*def {re.escape(function.split('.')[-1])}\(", text, re.M), f"{path}:{function}"
    for path in USED:
        assert (SRC / path).is_file(), path


def _run(run_dir: Path) -> None:
    from pipekit_train.cli import main

    args = ["run", str(PIPELINE), "--run-dir", str(run_dir)]
    for key, value in SHORT.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0


@pytest.fixture(scope="module")
def traced(tmp_path_factory: Any) -> dict[str, Any]:
    from pipekit_train.checkpoint import _layout

    # The checkpoint writer's plans per tree structure are a bounded cache, cleared when full: earlier tests of this
    # process may have filled it, so the traced run would work plans out again (a hop's helper the flow counts as
    # warm). Empty, the warm run fills it with this pipeline's few structures.
    _layout._PLANS.clear()
    _run(tmp_path_factory.mktemp("warm"))  # imports and compiles, so the trace sees the flow, not first-time costs
    src = str(SRC) + "/"
    first: dict[tuple[str, str], int] = {}
    edges: set[tuple[str, str, str, str]] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(src) or code.co_name == "<module>":
            return
        callee = (code.co_filename[len(src) :], code.co_qualname)
        first.setdefault(callee, len(first))
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(src):
            caller = caller.f_back  # through the standard library and JAX, back to our code
        if caller is not None:
            edges.add((caller.f_code.co_filename[len(src) :], caller.f_code.co_qualname, *callee))

    run_dir = tmp_path_factory.mktemp("traced")
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        _run(run_dir)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {"first": first, "edges": edges}


def test_the_run_goes_through_the_hops_in_order(traced: dict[str, Any]) -> None:
    first = traced["first"]
    missing = [f"{f}:{fn}" for f, fn in HOPS if (f, fn) not in first]
    assert not missing, f"hops the run never called: {missing}"
    order = [first[hop] for hop in HOPS]
    late = [f"{HOPS[i + 1][0]}:{HOPS[i + 1][1]}" for i in range(len(order) - 1) if order[i + 1] < order[i]]
    assert not late, f"hops first called before the hop listed above them: {late}"


def test_the_run_touches_only_files_the_flow_lists(traced: dict[str, Any]) -> None:
    touched = {f for f, _ in traced["first"]}
    listed = {f for f, _ in HOPS} | USED
    assert touched - listed == set(), (
        f"files the run calls into that design/overview.md does not list: {sorted(touched - listed)}"
    )
    assert listed - touched == set(), (
        f"files design/overview.md lists that the run never calls: {sorted(listed - touched)}"
    )


#: The names the core may call in a backend's package: the contract's members and an operator's own.
CONTRACT_NAMES = (
    {n for cls in (Backend, StepBackend, ModelOp) for n in vars(cls) if not n.startswith("_")}
    | {n for n in vars(Operator) if not n.startswith("_")}
    | {"__init__", "__call__", "__post_init__", "__eq__", "__hash__"}
)
#: Kit modules run by a backend, which call back what the backend handed them (a layer builder, a path step).
KIT = {"pipekit_train/backends/_zoo.py", "pipekit_train/backends/_shared.py"}


def test_the_core_reaches_a_backend_only_through_the_contract(traced: dict[str, Any]) -> None:
    def backend_file(path: str) -> bool:
        return path.startswith("pipekit_train/adapters/") and not path.startswith("pipekit_train/adapters/conformance")

    crossings = {
        (caller, caller_fn, callee, callee_fn)
        for caller, caller_fn, callee, callee_fn in traced["edges"]
        if backend_file(callee) and not backend_file(caller) and caller not in KIT
    }
    assert crossings, "the trace saw no call into the backend"
    outside = sorted(
        f"{caller}:{caller_fn} -> {callee}:{callee_fn}"
        for caller, caller_fn, callee, callee_fn in crossings
        if callee_fn.split(".")[-1] not in CONTRACT_NAMES
    )
    assert not outside, f"calls into a backend outside the contract: {outside}"
