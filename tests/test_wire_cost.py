"""``jxs.diagnostics.wire_time`` and ``compression_table``: the collective cost
formulas on hand-computed cases, monotonicity, a compiled 8-device step's report,
bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxscale as jxs

D = jxs.diagnostics
GPT2_SMALL = 124_439_808


def collective(kind: str, nbytes: int, n: int) -> D.Collective:
    """A record as the report builds it: ``wire_bytes`` by the ring formulas."""
    wire = {
        "all-reduce": 2 * (n - 1) * nbytes / n,
        "reduce-scatter": (n - 1) * nbytes,  # nbytes: the shard
        "collective-permute": nbytes,
    }.get(kind, (n - 1) * nbytes / n)
    return D.Collective(
        kind=kind,
        dtype="float32",
        shape=(nbytes // 4,),
        group_size=n,
        bytes=nbytes,
        wire_bytes=round(wire),
        carries="gradient",
        source="",
        op_name="",
        name=kind,
        groups=(),
        computation="main",
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kind", "nbytes", "sent", "steps"),
    [
        ("all-reduce", 4000, 6000, 6),  # 2 (n-1)/n x 4000, 2 (n-1) steps
        ("reduce-scatter", 1000, 3000, 3),  # (n-1) x the 1000-byte shard
        ("all-gather", 4000, 3000, 3),  # (n-1)/n x the gathered 4000
        ("all-to-all", 4000, 3000, 3),
        ("collective-permute", 4000, 4000, 1),
    ],
)
def test_each_collective_is_bytes_over_bandwidth_plus_latency_per_step(
    kind, nbytes, sent, steps
):
    c = collective(kind, nbytes, 4)
    assert c.wire_bytes == sent
    t = D.wire_time([c], link_bandwidth=1e9, latency=1e-6)
    (ct,) = t.collectives
    assert ct.collective is c
    assert ct.bandwidth_seconds == pytest.approx(sent / 1e9)
    assert ct.latency_seconds == pytest.approx(steps * 1e-6)
    assert t.seconds == pytest.approx(sent / 1e9 + steps * 1e-6)


@pytest.mark.unit
def test_a_combined_collective_pays_its_latency_once():
    parts = [
        dataclasses.replace(
            collective("all-reduce", 4000, 4), instruction="ar", parts=2
        )
        for _ in range(2)
    ]
    t = D.wire_time(parts, link_bandwidth=1e9, latency=1e-6)
    assert [ct.latency_seconds for ct in t.collectives] == pytest.approx([6e-6, 0.0])
    assert t.seconds == pytest.approx(2 * 6000 / 1e9 + 6e-6)


@pytest.mark.unit
def test_total_exposure_and_step_time():
    cs = [collective("all-reduce", 8000, 8), collective("all-gather", 8000, 8)]
    bw = D.Bandwidth("test link", 1e6)
    t = D.wire_time(cs, link_bandwidth=bw)  # 14000 + 7000 bytes at 1 MB/s
    assert t.seconds == pytest.approx(0.021)
    assert (t.exposed, t.step_seconds, t.compute_seconds) == (None, None, None)
    assert t.exposed_seconds == t.seconds
    serial = D.wire_time(cs, link_bandwidth=1e6, step_compute_seconds=0.01)
    assert serial.exposed and serial.exposed_seconds == pytest.approx(0.021)
    assert serial.step_seconds == pytest.approx(0.031)
    half = D.wire_time(cs, link_bandwidth=1e6, step_compute_seconds=0.01, overlap=0.5)
    assert half.exposed_seconds == pytest.approx(0.016)
    hidden = D.wire_time(cs, link_bandwidth=1e6, step_compute_seconds=0.05, overlap=1)
    assert (hidden.exposed, hidden.exposed_seconds) == (False, 0.0)
    assert hidden.step_seconds == pytest.approx(0.05)
    assert "21 ms" in str(t) and "all-gather" in str(t)
    one = D.wire_time(
        [collective("all-reduce", 8000, 1)], link_bandwidth=1e6, latency=1
    )
    assert one.seconds == 0.0  # one device: nothing sent, no steps


@pytest.mark.unit
def test_compression_table_by_hand():
    """1e6 values, 8 devices, 1 GB/s, 1 TB/s memory, block 256; the passes at
    the speed model's pass cost: 24% of the memory bandwidth, 3.1 us a kernel."""
    (row,) = D.compression_table(
        1_000_000,
        step_compute_seconds=0.002,
        devices=(8,),
        links=(1e9,),
        memory_bandwidth=1e12,
    ).rows
    assert row.link == "1 GB/s" and row.compute_seconds == 0.002
    wire = [7e-3, 3.5e-3, 1.75 * (2 + 4 / 256) * 1e-3, 1.75 * (1 + 4 / 256) * 1e-3]
    assert row.wire_seconds == pytest.approx(wire)
    # bytes read and written per value: quantise 8 + w (amax, scale, write), sum
    # w + 4/n, quantise the mean (8 + w)/n, dequantise w + 4; float8's error
    # feedback 8 + 8/n: 12 + 3w + (12 + w)/n (+ 8 + 8/n), n = 8; six kernels
    # (quantise: amax and cast, sum, quantise the mean: amax and cast,
    # dequantise), and two more for float8's residuals
    bf16, f8 = (18 + 14 / 8) * 1e-6, (15 + 13 / 8 + 9) * 1e-6
    passes = [0, 0, bf16 / 0.24 + 6 * 3.1e-6, f8 / 0.24 + 8 * 3.1e-6]
    assert row.pass_seconds == pytest.approx(passes)
    assert row.overhead_seconds == pytest.approx(
        [w + p for w, p in zip(wire, passes, strict=True)]
    )
    assert row.saved_over_16bit == pytest.approx(wire[1] - wire[3] - passes[3])
    assert row.pays_over_16bit and row.pays_over_float32


@pytest.mark.unit
def test_bfloat16_all_to_all_never_beats_a_16bit_ring_on_time():
    table = D.compression_table(GPT2_SMALL, step_compute_seconds=0.015)
    for row in table.rows:
        assert row.overhead_seconds[2] > row.overhead_seconds[1]


@pytest.mark.unit
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("scaling", ["weak", "strong"])
def test_more_devices_or_a_slower_link_compression_pays_more(overlap, scaling):
    devices = (8, 16, 64, 256, 1024)
    links = (450e9, 50e9, 12.5e9, 1e9)
    table = D.compression_table(
        GPT2_SMALL,
        step_compute_seconds=0.015,
        devices=devices,
        links=links,
        overlap=overlap,
        scaling=scaling,
    )
    saved = np.array([r.saved_over_16bit for r in table.rows]).reshape(
        len(devices), len(links)
    )
    assert np.all(np.diff(saved, axis=0) >= -1e-12), saved  # more devices
    assert np.all(np.diff(saved, axis=1) >= -1e-12), saved  # slower links


@pytest.mark.unit
def test_where_float8_pays_and_where_it_does_not():
    """GPT-2 small's gradient, 15 ms of compute: NVLink's 16-bit ring is faster
    than float8's passes; InfiniBand and Ethernet pay without overlap; with full
    overlap and enough compute nothing is exposed, and the passes only cost."""
    table = D.compression_table(GPT2_SMALL, step_compute_seconds=0.015, devices=(8,))
    pays = {r.link: r.pays_over_16bit for r in table.rows}
    assert pays == {"NVLink 4": False, "InfiniBand NDR": True, "100 Gb Ethernet": True}
    hidden = D.compression_table(
        GPT2_SMALL, step_compute_seconds=0.1, devices=(8,), overlap=1.0
    )
    for row in hidden.rows:
        assert not row.pays_over_16bit
        assert row.saved_over_16bit == pytest.approx(-row.pass_seconds[3])
    text = str(table)
    assert text.startswith("| n | link | compute |") and "does not pay" in text
    assert "float8 pays over 16 bits in 2" in repr(table)


@pytest.mark.unit
def test_bandwidth_presets_name_their_sources():
    for b in (*D.Bandwidth.LINKS, D.Bandwidth.H100_HBM):
        assert b.source and b.bytes_per_second > 0
    assert D.Bandwidth.NVLINK_H100.bytes_per_second == 450e9
    assert D.Bandwidth.INFINIBAND_NDR.bytes_per_second == 50e9
    assert D.Bandwidth.ETHERNET_100G.bytes_per_second == 12.5e9
    assert D.Bandwidth.H100_HBM.bytes_per_second == 3.35e12
    with pytest.raises(dataclasses.FrozenInstanceError):
        D.Bandwidth.H100_HBM.bytes_per_second = 1.0


@pytest.mark.core
def test_a_compiled_8_device_step_feeds_wire_time():
    """A data-parallel step on the suite's 8 CPU devices: float32 ``pmean`` and
    ``jxs.reduce_mean`` in float16 (dtypes XLA:CPU keeps on the wire); the model
    reads each collective of the compiled program."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    grads = {"w": jnp.ones((8 * 64, 32), jnp.float32), "b": jnp.ones((8, 32))}

    def step(reduce):
        return jax.shard_map(
            reduce, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False
        )

    def pmean(g):
        return lax.pmean(g, "data")

    def f16(g):
        return jxs.reduce_mean(g, "data", wire_dtype=jnp.float16, block_size=None)

    times = {}
    for name, reduce in (("pmean", pmean), ("f16", f16)):
        report = D.collective_report(step(reduce))(grads)
        assert report.devices == 8 and report.collectives
        t = D.wire_time(
            report, link_bandwidth=D.Bandwidth.ETHERNET_100G, step_compute_seconds=0
        )
        assert len(t.collectives) == len(report.collectives)
        assert t.seconds == pytest.approx(report.bytes(wire=True) / 12.5e9)
        assert t.exposed and t.step_seconds == pytest.approx(t.seconds)
        times[name] = t.seconds
    assert times["f16"] < times["pmean"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"link_bandwidth": 0}, ValueError, r"`link_bandwidth` must be .*> 0, got 0"),
        ({"link_bandwidth": -1e9}, ValueError, r"`link_bandwidth`.*got -1000000000"),
        ({"link_bandwidth": float("inf")}, ValueError, r"`link_bandwidth`.*inf"),
        ({"link_bandwidth": "fast"}, TypeError, r"`link_bandwidth` must be a number"),
        ({"link_bandwidth": True}, TypeError, r"`link_bandwidth`.*True"),
        (
            {"link_bandwidth": 1e9, "latency": -1},
            ValueError,
            r"`latency`.*>= 0, got -1",
        ),
        (
            {"link_bandwidth": 1e9, "step_compute_seconds": float("nan")},
            ValueError,
            r"`step_compute_seconds`.*nan",
        ),
        (
            {"link_bandwidth": 1e9, "overlap": 1.5},
            ValueError,
            r"`overlap`.*\[0, 1\].*1.5",
        ),
        ({"link_bandwidth": 1e9, "overlap": None}, TypeError, r"`overlap`.*None"),
    ],
)
def test_wire_time_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        D.wire_time([collective("all-reduce", 8, 2)], **kwargs)


@pytest.mark.unit
@pytest.mark.parametrize("report", ["HloModule m", 3, [1, 2]])
def test_wire_time_refuses_what_is_not_a_report(report):
    with pytest.raises(TypeError, match=r"`report` must be a `CollectiveReport`"):
        D.wire_time(report, link_bandwidth=1e9)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0,), {}, ValueError, r"`parameters` must be >= 1, got 0"),
        ((1.5,), {}, TypeError, r"`parameters` must be an int, got float: 1.5"),
        ((10,), {"devices": (8, 1)}, ValueError, r"`devices` must be >= 2, got 1"),
        ((10,), {"devices": 8}, TypeError, r"`devices` must be a sequence"),
        ((10,), {"devices": ()}, ValueError, r"`devices` must name at least one"),
        ((10,), {"links": ()}, ValueError, r"`links` must name at least one"),
        ((10,), {"links": (0.0,)}, ValueError, r"`links` must be .*> 0, got 0.0"),
        ((10,), {"links": 1e9}, TypeError, r"`links` must be a sequence"),
        ((10,), {"memory_bandwidth": -1.0}, ValueError, r"`memory_bandwidth`.*-1.0"),
        ((10,), {"scaling": "linear"}, ValueError, r"`scaling` must be.*'linear'"),
        ((10,), {"block_size": 0}, ValueError, r"`block_size` must be >= 1, got 0"),
        ((10,), {"overlap": -0.1}, ValueError, r"`overlap`.*-0.1"),
    ],
)
def test_compression_table_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        D.compression_table(*args, step_compute_seconds=0.01, **kwargs)


@pytest.mark.core
@pytest.mark.skipif(
    len(jax.devices()) < 8, reason="the guide's step runs on 8 default devices"
)
def test_the_guide_snippet_runs_after_the_compressed_reduction_step():
    """docs/multidevice.md's ``wire_time`` snippet, on the step of the
    compressed-reduction snippet before it."""
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "multidevice.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    (step,) = [b for b in blocks if "jxs.reduce_gradients(" in b]
    (snippet,) = [b for b in blocks if "jxs.diagnostics.wire_time(" in b]
    scope = {}
    with jax.numpy_dtype_promotion("standard"):  # optax.adam promotes itself
        exec(step, scope)  # noqa: S102 - our own documentation
        exec(snippet, scope)  # noqa: S102
    t = scope["t"]
    assert t.collectives and t.exposed  # overlap=0: all of it follows the compute
    assert t.step_seconds == pytest.approx(0.015 + t.seconds)
