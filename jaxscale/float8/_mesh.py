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
scalar all-reduce per tensor; several independent ones are one ``pmax`` of a
stacked vector (:func:`max_over_devices`), and XLA combines the all-reduces of
independent scalars in any case.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale._jax_private import manual_axes, varying_axes

__all__ = ["max_over_devices", "reduction_axes"]


def reduction_axes(x: jax.Array) -> tuple[str, ...]:
    """The manual mesh axes over which ``x``'s amax must be reduced: those it
    varies along (all manual axes in scope if they are not checked); ``()``
    outside ``shard_map``."""
    axes, checked = manual_axes()
    if not axes or not checked:
        return axes
    return tuple(a for a in varying_axes(jax.typeof(x)) if a in axes)


def max_over_devices(
    values: Sequence[jax.Array], axes: tuple[str, ...]
) -> list[jax.Array]:
    """Each scalar, its maximum over the mesh ``axes``, all in one
    ``pmax`` of a stacked vector (one all-reduce).

    Args:
      values: scalars of one dtype (amax keys, :func:`~._numerics.amax_key`).
      axes: manual mesh axes (``()``: returned as given).

    Returns:
      The reduced values, in the same order.
    """
    if not axes or not values:
        return list(values)
    if len(values) == 1:
        return [lax.pmax(values[0], axes)]
    out = lax.pmax(jnp.stack(values), axes)
    return [out[i] for i in range(len(values))]
