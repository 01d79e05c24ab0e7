"""The one cost model (``jaxscale/_cost.py``, issue 48 item 2): one table of
devices and one price per kind of kernel, read by the speed model, float8's
choice, the precision plan and the diagnostics' wire and compression costs."""

from __future__ import annotations

import pytest

import jaxscale as jxs
from jaxscale._cost import (
    DEVICES,
    FALLBACK,
    GEMM_EFFICIENCY,
    H100_SXM,
    KERNEL_US,
    PASS_EFFICIENCY,
    device_cost,
    device_row,
    gemm_seconds,
    is_known,
    pass_seconds,
)

pytestmark = [pytest.mark.unit]


def test_one_row_per_kind_each_with_its_data_sheet():
    assert len({d.pattern for d in DEVICES}) == len(DEVICES)
    for d in DEVICES:
        assert d.sheet.endswith("datasheet"), d
        assert min(d.cost.bf16_tflops, d.cost.f8_tflops, d.cost.hbm_tbs) > 0, d
        assert d.nvlink_gbs > 0 and d.link_bytes_per_second == d.nvlink_gbs * 5e8
        # A kind named as its row names it finds that row (first match wins).
        assert device_row(d.cost.name) is d and is_known(d.cost.name)
    assert DEVICES[-1] is H100_SXM and FALLBACK is H100_SXM.cost
    assert device_row("cpu") is None and not is_known("TPU v5p")
    assert device_cost("cpu") == (FALLBACK, f"cpu, as {FALLBACK.name}")


def test_the_two_prices_by_hand():
    bw = 3.35e12
    assert pass_seconds(0, 0, bw) == 0.0
    assert pass_seconds(1e9, 4, bw) == pytest.approx(
        1e9 / (PASS_EFFICIENCY * bw) + 4 * KERNEL_US * 1e-6
    )
    assert gemm_seconds(2e12, 989.5e12, 1e9, bw) == pytest.approx(
        2e12 / (GEMM_EFFICIENCY * 989.5e12) + 1e9 / bw
    )


def test_the_link_and_memory_presets_are_the_h100_sxm_row():
    bandwidth = jxs.diagnostics.Bandwidth
    assert bandwidth.NVLINK_H100.bytes_per_second == H100_SXM.link_bytes_per_second
    assert bandwidth.H100_HBM.bytes_per_second == H100_SXM.cost.hbm_tbs * 1e12
    for preset in (bandwidth.NVLINK_H100, bandwidth.H100_HBM):
        assert preset.source.startswith(H100_SXM.sheet)


def test_the_compression_table_states_the_fitted_constants():
    """Its docstring gives the pass cost in numbers: they are the fitted ones."""
    doc = jxs.diagnostics.compression_table.__doc__
    assert f"{PASS_EFFICIENCY:.0%} of ``memory_bandwidth``" in doc
    assert f"{KERNEL_US:g} us a\n    kernel" in doc
