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

__all__ = [
    "E4M3",
    "E5M2",
    "amax",
    "dequantize",
    "quantize",
    "scale_from_amax",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype("float32")


def amax(x: jax.Array) -> jax.Array:
    """``max(|x|)`` as ``f32[]``: inf if ``x`` holds an inf, else NaN if it holds
    a NaN."""
    a = jnp.max(jnp.abs(x)).astype(_F32)
    # max() may drop a NaN on some backends: make it loud (an inf stays inf).
    nan = jnp.isnan(jnp.sum(x.astype(_F32) * 0)) & ~jnp.isinf(a)
    return jnp.where(nan, jnp.nan, a)


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


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = _F32) -> jax.Array:
    """``q * scale`` in ``dtype`` (float32 by default).

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> q = jnp.array([1.0, 2.0], jnp.float8_e4m3fn)
      >>> jxs.float8.dequantize(q, jnp.float32(0.5))
      Array([0.5, 1. ], dtype=float32)
    """
    return (q.astype(_F32) * scale.astype(_F32)).astype(dtype)
