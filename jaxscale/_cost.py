"""The one cost model: a table of devices and what a kernel costs on them.

Every predicted time in jaxscale comes from here: the speed model of a matmul
site in each format (``_speed.py``), float8's per-matmul choice (its two-format
case, ``float8/_choice.py``), a precision plan's cost term, and the memory passes
of :func:`jaxscale.diagnostics.compression_table`; the link presets of
:class:`jaxscale.diagnostics.Bandwidth` read their NVLink and HBM figures from
the same table.

**The table** (:data:`DEVICES`): one row per device kind, with its dense (not
sparse) tensor throughput per format, its HBM bandwidth and its NVLink
bandwidth, all from the one vendor data sheet the row names.

**The prices.** Two kinds of kernel, each priced once:

- a GEMM (:func:`gemm_seconds`): its flops at ``e`` of the format's dense peak,
  plus the bytes of its operands and output at the full HBM bandwidth;
- a memory pass (:func:`pass_seconds`: a cast, an amax, a transpose, a
  quantisation, a dequantise-and-sum): its bytes at ``q`` of the HBM bandwidth,
  plus ``c`` per kernel.

``e`` (:data:`GEMM_EFFICIENCY`), ``q`` (:data:`PASS_EFFICIENCY`) and ``c``
(:data:`KERNEL_US`) were fitted once, to the one-site float8 sweep measured on
an H200 (``docs/measurements.md``, "Float8 on a GPU"; ``docs/float8.md`` gives
the fit), and serve every format, every device kind and every pass.

:func:`target_kind` finds the device kind a traced program is for: the devices
of its values' shardings, the mesh in context, or JAX's default device. A kind
not in the table (the CPU included) takes the H100 SXM's figures
(:data:`FALLBACK`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax

__all__ = [
    "DEVICES",
    "FALLBACK",
    "GEMM_EFFICIENCY",
    "H100_SXM",
    "KERNEL_US",
    "PASS_EFFICIENCY",
    "Device",
    "DeviceCost",
    "current_device",
    "device_cost",
    "device_row",
    "gemm_seconds",
    "is_known",
    "pass_seconds",
    "target_kind",
]

# Fitted to the H200 one-site float8 sweep (docs/measurements.md, "Float8 on a
# GPU"; the fit in docs/float8.md, "Which matmuls run in float8").
GEMM_EFFICIENCY = 0.69  # e: the GEMMs' fraction of the dense peak, every format
PASS_EFFICIENCY = 0.24  # q: a memory pass's fraction of the HBM bandwidth
KERNEL_US = 3.1  # c: the fixed cost of one kernel, microseconds


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


class Device(NamedTuple):
    """One row of :data:`DEVICES`: a device kind and its data sheet's figures."""

    pattern: str  # searched for, ignoring case, in `jax.Device.device_kind`
    cost: DeviceCost  # compute per format and HBM bandwidth
    nvlink_gbs: float  # NVLink GB/s as the data sheet gives it: both directions
    sheet: str  # the data sheet every figure of the row comes from

    @property
    def link_bytes_per_second(self) -> float:
        """NVLink bytes per second per direction (what one device sends while
        it receives as much)."""
        return self.nvlink_gbs * 1e9 / 2


_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"

# The H100 SXM: the fallback's figures, and the links and memory of
# jaxscale.diagnostics.Bandwidth's presets.
H100_SXM = Device(
    "H100", DeviceCost("NVIDIA H100 SXM", 989.5, 1979.0, 3.35), 900, _H100
)

# The first row whose pattern is in the device kind wins. The data sheets give
# tensor throughput "with sparsity": the dense figures here are half of it.
DEVICES: tuple[Device, ...] = (
    Device("H100 PCIe", DeviceCost("NVIDIA H100 PCIe", 756.5, 1513.0, 2.0), 600, _H100),
    Device("H100 NVL", DeviceCost("NVIDIA H100 NVL", 835.5, 1670.5, 3.9), 600, _H100),
    Device("H200 NVL", DeviceCost("NVIDIA H200 NVL", 835.5, 1670.5, 4.8), 900, _H200),
    Device("H200", DeviceCost("NVIDIA H200", 989.5, 1979.0, 4.8), 900, _H200),
    H100_SXM,
)
FALLBACK = H100_SXM.cost


def gemm_seconds(flops: float, peak: float, nbytes: float, bandwidth: float) -> float:
    """The predicted seconds of GEMMs of ``flops`` at a dense ``peak`` (flop/s)
    whose operands and outputs move ``nbytes`` at ``bandwidth`` (HBM bytes/s):
    ``flops / (e peak) + nbytes / bandwidth``."""
    return flops / (GEMM_EFFICIENCY * peak) + nbytes / bandwidth


def pass_seconds(nbytes: float, kernels: int, bandwidth: float) -> float:
    """The predicted seconds of ``kernels`` memory passes that read and write
    ``nbytes`` in all on a device of HBM ``bandwidth`` (bytes/s, the data
    sheet's): ``nbytes / (q bandwidth) + kernels c``."""
    return nbytes / (PASS_EFFICIENCY * bandwidth) + kernels * (KERNEL_US * 1e-6)


def device_row(kind: str) -> Device | None:
    """The row of :data:`DEVICES` for device kind ``kind`` (``None``: none)."""
    return next((d for d in DEVICES if d.pattern.lower() in kind.lower()), None)


def device_cost(kind: str) -> tuple[DeviceCost, str]:
    """The figures for device kind ``kind`` and the name the notes give it
    (an unknown kind takes :data:`FALLBACK`'s figures, and says so)."""
    row = device_row(kind)
    if row is not None:
        return row.cost, row.cost.name
    return FALLBACK, f"{kind}, as {FALLBACK.name}"


def is_known(kind: str) -> bool:
    """Whether :data:`DEVICES` has figures for device kind ``kind``."""
    return device_row(kind) is not None


def current_device(device_kind: str | None) -> tuple[DeviceCost, str]:
    """:func:`device_cost` of ``device_kind``, or of the first device of JAX's
    default backend (what the traced program will run on) if it is ``None``."""
    return device_cost(device_kind or jax.devices()[0].device_kind)


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
