"""The speed model: the predicted time of one matmul site in each format.

A *site* is a ``dot_general`` ``[M, K] x [K, N]`` with its two backward
products, ``dx = g w^T`` and ``dw = x^T g``: three GEMMs of ``F = 2MKN`` flops
each, over the three matrices of ``S = MK + KN + MN`` elements. A site's time in
a :class:`Format` is its GEMMs at the format's tensor-core peak plus the HBM
traffic of their operands and outputs, plus the passes the format adds (casts,
float8 quantisation), each a kernel of its own:

- ``float32``: ``3F / (e P32) + 12 S / B``: JAX's default precision runs a
  float32 GEMM on TF32 tensor cores on a GPU (half the 16-bit peak on Hopper);
  16-bit operands are widened by a cast pass.
- ``16-bit``: ``3F / (e P16) + 6 S / B``; each operand wider than 16 bits is cast
  by a pass of its own, ``(b + 2) size / (q B) + c``.
- ``16-bit, float32 result`` (``preferred_element_type=float32``: the widening
  rule, flax#4890's request): the 16-bit time plus the float32 output written
  and read by its consumer at 4 bytes instead of 2, ``4 MN / B``.
- ``float8`` (tensorwise): ``3F / (e P8) + 4 S / B`` plus the quantisation
  passes ``Q / (q B) + 9c``: an amax and a cast per operand and for the
  gradient, ``(2 b_x + 1) MK + (2 b_w + 1) KN + 5 MN``, and a transpose of each
  float8 tensor, ``2 S`` (Hopper's float8 GEMMs take only K-major operands).
- ``float8 rowwise``: each of x, w and g quantised twice (along each product's
  own contraction) and the row scales applied to the three outputs by a pass
  each (cuBLASLt's float8 GEMM takes scalar scales only): ``2 ((2 b_x + 1) MK +
  (2 b_w + 1) KN + 5 MN) + 4 S`` in fifteen kernels, no transposes.

``P32``, ``P16``, ``P8`` (dense TFLOP/s) and ``B`` (HBM TB/s) are a device
kind's row of the one table (:data:`jaxscale._cost.DEVICES`); a GEMM is priced
by :func:`~jaxscale._cost.gemm_seconds` and a pass by
:func:`~jaxscale._cost.pass_seconds`, with ``e``, ``q`` and ``c`` fitted there
once. The rowwise and float32 terms are counted, not fitted.
"""

from __future__ import annotations

import enum

from jaxscale._cost import DeviceCost, gemm_seconds, pass_seconds

__all__ = ["Format", "site_seconds"]


class Format(enum.Enum):
    """A format a matmul site can run in (its value names it in words).

    ``FLOAT32`` (on TF32 tensor cores on a GPU, JAX's default precision),
    ``HALF`` (16 bits: the autocast dtype), ``HALF_WIDE`` (16-bit operands with
    a float32 result), ``FLOAT8`` (per-tensor scales) and ``FLOAT8_ROWWISE``
    (per-row scales).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> [f.value for f in jxs.precision.Format]
      ['float32', '16-bit', '16-bit, float32 result', 'float8', 'float8 rowwise']
    """

    FLOAT32 = "float32"
    HALF = "16-bit"
    HALF_WIDE = "16-bit, float32 result"
    FLOAT8 = "float8"
    FLOAT8_ROWWISE = "float8 rowwise"


def site_seconds(
    fmt: Format,
    m: int,
    k: int,
    n: int,
    x_bytes: int,
    w_bytes: int,
    cost: DeviceCost,
) -> float:
    """The predicted seconds of a site of sizes ``m``, ``k``, ``n`` (its three
    products, the passes ``fmt`` adds included); ``x_bytes`` and ``w_bytes``
    are its operands' bytes per element as they arrive (4: float32)."""
    if not isinstance(fmt, Format):
        raise TypeError(f"`fmt` must be a Format, got {type(fmt).__name__} {fmt!r}.")
    p32, p16, p8 = (
        t * 1e12 for t in (cost.tf32_tflops, cost.bf16_tflops, cost.f8_tflops)
    )
    bw = cost.hbm_tbs * 1e12
    mk, kn, mn = m * k, k * n, m * n
    flops, s = 2.0 * m * k * n, mk + kn + mn

    def casts(to: int) -> float:  # one pass per operand of another width
        moved = [(b + to) * z for b, z in ((x_bytes, mk), (w_bytes, kn)) if b != to]
        return pass_seconds(sum(moved), len(moved), bw)

    if fmt is Format.FLOAT32:
        return gemm_seconds(3 * flops, p32, 12 * s, bw) + casts(4)
    if fmt in (Format.HALF, Format.HALF_WIDE):
        wider = [(b + 2) * z for b, z in ((x_bytes, mk), (w_bytes, kn)) if b > 2]
        t = gemm_seconds(3 * flops, p16, 6 * s, bw)
        t += pass_seconds(sum(wider), len(wider), bw)
        return t + (4 * mn / bw if fmt is Format.HALF_WIDE else 0.0)
    quantised = (2 * x_bytes + 1) * mk + (2 * w_bytes + 1) * kn + 5 * mn
    gemms = gemm_seconds(3 * flops, p8, 4 * s, bw)
    if fmt is Format.FLOAT8:
        return gemms + pass_seconds(quantised + 2 * s, 9, bw)
    return gemms + pass_seconds(2 * quantised + 4 * s, 15, bw)
