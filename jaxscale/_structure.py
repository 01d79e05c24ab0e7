"""Clear errors when gradients do not have the structure of the parameters.

Without these checks a mismatch surfaces deep inside the inner optimizer's
``tree_map`` (or not at all, for a stateless one such as ``optax.sgd``).
Everything here runs at trace time on static structure: no cost in the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from jaxscale import _nnx

__all__ = ["check_updates_match_params", "explain_structure_errors"]

_MAX_PATHS = 5
# Messages of JAX's own tree-structure errors (tree_map over mismatched trees).
_TREE_ERRORS = (
    "pytree structure error",
    "Custom node type mismatch",
    "Tuple arity mismatch",
    "Dict key mismatch",
    "List arity mismatch",
)


def _paths(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_nnx.is_variable)
    return {jax.tree_util.keystr(p): x for p, x in leaves}


def _some(paths: list[str]) -> str:
    shown = ", ".join(p or "<root>" for p in paths[:_MAX_PATHS])
    more = len(paths) - _MAX_PATHS
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def _shape(x: Any) -> tuple[int, ...] | None:
    x = _nnx.unwrap(x)
    shape = getattr(x, "shape", None)
    if shape is None and isinstance(x, bool | int | float | complex):
        return ()
    return None if shape is None else tuple(shape)


def check_updates_match_params(updates: Any, params: Any) -> None:
    """Raises a ``ValueError`` naming both structures if they differ.

    Compares tree structures (NNX variables count as leaves) and then leaf
    shapes. ``params=None`` (not passed to ``update``) is not checked.
    """
    if params is None:
        return
    su = jax.tree.structure(updates, is_leaf=_nnx.is_variable)
    sp = jax.tree.structure(params, is_leaf=_nnx.is_variable)
    if su != sp:
        pu, pp = _paths(updates), _paths(params)
        only_u = [p for p in pu if p not in pp]
        only_p = [p for p in pp if p not in pu]
        detail = (
            f" Leaves only in `updates`: {_some(only_u)}; only in `params`: "
            f"{_some(only_p)}."
            if only_u or only_p
            else ""
        )
        raise ValueError(
            "`updates` (the gradients) must have the tree structure of `params`, "
            f"got updates: {_short(su)} and params: {_short(sp)}.{detail} "
            "Differentiate the loss "
            "with respect to the same pytree you pass as `params`."
        )
    bad = []
    for (path, u), p in zip(
        jax.tree_util.tree_leaves_with_path(updates, is_leaf=_nnx.is_variable),
        jax.tree.leaves(params, is_leaf=_nnx.is_variable),
        strict=True,
    ):
        shape_u, shape_p = _shape(u), _shape(p)
        if shape_u is not None and shape_p is not None and shape_u != shape_p:
            bad.append(
                f"{jax.tree_util.keystr(path) or '<root>'}: {shape_u} vs {shape_p}"
            )
    if bad:
        raise ValueError(
            "`updates` (the gradients) must have the shapes of `params`, got "
            f"different shapes (updates vs params) at {_some(bad)}."
        )


@contextlib.contextmanager
def explain_structure_errors(updates: Any, inner_state: Any) -> Iterator[None]:
    """Re-raises the inner optimizer's tree-structure errors with context.

    A tree-structure error happens when ``params`` is not passed, so the expected
    structure is only known to the inner optimizer (from ``init(params)``).
    """
    try:
        yield
    except ValueError as e:
        if not str(e).startswith(_TREE_ERRORS):
            raise
        raise ValueError(
            "`updates` (the gradients) do not have the tree structure the inner "
            "optimizer's state was built for by `init(params)`: got updates "
            f"{_short(jax.tree.structure(updates))}, inner state "
            f"{_short(jax.tree.structure(inner_state))}. Pass `params` to "
            "`update` for a precise comparison. Inner error: "
            f"{str(e).splitlines()[0]}"
        ) from e


def _short(treedef: Any, limit: int = 500) -> str:
    text = str(treedef)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
