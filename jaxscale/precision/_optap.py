"""The sensor's tap at the sites that are not dense matmuls: batched products
(attention's score and value products) and convolutions.

The same probe (:class:`~jaxscale.precision._tap.TapStats`) and fields as the
dense tap (:mod:`jaxscale.precision._tap`), measured generically: each
format's product is differentiated with ``jax.vjp``, which gives its output
and both operand gradients, against the float32 reference at
``Precision.HIGHEST``. With a row sample (``Sensor(rows=)``), on a sample of
the batch: a batched product's slices (its batch axes flattened; each slice's
products are its own, so the sums scale exactly in expectation), at least
:data:`MIN_SLICES` of them, or a convolution's examples, in two parts, as the
dense tap's rows (its kernel gradient sums over them:
:func:`~jaxscale.precision._stats.fields`). The reference's sums, the range
counts and ``amax`` read every element. The reference's ``amax`` is the
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

from jaxscale._jax_private import bind, conv_dimension_numbers, dot_dimension_numbers
from jaxscale._jax_private import with_preferred_element_type as _with_out
from jaxscale._speed import Format
from jaxscale.internal import wide_product
from jaxscale.precision._stats import (
    Part,
    Sums,
    finite_sq,
    format_terms,
    halves_gap,
    low,
    probe,
    reference_terms,
    rounding_term,
    shared_rows,
    subset,
)

__all__ = ["MIN_SLICES", "op_tap"]

_F32 = np.dtype("float32")


# The fewest batch slices (a batched product) or examples (a convolution) each
# format is measured on when its sample is drawn from the batch.
MIN_SLICES = 8


def _product(prim: Any, params: Any, fmt: Format, dtype: np.dtype, wide: Any):
    """The product in ``fmt``, as a function of float32 operands; ``wide``:
    per operand, whether its gradient leaves autocast's 16-bit product in
    float32 (a parameter's: a convolution's kernel)."""
    if fmt is Format.FLOAT32:
        f32 = _with_out(params, _F32)
        return lambda x, w: bind(prim, f32, [x, w])[0]
    out_params = _with_out(params, dtype if fmt is Format.HALF else _F32)

    def product(x, w):
        pairs = tuple(zip((x, w), wide, strict=True))
        sources = [v if s else None for v, s in pairs]
        xl, wl = (v.astype(dtype) if s else low(v, dtype) for v, s in pairs)
        return wide_product(prim, out_params, xl, wl, sources=sources)

    return product


def _halves(x, g, lhs_batch: int, out_batch: int):
    """The first half of the batch of ``x`` and ``g`` (and its size)."""
    h = x.shape[lhs_batch] // 2
    return (
        lax.slice_in_dim(x, 0, h, axis=lhs_batch),
        lax.slice_in_dim(g, 0, h, axis=out_batch),
        h,
    )


def _batch_major(t, batch: tuple[int, ...]):
    """``t`` with its ``batch`` axes flattened into a leading one, and where
    each other axis went."""
    others = [a for a in range(t.ndim) if a not in batch]
    moved = jnp.transpose(t, [*batch, *others])
    where = {a: 1 + i for i, a in enumerate(others)}
    return moved.reshape(-1, *(t.shape[a] for a in others)), where


def _count_of(shape, axes) -> int:
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


def _sample_size(units: int, rows_per_unit: int, sample: int | None) -> int | None:
    """How many of ``units`` (slices or examples) to measure: enough for
    ``sample`` rows, at least :data:`MIN_SLICES`; ``None``: all of them."""
    if sample is None:
        return None
    k = max(MIN_SLICES, -(-sample // max(rows_per_unit, 1)))
    return k if k < units else None


def op_tap(
    prim: Any,
    params: Any,
    dtype: np.dtype,
    loss_scale: float,
    widens: bool,
    formats: tuple[Format, ...],
    scale: float,
    kind: str,
    sample: int | None = None,
    wide: tuple[bool, bool] = (False, False),
):
    """The reference product of a batched or convolution site (``kind``),
    whose backward measures ``formats`` (the others' fields are zeros) on a
    sample of the batch (the module doc; ``sample``: the rows wanted, ``None``:
    every element); ``widens``: autocast's 16-bit product returns float32
    there (the scale rule); ``scale``: the magnitude of the scale it then
    takes, by which ``amax`` is multiplied; ``wide``: per operand, whether
    autocast's 16-bit product gives its gradient in float32."""
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

    def sampled(x32, w32, y, g32, dx, dw):
        """The parts of the batch measured (:class:`Part`), the product's
        parameters there and ``(N, sizes)`` for :func:`fields` (or ``None``,
        the product's own parameters and ``None``: every element). A
        convolution's examples, in two parts (its kernel gradient sums over
        them: the error they share is estimated); a batched product's slices,
        in one (each slice's products are its own)."""
        if kind == "conv":
            lhs, _, out = conv_dimension_numbers(params)
            n = x32.shape[lhs[0]]
            k = _sample_size(n, _count_of(y.shape, out[2:]), sample)
            if k is not None:  # examples enough for the shared error too
                k = max(k, shared_rows(n, 0, w32.size))
            if k is None or k >= n:
                return None, params, None
            idx = subset(n, k)
            parts = []
            for pick in (idx[0::2], idx[1::2]):
                xs = jnp.take(x32, pick, axis=lhs[0])
                gs = jnp.take(g32, pick, axis=out[0])
                _, vjp_w = jax.vjp(lambda b, xs=xs: reference(xs, b), w32)
                (dwr,) = vjp_w(gs)
                ys, dxs = jnp.take(y, pick, axis=out[0]), jnp.take(dx, pick, lhs[0])
                parts.append(Part(xs, w32, gs, ys, dxs, dwr))
            return parts, params, (n, [len(idx[0::2]), len(idx[1::2])])
        (lc, rc), (lb, rb) = dot_dimension_numbers(params)
        units = _count_of(x32.shape, lb)
        free = [a for a in range(x32.ndim) if a not in (*lb, *lc)]
        # Every slice, or a sample, in one form (the batch axes flattened), so
        # that the two are the same program to the backend: XLA:CPU of jax
        # 0.12 rounds a bfloat16 batched product's transpose in the original
        # form otherwise than in this one (its dx 6x, its dw 0.2x).
        k = _sample_size(units, _count_of(x32.shape, free), sample)
        idx = np.arange(units) if k is None else subset(units, k)
        xb, xw = _batch_major(x32, lb)
        wb, ww = _batch_major(w32, rb)
        dims = ((tuple(xw[a] for a in lc), tuple(ww[a] for a in rc)), ((0,), (0,)))
        lead = len(lb)

        def out(t):
            return t.reshape(-1, *t.shape[lead:])[idx]

        dxs, dws = _batch_major(dx, lb)[0][idx], _batch_major(dw, rb)[0][idx]
        part = Part(xb[idx], wb[idx], out(g32), out(y), dxs, dws)
        sample_of = None if k is None else (units, [k])
        return [part], {**params, "dimension_numbers": dims}, sample_of

    def bwd(res, g):
        x, w, y = res
        x32, w32, g32 = x.astype(_F32), w.astype(_F32), g.astype(_F32)
        _, vjp = jax.vjp(reference, x32, w32)
        dx, dw = vjp(g32)
        sums, halves = Sums(), 0.0
        if kind == "conv":
            lhs, _, out = conv_dimension_numbers(params)
            n = x.shape[lhs[0]]
            if n >= 2:
                x1, g1, h = _halves(x32, g32, lhs[0], out[0])
                _, vjp1 = jax.vjp(lambda b: reference(x1, b), w32)
                (dw1,) = vjp1(g1)
                gap, coef = halves_gap(dw, dw1, n, h)
                sums.add("noise", coef * finite_sq(gap))
                halves = 1.0
        reference_terms(sums, x32, w32, y, g32, dx, dw, dtype, loss_scale)
        parts, prm, sample_of = sampled(x32, w32, y, g32, dx, dw)
        partial = kind == "conv" and parts is not None
        if parts is None:
            parts = [Part(x32, w32, g32, y, dx, dw)]
        # A sample's partial weight gradient is measured unrounded, the
        # rounding of a 16-bit one (a kernel that is no parameter) added from
        # the whole batch's.
        measured = (wide[0], True) if partial else wide
        made = {
            f: Format.HALF_WIDE if widens and f is Format.HALF else f for f in formats
        }
        rounds = {
            f: partial and not wide[1] and m is not Format.FLOAT32
            for f, m in made.items()
        }
        if any(rounds.values()):
            rounding_term(sums, dw, dtype, loss_scale)
        dtypes = {
            f: format_terms(
                sums, f, _product(prim, prm, m, dtype, measured), parts, loss_scale
            )
            for f, m in made.items()
        }
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
            amax * abs(scale),
        )
        return dx.astype(x.dtype), dw.astype(w.dtype), stats

    tap.defvjp(fwd, bwd)
    return tap
