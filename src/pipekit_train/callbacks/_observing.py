"""Whether a callback's `on_step_end` only observes: read from its source, so a callback that overrides it to read
the loss keeps the steps fused without declaring anything.

A hook *observes* when whatever it does at step ``s`` can wait until the end of the compiled call that ran ``s``:
it reads ``metrics`` and the step's numbers, keeps its own state (``ctx.state_of(self)``), writes records
(``ctx.writer``). It *acts* when it must run before the next step: it stops the run (``ctx.request_stop``, a
signal, an exception), reads or replaces the model (``ctx.model``, ``ctx.set_model``), changes the learning rate
(``ctx.lr_scale``), or calls anything else whose effect we cannot see. `observes_only` answers ``True`` only when
the source proves the first; anything it cannot read or does not know answers ``False``, which keeps the per-step
meaning (one step per compiled call under ``steps_per_call: auto``). A callback says it outright with
`Callback.needs_every_step`; the inference is used only when that is ``None``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from typing import Any

__all__ = ["OBSERVING_CALLS", "OBSERVING_CONTEXT", "OBSERVING_METHODS", "observes_only"]

#: What of the `TrainContext` an observing hook may read: nothing that acts, nothing of the model.
OBSERVING_CONTEXT = frozenset(
    {"step", "epoch", "stage", "run_id", "run_dir", "loop", "writer", "state_of", "artifact_fields", "last_eval"}
)

#: Built-in functions an observing hook may call: conversions, arithmetic, containers, ``print``.
OBSERVING_CALLS = frozenset(
    {
        "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "float", "format", "int", "isinstance", "len",
        "list", "max", "min", "print", "range", "repr", "round", "set", "sorted", "str", "sum", "tuple", "zip",
    }
)  # fmt: skip

#: Methods an observing hook may call on any object: reading and filling containers and strings, reading an
#: array's value, NumPy's and `math`'s arithmetic on it, writing a record or a line, and the context's `state_of`.
OBSERVING_METHODS = frozenset(
    {
        "add", "append", "asarray", "copy", "count", "endswith", "exp", "extend", "format", "get", "index",
        "insert", "isfinite", "isnan", "item", "items", "join", "keys", "log", "lower", "mean", "setdefault",
        "split", "sqrt", "startswith", "state_of", "strip", "tolist", "update", "upper", "values", "write",
    }
)  # fmt: skip

# Statements whose effect cannot wait for the end of a chunk (a raise fails the run at that step) or reaches
# beyond the hook (an attribute of another object, a global, a generator).
_ACTING = (ast.Raise, ast.Assert, ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await, ast.Delete)


@functools.lru_cache(maxsize=256)
def observes_only(hook: Callable[..., Any]) -> bool:
    """Whether the `on_step_end` function `hook` (as defined on its class) provably only observes.

    ``True`` when its source parses and every use of its context argument is a read of an `OBSERVING_CONTEXT`
    attribute, every call is to an `OBSERVING_CALLS` built-in or an `OBSERVING_METHODS` method, it assigns no
    attribute and has no ``raise``, ``assert``, ``global``, ``nonlocal``, ``yield``, ``await``, ``del`` or
    decorator. Anything else, including a source that cannot be read, is ``False``.

    Example:
        >>> def on_step_end(self, ctx, metrics):
        ...     ctx.state_of(self)["losses"].append(float(metrics["loss"]))
        >>> observes_only(on_step_end)
        True
        >>> def on_step_end(self, ctx, metrics):
        ...     if float(metrics["loss"]) < 0.1:
        ...         ctx.request_stop("converged")
        >>> observes_only(on_step_end)
        False
    """
    try:
        source = textwrap.dedent(inspect.getsource(hook))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return False
    if not _is_its_source(source, hook):
        return False
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False  # a lambda, or a hook assigned from something else
    fn = tree.body[0]
    if isinstance(fn, ast.AsyncFunctionDef) or fn.decorator_list or len(fn.args.args) < 2:
        return False
    ctx = fn.args.args[1].arg  # (self, ctx, metrics)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(fn):
        if isinstance(node, _ACTING):
            return False
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            return False  # `obj.flag = ...`: another object's attribute, seen who knows where
        if isinstance(node, ast.Name) and node.id == ctx:
            parent = parents.get(node)
            if not (
                isinstance(parent, ast.Attribute)
                and parent.value is node
                and isinstance(parent.ctx, ast.Load)
                and parent.attr in OBSERVING_CONTEXT
            ):
                return False  # `ctx.model`, `ctx.request_stop(...)`, `ctx` handed to something else
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in OBSERVING_CALLS:
                continue
            if isinstance(func, ast.Attribute) and func.attr in OBSERVING_METHODS:
                continue
            return False
    return True


def _is_its_source(source: str, hook: Callable[..., Any]) -> bool:
    """Whether `source` compiles to the code `hook` runs. `inspect.getsource` reads the file as it is now: one
    edited since it was imported gives other lines, perhaps another function's, whose verdict would not be this
    hook's (an edit during a long run; a benchmark's file saved while it ran once read an observing hook as acting)."""
    code = getattr(hook, "__code__", None)
    try:
        compiled = compile(source, "<on_step_end>", "exec")
    except (SyntaxError, ValueError):
        return False
    defined = [c for c in compiled.co_consts if isinstance(c, types.CodeType)]
    return code is not None and len(defined) == 1 and _names(defined[0]) == _names(code)


def _names(code: types.CodeType) -> tuple[Any, ...]:
    """What a function's code refers to — arguments, locals, outer names, constants, nested functions' the same —,
    not its bytecode, which the compiler makes differently in another context (a method call in an f-string). An
    outer name is a global when the source is compiled alone and a closure's cell when it was defined in a function:
    the same name either way."""
    consts = tuple(_names(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return code.co_argcount, code.co_varnames, tuple(sorted({*code.co_names, *code.co_freevars})), consts
