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

:func:`compression_table` (``_compression.py``) applies it to gradient
transport. Every figure is a :class:`Bandwidth` that names its source; a GPU's
own (NVLink, HBM) are its row of the one device table (``jaxscale/_cost.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, ClassVar

from jaxscale._cost import H100_SXM
from jaxscale.diagnostics._collectives import Collective, CollectiveReport
from jaxscale.diagnostics._report_text import columns, human_bytes, typed

__all__ = ["Bandwidth", "CollectiveTime", "WireTime", "wire_time"]

_STEPS = MappingProxyType(  # algorithm steps per (n - 1)
    {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1}
)


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
      link: the data sheet's figure, of which a pass over the gradient reaches
      the fitted share that :func:`compression_table` states).

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
    H100_SXM.link_bytes_per_second,
    f"{H100_SXM.sheet}: NVLink {H100_SXM.nvlink_gbs:g} GB/s (SXM), both "
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
    H100_SXM.cost.hbm_tbs * 1e12,
    f"{H100_SXM.sheet}: GPU memory bandwidth {H100_SXM.cost.hbm_tbs:g} TB/s (SXM)",
)
Bandwidth.LINKS = (
    Bandwidth.NVLINK_H100,
    Bandwidth.INFINIBAND_NDR,
    Bandwidth.ETHERNET_100G,
)


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


def check_number(name: str, value: Any, *, positive: bool) -> float:
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


def check_bandwidth(name: str, value: Any) -> float:
    if isinstance(value, Bandwidth):
        value = value.bytes_per_second
    return check_number(name, value, positive=True)


def check_overlap(overlap: Any) -> float:
    value = check_number("overlap", overlap, positive=False)
    if value > 1:
        raise ValueError(f"`overlap` must be in [0, 1], got {overlap!r}.")
    return value


def check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"`{name}` must be an int, got {type(value).__name__}: {value!r}."
        )
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value!r}.")
    return int(value)


def exposed_time(seconds: float, compute: float | None, overlap: float) -> float:
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
        for a ring all-reduce, ``n - 1`` for the others, 1 for a permute);
        0 for the second and later arrays of a combined collective (the
        instruction pays it once).
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
            f"wire time: {ms(self.seconds)} for {len(self.collectives)} "
            f"collective(s) at {self.link_bandwidth / 1e9:.4g} GB/s per device"
        )
        if self.latency:
            head += f", {self.latency * 1e6:.3g} us per step"
        lines = [head]
        if self.compute_seconds is not None:
            lines.append(
                f"compute {ms(self.compute_seconds)}, overlap {self.overlap:.0%}: "
                f"{ms(self.exposed_seconds)} exposed, step {ms(self.step_seconds)}"
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
                    ms(t.seconds),
                ]
            )
        return "\n".join([*lines, "", *columns(rows, right=(3, 4, 5))])


def ms(seconds: float | None) -> str:
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
    bandwidth = check_bandwidth("link_bandwidth", link_bandwidth)
    alpha = check_number("latency", latency, positive=False)
    compute = None
    if step_compute_seconds is not None:
        compute = check_number(
            "step_compute_seconds", step_compute_seconds, positive=False
        )
    share = check_overlap(overlap)
    times, started = [], set()
    for c in items:
        beta = c.wire_bytes / bandwidth
        # The arrays XLA combined into one instruction pay its latency once.
        key = (c.computation, c.instruction) if c.instruction else None
        first = key is None or key not in started
        started.add(key)
        lat = alpha * _steps(c.kind, c.group_size) if first else 0.0
        times.append(CollectiveTime(c, beta, lat, beta + lat))
    total = sum(t.seconds for t in times)
    exposed = exposed_time(total, compute, share)
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
