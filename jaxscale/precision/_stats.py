"""The sensor's probe kind, :class:`TapStats`: what one site's tap measures
(:mod:`jaxscale.precision._tap` for matmuls, :mod:`jaxscale.precision._optap`
for batched products and convolutions), field by field."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._probe import zeros
from jaxscale.precision._measure import PRECISION

__all__ = ["FIELDS", "REFERENCE", "TapStats", "count", "halves_noise", "sq"]

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


def halves_noise(dw, dw1, n: int, h: int) -> list[Any]:
    """``[noise, halves]`` of a weight gradient ``dw`` over ``n`` rows (or
    examples) whose first ``h`` give ``dw1``: ``h (n - h) |dw1 / h - (dw -
    dw1) / (n - h)|**2``, an estimate of ``tr Var(dw)``, and 1 (measured)."""
    d = dw1 * (1.0 / h) - (dw - dw1) * (1.0 / (n - h))
    return [float(h * (n - h)) * sq(d), 1.0]
