"""Float8 numerics: per-tensor scales, quantisation, the two scaling recipes.

The ground floor of float8 under :func:`jaxscale.autocast`: pure functions of
arrays and two frozen recipe classes, no tracing machinery. A tensor ``x`` is
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

import dataclasses
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "E4M3",
    "E5M2",
    "CurrentScaling",
    "DelayedScaling",
    "Recipe",
    "amax",
    "check_recipe",
    "dequantize",
    "quantize",
    "scale_from_amax",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype("float32")
_FLOAT8 = MappingProxyType({"float8_e4m3fn": E4M3, "float8_e5m2": E5M2})


def _float8_dtype(value: Any, name: str) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError:
        dt = None
    if dt is None or dt.name not in _FLOAT8:
        raise ValueError(
            f"`{name}` must be float8_e4m3fn or float8_e5m2 (as "
            "`jnp.float8_e4m3fn`, or its name), got "
            f"{value!r}."
        )
    return dt


def _min_dim(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"`min_dim` must be an int >= 0 (the smallest contracting and output "
            f"dimension a float8 matmul may have), got {type(value).__name__} "
            f"{value!r}."
        )
    if value < 0:
        raise ValueError(f"`min_dim` must be >= 0, got {value}.")
    return int(value)


def _margin(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"`margin` must be a number, got {type(value).__name__}.")
    if not np.isfinite(value) or abs(value) > 64:
        raise ValueError(
            f"`margin` must be a finite exponent in [-64, 64] (scales are "
            f"multiplied by 2**margin), got {value}."
        )
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RecipeBase:
    """Fields shared by both recipes (validated by :func:`check_recipe`)."""

    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    margin: float = 0.0
    min_dim: int = 4096

    def _validated(self) -> dict[str, Any]:
        fwd = _float8_dtype(self.fwd_dtype, "fwd_dtype")
        bwd = _float8_dtype(self.bwd_dtype, "bwd_dtype")
        if fwd == E5M2:
            raise ValueError(
                "`fwd_dtype` must be float8_e4m3fn, got float8_e5m2: the forward "
                "product would multiply two e5m2 operands, which XLA:GPU never "
                "turns into a float8 GEMM (and Transformer Engine has no such "
                "format). float8_e5m2 is for the gradient (`bwd_dtype`)."
            )
        return dict(
            fwd_dtype=fwd,
            bwd_dtype=bwd,
            margin=_margin(self.margin),
            min_dim=_min_dim(self.min_dim),
        )


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_RecipeBase):
    """Float8 with current (just-in-time) per-tensor scaling: stateless.

    Each float8 matmul scales every operand by its own amax *in this step*:
    the activation and the weight before the forward product
    (``fwd_dtype``, float8_e4m3fn by default), the incoming gradient before
    the two backward products (``bwd_dtype``, float8_e5m2). Nothing is kept
    between steps, so the train step needs no extra state; each scale costs a
    reduction over its tensor. This is torchao's default ("tensorwise"
    scaling) and the default of :func:`jaxscale.autocast`'s ``float8=``.

    Args:
      fwd_dtype: the float8 dtype of the forward operands (e4m3fn).
      bwd_dtype: the float8 dtype of the gradient in the backward (e5m2).
      margin: scales are multiplied by ``2**margin`` (headroom: a positive
        margin leaves room for values larger than the amax).
      min_dim: a matmul runs in float8 only if its contracting size and both
        output sizes are at least this (smaller products gain nothing from
        float8 and lose accuracy; ``docs/float8.md`` gives the measurement).
        0 puts every eligible matmul in float8.

    Examples:
      >>> import jaxscale as jxs
      >>> recipe = jxs.float8.CurrentScaling(min_dim=0)
      >>> recipe.fwd_dtype, recipe.bwd_dtype
      (dtype(float8_e4m3fn), dtype(float8_e5m2))
    """

    def __post_init__(self) -> None:
        for k, v in self._validated().items():
            object.__setattr__(self, k, v)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_RecipeBase):
    """Float8 with delayed scaling: scales from an amax history (Transformer
    Engine's recipe).

    Each float8 matmul (a *site*) keeps, per operand (the left operand: the
    activation of ``x @ w``; the right: the weight; the gradient), the amaxes
    of the last ``history_len`` steps and a scale. A
    step quantises with the scales the state holds, records its own amaxes,
    and the new scale is ``max(history) / finfo.max * 2**margin`` (Transformer
    Engine's ``amax_compute_algo="max"``). The state is a pytree
    (:class:`Float8State`) made by :func:`jaxscale.float8.init` and threaded
    through the train step by :func:`jaxscale.float8.value_and_grad`.

    Args:
      history_len: steps of amax history per operand (Transformer Engine: 1024).
      fwd_dtype: as :class:`CurrentScaling`.
      bwd_dtype: as :class:`CurrentScaling`.
      margin: as :class:`CurrentScaling`.
      min_dim: as :class:`CurrentScaling`.

    Examples:
      >>> import jaxscale as jxs
      >>> jxs.float8.DelayedScaling(history_len=16).history_len
      16
    """

    history_len: int = 1024

    def __post_init__(self) -> None:
        for k, v in self._validated().items():
            object.__setattr__(self, k, v)
        h = self.history_len
        if isinstance(h, bool) or not isinstance(h, int | np.integer) or h < 1:
            raise ValueError(f"`history_len` must be an int >= 1, got {h!r}.")
        object.__setattr__(self, "history_len", int(h))


Recipe = CurrentScaling | DelayedScaling


def check_recipe(value: Any) -> Recipe | None:
    """``autocast``'s ``float8=`` argument as a recipe (or ``None``: off)."""
    if value is None or value is False:
        return None
    if value is True or value == "current":
        return CurrentScaling()
    if value == "delayed":
        return DelayedScaling()
    if isinstance(value, CurrentScaling | DelayedScaling):
        return value
    raise TypeError(
        "`float8` must be None, True or 'current' (current scaling), 'delayed', "
        "or a `jxs.float8.CurrentScaling` / `jxs.float8.DelayedScaling` recipe, "
        f"got {type(value).__name__} {value!r}."
    )


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
