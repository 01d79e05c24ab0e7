"""An FSDP weight gathered in float8: :func:`all_gather`.

Under FSDP inside ``jax.shard_map`` each device holds a block of a weight's
rows and gathers the whole weight before its matmul
(``lax.all_gather(w, axis_name, tiled=True)``). A float8 site then quantises
the gathered weight: the gather moves the weight in its own dtype (4 bytes an
element for float32). :func:`all_gather` quantises each block first, with the
scale of the whole weight (the blocks' amaxes reduced over the devices, one
scalar all-reduce), and gathers the float8 values as their bits (``uint8``:
1 byte an element on every backend; XLA:CPU widens a float8 collective to
float16). It returns them dequantised (``q * scale``, in the weight's dtype):
the float8 site that reads it quantises it again to the same float8 values
(the amax of the dequantised weight is the amax the blocks were scaled by, to
a rounding far below float8's), so the product is the one of
gather-then-quantise.

Its backward is the transpose of the gather: the gradient of the gathered
weight, reduce-scattered (``lax.psum_scatter``) in its dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale._autocast.interp import REGION_PREFIX
from jaxscale._jax_private import manual_axes
from jaxscale._scope import FLOAT8_GATHER_SCOPE
from jaxscale.float8._mesh import max_over_devices, reduction_axes
from jaxscale.float8._numerics import (
    amax_key,
    dequantize,
    from_key,
    poison,
    saturate,
    scale_from_amax,
)
from jaxscale.float8._recipes import CurrentScaling, Recipe
from jaxscale.float8._site import current_context

__all__ = ["GATHER_SCOPE", "all_gather"]

#: The name scope of the gather: autocast runs what is inside as traced (its
#: prefix marks a region autocast does not rewrite), so the cast of the blocks
#: is the float32 one whatever autocast's dtype; ``collective_report`` finds
#: its gather by :data:`~jaxscale._scope.FLOAT8_GATHER_SCOPE` in the metadata.
GATHER_SCOPE = f"{REGION_PREFIX}_{FLOAT8_GATHER_SCOPE}"


def all_gather(
    x: jax.typing.ArrayLike,
    axis_name: Any,
    *,
    axis: int = 0,
    recipe: Recipe | None = None,
) -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` moved in float8.

    For a weight stored by blocks (FSDP) that a float8 matmul reads: each
    device's block is quantised to the recipe's ``fwd_dtype`` with the scale
    of the whole weight (the blocks' amaxes reduced over ``axis_name`` and,
    inside ``shard_map``, the other mesh axes along which ``x`` varies), its
    float8 bits are gathered (1 byte an element instead of 4), and the result
    is dequantised in ``x``'s dtype. A float8 site of
    :func:`jaxscale.autocast` quantises it again to the same float8 values, so
    its product is the one of ``lax.all_gather`` followed by the site's
    quantisation. The gradient is reduce-scattered over ``axis_name``
    (``lax.psum_scatter``, the transpose of the gather) in ``x``'s dtype.

    Call it where the step would call ``lax.all_gather(w, axis_name,
    tiled=True)``, inside the function that ``jxs.autocast(..., float8=...)``
    runs or around it. Outside a float8 matmul the result is the weight as
    float8 holds it (rounded to 3 mantissa bits): use ``lax.all_gather``
    there.

    Args:
      x: this device's block, floating.
      axis_name: the mesh axis (or tuple of axes) to gather over, as for
        ``lax.all_gather``.
      axis: the dimension of ``x`` along which the blocks are concatenated.
      recipe: the float8 recipe of the site that reads the result (its
        ``fwd_dtype`` and ``margin``); ``None`` for
        :class:`~jaxscale.float8.CurrentScaling`'s defaults. A recipe with
        state (delayed scaling) or axiswise scales (rowwise) is refused: its
        site would quantise with another scale than the gather's.

    Returns:
      The whole tensor (``x``'s shape with ``axis`` times the number of
      blocks), ``x``'s dtype: each value a ``fwd_dtype`` value times the
      scale. Non-finite values make the whole result NaN (as a site's product
      would be).

    Raises:
      ValueError: for a delayed or axiswise recipe, or under
        ``jxs.float8.value_and_grad`` with delayed scaling; an ``axis`` out
        of range.
      TypeError: for a non-floating ``x`` or a ``recipe`` that is not a
        :class:`~jaxscale.float8.Recipe`.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> w = jnp.arange(16.0).reshape(4, 4)  # 2 blocks of 2 rows
      >>> gather = lambda b: jxs.float8.all_gather(b, "i")
      >>> full = jax.vmap(gather, axis_name="i")(w.reshape(2, 2, 4))[0]
      >>> full.shape, full.dtype, bool(jnp.max(jnp.abs(full - w)) <= 0.5)
      ((4, 4), dtype('float32'), True)
    """
    recipe = _checked_recipe(recipe)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"`x` must be a floating array (a weight's block), got {x.dtype}."
        )
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"`axis` must be a dimension of `x` (rank {x.ndim}), got {axis}."
        )
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    with jax.named_scope(GATHER_SCOPE):
        return _gather(x, names, axis % x.ndim, recipe)


def _checked_recipe(recipe: Any) -> Recipe:
    if recipe is None:
        recipe = CurrentScaling()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            "`recipe` must be a float8 recipe (`jxs.float8.CurrentScaling(...)`) "
            f"or None, got {type(recipe).__name__} {recipe!r}."
        )
    ctx = current_context()
    delayed = recipe.needs_state or (ctx is not None and ctx.delayed)
    if delayed or recipe.axiswise:
        kind = "delayed scaling" if delayed else f"{type(recipe).__name__}"
        raise ValueError(
            f"`jxs.float8.all_gather` quantises with the current amax of the whole "
            f"tensor; under {kind} the float8 site would quantise the gathered "
            "values again with another scale (twice rounded). Use "
            "`lax.all_gather(x, axis_name, tiled=True)` (the site quantises the "
            "gathered weight), or current scaling (`float8=True`)."
        )
    return recipe


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(x: jax.Array, names: tuple, axis: int, recipe: Recipe) -> jax.Array:
    # The amax of the whole tensor: over the gathered axes, and inside
    # shard_map over the other manual axes along which x varies.
    manual, _ = manual_axes()
    axes = reduction_axes(x)
    axes += tuple(n for n in names if n not in axes and n not in manual)
    a = from_key(max_over_devices(amax_key(x), axes))
    s = poison(scale_from_amax(a, recipe.fwd_dtype, recipe.margin), a)
    bits = lax.bitcast_convert_type(saturate(x, s, recipe.fwd_dtype), jnp.uint8)
    bits = lax.all_gather(bits, names, axis=axis, tiled=True)
    q = lax.bitcast_convert_type(bits, recipe.fwd_dtype)
    return dequantize(q, s, x.dtype)


def _gather_fwd(x, names, axis, recipe):
    return _gather(x, names, axis, recipe), None


def _gather_bwd(names, axis, recipe, _, g):
    return (lax.psum_scatter(g, names, scatter_dimension=axis, tiled=True),)


_gather.defvjp(_gather_fwd, _gather_bwd)
