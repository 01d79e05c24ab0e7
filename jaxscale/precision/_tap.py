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

and, once, the reference's own sums (:data:`REFERENCE`), among them the
*noise*: the site's rows (the free elements of ``x``, the examples and
positions, in row-major order) split into two halves of ``h`` and ``N - h``
rows, with ``dw1`` the first half's weight gradient and ``dw2 = dw - dw1``,
``h (N - h) |dw1 / h - dw2 / (N - h)|**2`` estimates ``tr Var(dw)``, the
minibatch noise of the site's weight gradient (rows independent: the two
half-means differ by noise alone, their difference's variance is
``tr Sigma (1/h + 1/(N - h))`` and the batch's ``N tr Sigma``, ``Sigma`` a
row's covariance). A site of one row cannot split: its ``noise`` and
``halves`` are 0.

The probe is a :class:`TapStats` (:mod:`jaxscale._probe`): each field named,
the per-format ones ``f32[len(PRECISION)]``. Probes in a ``scan`` body enter
once per iteration; their cotangents are summed over the iterations (every
field declares ``"sum"``). :class:`~jaxscale.precision.Sensor`
(:mod:`jaxscale.precision._sensor`) turns the sums into
:class:`~jaxscale.precision.SiteMeasure` scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._jax_private import bind, dot_dimension_numbers
from jaxscale._jax_private import with_preferred_element_type as _with_out
from jaxscale._probe import zeros
from jaxscale._scope import Scope
from jaxscale._speed import Format
from jaxscale.internal import dtype_of, float8_dot, scaled_in_float32, wide_product
from jaxscale.precision._apply import FLOAT8_RECIPES, SiteRule
from jaxscale.precision._measure import PRECISION
from jaxscale.precision._sites import ProbeContext, SiteContext

__all__ = ["FIELDS", "REFERENCE", "SESSION", "SensorRule", "Session", "TapStats"]

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
    "noise",  # h (N - h) |dw1 / h - dw2 / (N - h)|**2: the weight gradient's noise
    "halves",  # 1 where the rows split in two (N >= 2), else 0: noise measured
)
SESSION = Scope("precision sensor")


class TapStats(NamedTuple):
    """One site's probe (and its cotangent): per format in ``PRECISION``
    order, ``f32[len(PRECISION)]``, the :data:`FIELDS`; then the reference's
    own sums, ``f32[]`` each, the :data:`REFERENCE`. Every field is a sum."""

    linear: Any
    fisher: Any
    dx: Any
    dw: Any
    overflow: Any
    range: Any
    grad_overflow: Any
    flush: Any
    dx_ref: Any
    dw_ref: Any
    outputs: Any
    grads: Any
    inputs: Any
    grad_beyond: Any
    noise: Any
    halves: Any

    @classmethod
    def zeros(cls) -> TapStats:
        """The zero probe."""
        return zeros(cls, **dict.fromkeys(FIELDS, (len(PRECISION),)))


TapStats.COMBINE = dict.fromkeys(TapStats._fields, "sum")
assert TapStats._fields == FIELDS + REFERENCE  # the layout the docs name


class Session:
    """One traced run of the sensor or of the monitor: the probes (``None``
    while the sites are only counted), and per site its size and operand bytes
    as met."""

    def __init__(self, probes: Sequence[Any] | None = None):
        self.probes = list(probes) if probes is not None else None
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


def _noise(x, w, g, dims, dw) -> tuple[jax.Array, float]:
    """``(noise, halves)`` of a site (see the module's docstring): its rows
    split in two, the first ``h`` rows' weight gradient against the rest's."""
    (lc, _), (lb, _) = dims
    free = [a for a in range(x.ndim) if a not in lc and a not in lb]
    rows = math.prod(x.shape[a] for a in free)
    if rows < 2:
        return jnp.zeros((), _F32), 0.0
    h = rows // 2
    index = jnp.zeros((), jnp.int32)  # the row's place in row-major order
    for a in free:
        index = index * x.shape[a] + lax.broadcasted_iota(jnp.int32, x.shape, a)
    first = jnp.where(index < h, x, 0.0)
    _, vjp = jax.vjp(lambda b: _reference(first, b, dims), w)
    (dw1,) = vjp(g)
    d = dw1 * (1.0 / h) - (dw - dw1) * (1.0 / (rows - h))
    return float(h * (rows - h)) * _sq(d), 1.0


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
    grad_overflow = _count(~jnp.isfinite(dxf)) + _count(~jnp.isfinite(dwf))
    if narrow:
        grad_overflow += _count(~jnp.isfinite(gf.astype(_F32)) & jnp.isfinite(g))
    return dict(
        linear=jnp.sum(gdy),
        fisher=jnp.sum(gdy**2),
        dx=_sq(dxf - dx),
        dw=_sq(dwf - dw),
        overflow=_count(~finite & jnp.isfinite(y)),
        range=in_range,
        grad_overflow=grad_overflow,
        flush=_count(flushed),
    )


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
        made, none = dict(makes), dict.fromkeys(FIELDS, 0.0)
        per = [
            _format_stats(f, made[f], x32, w32, y, g, dx, dw, dtype, loss_scale)
            if f in made
            else none
            for f in PRECISION
        ]
        top = float(jnp.finfo(dtype).max)
        ref = [_sq(dx), _sq(dw), y.size, _count(g != 0), x.size + w.size]
        ref.append(_count(jnp.abs(g) > top))
        ref.extend(_noise(x32, w32, g, dims, dw))
        # Stacked, then named: under ``vmap`` the sizes are batched like the
        # sums and added over the examples as they are.
        probe = TapStats(
            *(jnp.stack([jnp.asarray(p[k], _F32) for p in per]) for k in FIELDS),
            *jnp.stack([jnp.asarray(r, _F32) for r in ref]),
        )
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
