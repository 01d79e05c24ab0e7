"""The one finder of jaxscale states in a user object.

An optimizer state, a Flax ``TrainState``, an ``nnx.Optimizer`` or the
``nnx.State`` of a functional NNX loop: :func:`locate` finds the loss scale (in a
:class:`DynamicScalingState`, or bare) and its key path in one walk of the tree;
:func:`find_state` and :func:`scaling_state_of` find one node of a kind;
:func:`scaling_states` every scaling state, also in an ``nnx.State``.
``loss_scale_of``, the diagnostics, ``monitor``, ``validate_state``,
``jaxscale.flax``, ``jaxscale.equinox`` and ``jaxscale.testing`` all read through
it; :mod:`jaxscale._composition` judges the path it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from jaxscale import _nnx
from jaxscale._loss_scale import (
    DEFAULT_MAX_SCALE,
    DEFAULT_MIN_SCALE,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxscale._state import DynamicScalingState, LeafFlags

__all__ = [
    "RESTORED_WITHOUT_TARGET",
    "Located",
    "find_state",
    "locate",
    "looks_restored_without_target",
    "opt_state_of",
    "scaling_state_of",
    "scaling_states",
]


def opt_state_of(state: Any) -> Any:
    """The optimizer state inside a ``TrainState`` / ``nnx.Optimizer``, else
    ``state``."""
    if not isinstance(state, tuple | list | dict) and hasattr(state, "opt_state"):
        return state.opt_state
    return state


def find_state(
    tree: Any, kind: type | tuple[type, ...], name: str
) -> tuple[tuple[Any, ...], Any]:
    """The key path and value of the one node of type ``kind`` in ``tree``.

    ``tree`` may also be a ``TrainState`` or an ``nnx.Optimizer`` (its
    ``opt_state`` is searched). NNX variable wrappers are unwrapped in the
    result.

    Raises:
      ValueError: if there is no such node, or more than one.
    """
    tree = opt_state_of(tree)
    if isinstance(tree, kind):
        found = [((), tree)]
    else:
        flat, _ = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, kind) or _nnx.is_variable(x)
        )
        found = [(p, x) for p, x in flat if isinstance(x, kind)]
    what = " or ".join(f"jxs.{k.__name__}" for k in _as_tuple(kind))
    if not found:
        hint = ""
        if _nnx.is_state(tree):
            hint = (
                " An nnx.State (from `nnx.split`) holds the optimizer's arrays but "
                "not the loss scale's configuration, which lives in the GraphDef: "
                "merge first, `optimizer = nnx.merge(graphdef, state)`, and pass "
                "the optimizer (or `optimizer.opt_state`). "
                "`jxs.diagnostics.summary` and "
                "`jxs.validate_state` take the nnx.State itself."
            )
        if not hint and looks_restored_without_target(tree):
            raise ValueError(f"`{name}` {RESTORED_WITHOUT_TARGET}")
        raise ValueError(
            f"`{name}` contains no {what}. Build the optimizer with "
            "`jxs.dynamic_scaling(inner)` and pass its state (or a TrainState / "
            f"nnx.Optimizer holding it); got {type(tree).__name__}.{hint}"
        )
    if len(found) > 1:
        paths = ", ".join(jax.tree_util.keystr(p) or "<root>" for p, _ in found)
        raise ValueError(
            f"`{name}` contains {len(found)} {what} (at {paths}); expected exactly "
            "one. Wrap the whole optimizer in a single `jxs.dynamic_scaling`, or "
            "pass the sub-state you mean."
        )
    path, node = found[0]
    return path, jax.tree.map(_nnx.unwrap, node, is_leaf=_nnx.is_variable)


RESTORED_WITHOUT_TARGET = (
    "holds the fields of a jxs.DynamicScalingState as plain dicts: was it "
    "restored without a target? Restore into the structure of "
    "`tx.init(params)` (flax: `serialization.from_state_dict(tx.init(params), "
    "...)`; orbax: pass the abstract state as the restore target; a checkpoint "
    "of an older jaxscale: `jxs.upgrade_checkpoint`)."
)


def looks_restored_without_target(tree: Any) -> bool:
    """Whether ``tree`` holds a plain mapping with a scaling state's fields."""
    if _nnx.is_state(tree):
        return False
    nodes = [tree]
    while nodes:
        node = nodes.pop()
        if isinstance(node, Mapping):
            if {"loss_scale", "inner_state"} <= set(node):
                return True
            nodes.extend(node.values())
        elif isinstance(node, tuple | list):
            nodes.extend(node)
    return False


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


class Located(NamedTuple):
    """What :func:`locate` found: the loss scale (NNX variables unwrapped) and
    the key path of the :class:`DynamicScalingState` holding it (``None`` for a
    bare :class:`LossScale`), from the root of the optimizer state."""

    loss_scale: LossScale
    scaling_path: tuple[Any, ...] | None


def _is_scale_node(x: Any) -> bool:
    return isinstance(x, DynamicScalingState | LossScale) or _nnx.is_variable(x)


def locate(tree: Any, name: str) -> Located:
    """The one loss scale in ``tree`` and where its scaling state sits, in one
    walk of the tree (errors as :func:`find_state`'s for ``LossScale``).

    Raises:
      ValueError: if there is no loss scale, or more than one.
    """
    tree = opt_state_of(tree)
    if isinstance(tree, DynamicScalingState | LossScale):
        flat = [((), tree)]
    else:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_scale_node)
    found = []  # (path of the loss scale, the loss scale, path of its state)
    for path, node in flat:
        if isinstance(node, DynamicScalingState):
            inner, _ = jax.tree_util.tree_flatten_with_path(
                node, is_leaf=lambda x: isinstance(x, LossScale)
            )
            found += [(path + p, x, path) for p, x in inner if isinstance(x, LossScale)]
        elif isinstance(node, LossScale):
            found.append((path, node, None))
    if len(found) != 1:  # the finder's errors, for one kind
        find_state(tree, LossScale, name)
    _, scale, at = found[0]
    return Located(jax.tree.map(_nnx.unwrap, scale, is_leaf=_nnx.is_variable), at)


# --------------------------------------------------------------------------- #
# Every scaling state, also in an ``nnx.State``.
# --------------------------------------------------------------------------- #

# The keys that make a mapping in an ``nnx.State`` a split DynamicScalingState.
_SCALING_KEYS = frozenset({"steps", "skipped_steps", "consecutive_skips"})
_I32_MAX = 2**31 - 1


def _split_loss_scale(node: Any) -> Any:
    """The loss scale of a split state, as the kind its fields show, with the
    widest configuration the library allows (the GraphDef holds the real one)."""
    keys = set(node) if isinstance(node, Mapping) else set()
    if {"loss_scale", "growth_tracker", "hysteresis_tracker"} <= keys:
        return DynamicLossScale(
            loss_scale=node["loss_scale"],
            growth_tracker=node["growth_tracker"],
            hysteresis_tracker=node["hysteresis_tracker"],
            growth_interval=_I32_MAX,
            hysteresis=_I32_MAX,
            min_scale=DEFAULT_MIN_SCALE,
            max_scale=DEFAULT_MAX_SCALE,
        )
    if "loss_scale" in keys:
        return StaticLossScale(loss_scale=node["loss_scale"])
    return NoOpLossScale()


def _split_flags(node: Any) -> LeafFlags:
    """The flags of a split state (a mapping ``{"flags": variable}``; the names
    are in the GraphDef, so they come back as leaf indices)."""
    flags = node.get("flags") if isinstance(node, Mapping) else None
    n = 0 if flags is None else int(jax.numpy.shape(_nnx.unwrap(flags))[0])
    return LeafFlags(flags, tuple(str(i) for i in range(n)))


def _split_states(state: Any) -> list[tuple[tuple[Any, ...], Any]]:
    found = []

    def walk(path: tuple[Any, ...], node: Any) -> None:
        if not isinstance(node, Mapping):
            return
        if _SCALING_KEYS <= set(node):
            rebuilt = DynamicScalingState(
                loss_scale=_split_loss_scale(node.get("loss_scale")),
                inner_state=node.get("inner_state"),
                steps=node["steps"],
                skipped_steps=node["skipped_steps"],
                consecutive_skips=node["consecutive_skips"],
                nonfinite_leaves=_split_flags(node.get("nonfinite_leaves")),
            )
            found.append((path, rebuilt))
            return
        for key, value in node.items():
            walk((*path, jax.tree_util.DictKey(key)), value)

    walk((), state)
    return found


def scaling_states(obj: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(key path, DynamicScalingState)`` for every scaling state in ``obj``,
    with NNX variables kept as leaves (so a caller can write back into them).

    ``obj`` is an optimizer state, a ``TrainState`` / ``nnx.Optimizer`` (its
    ``opt_state`` is searched; paths start there), or an ``nnx.State``, where
    ``nnx.split`` has turned each state into a mapping by field name and moved
    the loss scale's configuration into the GraphDef: it comes back as the kind
    its fields show, with the widest configuration the library allows
    (``min_scale`` the smallest normal float32, ``growth_interval`` and
    ``hysteresis`` the int32 maximum).
    """
    if _nnx.is_state(obj):
        return _split_states(obj)
    tree = opt_state_of(obj)
    if isinstance(tree, DynamicScalingState):
        return [((), tree)]
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree,
        is_leaf=lambda x: isinstance(x, DynamicScalingState) or _nnx.is_variable(x),
    )
    return [(p, x) for p, x in flat if isinstance(x, DynamicScalingState)]


def scaling_state_of(obj: Any, name: str = "opt_state") -> DynamicScalingState:
    """The one :class:`DynamicScalingState` in ``obj`` (see
    :func:`scaling_states`), with plain arrays as leaves.

    Raises:
      ValueError: if there is none, or more than one; the message names ``name``
        and says what to pass.
    """
    if _nnx.is_state(obj):
        found = _split_states(obj)
        if len(found) != 1:
            raise ValueError(
                f"`{name}` must hold exactly one jxs.dynamic_scaling state, got "
                f"{len(found)} in this nnx.State. The state of a model alone "
                "holds none: pass the state of `nnx.split((model, optimizer))` "
                "or the `nnx.Optimizer`."
            )
        return jax.tree.map(_nnx.unwrap, found[0][1], is_leaf=_nnx.is_variable)
    return find_state(obj, DynamicScalingState, name)[1]
