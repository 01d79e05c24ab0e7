"""Run the inner update, or skip it: the one decision shared by
``dynamic_scaling`` (skip a non-finite step) and ``accumulate`` (wait for the
end of the window), in the shape of optax's ``MultiSteps``: branch-free.

``inner`` runs on every call and its effect is selected away where the
decision says skip. No ``lax.cond``: XLA:GPU copies a conditional's predicate
to the host and blocks the host until it has arrived, unless the conditional
runs inside a CUDA graph (jaxlib >= 0.10.2 only), which would stop JAX's
asynchronous dispatch on every step (docs/performance.md). The selects fuse
into ``inner``'s own elementwise passes and, within one ``jit``, into the
caller's ``optax.apply_updates``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal, Var

from jaxscale._distributed import match_varying
from jaxscale._jax_private import eqn_context, rebind

__all__ = ["update_or_skip"]


def _keep_update(run: jax.Array, u: Any) -> Any:
    """``u`` where ``run``, else ``-0.0`` (``-0.0 - 0.0j`` for complex leaves,
    ``0`` for the others).

    ``p + (-0.0)`` is ``p`` for every float ``p``, ``-0.0`` included, whereas
    ``-0.0 + 0.0`` would be ``+0.0``: so ``optax.apply_updates`` with these
    updates leaves every parameter bit-identical (a complex one part by part).
    """
    if u is None:
        return None
    u = jnp.asarray(u)
    fill: complex | float = 0
    if jnp.issubdtype(u.dtype, jnp.complexfloating):
        fill = complex(-0.0, -0.0)
    elif jnp.issubdtype(u.dtype, jnp.floating):
        fill = -0.0
    return jnp.where(run, u, jnp.asarray(fill, u.dtype))


def _keep_state(run: jax.Array, new: Any, old: jax.Array) -> jax.Array:
    """``new`` where ``run``, else ``old`` (typed as ``new``: a ``shard_map``
    state varies over the axes its gradients vary over)."""
    new = jnp.asarray(new)
    return lax.select(run, new, match_varying(old, new))


def _check_state_type(new: Any, old: jax.Array) -> None:
    """A new state leaf must have its old leaf's shape and dtype."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise TypeError(
            "The inner optimizer's `update` returned a state whose dtypes or "
            "shapes differ from the state it was given "
            f"({old.dtype}{list(old.shape)} in, {new.dtype}{list(new.shape)} "
            "out). jaxscale needs them equal: a skipped step returns the given "
            "state unchanged. A common cause is an integer leaf in `params` with "
            "an optimizer such as `optax.adam` (its moments start as integer "
            "zeros and come back float): keep integer leaves out of the "
            "differentiated parameters, or leave them to `optax.set_to_zero()` "
            "through `optax.multi_transform`."
        )


def update_or_skip(
    run: jax.Array,
    apply: Callable[[Any], tuple[Any, Any]],
    operand: Any,
    inner_state_of: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """``apply(operand)`` (an ``(updates, inner_state)`` pair) where ``run``
    (``bool[]``) is true; otherwise updates of ``-0.0`` and the inner state
    ``inner_state_of(operand)`` unchanged (bit for bit), typed as ``apply``
    types them.

    ``apply`` runs on every call; a skipped call discards what it computed.
    It is traced to a jaxpr and evaluated here, with each new state leaf
    selected (``select(run, new, old)``) where it is computed, so that what
    ``apply`` derives from it (Adam's update from its new moments) reads the
    selected value. The updates are the same wherever ``run`` is true, and
    discarded elsewhere; but XLA then materialises each new state leaf once
    and reads it, as in a plain optax step, instead of recomputing the new
    moments inside the parameter update from the old ones (with a copy of
    every donated moment buffer, read twice while written in place).
    """
    old_inner = inner_state_of(operand)
    leaves, treedef = jax.tree.flatten(operand)
    closed, out_shape = jax.make_jaxpr(
        lambda *xs: apply(jax.tree.unflatten(treedef, xs)), return_shape=True
    )(*leaves)
    out_updates, out_inner = out_shape
    if jax.tree.structure(old_inner) != jax.tree.structure(out_inner):
        raise ValueError(
            "The inner optimizer's `update` returned a state of another tree "
            f"structure than it was given: {jax.tree.structure(old_inner)} in, "
            f"{jax.tree.structure(out_inner)} out. A state must keep its "
            "structure from step to step (as every optax transformation does)."
        )
    old = [jnp.asarray(x) for x in jax.tree.leaves(old_inner)]
    for new, o in zip(jax.tree.leaves(out_inner), old, strict=True):
        _check_state_type(new, o)
    run = jnp.asarray(run, jnp.bool_)
    jaxpr = closed.jaxpr
    n_updates = len(jax.tree.leaves(out_updates))
    state_vars = jaxpr.outvars[n_updates:]
    # The state leaf each computed output stands for; a value that is two
    # leaves at once is selected at the end only.
    owner: dict[Any, int] = {}
    for i, v in enumerate(state_vars):
        if isinstance(v, Var):
            owner[v] = -1 if v in owner else i
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, leaves, strict=True):
        env[v] = x
    selected = set()  # the computed state leaves, selected where computed
    for eqn in jaxpr.eqns:
        with eqn_context(eqn):
            outs = rebind(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            i = owner.get(v, -1)
            if i >= 0:
                x = _keep_state(run, x, old[i])
                selected.add(v)
            env[v] = x
    outs = [read(v) for v in jaxpr.outvars]
    updates = [_keep_update(run, u) for u in outs[:n_updates]]
    # The rest (inputs or constants passed through, literals, values that are
    # two leaves at once) are selected here.
    inner = [
        x if isinstance(v, Var) and v in selected else _keep_state(run, x, o)
        for v, x, o in zip(state_vars, outs[n_updates:], old, strict=True)
    ]
    return (
        jax.tree.unflatten(jax.tree.structure(out_updates), updates),
        jax.tree.unflatten(jax.tree.structure(out_inner), inner),
    )
