"""The sensor's probe kind, :class:`TapStats`: what one site's tap measures
(:mod:`jaxscale.precision._tap` for matmuls, :mod:`jaxscale.precision._optap`
for batched products and convolutions), field by field."""

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
    "REFERENCE",
    "Sums",
    "TapStats",
    "beyond",
    "count",
    "fields",
    "finite_sq",
    "format_terms",
    "full_terms",
    "halves_gap",
    "halves_noise",
    "sq",
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


def count(mask) -> jax.Array:
    """The true elements of ``mask``, as a float32 sum."""
    return jnp.sum(mask.astype(np.float32))


def sq(d) -> jax.Array:
    """The sum of squares of ``d``'s finite elements."""
    return jnp.sum(jnp.where(jnp.isfinite(d), d, 0.0) ** 2)


def halves_gap(dw, dw1, n: int, h: int) -> tuple[Any, float]:
    """``(d, c)`` such that ``c |d|**2`` is the noise of a weight gradient
    ``dw`` over ``n`` rows (or examples) whose first ``h`` give ``dw1``:
    ``d = dw1 / h - (dw - dw1) / (n - h)``, ``c = h (n - h)``."""
    return dw1 * (1.0 / h) - (dw - dw1) * (1.0 / (n - h)), float(h * (n - h))


def halves_noise(dw, dw1, n: int, h: int) -> list[Any]:
    """``[noise, halves]`` of a weight gradient ``dw`` over ``n`` rows (or
    examples) whose first ``h`` give ``dw1``: ``h (n - h) |dw1 / h - (dw -
    dw1) / (n - h)|**2``, an estimate of ``tr Var(dw)``, and 1 (measured)."""
    d, c = halves_gap(dw, dw1, n, h)
    return [c * sq(d), 1.0]


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
        gf = (g * loss_scale).astype(d).astype(_F32)
        sums.add(("full", key, "grad"), ~jnp.isfinite(gf) & jnp.isfinite(g))
        if d != _F32:
            sums.add(("full", key, "overflow"), beyond(y, d))
            sums.add(("full", key, "flush"), (gf == 0) & (g != 0))
            sums.add(("full", key, "dx"), beyond(dx * loss_scale, d))
            sums.add(("full", key, "dw"), beyond(dw * loss_scale, d))
    sums.add(("full", "range", "x"), beyond(x, dtype))
    sums.add(("full", "range", "w"), beyond(w, dtype))


def format_terms(sums, fmt, make, xs, ws, gs, ys, dxr, dwr, loss_scale, n=None):
    """``fmt``'s elementwise terms, into ``sums``: the product ``make`` (of
    float32 operands) differentiated at ``xs, ws`` with the gradient ``gs``
    scaled by ``loss_scale`` and cast as the format takes it, against the
    reference's output ``ys`` and backward products ``dxr``, ``dwr`` on the
    same elements (``n``: the leading rows of ``xs`` and ``gs`` that are
    measured; the others only give float8 scales). Returns the dtypes its
    output, input gradient and weight gradient come in."""
    yf, vjp = jax.vjp(make, xs, ws)
    dxf, dwf = vjp((gs * loss_scale).astype(yf.dtype))
    dtypes = (np.dtype(yf.dtype), np.dtype(dxf.dtype), np.dtype(dwf.dtype))
    if n is not None:
        yf, dxf, gs = yf[:n], dxf[:n], gs[:n]
    out, dxf = yf.astype(_F32), dxf.astype(_F32) / loss_scale
    dwf = dwf.astype(_F32) / loss_scale
    finite = jnp.isfinite(out)
    gdy = gs * jnp.where(finite, out - ys, 0.0)
    sums.add((fmt, "linear"), gdy)
    sums.add((fmt, "fisher"), gdy**2)
    sums.add((fmt, "overflow"), ~finite & jnp.isfinite(ys))
    sums.add((fmt, "dx"), finite_sq(dxf - dxr))
    sums.add((fmt, "dx_bad"), ~jnp.isfinite(dxf))
    sums.add((fmt, "dw"), finite_sq(dwf - dwr))
    sums.add((fmt, "dw_bad"), ~jnp.isfinite(dwf))
    return dtypes


def fields(s, fmt, dtypes, dtype, scale, rounds) -> dict:
    """``fmt``'s probe fields from the reduced sums ``s``: the sample's sums
    scaled by ``scale``, plus, where the format's weight gradient is rounded
    to 16 bits (``rounds``: a 16-bit product whose weight is no parameter),
    that rounding, read on every row (``("full", "round")``); the counts read
    on every row are a floor under the estimated ones: a range failure of the
    reference is never missed."""
    out_dtype, dx_dtype, _ = dtypes

    def full(d, field):
        key = "d" if d == np.dtype(dtype) else "f32"
        return s.get(("full", key, field), 0.0)

    w_dtype = np.dtype(dtype) if rounds else _F32
    dw = scale * s[fmt, "dw"]
    if rounds:
        dw = dw + s["full", "round"]
    narrow = fmt is not Format.FLOAT32
    return dict(
        linear=scale * s[fmt, "linear"],
        fisher=scale * s[fmt, "fisher"],
        dx=scale * s[fmt, "dx"],
        dw=dw,
        overflow=jnp.maximum(scale * s[fmt, "overflow"], full(out_dtype, "overflow")),
        range=(s["full", "range", "x"] + s["full", "range", "w"])
        if fmt in (Format.HALF, Format.HALF_WIDE)
        else 0.0,
        grad_overflow=(
            (full(out_dtype, "grad") if narrow else 0.0)
            + jnp.maximum(scale * s[fmt, "dx_bad"], full(dx_dtype, "dx"))
            + jnp.maximum(s[fmt, "dw_bad"], full(w_dtype, "dw"))
        ),
        flush=full(out_dtype, "flush") if out_dtype != _F32 else 0.0,
    )
