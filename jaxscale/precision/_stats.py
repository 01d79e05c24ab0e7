"""The sensor's probe kind, :class:`TapStats`: what one site's tap measures
(:mod:`jaxscale.precision._tap` for matmuls, :mod:`jaxscale.precision._optap`
for batched products and convolutions), field by field; and what both taps
measure it with: the row sample (:func:`subset`), each format's elementwise
terms (:func:`format_terms`, :func:`full_terms`), their sums (:class:`Sums`),
the weight-gradient sketch (:class:`Sketch`) and the fields (:func:`fields`)."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._probe import zeros
from jaxscale._speed import Format
from jaxscale.precision._measure import PRECISION

__all__ = [
    "FIELDS",
    "Part",
    "REFERENCE",
    "SHARED_NOISE",
    "SKETCH",
    "Sketch",
    "Sums",
    "TapStats",
    "beyond",
    "fields",
    "finite_sq",
    "format_terms",
    "full_terms",
    "halves_gap",
    "low",
    "probe",
    "reference_terms",
    "rounded",
    "rounding_term",
    "shared_rows",
    "subset",
]

_F32 = np.dtype("float32")
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0

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
    "amax",  # the output's largest magnitude (after the scale rule's scale)
)


class TapStats(NamedTuple):
    """One site's probe (and its cotangent): per format in ``PRECISION``
    order, ``f32[len(PRECISION)]``, the :data:`FIELDS`; then the reference's
    own sums, ``f32[]`` each, the :data:`REFERENCE`. Every field is a sum but
    ``amax``, a maximum."""

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
    amax: Any

    @classmethod
    def zeros(cls) -> TapStats:
        """The zero probe."""
        return zeros(cls, **dict.fromkeys(FIELDS, (len(PRECISION),)))


TapStats.COMBINE = MappingProxyType(
    {**dict.fromkeys(TapStats._fields, "sum"), "amax": "max"}
)
assert TapStats._fields == FIELDS + REFERENCE  # the layout the docs name


def halves_gap(dw, dw1, n: int, h: int) -> tuple[Any, float]:
    """``(d, c)`` such that ``c |d|**2`` is the noise of a weight gradient
    ``dw`` over ``n`` rows (or examples) whose first ``h`` give ``dw1``:
    ``d = dw1 / h - (dw - dw1) / (n - h)``, ``c = h (n - h)``."""
    return dw1 * (1.0 / h) - (dw - dw1) * (1.0 / (n - h)), float(h * (n - h))


def subset(rows: int, sample: int | None) -> np.ndarray | None:
    """The rows the formats are measured on: one in each of ``sample`` equal
    strata of ``rows``, at a place that moves from stratum to stratum (the
    golden-ratio sequence: no stride that a sequence length or a head count
    could alias with, so that position 0 of every sequence, whose gradients
    causal attention makes the largest, is not over-sampled); ``None``: every
    row."""
    if sample is None or sample >= rows:
        return None
    j = np.arange(sample)
    jitter = np.modf((j + 1) * _GOLDEN)[0]
    return np.minimum(((j + jitter) * rows / sample).astype(np.int64), rows - 1)


# The relative noise allowed in the estimate of the weight-gradient error that
# a sample's rows share (:func:`fields`): the inner product of the two parts'
# errors, scaled by N (N - s) / (a b), has a relative spread of about
# sqrt(2) (N / s) / sqrt(k n) for a k x n weight with independent element
# errors; :func:`shared_rows` sizes the sample to keep it at this.
SHARED_NOISE = 0.15


def shared_rows(rows: int, sample: int | None, size: int) -> int | None:
    """The rows to measure a weight gradient of ``size`` elements over
    ``rows`` on: ``sample``, or more where the weight is small, so that the
    shared-error estimate's spread stays near :data:`SHARED_NOISE` (a small
    weight's sample is cheap); ``None``: every row."""
    if sample is None:
        return None
    need = math.ceil(math.sqrt(2.0) * rows / (SHARED_NOISE * math.sqrt(max(size, 1))))
    return max(sample, need)


# The random directions a sketched weight-gradient error is measured along.
SKETCH = 32


class Sketch:
    """The squared error of a weight gradient ``x^T g`` over every row, from
    the operands a format multiplies (``x~ = x + dx``, ``g~ = g + dg``: rounded
    or quantised as its product takes them) without that product: ``|E|**2``
    of ``E = x~^T g~ - x^T g = dx^T g~ + x^T dg`` is the mean of ``|E v|**2``
    over random directions ``v`` (entries of variance ``1 / SKETCH``), and
    ``E v = dx^T (g v + dg v) + x^T (dg v)`` costs ``SKETCH / n`` of the
    product (``n`` the smaller of the weight's two sides, sketched along the
    larger). Written on the rounding errors ``dx``, ``dg``, the products need
    no more precision than their own (the default: a GPU's TF32 is ~8x finer
    than the 16-bit errors measured), with no difference of two large ones.
    Unbiased; its relative spread is about ``sqrt(2 / (SKETCH r))`` for an
    error of rank ``r`` (one the rows share, of rank ~2: ~18%; independent
    roundings: far less). Where a side is at most ``SKETCH`` the error is
    computed whole. ``x`` ``[M, K]``, ``g`` ``[M, N]``."""

    def __init__(self, x, g):
        (_, k), (_, n) = x.shape, g.shape
        self.x, self.g = x, g
        self.exact = min(k, n) <= SKETCH
        self.right = n >= k  # the directions span g's columns
        if not self.exact:
            size = n if self.right else k
            key = jax.random.key(0)
            self.v = jax.random.normal(key, (size, SKETCH), _F32) / math.sqrt(SKETCH)
            self.projected = self.g @ self.v if self.right else self.x @ self.v

    def error(self, xq, gq):
        """The elementwise terms whose sum estimates ``|xq^T gq - x^T g|**2``."""
        dx, dg = xq - self.x, gq - self.g
        if self.exact:
            e = dx.T @ gq + self.x.T @ dg
        elif self.right:  # E v, [K, SKETCH]
            dgv = dg @ self.v
            e = dx.T @ (self.projected + dgv) + self.x.T @ dgv
        else:  # (U^T E)^T = g~^T (dx U) + dg^T (x U), [N, SKETCH]
            e = gq.T @ (dx @ self.v) + dg.T @ self.projected
        return finite_sq(e)


def beyond(x, dtype: np.dtype) -> jax.Array:
    """Elements of float32 ``x`` that ``dtype`` cannot hold (non-finite once
    cast where finite before), a mask (all false for float32)."""
    if dtype == _F32:
        return jnp.zeros(np.shape(x), bool)
    return jnp.isfinite(x) & ~jnp.isfinite(x.astype(dtype))


def finite_sq(t):
    return jnp.where(jnp.isfinite(t), t, 0.0) ** 2


class Sums:
    """Named sums of elementwise terms (arrays or masks). On a GPU, one
    reduction per shape: XLA:GPU runs each reduction as a kernel of its own,
    which reads its inputs again (~50 kernels a site where each sum was
    reduced alone; ``benchmarks/sensor_cost.py --gpu``); XLA:CPU instead
    fuses each sum with the terms it reads and materialises a stack, so
    there each term is summed alone (the faster program on either)."""

    def __init__(self):
        self.terms: dict[Any, Any] = {}

    def add(self, key: Any, term: Any) -> None:
        self.terms[key] = term

    def reduce(self) -> dict[Any, jax.Array]:
        keys = list(self.terms)
        ops = [self.terms[k] for k in keys]
        sums = lax.platform_dependent(*ops, cpu=_each, default=_by_shape)
        return dict(zip(keys, sums, strict=True))


def _each(*terms):
    return tuple(jnp.sum(jnp.asarray(t, _F32)) for t in terms)


def _by_shape(*terms):
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(terms):
        groups.setdefault(np.shape(t), []).append(i)
    out: list[Any] = [None] * len(terms)
    for shape, idx in groups.items():
        stacked = jnp.stack([jnp.asarray(terms[i], _F32) for i in idx])
        sums = jnp.sum(stacked, axis=tuple(range(1, len(shape) + 1)))
        for j, i in enumerate(idx):
            out[i] = sums[j]
    return tuple(out)


def full_terms(sums, x, w, y, g, dx, dw, dtype, loss_scale) -> None:
    """The counts read on every row from the reference, into ``sums``: for
    the 16-bit ``dtype`` (``"d"``) and float32, the scaled gradient
    overflowing in it (``grad``), and for ``dtype``, outputs beyond it
    (``overflow``), the scaled gradient flushing to zero in it (``flush``),
    input and weight gradients beyond it once scaled (``dx``, ``dw``), and
    operands beyond it (``range``)."""
    for d, key in ((dtype, "d"), (_F32, "f32")):
        gf = rounded(g * loss_scale, d)
        sums.add(("full", key, "grad"), ~jnp.isfinite(gf) & jnp.isfinite(g))
        if d != _F32:
            sums.add(("full", key, "overflow"), beyond(y, d))
            sums.add(("full", key, "flush"), (gf == 0) & (g != 0))
            sums.add(("full", key, "dx"), beyond(dx * loss_scale, d))
            sums.add(("full", key, "dw"), beyond(dw * loss_scale, d))
    sums.add(("full", "range", "x"), beyond(x, dtype))
    sums.add(("full", "range", "w"), beyond(w, dtype))


class Part(NamedTuple):
    """Elements a format is measured on: the operands ``x``, ``w`` and the
    gradient ``g`` (``n``: the leading rows of ``x`` and ``g`` measured, the
    others only giving float8 scales; ``None``: all), and the reference's
    output ``y`` and backward products ``dx``, ``dw`` there."""

    x: Any
    w: Any
    g: Any
    y: Any
    dx: Any
    dw: Any
    n: int | None = None


def rounded(x, dtype):
    """``x`` rounded to ``dtype`` and back in its own dtype, the rounding kept:
    XLA, which may keep excess precision, can remove a cast there and back (and
    fold a 16-bit product's widening into the product, as XLA:CPU did for a
    reshaped batched product); an optimization barrier between the two casts
    keeps the 16-bit value."""
    return lax.optimization_barrier(x.astype(dtype)).astype(x.dtype)


def _widened(t):
    """16-bit ``t`` in float32, rounded to its dtype for certain
    (:func:`rounded`): the step keeps the value in 16 bits."""
    if np.dtype(t.dtype) == _F32:
        return t
    return lax.optimization_barrier(t).astype(_F32)


def low(x, dtype: np.dtype):
    """``x`` cast to the 16-bit ``dtype``, its gradient rounded to ``dtype``
    for certain before it is widened back (:func:`_widened`): the product's
    16-bit cotangent, as the step keeps it."""

    @jax.custom_vjp
    def cast(v):
        return v.astype(dtype)

    def fwd(v):
        return v.astype(dtype), None

    def bwd(_, ct):
        return (_widened(ct).astype(x.dtype),)

    cast.defvjp(fwd, bwd)
    return cast(x)


def reference_terms(sums, x, w, y, g, dx, dw, dtype, loss_scale) -> None:
    """The reference's own terms, into ``sums``: the counts read on every row
    (:func:`full_terms`), the squares of its backward products, the nonzero
    gradients and those beyond ``dtype`` unscaled."""
    full_terms(sums, x, w, y, g, dx, dw, dtype, loss_scale)
    sums.add("dx_ref", finite_sq(dx))
    sums.add("dw_ref", finite_sq(dw))
    sums.add("grads", g != 0)
    sums.add("grad_beyond", jnp.abs(g) > float(jnp.finfo(dtype).max))


def rounding_term(sums, dw, dtype, loss_scale) -> None:
    """The rounding of the (scaled) weight gradient ``dw`` to 16 bits, read
    on every row (``("full", "round")``; :func:`fields` adds it where a
    sample's weight gradient was measured unrounded)."""
    wider = rounded(dw * loss_scale, dtype) / loss_scale
    sums.add(("full", "round"), finite_sq(wider - dw))


def probe(sums, formats, dtypes, dtype, sample, rounds, sizes, halves, amax):
    """A site's :class:`TapStats` from its ``sums`` (reduced here): each of
    ``formats``' fields (:func:`fields`; zeros for a format not measured),
    then the reference's (``sizes``: the output's and both operands'
    elements; ``halves``: 1 where the noise was measured; ``amax``)."""
    s = sums.reduce()
    per = [
        fields(s, f, dtypes[f], dtype, sample, rounds[f])
        if f in formats
        else dict.fromkeys(FIELDS, 0.0)
        for f in PRECISION
    ]
    outputs, inputs = sizes
    ref = [s["dx_ref"], s["dw_ref"], outputs, s["grads"], inputs]
    ref += [s["grad_beyond"], s.get("noise", 0.0), halves, amax]
    # Stacked, then named: under ``vmap`` the sizes are batched like the sums
    # and added over the examples as they are.
    return TapStats(
        *(jnp.stack([jnp.asarray(p[k], _F32) for p in per]) for k in FIELDS),
        *jnp.stack([jnp.asarray(r, _F32) for r in ref]),
    )


def format_terms(sums, fmt, make, parts, loss_scale, dw=True):
    """``fmt``'s elementwise terms, into ``sums``: the product ``make`` (of
    float32 operands) differentiated on each of ``parts`` (:class:`Part`),
    the gradient scaled by ``loss_scale`` and cast as the format takes it.
    The weight gradient's error is that of the parts' sum, and, of two parts,
    the inner product of their errors (``dw_cross``; :func:`fields`).
    Returns the dtypes its output, input gradient and weight gradient come
    in. ``dw=False``: no weight-gradient terms (measured otherwise:
    :class:`Sketch`)."""
    errors = []
    for i, p in enumerate(parts):
        yf, vjp = jax.vjp(make, p.x, p.w)
        dxf, dwf = vjp((p.g * loss_scale).astype(yf.dtype))
        dtypes = (np.dtype(yf.dtype), np.dtype(dxf.dtype), np.dtype(dwf.dtype))
        gs = p.g
        if p.n is not None:
            yf, dxf, gs = yf[: p.n], dxf[: p.n], gs[: p.n]
        out, dxf = _widened(yf), _widened(dxf) / loss_scale
        dwf = _widened(dwf) / loss_scale
        finite = jnp.isfinite(out)
        gdy = gs * jnp.where(finite, out - p.y, 0.0)
        sums.add((fmt, "linear", i), gdy)
        sums.add((fmt, "fisher", i), gdy**2)
        sums.add((fmt, "overflow", i), ~finite & jnp.isfinite(p.y))
        sums.add((fmt, "dx", i), finite_sq(dxf - p.dx))
        sums.add((fmt, "dx_bad", i), ~jnp.isfinite(dxf))
        if dw:
            sums.add((fmt, "dw_bad", i), ~jnp.isfinite(dwf))
            errors.append(jnp.where(jnp.isfinite(dwf), dwf - p.dw, 0.0))
    if not dw:
        return dtypes
    sums.add((fmt, "dw"), finite_sq(sum(errors)))
    if len(errors) == 2:
        sums.add((fmt, "dw_cross"), errors[0] * errors[1])
    return dtypes


def fields(s, fmt, dtypes, dtype, sample, rounds) -> dict:
    """``fmt``'s probe fields from the reduced sums ``s`` (:func:`format_terms`,
    :func:`full_terms`). ``sample``: ``(N, sizes)``, the rows (or examples) of
    the batch and those of each part measured (``None``: every row, one
    part): the forward's and the input gradient's sums over the rows are
    scaled by ``N / s`` (``s`` rows measured). The weight gradient sums over
    the rows: of rows whose errors have mean ``mu`` and trace variance ``t``,
    its squared error is ``N t + N**2 |mu|**2``; the two parts' errors, being
    independent, estimate ``|mu|**2`` by their inner product over the product
    of their sizes (kept at 0 or above: a conservative estimate), so that
    errors the rows share (rows alike, rounded alike) are not scaled as if
    independent. Where the format's weight gradient is rounded to 16 bits
    (``rounds``: a 16-bit product whose weight is no parameter, measured
    unrounded on a sample), that rounding, read on every row, is added. The
    counts read on every row are a floor under the estimated ones: a range
    failure of the reference is never missed."""
    out_dtype, dx_dtype, _ = dtypes

    def full(d, field):
        key = "d" if d == np.dtype(dtype) else "f32"
        return s.get(("full", key, field), 0.0)

    def total(field):
        return sum(v for k, v in s.items() if k[:2] == (fmt, field) and len(k) == 3)

    scale, dw = 1.0, s.get((fmt, "dw"), 0.0)
    if sample is not None:
        rows, sizes = sample
        measured = sum(sizes)
        scale = rows / measured
        dw = scale * dw
        if (fmt, "dw_cross") in s:
            mu2 = jnp.maximum(s[fmt, "dw_cross"] / float(sizes[0] * sizes[1]), 0.0)
            dw = dw + float(rows * (rows - measured)) * mu2
    if (fmt, "dw_sketch") in s:  # every row, sketched (:class:`Sketch`)
        dw = s[fmt, "dw_sketch"]
    if rounds:
        dw = dw + s["full", "round"]
    w_dtype = np.dtype(dtype) if rounds else _F32
    narrow = fmt is not Format.FLOAT32
    return dict(
        linear=scale * total("linear"),
        fisher=scale * total("fisher"),
        dx=scale * total("dx"),
        dw=dw,
        overflow=jnp.maximum(scale * total("overflow"), full(out_dtype, "overflow")),
        range=(s["full", "range", "x"] + s["full", "range", "w"])
        if fmt in (Format.HALF, Format.HALF_WIDE)
        else 0.0,
        grad_overflow=(
            (full(out_dtype, "grad") if narrow else 0.0)
            + jnp.maximum(scale * total("dx_bad"), full(dx_dtype, "dx"))
            + jnp.maximum(total("dw_bad"), full(w_dtype, "dw"))
        ),
        flush=full(out_dtype, "flush") if out_dtype != _F32 else 0.0,
    )
