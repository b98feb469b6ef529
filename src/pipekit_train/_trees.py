"""Paths of pytree leaves as ``a/b/0``: one name for a dict key, an attribute or an index, so a tree restored as
plain containers (a checkpoint read back as saved) and the tree that was saved (modules, named tuples) name their
leaves alike. Checkpoints, warm starts and `TrainingLoop.carry` match leaves by these names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["flatten", "path_name"]


def path_name(path: Iterable[Any]) -> str:
    """A leaf's path as ``a/b/0``, the same for a dict key, an attribute or an index (Orbax restores dicts)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def flatten(tree: Any) -> list[tuple[str, Any]]:
    """``[(path name, leaf)]`` of `tree`, in JAX's leaf order."""
    import jax

    return [(path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
