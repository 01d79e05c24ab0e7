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

``P32``, ``P16``, ``P8`` (dense TFLOP/s) and ``B`` (HBM TB/s) are the vendor's
figures per device kind (:data:`DEVICES`). ``e``, ``q`` and ``c`` were fitted to
the one-site float8 sweep measured on an H200 (``docs/float8.md``) and serve
every format; the rowwise and float32 terms are counted, not fitted. A kind not
in the table (the CPU included) takes the H100 SXM's figures.

:func:`target_kind` finds the device kind a traced program is for: the devices
of its values' shardings, the mesh in context, or JAX's default device.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax

__all__ = [
    "DEVICES",
    "FALLBACK",
    "GEMM_EFFICIENCY",
    "KERNEL_US",
    "PASS_EFFICIENCY",
    "DeviceCost",
    "Format",
    "current_device",
    "device_cost",
    "is_known",
    "site_seconds",
    "target_kind",
]

# Fitted to the H200 sweep (docs/float8.md, "Which matmuls run in float8").
GEMM_EFFICIENCY = 0.69  # e: the GEMMs' fraction of the dense peak, every format
PASS_EFFICIENCY = 0.24  # q: the cast and quantisation passes' fraction of HBM
KERNEL_US = 3.1  # c: the fixed cost of one kernel, microseconds


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


class DeviceCost(NamedTuple):
    """A device kind's figures for the speed model: dense (not sparse) tensor
    throughput in bfloat16 and float8 (TFLOP/s), and HBM bandwidth (TB/s), from
    the vendor's data sheet. TF32, what a float32 GEMM runs on, is half the
    bfloat16 figure on every kind listed (the same data sheets).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> mine = jxs.precision.DeviceCost("my GPU", 1000.0, 2000.0, 4.0)
      >>> mine.tf32_tflops
      500.0
    """

    name: str
    bf16_tflops: float
    f8_tflops: float
    hbm_tbs: float

    @property
    def tf32_tflops(self) -> float:
        return self.bf16_tflops / 2


# ``jax.devices()[0].device_kind`` is searched for each pattern, first match
# wins. NVIDIA H100 and H200 data sheets (2024), the "with sparsity" figures
# halved.
DEVICES: tuple[tuple[str, DeviceCost], ...] = (
    ("H100 PCIe", DeviceCost("NVIDIA H100 PCIe", 756.5, 1513.0, 2.0)),
    ("H100 NVL", DeviceCost("NVIDIA H100 NVL", 835.5, 1670.5, 3.9)),
    ("H200 NVL", DeviceCost("NVIDIA H200 NVL", 835.5, 1670.5, 4.8)),
    ("H200", DeviceCost("NVIDIA H200", 989.5, 1979.0, 4.8)),
    ("H100", DeviceCost("NVIDIA H100 SXM", 989.5, 1979.0, 3.35)),
)
FALLBACK = DEVICES[-1][1]  # the H100 SXM


def device_cost(kind: str) -> tuple[DeviceCost, str]:
    """The figures for device kind ``kind`` and the name the notes give it
    (an unknown kind takes :data:`FALLBACK`'s figures, and says so)."""
    for pattern, cost in DEVICES:
        if pattern.lower() in kind.lower():
            return cost, cost.name
    return FALLBACK, f"{kind}, as {FALLBACK.name}"


def is_known(kind: str) -> bool:
    """Whether :data:`DEVICES` has figures for device kind ``kind``."""
    return any(pattern.lower() in kind.lower() for pattern, _ in DEVICES)


def _kind_of_value(value: Any) -> str | None:
    """The device kind ``value`` lives on, if its type says: a tracer's
    sharding names a mesh with an abstract device when the traced program's
    arguments had shardings (``ShapeDtypeStruct(..., sharding=)`` on a
    deviceless topology included) or a mesh was set; an array knows its
    devices."""
    if isinstance(value, jax.core.Tracer):
        sharding = getattr(getattr(value, "aval", None), "sharding", None)
        device = getattr(getattr(sharding, "mesh", None), "abstract_device", None)
        return getattr(device, "device_kind", None)
    if isinstance(value, jax.Array):
        try:
            devices = value.sharding.device_set
        except Exception:  # a deleted or otherwise unreadable array
            return None
        return next(iter(devices)).device_kind if devices else None
    return None


def target_kind(values: Iterable[Any] = ()) -> tuple[str, str]:
    """The device kind the program being traced is for, and where it was found
    (in words): the devices of the first of ``values`` whose sharding names
    them, else the mesh in context (``jax.set_mesh``,
    ``jax.sharding.use_abstract_mesh``), else JAX's default device (the
    ``jax_default_device`` setting, or the first device of the default
    backend). Tracing cannot see ``jit``'s ``in_shardings``: only the
    arguments' own shardings and the mesh in context."""
    for value in values:
        kind = _kind_of_value(value)
        if kind:
            return kind, "the devices of the traced values' sharding"
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if getattr(device, "device_kind", None):
        return device.device_kind, "the mesh in context"
    default = jax.config.jax_default_device
    if isinstance(default, str):  # a platform name
        default = jax.devices(default)[0]
    if isinstance(default, jax.Device):
        return default.device_kind, "the `jax_default_device` setting"
    first = jax.devices()[0]
    return first.device_kind, f"JAX's default backend ({first.platform})"


def current_device(device_kind: str | None) -> tuple[DeviceCost, str]:
    """:func:`device_cost` of ``device_kind``, or of the first device of JAX's
    default backend (what the traced program will run on) if it is ``None``."""
    return device_cost(device_kind or jax.devices()[0].device_kind)


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
    e, q, c = GEMM_EFFICIENCY, PASS_EFFICIENCY, KERNEL_US * 1e-6
    p32, p16, p8 = (
        t * 1e12 for t in (cost.tf32_tflops, cost.bf16_tflops, cost.f8_tflops)
    )
    bw = cost.hbm_tbs * 1e12
    mk, kn, mn = m * k, k * n, m * n
    flops, s = 2.0 * m * k * n, mk + kn + mn

    def casts(to: int) -> float:  # one pass per operand of another width
        moved = [(b + to) * z for b, z in ((x_bytes, mk), (w_bytes, kn)) if b != to]
        return sum(moved) / (q * bw) + len(moved) * c

    if fmt is Format.FLOAT32:
        return 3 * flops / (e * p32) + 12 * s / bw + casts(4)
    if fmt in (Format.HALF, Format.HALF_WIDE):
        wider = [(b, z) for b, z in ((x_bytes, mk), (w_bytes, kn)) if b > 2]
        t = 3 * flops / (e * p16) + 6 * s / bw
        t += sum((b + 2) * z for b, z in wider) / (q * bw) + len(wider) * c
        return t + (4 * mn / bw if fmt is Format.HALF_WIDE else 0.0)
    quantised = (2 * x_bytes + 1) * mk + (2 * w_bytes + 1) * kn + 5 * mn
    gemms = 3 * flops / (e * p8) + 4 * s / bw
    if fmt is Format.FLOAT8:
        return gemms + (quantised + 2 * s) / (q * bw) + 9 * c
    return gemms + (2 * quantised + 4 * s) / (q * bw) + 15 * c
