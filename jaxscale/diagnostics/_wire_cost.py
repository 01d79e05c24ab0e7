"""``jxs.diagnostics.wire_time``: how long a step's collectives take on a link.

A model, not a measurement, in the manner of ``jax.experimental.roofline``: each
collective's time is the bytes each device sends (the ring and all-to-all
formulas of :class:`~jaxscale.diagnostics.Collective`'s ``wire_bytes``) over
the link's bandwidth, plus a latency ``alpha`` per step of the algorithm
(the alpha-beta model of Thakur, Rabenseifner and Gropp, 2005):

=================  ===================  ============
collective          bytes each sends     steps
=================  ===================  ============
all-reduce (ring)   2 (n-1)/n x size     2 (n-1)
reduce-scatter      (n-1)/n x size       n-1
all-gather          (n-1)/n x size       n-1
all-to-all          (n-1)/n x size       n-1
collective-permute  size                 1
=================  ===================  ============

:func:`compression_table` applies it to one gradient sent four ways (a float32
or 16-bit ring all-reduce, :func:`jaxscale.reduce_gradients`' all-to-all in
bfloat16 or float8) and charges the compressed ones the memory passes their
quantisation and float32 sum make over the gradient, at a memory bandwidth.
Every figure it uses is a :class:`Bandwidth` that names its source.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from jaxscale.diagnostics._collectives import Collective, CollectiveReport
from jaxscale.diagnostics._report_text import columns, human_bytes, typed

__all__ = [
    "Bandwidth",
    "CollectiveTime",
    "CompressionRow",
    "CompressionTable",
    "WireTime",
    "compression_table",
    "wire_time",
]

#: The gradient transports of :func:`compression_table`, in its columns' order.
SCHEMES = (
    "float32 all-reduce",
    "16-bit all-reduce",
    "bfloat16 all-to-all",
    "float8 all-to-all",
)
_LABELS = ("float32 ring", "16-bit ring", "bf16 all-to-all", "f8 all-to-all")
_STEPS = MappingProxyType(  # algorithm steps per (n - 1)
    {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1}
)
_SCALINGS = ("weak", "strong")


# --------------------------------------------------------------------------- #
# Figures, each with its source
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """A bandwidth in bytes per second, with where the figure comes from.

    Links are per device and per direction (what one device can send while it
    receives as much). The presets are vendors' figures about their own
    products, as :func:`compression_table` uses them:

    * ``Bandwidth.NVLINK_H100``: 450 GB/s, NVLink 4 on an H100 SXM (900 GB/s
      "NVLink" in NVIDIA's H100 datasheet counts both directions).
    * ``Bandwidth.INFINIBAND_NDR``: 50 GB/s, one 400 Gb/s NDR InfiniBand port
      per GPU (a DGX H100 has eight ConnectX-7 400 Gb/s ports for eight GPUs).
    * ``Bandwidth.ETHERNET_100G``: 12.5 GB/s, one 100 Gb/s Ethernet port per
      GPU (IEEE 802.3 100GBASE), a cloud cluster without InfiniBand.
    * ``Bandwidth.H100_HBM``: 3.35 TB/s, an H100 SXM's HBM3 (memory, not a
      link: what a pass over the gradient runs at).

    ``Bandwidth.LINKS`` is the three links, fastest first.

    Attributes:
      name: what it is.
      bytes_per_second: the figure.
      source: where it comes from.

    Examples:
      >>> import jaxscale as jxs
      >>> link = jxs.diagnostics.Bandwidth.INFINIBAND_NDR
      >>> link.name, link.bytes_per_second
      ('InfiniBand NDR', 50000000000.0)
      >>> [b.name for b in jxs.diagnostics.Bandwidth.LINKS]
      ['NVLink 4', 'InfiniBand NDR', '100 Gb Ethernet']
    """

    name: str
    bytes_per_second: float
    source: str = ""

    NVLINK_H100: ClassVar[Bandwidth]
    INFINIBAND_NDR: ClassVar[Bandwidth]
    ETHERNET_100G: ClassVar[Bandwidth]
    H100_HBM: ClassVar[Bandwidth]
    LINKS: ClassVar[tuple[Bandwidth, ...]]


Bandwidth.NVLINK_H100 = Bandwidth(
    "NVLink 4",
    450e9,
    "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s (SXM), both "
    "directions together",
)
Bandwidth.INFINIBAND_NDR = Bandwidth(
    "InfiniBand NDR",
    400e9 / 8,
    "NVIDIA DGX H100 datasheet: 8x single-port ConnectX-7, 400 Gb/s "
    "InfiniBand, one per GPU",
)
Bandwidth.ETHERNET_100G = Bandwidth(
    "100 Gb Ethernet", 100e9 / 8, "IEEE 802.3 100 Gb/s Ethernet, one port per GPU"
)
Bandwidth.H100_HBM = Bandwidth(
    "H100 SXM HBM3",
    3.35e12,
    "NVIDIA H100 Tensor Core GPU datasheet: GPU memory bandwidth 3.35 TB/s (SXM)",
)
Bandwidth.LINKS = (
    Bandwidth.NVLINK_H100,
    Bandwidth.INFINIBAND_NDR,
    Bandwidth.ETHERNET_100G,
)


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


def _number(name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:  # NumPy and JAX scalars
            if isinstance(value, bool) or getattr(value, "shape", None) != ():
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"`{name}` must be a number, got {type(value).__name__}: {value!r}."
            ) from None
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        rule = "> 0" if positive else ">= 0"
        raise ValueError(f"`{name}` must be finite and {rule}, got {value!r}.")
    return value


def _bandwidth(name: str, value: Any) -> float:
    if isinstance(value, Bandwidth):
        value = value.bytes_per_second
    return _number(name, value, positive=True)


def _overlap(overlap: Any) -> float:
    value = _number("overlap", overlap, positive=False)
    if value > 1:
        raise ValueError(f"`overlap` must be in [0, 1], got {overlap!r}.")
    return value


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"`{name}` must be an int, got {type(value).__name__}: {value!r}."
        )
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value!r}.")
    return int(value)


def _exposed(seconds: float, compute: float | None, overlap: float) -> float:
    """The part of ``seconds`` of communication not hidden behind ``overlap``
    of ``compute``."""
    return seconds if compute is None else max(0.0, seconds - overlap * compute)


# --------------------------------------------------------------------------- #
# wire_time
# --------------------------------------------------------------------------- #


def _steps(kind: str, n: int) -> int:
    if n < 2:
        return 0
    return 1 if kind == "collective-permute" else _STEPS[kind] * (n - 1)


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """One collective's modelled time (:attr:`WireTime.collectives`).

    Attributes:
      collective: the :class:`Collective`.
      bandwidth_seconds: its ``wire_bytes`` over the link bandwidth.
      latency_seconds: the latency times its algorithm's steps (``2 (n - 1)``
        for a ring all-reduce, ``n - 1`` for the others, 1 for a permute).
      seconds: the sum of the two.

    Examples:
      >>> import jaxscale as jxs
      >>> hlo = '''HloModule m, num_partitions=4
      ... ENTRY %main (p: f32[250]) -> f32[250] {
      ...   %p = f32[250]{0} parameter(0)
      ...   ROOT %ar = f32[250]{0} all-reduce(%p), replica_groups={}, to_apply=%add
      ... }'''
      >>> report = jxs.diagnostics.CollectiveReport.from_hlo(hlo)
      >>> t = jxs.diagnostics.wire_time(report, link_bandwidth=1e9, latency=1e-6)
      >>> c = t.collectives[0]
      >>> c.collective.wire_bytes, c.bandwidth_seconds, c.latency_seconds
      (1500, 1.5e-06, 6e-06)
    """

    collective: Collective
    bandwidth_seconds: float
    latency_seconds: float
    seconds: float


@dataclasses.dataclass(frozen=True, repr=False)
class WireTime:
    """What :func:`wire_time` returns: the collectives' times and their total.

    Attributes:
      collectives: one :class:`CollectiveTime` per collective, in the report's
        order.
      seconds: their sum: the step's communication, none of it overlapped.
      link_bandwidth: the bandwidth used, bytes per second.
      latency: the latency per step of an algorithm, seconds.
      compute_seconds: the step's compute time given (``None``: not given).
      overlap: the share of ``compute_seconds`` that communication may hide
        behind.
      exposed_seconds: the communication not hidden, ``max(0, seconds -
        overlap * compute_seconds)`` (``seconds`` without a compute time).
      exposed: whether any communication is exposed (``None`` without a
        compute time).
      step_seconds: ``compute_seconds + exposed_seconds`` (``None`` without a
        compute time).

    Examples:
      >>> import jaxscale as jxs
      >>> hlo = '''HloModule m, num_partitions=8
      ... ENTRY %main (p: f16[1000]) -> f16[1000] {
      ...   %p = f16[1000]{0} parameter(0)
      ...   ROOT %ar = f16[1000]{0} all-reduce(%p), replica_groups={}, to_apply=%add
      ... }'''
      >>> report = jxs.diagnostics.CollectiveReport.from_hlo(hlo)
      >>> t = jxs.diagnostics.wire_time(
      ...     report, link_bandwidth=1e6, step_compute_seconds=0.002, overlap=0.5
      ... )
      >>> t.seconds, t.exposed_seconds, t.exposed, round(t.step_seconds, 9)
      (0.0035, 0.0025, True, 0.0045)
    """

    collectives: tuple[CollectiveTime, ...]
    seconds: float
    link_bandwidth: float
    latency: float
    compute_seconds: float | None
    overlap: float
    exposed_seconds: float
    exposed: bool | None
    step_seconds: float | None

    def __repr__(self) -> str:
        return (
            f"WireTime({len(self.collectives)} collectives, "
            f"{self.seconds * 1e3:.4g} ms at {self.link_bandwidth / 1e9:.4g} GB/s)"
        )

    def __str__(self) -> str:
        head = (
            f"wire time: {_ms(self.seconds)} for {len(self.collectives)} "
            f"collective(s) at {self.link_bandwidth / 1e9:.4g} GB/s per device"
        )
        if self.latency:
            head += f", {self.latency * 1e6:.3g} us per step"
        lines = [head]
        if self.compute_seconds is not None:
            lines.append(
                f"compute {_ms(self.compute_seconds)}, overlap {self.overlap:.0%}: "
                f"{_ms(self.exposed_seconds)} exposed, step {_ms(self.step_seconds)}"
            )
        rows = [["kind", "carries", "array", "n", "sent", "time"]]
        for t in self.collectives:
            c = t.collective
            rows.append(
                [
                    c.kind,
                    c.carries,
                    typed(c.dtype, c.shape),
                    str(c.group_size),
                    human_bytes(c.wire_bytes),
                    _ms(t.seconds),
                ]
            )
        return "\n".join([*lines, "", *columns(rows, right=(3, 4, 5))])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def wire_time(
    report: CollectiveReport | Iterable[Collective],
    *,
    link_bandwidth: float | Bandwidth,
    latency: float = 0.0,
    step_compute_seconds: float | None = None,
    overlap: float = 0.0,
) -> WireTime:
    """The time a step's collectives take on a link, and how much is exposed.

    Each collective of ``report`` takes ``wire_bytes / link_bandwidth`` (the
    bytes each device sends: ``2 (n - 1) / n`` of the array for a ring
    all-reduce, ``(n - 1) / n`` for a reduce-scatter, all-gather or all-to-all)
    plus ``latency`` per step of its algorithm (``2 (n - 1)`` for a ring
    all-reduce, ``n - 1`` for the others). Their sum is the step's
    communication. With ``step_compute_seconds``, the exposed part is what
    ``overlap`` of the compute cannot hide: ``overlap=0`` (the default)
    serialises them, as :func:`jaxscale.reduce_gradients` does (one reduction
    after the backward pass); ``overlap=1`` hides communication up to the whole
    compute time, as a bucketed all-reduce during the backward pass can at best.

    A model, not a measurement: one link speed for every collective and device
    (a hierarchy of NVLink inside a node and a network between nodes is not
    modelled), no contention, a collective in a loop body counted once. Read the
    report of a GPU's program from a GPU compile (XLA:CPU widens float8 and
    bfloat16 collectives).

    Args:
      report: a :class:`CollectiveReport` (or its collectives).
      link_bandwidth: bytes per second each device sends (one direction), or a
        :class:`Bandwidth` such as ``Bandwidth.INFINIBAND_NDR``.
      latency: seconds per step of an algorithm (``alpha``), ``>= 0``.
      step_compute_seconds: the step's compute time, ``>= 0``, or ``None``.
      overlap: the share of the compute time that communication may hide
        behind, in ``[0, 1]``.

    Returns:
      A :class:`WireTime`.

    Raises:
      TypeError: for a ``report`` that is neither, or a non-numeric argument.
      ValueError: for a bandwidth ``<= 0``, a negative or non-finite time or
        latency, or an ``overlap`` outside ``[0, 1]``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices("cpu")[:8], ("data",))
      >>> step = jax.shard_map(
      ...     lambda g: jax.lax.pmean(g, "data"), mesh=mesh, in_specs=P("data"),
      ...     out_specs=P(),
      ... )
      >>> report = jxs.diagnostics.collective_report(step)(jnp.ones((8, 1_000_000)))
      >>> t = jxs.diagnostics.wire_time(
      ...     report, link_bandwidth=jxs.diagnostics.Bandwidth.INFINIBAND_NDR,
      ...     step_compute_seconds=1e-3,
      ... )
      >>> report.bytes(wire=True), round(t.seconds * 1e3, 3), t.exposed
      (7000000, 0.14, True)

    References:
      R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective
      communication operations in MPICH", IJHPCA 19(1), 2005.
    """
    if isinstance(report, CollectiveReport):
        items = report.collectives
    elif isinstance(report, Iterable) and not isinstance(report, str | bytes):
        items = tuple(report)
        bad = [type(c).__name__ for c in items if not isinstance(c, Collective)]
        if bad:
            raise TypeError(
                "`report` must be a `CollectiveReport` or an iterable of "
                f"`Collective`, got an iterable holding {bad[0]}."
            )
    else:
        raise TypeError(
            "`report` must be a `CollectiveReport` (from "
            "`jxs.diagnostics.collective_report(step)(*args)`) or an iterable of "
            f"`Collective`, got {type(report).__name__}."
        )
    bandwidth = _bandwidth("link_bandwidth", link_bandwidth)
    alpha = _number("latency", latency, positive=False)
    compute = None
    if step_compute_seconds is not None:
        compute = _number("step_compute_seconds", step_compute_seconds, positive=False)
    share = _overlap(overlap)
    times = []
    for c in items:
        beta = c.wire_bytes / bandwidth
        lat = alpha * _steps(c.kind, c.group_size)
        times.append(CollectiveTime(c, beta, lat, beta + lat))
    total = sum(t.seconds for t in times)
    exposed = _exposed(total, compute, share)
    return WireTime(
        collectives=tuple(times),
        seconds=total,
        link_bandwidth=bandwidth,
        latency=alpha,
        compute_seconds=compute,
        overlap=share,
        exposed_seconds=exposed,
        exposed=None if compute is None else exposed > 0,
        step_seconds=None if compute is None else compute + exposed,
    )


# --------------------------------------------------------------------------- #
# compression_table
# --------------------------------------------------------------------------- #


def _wire_bytes(scheme: str, parameters: int, n: int, block: int) -> float:
    """Bytes each device sends to average ``parameters`` gradient values."""
    share = (n - 1) / n
    if scheme == "float32 all-reduce":
        return 2 * share * 4 * parameters
    if scheme == "16-bit all-reduce":
        return 2 * share * 2 * parameters
    width = 2 if scheme == "bfloat16 all-to-all" else 1
    # an all-to-all out and an all-gather back, each with a float32 scale per block
    return 2 * share * (width + 4 / block) * parameters


def _pass_bytes(scheme: str, parameters: int, n: int) -> float:
    """Memory traffic per device that :func:`jaxscale.reduce_mean` adds to the
    collectives (an all-reduce's own reads and writes run inside it, at link
    speed, and count as nothing): per float32 gradient value, quantise (read
    twice: the block amax, then the scaled values; write ``w``), dequantise and
    sum the ``n`` received chunks (read ``w``, write ``4 / n``), quantise the
    mean (``(8 + w) / n``), dequantise what comes back (read ``w``, write 4);
    float8's error feedback reads and writes both residuals (``8 + 8 / n``)."""
    if scheme in SCHEMES[:2]:
        return 0.0
    w = 2 if scheme == "bfloat16 all-to-all" else 1
    per_value = 12 + 3 * w + (12 + w) / n
    if scheme == "float8 all-to-all":
        per_value += 8 + 8 / n
    return per_value * parameters


@dataclasses.dataclass(frozen=True)
class CompressionRow:
    """One device count and link of a :class:`CompressionTable`.

    Attributes:
      devices: ``n``, the data-parallel devices.
      link: the link's name.
      link_bandwidth: its bytes per second, per device and direction.
      compute_seconds: the step's compute time at ``n`` devices.
      wire_seconds: per scheme (:data:`SCHEMES` order: float32 all-reduce,
        16-bit all-reduce, bfloat16 all-to-all, float8 all-to-all), the
        communication time.
      pass_seconds: per scheme, the memory passes over the gradient that the
        compressed reduction adds (0 for the all-reduces).
      overhead_seconds: per scheme, what it adds to the step: the exposed
        communication plus the passes.

    Examples:
      >>> import jaxscale as jxs
      >>> table = jxs.diagnostics.compression_table(
      ...     100_000_000, step_compute_seconds=0.01, devices=(8,),
      ...     links=(jxs.diagnostics.Bandwidth.ETHERNET_100G,),
      ... )
      >>> row = table.rows[0]
      >>> row.devices, row.link, round(row.wire_seconds[0], 4)
      (8, '100 Gb Ethernet', 0.056)
      >>> row.pays_over_16bit, round(row.saved_over_16bit * 1e3, 1)
      (True, 13.0)
    """

    devices: int
    link: str
    link_bandwidth: float
    compute_seconds: float
    wire_seconds: tuple[float, ...]
    pass_seconds: tuple[float, ...]
    overhead_seconds: tuple[float, ...]

    @property
    def saved_over_16bit(self) -> float:
        """Seconds per step float8 saves against the 16-bit all-reduce
        (negative: it costs)."""
        return self.overhead_seconds[1] - self.overhead_seconds[3]

    @property
    def pays_over_16bit(self) -> bool:
        """Whether the float8 all-to-all makes the step faster than the 16-bit
        all-reduce: link time saved beyond the passes it adds."""
        return self.saved_over_16bit > 0

    @property
    def pays_over_float32(self) -> bool:
        """Whether the float8 all-to-all makes the step faster than the float32
        all-reduce."""
        return self.overhead_seconds[3] < self.overhead_seconds[0]


@dataclasses.dataclass(frozen=True, repr=False)
class CompressionTable:
    """What :func:`compression_table` returns; ``print(table)`` shows it as a
    Markdown table.

    Attributes:
      parameters: the gradient's values (float32 on each device).
      rows: one :class:`CompressionRow` per device count and link.
      memory_bandwidth: the memory bandwidth of the passes, bytes per second.
      overlap: the share of the compute that communication may hide behind.
      scaling: ``"weak"`` or ``"strong"``.

    Examples:
      >>> import jaxscale as jxs
      >>> table = jxs.diagnostics.compression_table(
      ...     124_439_808, step_compute_seconds=0.015, devices=(8, 1024)
      ... )
      >>> [(r.devices, r.link, r.pays_over_16bit) for r in table.rows]
      ... # doctest: +NORMALIZE_WHITESPACE
      [(8, 'NVLink 4', False), (8, 'InfiniBand NDR', True),
       (8, '100 Gb Ethernet', True), (1024, 'NVLink 4', False),
       (1024, 'InfiniBand NDR', True), (1024, '100 Gb Ethernet', True)]
    """

    parameters: int
    rows: tuple[CompressionRow, ...]
    memory_bandwidth: float
    overlap: float
    scaling: str

    def __repr__(self) -> str:
        paid = sum(r.pays_over_16bit for r in self.rows)
        return (
            f"CompressionTable({self.parameters:,} values, {len(self.rows)} rows, "
            f"float8 pays over 16 bits in {paid})"
        )

    def __str__(self) -> str:
        """Per row, what each scheme adds to the step (exposed wire time plus,
        for the all-to-alls, the passes in parentheses)."""
        head = ["n", "link", "compute", *_LABELS, "float8 against 16-bit"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            cells = [str(r.devices), r.link, _ms(r.compute_seconds)]
            for passes, over in zip(r.pass_seconds, r.overhead_seconds, strict=True):
                cells.append(_ms(over) + (f" ({_ms(passes)} passes)" if passes else ""))
            verdict = "pays" if r.pays_over_16bit else "does not pay"
            cells.append(f"{verdict}: {r.saved_over_16bit * 1e3:+.3g} ms")
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def compression_table(
    parameters: int,
    *,
    step_compute_seconds: float,
    devices: Sequence[int] = (8, 64, 256, 1024),
    links: Sequence[Bandwidth | float] = Bandwidth.LINKS,
    memory_bandwidth: float | Bandwidth = Bandwidth.H100_HBM,
    overlap: float = 0.0,
    scaling: str = "weak",
    block_size: int = 256,
    latency: float = 0.0,
) -> CompressionTable:
    """Where a compressed gradient reduction pays: float32, 16-bit and float8
    transport of one gradient, per device count and link.

    For a float32 gradient of ``parameters`` values on each of ``n`` devices,
    four ways to average it (:data:`SCHEMES`): a ring all-reduce in float32, a
    ring all-reduce in 16 bits (what XLA's partitioner sends under 16-bit
    autocast, and the baseline that compression must beat, not float32: arXiv
    2407.01378),
    :func:`jaxscale.reduce_gradients`' all-to-all and all-gather in bfloat16, and
    in float8 with error feedback (each with a float32 scale per
    ``block_size`` values). Each gets its link time from :func:`wire_time`'s
    formulas and the memory passes its quantisation and float32 sum make over
    the gradient (counted in :class:`CompressionRow`), at
    ``memory_bandwidth``. The step's *overhead* is the exposed communication
    (``max(0, wire - overlap * compute)``) plus the passes; float8 *pays* where
    its overhead is below the 16-bit all-reduce's. The bfloat16 all-to-all never
    pays on time against a 16-bit all-reduce (the same bytes, plus passes): it
    buys an error that does not grow with ``n``.

    ``scaling="weak"`` keeps ``step_compute_seconds`` at every ``n`` (each
    device keeps its batch); ``"strong"`` fixes the global batch, so the compute
    at ``n`` devices is ``step_compute_seconds * devices[0] / n``.

    Args:
      parameters: the gradient's values, ``>= 1``.
      step_compute_seconds: the step's compute time (at ``devices[0]``).
      devices: the device counts, each ``>= 2``.
      links: the links, :class:`Bandwidth` or bytes per second.
      memory_bandwidth: bytes per second of the passes over the gradient.
      overlap: the share of the compute that communication may hide behind,
        in ``[0, 1]`` (0: after the backward pass, as
        :func:`jaxscale.reduce_gradients` runs).
      scaling: ``"weak"`` or ``"strong"``.
      block_size: values per float32 scale of the compressed schemes.
      latency: seconds per step of the algorithms (the same ``2 (n - 1)`` steps
        for a ring all-reduce and for an all-to-all plus all-gather, so it
        changes what is exposed, never the bytes saved).

    Returns:
      A :class:`CompressionTable`.

    Raises:
      TypeError: for a non-numeric argument.
      ValueError: for a count, bandwidth or time out of range, an empty
        ``devices`` or ``links``, or an unknown ``scaling``.

    Examples:
      >>> import jaxscale as jxs
      >>> table = jxs.diagnostics.compression_table(
      ...     124_439_808, step_compute_seconds=0.015, devices=(8,),
      ...     links=(jxs.diagnostics.Bandwidth.NVLINK_H100,),
      ... )
      >>> row = table.rows[0]
      >>> [round(t * 1e3, 3) for t in row.overhead_seconds]  # ms per scheme
      [1.936, 0.968, 1.709, 1.443]
      >>> row.pays_over_16bit, row.pays_over_float32
      (False, True)

    ``print(table)`` shows it as a Markdown table (docs/multidevice.md).

    References:
      S. Agarwal, H. Wang, S. Venkataraman, D. Papailiopoulos, "On the
      utility of gradient compression in distributed training systems", MLSys
      2022, arXiv 2103.00543 (compression paid in 6 of more than 200
      data-center set-ups).
      "Beyond Throughput and Compression Ratios: Towards High End-to-end Utility
      of Gradient Compression", arXiv 2407.01378 (compare with a 16-bit
      baseline, not a 32-bit one).
      R. Thakur, R. Rabenseifner and W. Gropp, IJHPCA 19(1), 2005 (the
      collective cost formulas).
    """
    size = _count("parameters", parameters, 1)
    compute = _number("step_compute_seconds", step_compute_seconds, positive=False)
    if isinstance(devices, int) or not isinstance(devices, Sequence):
        raise TypeError(f"`devices` must be a sequence of ints, got {devices!r}.")
    if not devices:
        raise ValueError("`devices` must name at least one device count, got ().")
    counts = [_count("devices", n, 2) for n in devices]
    if isinstance(links, Bandwidth | int | float) or not isinstance(links, Sequence):
        raise TypeError(f"`links` must be a sequence of bandwidths, got {links!r}.")
    if not links:
        raise ValueError("`links` must name at least one link, got ().")
    named = []
    for link in links:
        bw = _bandwidth("links", link)
        named.append(
            (link.name if isinstance(link, Bandwidth) else f"{bw / 1e9:.4g} GB/s", bw)
        )
    memory = _bandwidth("memory_bandwidth", memory_bandwidth)
    share = _overlap(overlap)
    if scaling not in _SCALINGS:
        raise ValueError(f"`scaling` must be 'weak' or 'strong', got {scaling!r}.")
    block = _count("block_size", block_size, 1)
    alpha = _number("latency", latency, positive=False)
    rows = []
    for n in counts:
        at_n = compute if scaling == "weak" else compute * counts[0] / n
        for name, bw in named:
            wire = tuple(
                _wire_bytes(s, size, n, block) / bw + alpha * 2 * (n - 1)
                for s in SCHEMES
            )
            passes = tuple(_pass_bytes(s, size, n) / memory for s in SCHEMES)
            over = tuple(
                _exposed(w, at_n, share) + p for w, p in zip(wire, passes, strict=True)
            )
            rows.append(CompressionRow(n, name, bw, at_n, wire, passes, over))
    return CompressionTable(size, tuple(rows), memory, share, scaling)
