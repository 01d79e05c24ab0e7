"""The speed model per format (``jaxscale/_speed.py``, issue 41 item 2).

One model for every format a matmul site can run in: float32 (TF32 tensor
cores), 16 bits, 16-bit operands with a float32 result, float8 tensorwise and
rowwise. float8's per-matmul choice is its two-format case and must give the
same numbers it gave as a model of its own.
"""

from __future__ import annotations

import itertools

import pytest

from jaxscale._cost import (
    DEVICES,
    FALLBACK,
    GEMM_EFFICIENCY,
    KERNEL_US,
    PASS_EFFICIENCY,
    device_cost,
)
from jaxscale._speed import Format, site_seconds
from jaxscale.float8._choice import predicted_times

pytestmark = [pytest.mark.unit]

SIZES = [(64, 64, 64), (4096, 768, 3072), (8192, 8192, 8192), (1, 4096, 50304)]
H100, _ = device_cost("NVIDIA H100 80GB HBM3")
H200, _ = device_cost("NVIDIA H200")


@pytest.mark.parametrize(
    ("mkn", "nbytes"), list(itertools.product(SIZES, [(2, 4), (4, 4)]))
)
def test_float8s_choice_is_the_two_format_case(mkn, nbytes):
    for device in DEVICES:
        cost = device.cost
        t16, t8 = predicted_times(*mkn, *nbytes, cost)
        assert t16 == site_seconds(Format.HALF, *mkn, *nbytes, cost)
        assert t8 == site_seconds(Format.FLOAT8, *mkn, *nbytes, cost)


def test_float32_and_the_wide_result_by_hand():
    """An 8192-cube site with float32 operands on an H100 SXM, counted by hand."""
    m = k = n = 8192
    e, q, c = GEMM_EFFICIENCY, PASS_EFFICIENCY, KERNEL_US * 1e-6
    flops, s, bw = 2.0 * m * k * n, 3 * m * k, 3.35e12
    t32 = 3 * flops / (e * 494.75e12) + 12 * s / bw
    assert site_seconds(Format.FLOAT32, m, k, n, 4, 4, H100) == pytest.approx(t32)
    t16 = 3 * flops / (e * 989.5e12) + 6 * s / bw + 2 * (6 * m * k) / (q * bw) + 2 * c
    assert site_seconds(Format.HALF, m, k, n, 4, 4, H100) == pytest.approx(t16)
    wide = site_seconds(Format.HALF_WIDE, m, k, n, 4, 4, H100)
    assert wide == pytest.approx(t16 + 4 * m * n / bw)
    # 16-bit operands: float32 pays a widening cast of each, 16 bits none.
    assert site_seconds(Format.FLOAT32, m, k, n, 2, 2, H100) == pytest.approx(
        t32 + 2 * (6 * m * k) / (q * bw) + 2 * c
    )


def test_a_large_site_orders_the_formats_by_their_peaks():
    times = {f: site_seconds(f, 8192, 8192, 8192, 2, 2, H200) for f in Format}
    assert (
        times[Format.FLOAT8]
        < times[Format.FLOAT8_ROWWISE]
        < times[Format.HALF]
        < times[Format.HALF_WIDE]
        < times[Format.FLOAT32]
    ), times
    # float32 runs on TF32, half the 16-bit peak: about twice the 16-bit time.
    assert 1.8 < times[Format.FLOAT32] / times[Format.HALF] < 2.2


def test_a_small_site_is_fastest_in_16_bits():
    """Kernel overheads: quantisation passes cost more than they save."""
    times = {f: site_seconds(f, 256, 256, 256, 2, 2, H100) for f in Format}
    assert min(times, key=times.get) is Format.HALF, times


@pytest.mark.parametrize("fmt", list(Format))
def test_time_grows_with_every_size(fmt):
    base = site_seconds(fmt, 1024, 1024, 1024, 2, 4, FALLBACK)
    for i in range(3):
        mkn = [1024, 1024, 1024]
        mkn[i] *= 2
        assert site_seconds(fmt, *mkn, 2, 4, FALLBACK) > base


def test_tf32_is_half_the_16_bit_peak_on_every_kind():
    for device in DEVICES:
        assert device.cost.tf32_tflops == device.cost.bf16_tflops / 2


def test_a_format_is_required():
    with pytest.raises(TypeError, match=r"`fmt` must be a Format, got str 'float8'"):
        site_seconds("float8", 64, 64, 64, 2, 2, H100)
