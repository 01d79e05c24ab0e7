"""Float8 numerics: per-tensor scales and quantisation.

The ground floor of the float8 wing: pure functions of arrays, no tracing
machinery and no recipe. A tensor ``x`` is
stored as ``q = x / scale`` in a float8 dtype and read back as ``q * scale``
(the *dequantisation* convention; Transformer Engine stores the reciprocal,
``x * scale`` before the cast, and calls ours ``scale_inv``).

``scale`` is chosen so that the tensor's largest magnitude (its *amax*) lands on
the float8 dtype's largest finite value: ``scale = amax / finfo(dtype).max``
times ``2**margin``. An amax of 0 or one that is not finite keeps the previous
scale (1 where there is none), as Transformer Engine's default scale update does.

Quantisation saturates finite values at the dtype's finite range and keeps
infinities and NaNs non-finite (``float8_e4m3fn`` has no infinity: an infinite
value becomes NaN), so an overflow upstream still reaches the loss-scale check.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale.float8._mesh import max_over_devices, reduction_axes

__all__ = [
    "E4M3",
    "E5M2",
    "amax",
    "amax_key",
    "dequantize",
    "from_key",
    "quantize",
    "scale_from_amax",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype("float32")


def amax(x: jax.Array, axis: int | None = None) -> jax.Array:
    """``max(|x|)`` as ``f32[]``: NaN if ``x`` holds a NaN, else inf if it holds
    an inf. Inside ``shard_map``, of the whole tensor: each device's block's
    amax reduced over the manual mesh axes along which ``x`` varies
    (:mod:`jaxscale.float8._mesh`), so every device gets the same value.

    One integer reduction, one read of ``x`` (:func:`amax_key`), and one
    all-reduce of a scalar where the tensor is sharded. With an ``axis``, the
    amax along it (``float32``, ``x``'s shape with size 1 there), each
    device's own block's inside ``shard_map``.
    """
    if axis is not None:
        if not x.size:
            return jnp.zeros((*x.shape[:axis], 1, *x.shape[axis:][1:]), _F32)
        bits = lax.bitcast_convert_type(jnp.abs(x).astype(_F32), jnp.int32)
        return from_key(jnp.max(bits, axis=axis, keepdims=True))
    return from_key(max_over_devices(amax_key(x), reduction_axes(x)))


def amax_key(x: jax.Array) -> jax.Array:
    """``i32[]``: the largest of the float32 bits of ``|x|`` read as int32s.

    The bits of a non-negative float32, read as an int32, are ordered as the
    values, and every NaN's bits lie above infinity's: the key's maximum over
    several blocks is the key of their union, exact, and a NaN always wins on
    any backend, whatever its float ``max`` does with NaN. (The reduction of
    ``max(|x|)`` and a second, summing one to catch a dropped NaN read ``x``
    twice, and XLA:GPU transposed a float32 weight for the second.)
    """
    if not x.size:
        return jnp.zeros((), jnp.int32)
    return jnp.max(lax.bitcast_convert_type(jnp.abs(x).astype(_F32), jnp.int32))


def from_key(key: jax.Array) -> jax.Array:
    """The amax (``f32[]``, NaN or inf where the tensor holds them) of a key."""
    return lax.bitcast_convert_type(key, _F32)


def scale_from_amax(
    amax_: jax.Array, dtype: Any, margin: float = 0.0, previous: Any = 1.0
) -> jax.Array:
    """The dequantisation scale that maps ``amax_`` onto ``dtype``'s largest
    finite value, times ``2**margin``; ``previous`` where ``amax_`` is 0 or not
    finite (Transformer Engine's rule).

    Args:
      amax_: ``f32[]``, or any shape (elementwise).
      dtype: the float8 dtype.
      margin: headroom exponent.
      previous: the scale to keep when ``amax_`` is 0, inf or NaN.

    Returns:
      ``f32`` of ``amax_``'s shape, positive and finite.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> float(jxs.float8.scale_from_amax(jnp.float32(896.0), jnp.float8_e4m3fn))
      2.0
      >>> float(jxs.float8.scale_from_amax(jnp.float32(0.0), jnp.float8_e4m3fn))
      1.0
    """
    fmax = float(jnp.finfo(dtype).max)
    amax_ = jnp.asarray(amax_, _F32)
    s = amax_ / np.float32(fmax) * np.float32(2.0**margin)
    ok = (amax_ > 0) & jnp.isfinite(s) & (s > 0)
    return jnp.where(ok, s, jnp.asarray(previous, _F32))


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x / scale`` in float8 ``dtype``: finite values saturate at its finite
    range, infinities and NaNs stay non-finite (NaN in float8_e4m3fn).

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> x = jnp.array([1.0, 1000.0, jnp.inf])
      >>> jxs.float8.quantize(x, jnp.float32(1.0), jnp.float8_e4m3fn)
      Array([1, 448, nan], dtype=float8_e4m3fn)
    """
    dtype = np.dtype(jnp.dtype(dtype))
    fmax = np.float32(jnp.finfo(dtype).max)
    x32 = x.astype(_F32)
    y = x32 / scale.astype(_F32)
    # Finite inputs saturate even where x / scale overflows float32.
    y = lax.select(jnp.isfinite(x32), jnp.clip(y, -fmax, fmax), y)
    return y.astype(dtype)


def saturate(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x / scale`` in float8 ``dtype``, every value saturated at its finite
    range (an infinity too): what a float8 site casts, reading ``x`` once.

    :func:`quantize` keeps an infinity non-finite with a select on
    ``isfinite(x)``, a second use of ``x``: XLA:GPU then splits the cast of a
    weight, which it transposes for the GEMM, into two kernels (a float32 or
    mask array written and read again). A site instead makes the scale NaN
    where the operand's :func:`amax` is not finite (:func:`poison`), which
    makes the product NaN.
    """
    dtype = np.dtype(jnp.dtype(dtype))
    fmax = np.float32(jnp.finfo(dtype).max)
    y = x.astype(_F32) / scale.astype(_F32)
    return jnp.clip(y, -fmax, fmax).astype(dtype)


def poison(scale: jax.Array, amax_: jax.Array) -> jax.Array:
    """``scale``, or NaN where ``amax_`` is not finite: the scale a site
    casts and multiplies its product by, so an operand's inf or NaN makes the
    product NaN (as the loss-scale check needs)."""
    return jnp.where(jnp.isfinite(amax_), scale, np.float32(np.nan))


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = _F32) -> jax.Array:
    """``q * scale`` in ``dtype`` (float32 by default).

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> q = jnp.array([1.0, 2.0], jnp.float8_e4m3fn)
      >>> jxs.float8.dequantize(q, jnp.float32(0.5))
      Array([0.5, 1. ], dtype=float32)
    """
    return (q.astype(_F32) * scale.astype(_F32)).astype(dtype)
