"""Clipping by global norm that cannot overflow on float16 gradients.

``optax.clip_by_global_norm`` squares and sums the gradients in their own dtype
and divides each leaf by the norm cast to the leaf's dtype. With float16
gradients both overflow: a single element above 256 squares to ``inf``, and any
norm above 65504 becomes ``inf`` in float16, so every gradient is divided by
``inf`` and the update is silently zero. Here the norm is accumulated in float32
(float64 when a leaf is float64) and each leaf is rescaled in float32 before it
is cast back to its own dtype.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from optax import Params, Updates

from jaxscale._tree import compute_dtype, is_inexact_leaf, map_parts, real_parts

__all__ = ["clip_by_global_norm", "global_norm"]


def overflow_safe_norm(leaves: list[jax.Array], dtype: Any) -> jax.Array:
    """``sqrt(sum(x**2))`` over the leaves, accumulated in ``dtype``.

    Branch-free and from one read of each leaf: beside the sum of squares (as
    optax computes it) the same pass sums the squares of ``x * 2**-k``
    (``k = 5/8`` of the dtype's largest exponent: 80 for float32). Where the
    first sum overflows (a norm above about ``1.8e19`` in float32) the norm is
    ``2**k`` times the second's root: every finite tree has a finite norm. The
    elements the second sum flushes to zero (below ``2**17`` in float32) are
    then at most a ``2**-64``-th of the total each. ``inf`` in the tree gives
    ``inf``, ``NaN`` gives ``NaN``. (No ``lax.cond``: XLA:GPU reads a
    conditional's predicate on the host.)
    """
    if not leaves:
        return jnp.zeros((), dtype)
    k = (jnp.finfo(dtype).maxexp * 5) // 8
    down = jnp.asarray(2.0**-k, dtype)
    sumsq = jnp.zeros((), dtype)
    small = jnp.zeros((), dtype)
    for x in leaves:
        x = x.astype(dtype)
        sumsq = sumsq + jnp.sum(jnp.square(x))
        small = small + jnp.sum(jnp.square(x * down))
    rescaled = jnp.sqrt(small) * jnp.asarray(2.0**k, dtype)
    return jnp.where(jnp.isfinite(sumsq), jnp.sqrt(sumsq), rescaled)


def _parts(tree: Any) -> list[jax.Array]:
    """The real arrays of the inexact leaves of ``tree``: a complex leaf's real
    and imaginary parts, so that their squares sum to ``|z|**2``."""
    return [
        p for x in jax.tree.leaves(tree) if is_inexact_leaf(x) for p in real_parts(x)
    ]


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of the floating and complex leaves of a tree, without overflow.

    Every floating leaf is squared and summed in float32 (float64 if some leaf
    is float64), so float16 and bfloat16 gradients give the same norm as their
    float32 copies; ``optax.tree.norm`` accumulates in the leaves' own dtype and
    returns ``inf`` for a float16 tree whose norm exceeds 65504. If even the
    float32 sum of squares overflows, the norm comes from a second sum of
    rescaled squares taken in the same pass (no branch), so any finite tree
    has a finite norm. A complex element counts as ``|z|**2 = real(z)**2 +
    imag(z)**2`` (as in ``optax.tree.norm``; complex64 in float32). Integer,
    boolean and ``None`` leaves are ignored; an ``inf`` element gives ``inf``
    and a ``NaN`` gives ``NaN``.

    Args:
      tree: a pytree, typically gradients.

    Returns:
      ``f32[]`` (``f64[]`` if a leaf is float64): the global norm.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> g = {"w": jnp.full((4,), 40000.0, jnp.float16)}
      >>> jxs.global_norm(g)
      Array(80000., dtype=float32)
      >>> optax.tree.norm(g)  # squares 40000 in float16
      Array(inf, dtype=float16)
      >>> jxs.global_norm({"z": jnp.array([3 + 4j], jnp.complex64)})
      Array(5., dtype=float32)
    """
    parts = _parts(tree)
    return overflow_safe_norm(parts, compute_dtype([x.dtype for x in parts]))


def _check_max_norm(max_norm: Any) -> None:
    """Validates a concrete ``max_norm``; traced or array values pass through."""
    if isinstance(max_norm, jax.core.Tracer):
        return
    if isinstance(max_norm, bool) or not (
        isinstance(max_norm, numbers.Real)
        or (hasattr(max_norm, "dtype") and jnp.ndim(max_norm) == 0)
    ):
        raise TypeError(f"`max_norm` must be a real scalar, got {max_norm!r}.")
    value = float(max_norm)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"`max_norm` must be finite and > 0, got {max_norm!r}.")


def clip_by_global_norm(max_norm: jax.typing.ArrayLike) -> optax.GradientTransformation:
    """Clips updates by their global norm, computed without float16 overflow.

    A drop-in for ``optax.clip_by_global_norm`` (same rule, same empty state, so
    checkpoints are interchangeable): if the global norm ``n`` of the updates is
    at least ``max_norm``, every leaf is multiplied by ``max_norm / n``.

    The difference is the arithmetic. ``optax.clip_by_global_norm`` squares and
    sums float16 gradients in float16, and divides each leaf by the norm cast to
    float16: once the norm exceeds 65504 it is ``inf`` and every update is
    silently zero. Here the norm is computed by :func:`global_norm` (in float32,
    never overflowing for finite gradients) and each leaf is rescaled in float32
    and cast back to its own dtype, so dtypes are preserved and the clipped
    norm is ``max_norm`` up to rounding. For float32 leaves the result equals
    optax's bit for bit. Complex leaves count with ``|z|**2`` in the norm, as
    in optax, and are rescaled part by part (the real and the imaginary part
    by the same real factor).

    Put it *inside* :func:`dynamic_scaling`, so that it clips the unscaled
    gradients (torch's ``scaler.unscale_(opt)`` then ``clip_grad_norm_``)::

      jxs.dynamic_scaling(optax.chain(jxs.clip_by_global_norm(1.0), optax.adamw(lr)))

    Args:
      max_norm: the largest global norm allowed, ``> 0``; a Python number, or an
        array (e.g. under ``optax.inject_hyperparams``).

    Returns:
      An ``optax.GradientTransformation`` with ``optax.EmptyState``.

    Raises:
      TypeError: if ``max_norm`` is not a real scalar.
      ValueError: if a concrete ``max_norm`` is not finite and positive.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> g = {"w": jnp.full((4,), 40000.0, jnp.float16)}  # norm 80000
      >>> clipped, _ = jxs.clip_by_global_norm(1.0).update(g, optax.EmptyState())
      >>> clipped["w"]
      Array([0.5, 0.5, 0.5, 0.5], dtype=float16)
      >>> optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]["w"]
      Array([0., 0., 0., 0.], dtype=float16)
    """
    _check_max_norm(max_norm)

    def init_fn(params: Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(
        updates: Updates, state: optax.EmptyState, params: Params | None = None
    ) -> tuple[Updates, optax.EmptyState]:
        del params
        parts = _parts(updates)
        dtype = compute_dtype([x.dtype for x in parts])
        norm = overflow_safe_norm(parts, dtype)
        limit = jnp.asarray(max_norm, dtype)
        trigger = norm < limit

        def part(t: jax.Array) -> jax.Array:
            c = compute_dtype(t.dtype)
            return ((t.astype(c) / norm.astype(c)) * limit.astype(c)).astype(t.dtype)

        def clip(t: Any) -> Any:
            if not is_inexact_leaf(t):
                return t
            t = jnp.asarray(t)
            return lax.select(trigger, t, map_parts(part, t))

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(init_fn, update_fn)
