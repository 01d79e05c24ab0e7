"""Where the loss-scale state sits in an optimizer state, and whether that is right.

``jxs.dynamic_scaling`` must see the gradients of the scaled loss first and own
the whole optimizer: a transformation in front of it sees *scaled* gradients
(a clip then clips at ``scale`` times the wrong norm; ``optax.clip`` turns an
``inf`` into a finite value, so overflows go unnoticed), and a wrapper around it
runs on skipped steps or replays the overflow. The nesting is visible in the
optimizer state: this module finds the one :class:`DynamicScalingState` (or
bare :class:`LossScale`) with its key path, and :func:`check_composition` reads
the path, at trace time, at no cost in the compiled step.

It is the one finder of jaxscale states in a user object (an optimizer state, a
Flax ``TrainState``, an ``nnx.Optimizer``, the ``nnx.State`` of a functional NNX
loop): ``loss_scale_of``, the diagnostics, ``monitor``, ``validate_state``,
``jaxscale.flax`` and ``jaxscale.testing`` all read through it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import optax

from jaxscale import _nnx
from jaxscale._loss_scale import (
    DEFAULT_MAX_SCALE,
    DEFAULT_MIN_SCALE,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxscale._state import DynamicScalingState, LeafFlags

__all__ = [
    "CompositionWarning",
    "check_composition",
    "check_inner",
    "find_state",
    "scaling_state_of",
    "scaling_states",
]


class CompositionWarning(UserWarning):
    """Warned when ``jxs.dynamic_scaling`` is composed in a suspicious order.

    Orders that are certainly wrong (another transformation in front of the
    wrapper, the wrapper inside ``optax.MultiSteps`` or one group of
    ``optax.multi_transform``) raise a ``ValueError`` instead. This warning is
    for orders whose effect is subtle: ``optax.inject_hyperparams`` around the
    wrapper (its schedule also advances on skipped steps) and transformations
    chained after it (they also run on skipped steps). The message says how to
    nest them instead. Filter it with :mod:`warnings` once you have checked.

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.CompositionWarning, UserWarning)
      True
    """


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


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


# What to write instead, by the wrapper found around ``dynamic_scaling``
# (``PartitionState`` is ``optax.multi_transform``'s state).
_RIGHT = {
    "MultiStepsState": (
        "`optax.MultiSteps` around `jxs.dynamic_scaling` runs the inner update on "
        "every micro-step and keeps an `inf` of one micro-batch in its accumulator "
        "(0 * inf = NaN), so every later window is skipped. Accumulate with "
        "`jxs.accumulate(jxs.dynamic_scaling(inner), every_k)` instead."
    ),
    "PartitionState": (
        "`jxs.dynamic_scaling` on one group of `optax.multi_transform` unscales "
        "only that group: the other groups receive gradients multiplied by the "
        "loss scale. Wrap the whole multi_transform instead: "
        "`jxs.dynamic_scaling(optax.multi_transform(...))`."
    ),
    "MaskedState": (
        "`optax.masked` around `jxs.dynamic_scaling` leaves the masked-out leaves "
        "scaled. Put the mask inside: `jxs.dynamic_scaling(optax.masked(...))`."
    ),
}
_INJECT = {"InjectHyperparamsState", "InjectStatefulHyperparamsState"}
# Put in front on purpose: test-time fault injection (jaxscale.testing).
_ALLOWED_BEFORE = {"NonfiniteAtState"}
_RIGHT["MultiTransformState"] = _RIGHT["PartitionState"]  # older optax


def _is_empty(state: Any) -> bool:
    return isinstance(state, optax.EmptyState) or state == ()


def check_composition(opt_state: Any, name: str = "opt_state") -> None:
    """Raises or warns if ``dynamic_scaling`` is nested wrongly in ``opt_state``.

    Reads only the static structure of the state (its node types and the key
    path to the scaling state): nothing is added to the compiled step. A state
    that holds no :class:`DynamicScalingState` (a bare :class:`LossScale`) is
    not checked.
    """
    try:
        path, _ = find_state(opt_state, DynamicScalingState, name)
    except ValueError:
        return
    node = opt_state_of(opt_state)
    for depth, key in enumerate(path):
        kind = type(node).__name__
        where = jax.tree_util.keystr(path[: depth + 1])
        if kind in _RIGHT:
            raise ValueError(
                f"`{name}`: the jxs.DynamicScalingState sits inside a {kind} (at "
                f"`{where}`). {_RIGHT[kind]}"
            )
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            index = getattr(key, "idx", 0)
            before = [
                type(s).__name__
                for s in node[:index]
                if type(s).__name__ not in _ALLOWED_BEFORE
            ]
            if before:
                raise ValueError(
                    f"`{name}`: `jxs.dynamic_scaling` is element {index} of an "
                    f"`optax.chain`, after {len(before)} other transformation(s) "
                    f"(states {before}): "
                    "they receive the gradients of the *scaled* loss (a clip "
                    "clips at the wrong norm, `optax.clip` turns an inf into a "
                    "finite value so overflows go undetected, weight decay is "
                    "divided by the scale). Move them inside the wrapper: "
                    "`jxs.dynamic_scaling(optax.chain(clip, ..., optimizer))`."
                )
            after = [s for s in node[index + 1 :] if not _is_empty(s)]
            if after:
                warnings.warn(
                    f"`{name}`: transformations are chained after "
                    f"`jxs.dynamic_scaling` (element {index} of {len(node)}), with "
                    "state: they also run on skipped steps, on the -0.0 updates, "
                    "and advance their state there. "
                    "Put them inside: `jxs.dynamic_scaling(optax.chain(..., "
                    "them))`.",
                    CompositionWarning,
                    stacklevel=4,
                )
        elif kind in _INJECT:
            warnings.warn(
                f"`{name}`: `optax.inject_hyperparams` wraps `jxs.dynamic_scaling` "
                f"(at `{where}`): its schedules advance on skipped steps too. "
                "Inject inside the wrapper so they count applied steps only: "
                "`jxs.dynamic_scaling(optax.inject_hyperparams(optax.adam)("
                "learning_rate=schedule))`.",
                CompositionWarning,
                stacklevel=4,
            )
        node = _child(node, key)


def _child(node: Any, key: Any) -> Any:
    node = _nnx.unwrap(node)
    if hasattr(key, "idx"):
        return node[key.idx]
    if hasattr(key, "key"):
        return node[key.key]
    if hasattr(key, "name"):
        return getattr(node, key.name)
    return node


def check_inner(inner: Any, inner_state: Any) -> None:
    """Raises if ``inner`` (of ``dynamic_scaling``) holds what belongs outside."""
    if isinstance(inner, optax.MultiSteps):
        raise TypeError(
            "`inner` must be an optax.GradientTransformation, got optax.MultiSteps; "
            "and accumulation belongs outside the wrapper anyway: use "
            "`jxs.accumulate(jxs.dynamic_scaling(inner), every_k)`."
        )
    nodes = jax.tree.leaves(
        inner_state,
        is_leaf=lambda x: type(x).__name__ in _INSIDE_WRONG,
    )
    for node in nodes:
        kind = type(node).__name__
        if kind in _INSIDE_WRONG:
            raise ValueError(f"`inner`'s state holds a {kind}: {_INSIDE_WRONG[kind]}")


_INSIDE_WRONG = {
    "AccumulateState": (
        "`jxs.dynamic_scaling(jxs.accumulate(inner, k))` checks and adjusts the "
        "scale on every micro-batch while the window mixes scales. Nest it the "
        "other way round: `jxs.accumulate(jxs.dynamic_scaling(inner), k)`."
    ),
    "MultiStepsState": (
        "use `jxs.accumulate(jxs.dynamic_scaling(inner), every_k)` instead of "
        "`optax.MultiSteps` inside the wrapper."
    ),
    "DynamicScalingState": (
        "`jxs.dynamic_scaling` is nested inside another `jxs.dynamic_scaling`; "
        "wrap the optimizer once."
    ),
}


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
