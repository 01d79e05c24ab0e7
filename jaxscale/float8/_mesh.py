"""Float8 across devices: one scale for every device.

A per-tensor scale is the tensor's largest magnitude (its *amax*). Under ``jit``
with sharded arrays (GSPMD), ``jnp.max(jnp.abs(x))`` of a sharded ``x`` is a
global reduction already: XLA inserts the all-reduce. Inside a ``shard_map``
body, code sees only its own block, so the amax of a block is reduced here with
``lax.pmax`` over the manual mesh axes along which the tensor varies: its
varying axes (``check_vma=True``, the default), or every manual axis in scope
when they are not checked (a ``pmax`` of a replicated value is the value). Every
device then quantises with the same scale, and delayed scaling records the same
amax on every device (its state stays replicated).

An amax is reduced as a key (:func:`jaxscale.float8._numerics.amax_key`) whose
maximum keeps inf and NaN as :func:`~jaxscale.float8._numerics.amax` does: one
scalar all-reduce per tensor (:func:`max_over_devices`); XLA combines the
all-reduces of independent scalars.
"""

from __future__ import annotations

import jax
from jax import lax

from jaxscale._jax_private import manual_axes, varying_axes
from jaxscale._scope import AMAX_SCOPE

__all__ = ["AMAX_SCOPE", "max_over_devices", "reduction_axes"]


def reduction_axes(x: jax.Array) -> tuple[str, ...]:
    """The manual mesh axes over which ``x``'s amax must be reduced: those it
    varies along (all manual axes in scope if they are not checked); ``()``
    outside ``shard_map``."""
    axes, checked = manual_axes()
    if not axes or not checked:
        return axes
    return tuple(a for a in varying_axes(jax.typeof(x)) if a in axes)


def max_over_devices(value: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``value``'s maximum over the mesh ``axes`` (one all-reduce of a scalar;
    ``value`` itself for ``()``)."""
    if not axes:
        return value
    with jax.named_scope(AMAX_SCOPE):
        return lax.pmax(value, axes)
