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
  the gradient scaled by the loss scale and cast as the format would see it;
  a parameter's ``x^T g`` leaves a 16-bit product in float32, as in the
  plan's program, and a 16-bit result or gradient is rounded to 16 bits for
  certain, whatever excess precision XLA would keep);
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

With a row sample (``Sensor(rows=)``) each format runs on the sample's rows
only (:func:`~jaxscale.precision._stats.subset`), dealt into two parts: the
row sums are scaled up, and the weight gradient's squared error, a sum over
the rows too, is scaled up with the error the rows share added (the two
parts' errors' inner product; :func:`~jaxscale.precision._stats.fields`).

The probe is a :class:`TapStats` (:mod:`jaxscale._probe`): each field named,
the per-format ones ``f32[len(PRECISION)]``. Probes in a ``scan`` body enter
once per iteration; their cotangents are summed over the iterations (every
field but ``amax``, a maximum, declares ``"sum"``).
:class:`~jaxscale.precision.Sensor`
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
from jaxscale.internal import (
    dtype_of,
    float8_dot,
    scaled_in_float32,
    weight_grad_operands,
    wide_product,
)
from jaxscale.precision._apply import FLOAT8_RECIPES, SiteRule
from jaxscale.precision._measure import PRECISION, measured_formats
from jaxscale.precision._optap import op_tap
from jaxscale.precision._sites import ProbeContext, SiteContext
from jaxscale.precision._stats import (
    FIELDS,
    REFERENCE,
    Part,
    Sketch,
    Sums,
    TapStats,
    finite_sq,
    format_terms,
    halves_gap,
    low,
    probe,
    reference_terms,
    rounded,
    rounding_term,
    subset,
)

__all__ = ["FIELDS", "REFERENCE", "SESSION", "SensorRule", "Session", "TapStats"]

_F32 = np.dtype("float32")
SESSION = Scope("precision sensor")


class Session:
    """One traced run of the sensor or of the monitor: the probes (``None``
    while the sites are only counted), and per site its size and operand bytes
    as met."""

    def __init__(self, probes: Sequence[Any] | None = None):
        self.probes = list(probes) if probes is not None else None
        # per site: (m, k, n), operand bytes, runs per step; and its kind
        self.sites: dict[str, tuple[tuple[int, int, int], tuple[int, int], int]] = {}
        self.kinds: dict[str, str] = {}
        # per site: whether each operand's gradient leaves autocast's 16-bit
        # product in float32 (a float32 parameter's, ``gradient_dtype``)
        self.wide: dict[str, tuple[bool, ...]] = {}
        self.order: list[str] = []


def _fold_scale(it: Any, eqn: Any) -> float:
    """The magnitude of the scalar scale the scale rule applies after product
    ``eqn`` in float32 before rounding (``q @ k.T * 0.125``): a literal's, or
    1 where it is not known at trace time (the product's own range)."""
    fold = it.fold_of(eqn)
    if fold is None:
        return 1.0
    out = eqn.outvars[0]
    others = [v for v in fold.invars if v is not out]
    val = getattr(others[0], "val", None) if len(others) == 1 else None
    if val is None or np.ndim(val) != 0:
        return 1.0
    c = abs(float(np.asarray(val)))
    if fold.primitive.name == "div":
        return 1.0 / c if c > 0 else 1.0
    return c


def _reference(x, w, dims):
    return lax.dot_general(
        x.astype(_F32),
        w.astype(_F32),
        dims,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=_F32,
    )


def _product(
    fmt: Format, params: Any, dims: Any, dtype: np.dtype, wide: tuple[bool, bool]
):
    """The site's product in ``fmt``, as a function of float32 operands.
    ``wide``: per operand, whether its gradient leaves a 16-bit product in
    float32 (a parameter: autocast's ``gradient_dtype``), as the plan's
    16-bit product gives it."""
    prim = lax.dot_general_p
    if fmt is Format.FLOAT32:
        return lambda x, w: bind(prim, _with_out(params, _F32), [x, w])[0]
    if fmt in (Format.HALF, Format.HALF_WIDE):
        out = _F32 if fmt is Format.HALF_WIDE else dtype
        out_params = _with_out(params, out)

        def product(x, w):
            sources = [v if s else None for v, s in zip((x, w), wide, strict=True)]
            xl, wl = (
                v.astype(dtype) if s else low(v, dtype)
                for v, s in zip((x, w), wide, strict=True)
            )
            return wide_product(prim, out_params, xl, wl, sources=sources)

        return product
    recipe = FLOAT8_RECIPES[fmt]
    return lambda x, w: float8_dot(x, w, dims, dtype, recipe, None)


class _Rows:
    """A site's operands as matrices of rows: ``x``'s free axes (the examples
    and positions) first, flattened in row-major order, its contracting axes
    after; the output and its gradient ``(rows, *w's free axes)``."""

    def __init__(self, shape: tuple[int, ...], dims: Any):
        (lc, rc), _ = dims
        self.free = [a for a in range(len(shape)) if a not in lc]
        self.perm = [*self.free, *lc]
        self.rows = math.prod(shape[a] for a in self.free)
        self.inner = [shape[a] for a in lc]
        self.outer = [shape[a] for a in self.free]
        n = len(lc)
        self.dims = ((tuple(range(1, n + 1)), tuple(rc)), ((), ()))

    def x(self, x):
        return jnp.transpose(x, self.perm).reshape(self.rows, *self.inner)

    def back(self, dx):
        """``dx`` of the matrix back in ``x``'s layout."""
        dx = dx.reshape(*self.outer, *self.inner)
        return jnp.transpose(dx, np.argsort(self.perm))

    def out(self, y):
        return y.reshape(self.rows, *y.shape[len(self.outer) :])


def _colmax(t):
    """``t``'s largest magnitude per column over its rows (NaN where a column
    holds one): a row that gives a float8 scale the whole tensor's."""
    return jnp.max(jnp.abs(t), axis=0, keepdims=True)


def _dw_operands(fmt: Format, x, g, dtype: np.dtype, loss_scale: float):
    """The operands of ``fmt``'s weight gradient ``x^T g`` as its product
    multiplies them (``x`` ``[M, K]``, ``g`` ``[M, N]``, float32), in float32,
    the gradient unscaled: the 16-bit cast of ``x`` and of the scaled
    gradient, or their float8 quantisations (from that 16-bit gradient)."""
    g16 = rounded(g * loss_scale, dtype)
    if fmt in FLOAT8_RECIPES:
        xq, gq = weight_grad_operands(x, g16, FLOAT8_RECIPES[fmt])
    else:
        xq, gq = rounded(x, dtype), g16
    return xq, gq / loss_scale


def _weight_grad(x, w, g, dims):
    """The reference weight gradient ``x^T g`` (``w``'s shape)."""
    _, vjp = jax.vjp(lambda b: _reference(x, b, dims), w)
    return vjp(g)[0]


def _tap(
    params: Any,
    dims: Any,
    dtype: np.dtype,
    loss_scale: float,
    widens: bool,
    formats: tuple[Format, ...],
    sample: int | None,
    wide: tuple[bool, bool] = (False, False),
):
    """The site's reference product, whose backward measures ``formats`` (the
    others' fields are zeros) on ``sample`` of its rows (``None``: all).
    ``widens``: autocast's 16-bit product returns float32 there, to take a
    scale in float32 before it is rounded (the float16 scale rule); ``wide``:
    per operand, whether autocast's 16-bit product gives its gradient in
    float32 (a parameter's)."""

    @jax.custom_vjp
    def tap(x, w, probe):
        return _reference(x, w, dims)

    def fwd(x, w, probe):
        y = _reference(x, w, dims)
        return y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        lay = _Rows(x.shape, dims)
        x2, w32 = lay.x(x.astype(_F32)), w.astype(_F32)
        g2, y2 = lay.out(g.astype(_F32)), lay.out(y)
        _, vjp = jax.vjp(lambda a: _reference(a, w32, lay.dims), x2)
        (dx2,) = vjp(g2)
        rows = lay.rows
        sums = Sums()
        halves = 0.0
        if rows >= 2:  # the weight gradient in two halves: the noise (module doc)
            h = rows // 2
            dw1 = _weight_grad(x2[:h], w32, g2[:h], lay.dims)
            dw = dw1 + _weight_grad(x2[h:], w32, g2[h:], lay.dims)
            gap, coef = halves_gap(dw, dw1, rows, h)
            sums.add("noise", coef * finite_sq(gap))
            halves = 1.0
        else:
            dw = _weight_grad(x2, w32, g2, lay.dims)
        reference_terms(sums, x2, w32, y2, g2, dx2, dw, dtype, loss_scale)
        sub = subset(rows, sample)
        # Each format on the sample's rows, dealt alternately into two parts
        # (their errors' inner product: the error the rows share; ``fields``).
        picks = [None] if sub is None else [sub[0::2], sub[1::2]][: len(sub)]
        parts = []
        for pick in picks:
            if pick is None:  # against one product's (``dw`` sums two halves')
                whole = _weight_grad(x2, w32, g2, lay.dims) if rows >= 2 else dw
                parts.append(Part(x2, w32, g2, y2, dx2, whole))
                continue
            xs, gs = x2[pick], g2[pick]
            dwr = _weight_grad(xs, w32, gs, lay.dims)
            parts.append(Part(xs, w32, gs, y2[pick], dx2[pick], dwr, len(pick)))
        sample_of = None if sub is None else (rows, [p.n for p in parts])
        matrix = {**params, "dimension_numbers": lay.dims}
        # A sample's weight gradient is measured unrounded, the rounding of a
        # 16-bit one (a weight that is no parameter) added from every row's.
        measured = wide if sub is None else (wide[0], True)
        made = {
            f: Format.HALF_WIDE if widens and f is Format.HALF else f for f in formats
        }
        rounds = {
            f: sub is not None and not wide[1] and m in (Format.HALF, Format.HALF_WIDE)
            for f, m in made.items()
        }
        if any(rounds.values()):
            rounding_term(sums, dw, dtype, loss_scale)
        # Every format's weight-gradient error but float32's over every row,
        # sketched from the operands it multiplies (``Sketch``); float32's,
        # whose operands a GPU rounds its own way, from the sample's parts.
        sketch = None
        if sub is not None:
            xm, gm = x2.reshape(rows, -1), g2.reshape(rows, -1)
            sketch = Sketch(xm, gm)
            errors = {}  # 16 bits with either result: one backward
            for f, m in made.items():
                if m is not Format.FLOAT32:
                    key = m if m in FLOAT8_RECIPES else Format.HALF
                    if key not in errors:
                        xq, gq = _dw_operands(m, xm, gm, dtype, loss_scale)
                        errors[key] = sketch.error(xq, gq)
                    sums.add((f, "dw_sketch"), errors[key])
        dtypes = {}
        for f, m in made.items():
            fparts = parts
            if sub is not None and f in FLOAT8_RECIPES:
                # Two more rows give every recipe the whole tensors' scales and
                # add exactly nothing to x^T g: x's column maxima against a
                # zero gradient, a zero input against g's.
                cx, cg = _colmax(x2), _colmax(g2)
                zx, zg = jnp.zeros_like(cx), jnp.zeros_like(cg)
                fparts = [
                    p._replace(
                        x=jnp.concatenate([p.x, cx, zx]),
                        g=jnp.concatenate([p.g, zg, cg]),
                    )
                    for p in parts
                ]
            make = _product(m, matrix, lay.dims, dtype, measured)
            own = sketch is None or m is Format.FLOAT32
            dtypes[f] = format_terms(sums, f, make, fparts, loss_scale, dw=own)
        amax = jnp.max(jnp.where(jnp.isfinite(y), jnp.abs(y), 0.0), initial=0.0)
        stats = probe(
            sums,
            made,
            dtypes,
            dtype,
            sample_of,
            rounds,
            (y.size, x.size + w.size),
            halves,
            amax,
        )
        return lay.back(dx2).astype(x.dtype), dw.astype(w.dtype), stats

    tap.defvjp(fwd, bwd)
    return tap


@dataclasses.dataclass(frozen=True)
class SensorRule(SiteRule):
    """The sensor's autocast rule: every site's reference product, tapped
    while a :class:`Session` with probes is in scope (:data:`SESSION`), and
    counted (its size and operand bytes recorded) in any case."""

    loss_scale: float = 1.0
    formats: tuple[Format, ...] = PRECISION
    rows: int | None = None

    def begin(self) -> SiteContext:
        session = SESSION.current()
        return ProbeContext(session if session is not None else Session())

    def format_of(self, ctx, name, mkn, eqn, vals, infos, kind="dense"):
        """Records the site (its size, operand bytes and kind as met); the sensor runs
        it as the float32 reference."""
        nbytes = tuple(
            dtype_of(v).itemsize if i.param else 2
            for v, i in zip(vals, infos, strict=True)
        )
        runs = math.prod(ctx.loops)
        ctx.session.sites.setdefault(name, (mkn, nbytes, runs))
        ctx.session.kinds.setdefault(name, kind)
        ctx.session.wide.setdefault(
            name,
            tuple(
                bool(i.wide) and dtype_of(v) == _F32
                for v, i in zip(vals, infos, strict=True)
            ),
        )
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
        probe = ctx.probe()
        kind = ctx.session.kinds.get(name, "dense")
        widens = scaled_in_float32(it, eqn)
        if kind != "dense":
            formats = measured_formats(kind, it.dtype, self.formats)
            scale = _fold_scale(it, eqn) if widens else 1.0
            tap = op_tap(
                eqn.primitive,
                params,
                it.dtype,
                self.loss_scale,
                widens,
                formats,
                scale,
                kind,
                self.rows,
                ctx.session.wide.get(name, (False, False)),
            )
            if probe is None:
                probe = TapStats.zeros()  # only counting: the forward's value
            else:
                it.note(f"site {name}: measured")
            return [tap(*vals, probe)]
        dims = dot_dimension_numbers(params)
        x, w = vals
        if probe is None:
            return [_reference(x, w, dims)]
        it.note(f"site {name}: measured")
        wide = ctx.session.wide.get(name, (False, False))
        tap = _tap(
            params,
            dims,
            it.dtype,
            self.loss_scale,
            widens,
            self.formats,
            self.rows,
            wide,
        )
        return [tap(x, w, probe)]
