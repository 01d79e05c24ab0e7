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

__all__ = ["cast_masks", "half_dtype", "scale_value"]

_F32 = jnp.float32


def half_dtype(dtype: Any) -> np.dtype:
    """The low-precision dtype to analyse (the policy's one dtype parser); a
    ``TypeError`` for a non-floating one, as for any argument of the wrong kind."""
    try:
        return parse_float_dtype(dtype, "dtype")
    except ValueError as e:
        raise TypeError(str(e)) from None


def cast_masks(xf: jax.Array, dt: Any, scale: Any = None) -> tuple[jax.Array, ...]:
    """Where float32 ``xf`` (times ``scale``) cast to ``dt`` is (zero, subnormal, inf).

    Elements already zero, ``inf`` or ``NaN`` in ``xf`` never count as flushed to
    zero or overflowed.
    """
    y = (xf if scale is None else xf * scale).astype(dt).astype(_F32)
    candidate = (xf != 0) & jnp.isfinite(xf)
    z = candidate & (y == 0)
    sub = (y != 0) & (jnp.abs(y) < float(jnp.finfo(dt).smallest_normal))
    over = candidate & ~jnp.isfinite(y)
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
