"""What a cast to a low-precision dtype does to float32 values: the helpers that
``underflow_report`` (parameter gradients) and ``cotangent_report`` (activation
gradients) share."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._grad import loss_scale_of
from jaxscale._loss_scale import LossScale
from jaxscale._policy import parse_float_dtype

__all__ = ["cast_masks", "cast_thresholds", "half_dtype", "scale_value"]

_F32 = jnp.float32


def half_dtype(dtype: Any) -> np.dtype:
    """The low-precision dtype to analyse (the policy's one dtype parser); a
    ``TypeError`` for a non-floating one, as for any argument of the wrong kind."""
    try:
        return parse_float_dtype(dtype, "dtype")
    except ValueError as e:
        raise TypeError(str(e)) from None


def cast_thresholds(dt: Any) -> tuple[np.float32, np.float32, np.float32]:
    """The float32 magnitudes where a round-to-nearest-even cast to ``dt`` changes
    kind: ``(zero, normal, inf)``. ``|v| <= zero`` rounds to 0 (half the smallest
    subnormal: the tie goes to the even 0); ``zero < |v| < normal`` to a
    subnormal (the tie half a subnormal step below the smallest normal goes up
    to it); ``|v| >= inf`` to infinity (half an ulp above the largest finite
    value: the tie goes to the even infinity; in a type without infinities, as
    float8_e4m3fn, the largest value is even and the tie rounds down to it).
    Each is exact in float32."""
    fi = jnp.finfo(dt)
    tiny, sub, big = (
        float(v) for v in (fi.smallest_normal, fi.smallest_subnormal, fi.max)
    )
    ulp_max = 2.0 ** (int(fi.maxexp) - 1 - int(fi.nmant))
    over = np.float32(big + ulp_max / 2)
    if not np.isinf(np.array(np.inf, np.float32).astype(dt)):  # e4m3fn: no inf
        # Its largest value's mantissa is even: the tie rounds down to it, and
        # only larger magnitudes become NaN.
        over = np.nextafter(over, np.float32(np.inf))
    return np.float32(sub / 2), np.float32(tiny - sub / 2), over


def cast_masks(xf: jax.Array, dt: Any, scale: Any = None) -> tuple[jax.Array, ...]:
    """Where float32 ``xf`` (times ``scale``) cast to ``dt`` is (zero, subnormal, inf).

    Decided by comparing magnitudes with the exact thresholds of
    :func:`cast_thresholds`, not by casting there and back: XLA:GPU may remove
    a ``convert(convert(x, f16), f32)`` pair (``xla_allow_excess_precision``, on
    by default), and ``lax.reduce_precision`` flushes subnormals. Elements
    already zero, ``inf`` or ``NaN`` in ``xf`` never count as flushed to zero or
    overflowed.
    """
    v = jnp.abs(xf if scale is None else xf * scale)
    zero, normal, inf = cast_thresholds(dt)
    candidate = (xf != 0) & jnp.isfinite(xf)
    z = candidate & (v <= zero)
    sub = (v > zero) & (v < normal)
    over = candidate & (v >= inf)
    return z, sub, over


def scale_value(loss_scale: Any) -> jax.Array:
    """``f32[]``: a number, a :class:`LossScale` or a state holding one."""
    if loss_scale is None:
        return jnp.ones((), _F32)
    if isinstance(loss_scale, bool):
        raise TypeError(
            f"`loss_scale` must be a number or a state, got {loss_scale!r}."
        )
    if isinstance(loss_scale, int | float | np.ndarray | np.generic | jax.Array):
        s = jnp.asarray(loss_scale)
        if s.shape != () or not (
            jnp.issubdtype(s.dtype, jnp.floating)
            or jnp.issubdtype(s.dtype, jnp.integer)
        ):
            raise TypeError(
                "`loss_scale` must be a real scalar, a jxs.LossScale or an optimizer "
                f"state holding one, got {s.dtype}{list(s.shape)}."
            )
        return s.astype(_F32)
    if isinstance(loss_scale, LossScale):
        return jnp.asarray(loss_scale.loss_scale, _F32)
    return jnp.asarray(loss_scale_of(loss_scale).loss_scale, _F32)
