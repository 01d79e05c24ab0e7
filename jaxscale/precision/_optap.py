"""The sensor's tap at the sites that are not dense matmuls: batched products
(attention's score and value products) and convolutions.

The same probe (:class:`~jaxscale.precision._tap.TapStats`) and fields as the
dense tap (:mod:`jaxscale.precision._tap`), measured on every element (no row
sample) and generically: each format's product is differentiated with
``jax.vjp``, which gives its output and both operand gradients, against the
float32 reference at ``Precision.HIGHEST``. The reference's ``amax`` is the
largest magnitude of its output times the scale the 16-bit product takes in
float32 before it is rounded (the float16 scale rule: ``q @ k.T * scale``), the
range the sensor's per-site widening rule reads.

A convolution's weight-gradient noise splits the batch in two halves, as the
dense tap splits rows: ``h (N - h) |dw1 / h - dw2 / (N - h)|**2`` with ``dw1``
the first ``h`` examples' kernel gradient. A batched product has no weight:
its ``noise`` and ``halves`` are 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._jax_private import bind, conv_dimension_numbers
from jaxscale._jax_private import with_preferred_element_type as _with_out
from jaxscale._speed import Format
from jaxscale.internal import wide_product
from jaxscale.precision._measure import PRECISION
from jaxscale.precision._stats import FIELDS, TapStats, halves_noise
from jaxscale.precision._stats import count as _count
from jaxscale.precision._stats import sq as _sq

__all__ = ["op_tap"]

_F32 = np.dtype("float32")


def _beyond(x, dtype: np.dtype) -> jax.Array:
    if dtype == _F32:
        return jnp.zeros((), _F32)
    return _count(jnp.isfinite(x) & ~jnp.isfinite(x.astype(dtype)))


def _product(prim: Any, params: Any, fmt: Format, dtype: np.dtype):
    """The product in ``fmt``, as a function of float32 operands."""
    if fmt is Format.FLOAT32:
        f32 = _with_out(params, _F32)
        return lambda x, w: bind(prim, f32, [x, w])[0]
    if fmt is Format.HALF:
        low = _with_out(params, dtype)
        return lambda x, w: bind(prim, low, [x.astype(dtype), w.astype(dtype)])[0]
    wide = _with_out(params, _F32)  # HALF_WIDE
    return lambda x, w: wide_product(prim, wide, x.astype(dtype), w.astype(dtype))


def _halves(x, g, lhs_batch: int, out_batch: int):
    """The first half of the batch of ``x`` and ``g`` (and its size)."""
    h = x.shape[lhs_batch] // 2
    return (
        lax.slice_in_dim(x, 0, h, axis=lhs_batch),
        lax.slice_in_dim(g, 0, h, axis=out_batch),
        h,
    )


def op_tap(
    prim: Any,
    params: Any,
    dtype: np.dtype,
    loss_scale: float,
    widens: bool,
    formats: tuple[Format, ...],
    scale: float,
    kind: str,
):
    """The reference product of a batched or convolution site (``kind``),
    whose backward measures ``formats`` (the others' fields are zeros);
    ``widens``: autocast's 16-bit product returns float32 there (the scale
    rule); ``scale``: the magnitude of the scale it then takes, by which
    ``amax`` is multiplied."""
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    ref_params = dict(_with_out(params, _F32), precision=highest)

    def reference(x, w):
        return bind(prim, ref_params, [x.astype(_F32), w.astype(_F32)])[0]

    @jax.custom_vjp
    def tap(x, w, probe):
        return reference(x, w)

    def fwd(x, w, probe):
        y = reference(x, w)
        return y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        x32, w32, g32 = x.astype(_F32), w.astype(_F32), g.astype(_F32)
        _, vjp = jax.vjp(reference, x32, w32)
        dx, dw = vjp(g32)
        noise = [jnp.zeros((), _F32), 0.0]
        if kind == "conv":
            lhs, _, out = conv_dimension_numbers(params)
            n = x.shape[lhs[0]]
            if n >= 2:
                x1, g1, h = _halves(x32, g32, lhs[0], out[0])
                _, vjp1 = jax.vjp(lambda b: reference(x1, b), w32)
                (dw1,) = vjp1(g1)
                noise = halves_noise(dw, dw1, n, h)
        per = []
        for f in PRECISION:
            if f not in formats:
                per.append(dict.fromkeys(FIELDS, 0.0))
                continue
            made = Format.HALF_WIDE if widens and f is Format.HALF else f
            yf, vjp_f = jax.vjp(_product(prim, params, made, dtype), x32, w32)
            gf = (g32 * loss_scale).astype(yf.dtype)
            dxf, dwf = vjp_f(gf)
            out_dtype = np.dtype(yf.dtype)
            out = yf.astype(_F32)
            dxf = dxf.astype(_F32) / loss_scale
            dwf = dwf.astype(_F32) / loss_scale
            finite = jnp.isfinite(out)
            gdy = g32 * jnp.where(finite, out - y, 0.0)
            narrow = f is not Format.FLOAT32
            per.append(
                dict(
                    linear=jnp.sum(gdy),
                    fisher=jnp.sum(gdy**2),
                    dx=_sq(dxf - dx),
                    dw=_sq(dwf - dw),
                    overflow=jnp.maximum(
                        _count(~finite & jnp.isfinite(y)), _beyond(y, out_dtype)
                    ),
                    range=(_beyond(x32, dtype) + _beyond(w32, dtype))
                    if f in (Format.HALF, Format.HALF_WIDE)
                    else 0.0,
                    grad_overflow=(
                        _count(~jnp.isfinite(gf.astype(_F32)) & jnp.isfinite(g32))
                        if narrow
                        else 0.0
                    )
                    + _count(~jnp.isfinite(dxf))
                    + _count(~jnp.isfinite(dwf)),
                    flush=_count((gf == 0) & (g32 != 0)) if narrow else 0.0,
                )
            )
        top = float(jnp.finfo(dtype).max)
        amax = jnp.max(jnp.where(jnp.isfinite(y), jnp.abs(y), 0.0), initial=0.0)
        ref = [_sq(dx), _sq(dw), y.size, _count(g32 != 0), x.size + w.size]
        ref += [_count(jnp.abs(g32) > top), *noise, amax * abs(scale)]
        probe = TapStats(
            *(jnp.stack([jnp.asarray(p[k], _F32) for p in per]) for k in FIELDS),
            *jnp.stack([jnp.asarray(r, _F32) for r in ref]),
        )
        return dx.astype(x.dtype), dw.astype(w.dtype), probe

    tap.defvjp(fwd, bwd)
    return tap
