"""The sensor's tap: what each format would do at each matmul site, measured.

On a calibration batch the function runs in float32 (every site's product at
``Precision.HIGHEST``: the reference) under the autocast interpreter, with a
*tap* at each site (:class:`SensorRule`): a ``custom_vjp`` whose backward,
given the site's incoming gradient ``g`` (what one backward pass of the loss
gives), recomputes the site's three products in every format from the same
operands and returns, as the cotangent of a zero *probe* input, per format:

- the first-order change of the loss, ``sum(g * dy)``, and its square summed
  elementwise, ``sum((g * dy)**2)`` (the variance of the loss change the
  format's rounding adds, if the elements' errors are independent: the
  Taylor/Fisher score NVIDIA ModelOpt's ``auto_quantize`` ranks layers by),
  where ``dy`` is the format's output minus the reference;
- the squared errors of its backward products ``g w^T`` and ``x^T g`` (run on
  the gradient scaled by the loss scale and cast as the format would see it);
- counts: outputs that overflow where the reference is finite, operands beyond
  the format's range, gradients that overflow or flush to zero once scaled.

Probes in a ``scan`` body enter once per iteration; their cotangents are
summed over the iterations. :class:`~jaxscale.precision.Sensor`
(:mod:`jaxscale.precision._sensor`) turns the sums into
:class:`~jaxscale.precision.SiteMeasure` scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._jax_private import bind, dot_dimension_numbers
from jaxscale._jax_private import with_preferred_element_type as _with_out
from jaxscale._scope import Scope
from jaxscale._speed import Format
from jaxscale.internal import dtype_of, float8_dot, scaled_in_float32, wide_product
from jaxscale.precision._apply import FLOAT8_RECIPES, SiteRule
from jaxscale.precision._measure import PRECISION
from jaxscale.precision._sites import ProbeContext, SiteContext

__all__ = ["FIELDS", "REFERENCE", "SESSION", "SensorRule", "Session", "WIDTH"]

_F32 = np.dtype("float32")
# Per format, in PRECISION order; then the reference's own sums.
FIELDS = (
    "linear",  # sum(g * dy): the loss change, to first order
    "fisher",  # sum((g * dy)**2)
    "dx",  # sum of squared errors of g w^T
    "dw",  # sum of squared errors of x^T g
    "overflow",  # outputs non-finite where the reference is finite
    "range",  # operands beyond the format's range
    "grad_overflow",  # scaled gradients or backward products non-finite
    "flush",  # nonzero gradients flushed to zero once scaled and cast
)
REFERENCE = (
    "dx_ref",  # sum of squares of g w^T
    "dw_ref",  # sum of squares of x^T g
    "outputs",  # elements of the output (and of its gradient)
    "grads",  # nonzero elements of the gradient
    "inputs",  # elements of both operands
    "grad_beyond",  # gradient elements beyond the 16-bit dtype's range unscaled
)
WIDTH = len(PRECISION) * len(FIELDS) + len(REFERENCE)
SESSION = Scope("precision sensor")


class Session:
    """One traced run of the sensor: the probes (``None`` while the sites are
    only counted), and per site its size and operand bytes as met."""

    def __init__(self, probes: Sequence[Any] | None = None, combine: str = "sum"):
        self.probes = list(probes) if probes is not None else None
        self.combine = combine  # how a loop's iterations combine: "sum", "max"
        # per site: (m, k, n), operand bytes, runs per step
        self.sites: dict[str, tuple[tuple[int, int, int], tuple[int, int], int]] = {}
        self.order: list[str] = []


def _reference(x, w, dims):
    return lax.dot_general(
        x.astype(_F32),
        w.astype(_F32),
        dims,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=_F32,
    )


def _product(fmt: Format, params: Any, dims: Any, dtype: np.dtype):
    """The site's product in ``fmt``, as a function of float32 operands."""
    prim = lax.dot_general_p
    if fmt is Format.FLOAT32:
        return lambda x, w: bind(prim, _with_out(params, _F32), [x, w])[0]
    if fmt is Format.HALF:
        return lambda x, w: bind(
            prim, _with_out(params, dtype), [x.astype(dtype), w.astype(dtype)]
        )[0]
    if fmt is Format.HALF_WIDE:
        from_params = _with_out(params, _F32)
        return lambda x, w: _wide(prim, from_params, x.astype(dtype), w.astype(dtype))
    recipe = FLOAT8_RECIPES[fmt]
    return lambda x, w: float8_dot(x, w, dims, dtype, recipe, None)


def _wide(prim, params, x, w):
    # The widening rule's product: float32 out, its backward in x's dtype.
    return wide_product(prim, params, x, w)


def _count(mask) -> jax.Array:
    return jnp.sum(mask.astype(_F32))


def _beyond(x, dtype: np.dtype) -> jax.Array:
    """Elements of float32 ``x`` that ``dtype`` cannot hold (non-finite once
    cast where finite before)."""
    return _count(jnp.isfinite(x) & ~jnp.isfinite(x.astype(dtype)))


def _sq(d) -> jax.Array:
    return jnp.sum(jnp.where(jnp.isfinite(d), d, 0.0) ** 2)


def _format_stats(fmt, make, x, w, y, g, dx, dw, dtype, loss_scale):
    yf, vjp = jax.vjp(make, x, w)
    out = yf.astype(_F32)
    finite = jnp.isfinite(out)
    dy = jnp.where(finite, out - y, 0.0)
    gdy = g * dy
    narrow = fmt is not Format.FLOAT32
    scaled = g * loss_scale
    gf = scaled.astype(yf.dtype)
    dxf, dwf = (t.astype(_F32) / loss_scale for t in vjp(gf))
    flushed = (gf == 0) & (g != 0) if yf.dtype != _F32 else jnp.zeros((), bool)
    in_range = (
        _beyond(x, dtype) + _beyond(w, dtype)
        if fmt in (Format.HALF, Format.HALF_WIDE)
        else jnp.zeros((), _F32)
    )
    return [
        jnp.sum(gdy),
        jnp.sum(gdy**2),
        _sq(dxf - dx),
        _sq(dwf - dw),
        _count(~finite & jnp.isfinite(y)),
        in_range,
        _count(~jnp.isfinite(dxf))
        + _count(~jnp.isfinite(dwf))
        + (_count(~jnp.isfinite(gf.astype(_F32)) & jnp.isfinite(g)) if narrow else 0.0),
        _count(flushed),
    ]


def _tap(
    params: Any,
    dims: Any,
    dtype: np.dtype,
    loss_scale: float,
    widens: bool,
    formats: tuple[Format, ...],
):
    """The site's reference product, whose backward measures ``formats`` (the
    others' fields are zeros). ``widens``: autocast's 16-bit product returns
    float32 there, to take a scale in float32 before it is rounded (the float16
    scale rule)."""
    makes = [
        (
            f,
            _product(
                Format.HALF_WIDE if widens and f is Format.HALF else f,
                params,
                dims,
                dtype,
            ),
        )
        for f in PRECISION
        if f in formats
    ]

    @jax.custom_vjp
    def tap(x, w, probe):
        return _reference(x, w, dims)

    def fwd(x, w, probe):
        y = _reference(x, w, dims)
        return y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        x32, w32, g = x.astype(_F32), w.astype(_F32), g.astype(_F32)
        _, vjp = jax.vjp(lambda a, b: _reference(a, b, dims), x32, w32)
        dx, dw = vjp(g)
        stats, made = [], dict(makes)
        for fmt in PRECISION:
            if fmt not in made:
                stats += [0.0] * len(FIELDS)
                continue
            make = made[fmt]
            stats += _format_stats(fmt, make, x32, w32, y, g, dx, dw, dtype, loss_scale)
        top = float(jnp.finfo(dtype).max)
        stats += [_sq(dx), _sq(dw), jnp.asarray(y.size, _F32), _count(g != 0)]
        stats += [jnp.asarray(x.size + w.size, _F32), _count(jnp.abs(g) > top)]
        probe = jnp.stack([jnp.asarray(s, _F32) for s in stats])
        return dx.astype(x.dtype), dw.astype(w.dtype), probe

    tap.defvjp(fwd, bwd)
    return tap


@dataclasses.dataclass(frozen=True)
class SensorRule(SiteRule):
    """The sensor's autocast rule: every site's reference product, tapped
    while a :class:`Session` with probes is in scope (:data:`SESSION`), and
    counted (its size and operand bytes recorded) in any case."""

    loss_scale: float = 1.0
    formats: tuple[Format, ...] = PRECISION

    def begin(self) -> SiteContext:
        session = SESSION.current()
        return ProbeContext(session if session is not None else Session())

    def format_of(self, ctx, name, mkn, eqn, vals, infos):
        """Records the site (its size and operand bytes as met); the sensor runs
        it as the float32 reference."""
        nbytes = tuple(
            dtype_of(v).itemsize if i.param else 2
            for v, i in zip(vals, infos, strict=True)
        )
        runs = math.prod(ctx.loops)
        ctx.session.sites.setdefault(name, (mkn, nbytes, runs))
        if name not in ctx.session.order:
            ctx.session.order.append(name)
        return Format.FLOAT32

    def cast_operands(self, it, eqn, vals, infos, traced):
        if self.decide(it, eqn, vals, infos) is not None:
            return vals, None  # operands as they come: the tap reads them in float32
        return super().cast_operands(it, eqn, vals, infos, traced)

    def adjust_params(self, it, eqn, vals, traced):
        if self.chosen(it, eqn) is not None:
            return eqn.params
        return super().adjust_params(it, eqn, vals, traced)

    def emit_site(self, it, eqn, params, vals, name, fmt):
        ctx = it.extension
        dims = dot_dimension_numbers(params)
        probe = ctx.probe()
        x, w = vals
        if probe is None:
            return [_reference(x, w, dims)]
        it.note(f"site {name}: measured")
        widens = scaled_in_float32(it, eqn)
        tap = _tap(params, dims, it.dtype, self.loss_scale, widens, self.formats)
        return [tap(x, w, probe)]
