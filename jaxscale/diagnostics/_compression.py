"""``jxs.diagnostics.compression_table``: where a compressed gradient reduction pays.

One float32 gradient averaged four ways (a float32 or 16-bit ring all-reduce,
:func:`jaxscale.reduce_gradients`' all-to-all in bfloat16 or float8), each timed
on a link by :mod:`._wire_cost`'s formulas, the compressed ones charged the
memory passes their quantisation and float32 sum make over the gradient, priced
as every pass in jaxscale is (``jaxscale/_cost.py``: ``q`` of the HBM bandwidth
plus ``c`` per kernel, fitted to an H200's float8 quantisation passes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxscale._cost import pass_seconds
from jaxscale.diagnostics._wire_cost import (
    Bandwidth,
    check_bandwidth,
    check_count,
    check_number,
    check_overlap,
    exposed_time,
    ms,
)

__all__ = ["SCHEMES", "CompressionRow", "CompressionTable", "compression_table"]

#: The gradient transports of :func:`compression_table`, in its columns' order.
SCHEMES = (
    "float32 all-reduce",
    "16-bit all-reduce",
    "bfloat16 all-to-all",
    "float8 all-to-all",
)
_LABELS = ("float32 ring", "16-bit ring", "bf16 all-to-all", "f8 all-to-all")
_SCALINGS = ("weak", "strong")


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


def _passes(scheme: str, parameters: int, n: int) -> tuple[float, int]:
    """Memory traffic per device that :func:`jaxscale.reduce_mean` adds to the
    collectives, in bytes, and its kernels (an all-reduce's own reads and
    writes run inside it, at link speed, and count as nothing): per float32
    gradient value, quantise (read twice: the block amax, then the scaled
    values; write ``w``), dequantise and sum the ``n`` received chunks (read
    ``w``, write ``4 / n``), quantise the mean (``(8 + w) / n``), dequantise
    what comes back (read ``w``, write 4): six kernels; float8's error feedback
    reads and writes both residuals (``8 + 8 / n``), two kernels more. The
    kernels are counted, one per pass named here, not read from a compile."""
    if scheme in SCHEMES[:2]:
        return 0.0, 0
    w = 2 if scheme == "bfloat16 all-to-all" else 1
    per_value = 12 + 3 * w + (12 + w) / n
    if scheme == "float8 all-to-all":
        return (per_value + 8 + 8 / n) * parameters, 8
    return per_value * parameters, 6


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
        compressed reduction adds (0 for the all-reduces), priced as
        :func:`compression_table` says.
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
      (True, 10.6)
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
      memory_bandwidth: the device's memory bandwidth (a data sheet's), bytes
        per second.
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
            cells = [str(r.devices), r.link, ms(r.compute_seconds)]
            for passes, over in zip(r.pass_seconds, r.overhead_seconds, strict=True):
                cells.append(ms(over) + (f" ({ms(passes)} passes)" if passes else ""))
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
    the gradient (counted in :class:`CompressionRow`), priced as the speed model
    prices every pass: the bytes at 24% of ``memory_bandwidth`` plus 3.1 us a
    kernel (fitted to float8's quantisation passes on an H200,
    ``docs/float8.md``). The step's *overhead* is the exposed communication
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
      memory_bandwidth: the device's memory bandwidth, bytes per second (a data
        sheet's figure: the passes reach 24% of it).
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
      [1.936, 0.968, 4.051, 4.482]
      >>> row.pays_over_16bit, row.pays_over_float32
      (False, False)

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
    size = check_count("parameters", parameters, 1)
    compute = check_number("step_compute_seconds", step_compute_seconds, positive=False)
    if isinstance(devices, int) or not isinstance(devices, Sequence):
        raise TypeError(f"`devices` must be a sequence of ints, got {devices!r}.")
    if not devices:
        raise ValueError("`devices` must name at least one device count, got ().")
    counts = [check_count("devices", n, 2) for n in devices]
    if isinstance(links, Bandwidth | int | float) or not isinstance(links, Sequence):
        raise TypeError(f"`links` must be a sequence of bandwidths, got {links!r}.")
    if not links:
        raise ValueError("`links` must name at least one link, got ().")
    named = []
    for link in links:
        bw = check_bandwidth("links", link)
        named.append(
            (link.name if isinstance(link, Bandwidth) else f"{bw / 1e9:.4g} GB/s", bw)
        )
    memory = check_bandwidth("memory_bandwidth", memory_bandwidth)
    share = check_overlap(overlap)
    if scaling not in _SCALINGS:
        raise ValueError(f"`scaling` must be 'weak' or 'strong', got {scaling!r}.")
    block = check_count("block_size", block_size, 1)
    alpha = check_number("latency", latency, positive=False)
    rows = []
    for n in counts:
        at_n = compute if scaling == "weak" else compute * counts[0] / n
        for name, bw in named:
            wire = tuple(
                _wire_bytes(s, size, n, block) / bw + alpha * 2 * (n - 1)
                for s in SCHEMES
            )
            passes = tuple(pass_seconds(*_passes(s, size, n), memory) for s in SCHEMES)
            over = tuple(
                exposed_time(w, at_n, share) + p
                for w, p in zip(wire, passes, strict=True)
            )
            rows.append(CompressionRow(n, name, bw, at_n, wire, passes, over))
    return CompressionTable(size, tuple(rows), memory, share, scaling)
