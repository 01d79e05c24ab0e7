"""benchmarks/site_scales.py (issue 49 item 4): per-site power-of-two cotangent
scales against one global loss scale. The boundary re-expresses a float16
cotangent at its own scale, under jit and autocast; the delayed rule picks the
power of two; the quick run prints both tables with per-layer underflow shares."""

import importlib.util
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "site_scales.py"
_SPEC = importlib.util.spec_from_file_location("site_scales", _PATH)
bench = sys.modules.setdefault("site_scales", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(bench)


def _cotangents(scale: float, above: float, dtype):
    """The boundary's backward under jit: an incoming cotangent of 2**-30 (at
    scale ``above``) leaves at ``scale``; returns (what flows on, the probe)."""
    g_true = jnp.full((4, 3), 2.0**-30, jnp.float32)
    h = jnp.ones((4, 3), dtype)
    probe = jnp.zeros((4, 3), jnp.float32)

    @jax.jit
    def run(h, probe, scale, above):
        out, vjp = jax.vjp(
            lambda h, p, s: bench.boundary(h, scale, above, p, s, dtype),
            h,
            probe,
            jnp.float32(0),
        )
        return vjp((g_true * above).astype(dtype))

    return run(h, probe, jnp.float32(scale), jnp.float32(above))


@pytest.mark.core
def test_boundary_rescales_the_float16_cotangent():
    # One scale: 2**-30 * 2**5 is below float16's smallest subnormal (2**-24).
    flows, true, amax = _cotangents(2.0**5, 2.0**5, jnp.float16)
    assert amax == 0.0  # 2**-25 arrived as zero already
    assert flows.dtype == jnp.float16 and true.dtype == jnp.float32
    assert not np.any(np.asarray(flows))
    # Arriving at 2**10 (2**-20, a subnormal), leaving at its own scale 2**30 (a
    # ratio 2**20, no float16): exactly 1, true value 2**-30.
    flows, true, amax = _cotangents(2.0**30, 2.0**10, jnp.float16)
    assert amax == 2.0**-30 and amax.dtype == jnp.float32  # the incoming amax
    np.testing.assert_array_equal(np.asarray(flows, np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(true), 2.0**-30)


@pytest.mark.core
def test_boundary_keeps_float32_under_autocast():
    # Under autocast the rule is traced at float32 and runs on a float16
    # cotangent; the product must not be taken to float16 (2**25 is inf there).
    def f(h, probe, scale, above):
        out = bench.boundary(h @ h, scale, above, probe, jnp.float32(0), jnp.float16)
        return jnp.sum(out) * 2.0**-20  # a float16 cotangent of 2**-20

    h = jnp.full((3, 3), 2.0**-6, jnp.float32)
    probe = jnp.zeros((3, 3), jnp.float32)
    grad = jax.jit(jax.grad(jxs.autocast(f, jnp.float16), argnums=(0, 1)))
    dh, true = grad(h, probe, jnp.float32(2.0**25), jnp.float32(1.0))
    assert dh.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(dh)))  # the ratio 2**25 stayed float32
    np.testing.assert_array_equal(np.asarray(true), 2.0**-20)


@pytest.mark.core
def test_next_scales_rule():
    scales = jnp.array([2.0**10, 2.0**10, 2.0**10, 2.0**10])
    amax = jnp.array([2.0**-20, 3.0, 0.0, 2.0**-20])
    finite = jnp.array([True, True, True, False])
    got = np.asarray(
        jax.jit(bench.next_scales, static_argnums=3)(scales, amax, finite, 8)
    )
    # amax * S in [2**7, 2**8); all zero: kept; overflow in the layer: / 16.
    np.testing.assert_array_equal(got, [2.0**28, 2.0**6, 2.0**10, 2.0**6])
    assert got.dtype == np.float32
    inf = jnp.array([jnp.inf, 2.0**-100, 1e38, 1.0])
    got = np.asarray(bench.next_scales(scales, inf, jnp.ones(4, bool), 8))
    assert got[0] == 2.0**6 and got[1] == bench.MAX_SCALE  # clipped
    assert np.all((got >= bench.MIN_SCALE) & (got <= bench.MAX_SCALE))


@pytest.mark.integration
def test_quick_run_prints_both_tables(capsys):
    # optax.adam promotes implicitly itself: standard promotion for the run.
    with jax.numpy_dtype_promotion("standard"):
        doc = bench.main(["--quick", "--seeds", "0", "--models", "deep"])
    text = capsys.readouterr().out
    assert text.startswith("env: jax ")
    depth = bench.SIZES["quick"]["depth"]
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    losses = [ln for ln in rows if ln.split("|")[1].strip() in bench.RUNS]
    assert [ln.split("|")[1].strip() for ln in losses] == list(bench.RUNS)
    layers = [ln for ln in rows if re.match(r"\| \d+ \|", ln)]
    assert [int(ln.split("|")[1]) for ln in layers] == list(range(depth))
    assert all(ln.count("|") == 9 for ln in layers)
    runs = doc["models"]["deep"][0]["runs"]
    for run in ("global", "per-site"):
        assert len(runs[run]["share"]) == depth
        assert all(0.0 <= x <= 1.0 for x in runs[run]["share"])
        assert len(runs[run]["zeros_all"]) == depth
        assert all(0.0 <= x <= 1.0 for x in runs[run]["zeros_all"])
    for run in bench.RUNS:
        assert np.isfinite(runs[run]["eval"])
