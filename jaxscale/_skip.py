"""Run the inner update, or skip it: the one conditional shared by
``dynamic_scaling`` (skip a non-finite step) and ``accumulate`` (wait for the
end of the window), in the shape of optax's ``conditionally_transform``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale._distributed import match_varying

__all__ = ["negative_zeros", "update_or_skip"]


def negative_zeros(tree: Any) -> Any:
    """``-0.0`` of each float leaf's shape and dtype (``0`` for other dtypes).

    ``p + (-0.0)`` is ``p`` for every float ``p``, ``-0.0`` included, whereas
    ``-0.0 + 0.0`` would be ``+0.0``: so ``optax.apply_updates`` with these
    updates leaves every parameter bit-identical.
    """

    def leaf(s):
        # ``lax.cond`` compares types: match the sharding (explicit mesh axes)
        # and the varying ``shard_map`` axes of the updates stood in for.
        fill = -0.0 if jnp.issubdtype(s.dtype, jnp.floating) else 0
        x = jnp.full(s.shape, fill, s.dtype, device=getattr(s, "sharding", None))
        return match_varying(x, s)

    return jax.tree.map(leaf, tree)


def update_or_skip(
    run: jax.Array,
    apply: Callable[[Any], tuple[Any, Any]],
    operand: Any,
    inner_state_of: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """``apply(operand)`` (an ``(updates, inner_state)`` pair) where ``run``
    (``bool[]``) is true; otherwise updates of ``-0.0`` and the inner state
    ``inner_state_of(operand)`` unchanged, both typed as ``apply`` types them.

    A ``lax.cond``: ``apply`` does not run on skipped calls.
    """

    def skip(operand: Any) -> tuple[Any, Any]:
        out_updates, out_inner = jax.eval_shape(apply, operand)
        # The inner state comes back unchanged, typed as ``apply`` types it
        # (e.g. varying over ``shard_map`` axes, as its gradients are).
        kept = jax.tree.map(match_varying, inner_state_of(operand), out_inner)
        return negative_zeros(out_updates), kept

    return lax.cond(run, apply, skip, operand)
