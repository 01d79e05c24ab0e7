"""What holds on an NVIDIA GPU, checked on the CPU: programs lowered for CUDA
(``lowering_platforms=("cuda",)``, no GPU needed) hold nothing XLA:GPU may
rewrite into another answer, and the numerics that decide a GPU result are
checked against numpy here.

The first GPU run (``shared/reports/gpu-h200-5e7cbb9``) found the diagnostics
counting float16 flushes as subnormals: they emulated float16 with a
``convert(convert(x, f16), f32)`` pair, which XLA:GPU may remove
(``xla_allow_excess_precision``, on by default).
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxscale as jxs
from jaxscale import _hlo
from jaxscale.diagnostics._underflow import cast_masks, cast_thresholds

pytestmark = pytest.mark.core

LOW = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2]


def _cuda_text(fn, *args):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def _narrow_converts(text):
    """The ``stablehlo.convert`` ops of a lowered module whose result is a
    16-bit or 8-bit float (an emulation by cast would have one)."""
    converts = _hlo.stablehlo_converts(text).elements()
    return [t for t in converts if t in ("f16", "bf16") or t.startswith("f8E")]


@pytest.mark.parametrize("dt", LOW, ids=lambda d: jnp.dtype(d).name)
def test_cast_masks_match_a_real_cast(dt):
    """The thresholds give what numpy's round-to-nearest-even cast gives, at
    every tie and across the whole range."""
    rng = np.random.default_rng(0)
    mags = rng.standard_normal(50_000) * 10.0 ** rng.integers(-45, 39, 50_000)
    zero, normal, inf = (float(t) for t in cast_thresholds(dt))
    ties = [zero, normal, inf, np.nextafter(np.float32(zero), 1), 1e-9, 1.0, 0.0]
    x = np.concatenate([mags, ties, [np.inf, -np.inf, np.nan]]).astype(np.float32)
    x = x[(np.abs(x) >= np.finfo(np.float32).tiny) | ~np.isfinite(x) | (x == 0)]
    with np.errstate(all="ignore"):
        y = x.astype(jnp.dtype(dt)).astype(np.float32)
    tiny = float(jnp.finfo(dt).smallest_normal)
    cand = (x != 0) & np.isfinite(x)
    want = (cand & (y == 0), (y != 0) & (np.abs(y) < tiny), cand & ~np.isfinite(y))
    got = jax.jit(lambda a: cast_masks(a, dt))(x)
    for name, g, w in zip(("zero", "subnormal", "overflow"), got, want, strict=True):
        bad = np.flatnonzero(np.asarray(g) != w)
        assert bad.size == 0, (name, x[bad[:5]])


def test_float16_flushes_are_not_subnormals():
    """The GPU run's case: 1e-9 flushes to zero in float16 (not subnormal)."""
    z, s, _ = cast_masks(jnp.array([1e-9, 1e-6, 1e-3, 1.0]), jnp.float16)
    assert z.tolist() == [True, False, False, False]
    assert s.tolist() == [False, True, False, False]


def test_the_reports_lowered_for_cuda_emulate_no_dtype_by_casting():
    grads = {"w": jnp.array([1e-9, 1e-6, 1e-3, 1.0])}
    for dt in (jnp.float16, jnp.bfloat16):
        text = _cuda_text(
            lambda g, dt=dt: jxs.diagnostics.underflow_report(g, dt), grads
        )
        assert not _narrow_converts(text), _narrow_converts(text)[:3]

    def loss(w, x):
        return jnp.mean(jxs.diagnostics.cotangent_probe(x @ w, "logits"))

    report = jxs.diagnostics.cotangent_report(loss, 2.0**15, jnp.float16)
    text = _cuda_text(report, jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert not _narrow_converts(text), _narrow_converts(text)[:3]


def test_the_check_finds_an_emulation_by_casting():
    text = _cuda_text(lambda x: x.astype(jnp.float16).astype(jnp.float32), jnp.ones(3))
    assert _narrow_converts(text)
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == 448


# --------------------------------------------------------------------------- #
# float8: the dots XLA:GPU would multiply in float16
# --------------------------------------------------------------------------- #

# XLA:GPU's default `xla_gpu_gemm_rewrite_size_threshold`: a dot whose
# (M + N) * K is below it goes to the loop emitter, which multiplies float8
# operands widened to float16 (gemm_rewriter.cc, gpu_float_support.cc).
XLA_GPU_GEMM_REWRITE_SIZE_THRESHOLD = 100


def _loop_emitter(qa, qb):
    """XLA:GPU's loop emitter for ``dot(f8, f8) -> f32``, emulated exactly with
    numpy: each product in float16, the sum in float32."""
    a = np.asarray(qa).astype(np.float16)
    b = np.asarray(qb).astype(np.float16)
    with np.errstate(over="ignore"):
        prods = a[:, :, None] * b[None, :, :]  # float16 products
    return prods.astype(np.float32).sum(axis=1)


def test_why_small_float8_dots_gave_inf_on_the_gpu():
    """The GPU run's ``jxs.float8.apply`` doctest (x = ones(4, 8), w = eye(8)):
    per-tensor scales put both operands at e4m3's maximum, 448, and
    448 * 448 = 200704 is above float16's 65504."""
    from jaxscale.float8._numerics import quantize, scale_from_amax

    f8 = jnp.float8_e4m3fn
    x, w = jnp.ones((4, 8)), jnp.eye(8)
    qx = quantize(x, scale_from_amax(jnp.max(x), f8), f8)
    qw = quantize(w, scale_from_amax(jnp.max(w), f8), f8)
    assert float(jnp.max(qx.astype(jnp.float32))) == 448.0
    assert np.isinf(_loop_emitter(qx, qw)).all()  # what the GPU returned
    exact = np.asarray(qx, np.float32) @ np.asarray(qw, np.float32)
    assert (exact == 448.0 * 448.0).all()  # exact in float32


def test_small_float8_products_widen_their_operands_to_float32():
    """Below ``SMALL_DOT`` (well above XLA:GPU's threshold) a site's dots take
    float32 operands (exact, and finite on the GPU); above it they keep
    ``dot(f8, f8)``, the form XLA:GPU rewrites to a float8 cuBLASLt GEMM."""
    from jaxscale.float8._site import SMALL_DOT, gemm_form

    assert SMALL_DOT >= 5 * XLA_GPU_GEMM_REWRITE_SIZE_THRESHOLD
    assert gemm_form(4, 8, 8) == "float32" and gemm_form(16, 16, 16) == "float8"
    recipe = jxs.float8.DelayedScaling(history_len=4, min_dim=0)
    for (m, k, n), form in [((4, 8, 8), "float32"), ((32, 32, 32), "float8")]:
        f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16, float8=recipe)
        w, x = jnp.eye(k, n), jnp.ones((m, k))
        state = jxs.float8.init(f, w, x)
        step = jxs.float8.value_and_grad(f, state)
        text = _cuda_text(step, w, x)
        dots = _hlo.stablehlo_dots(text)
        # The forward and the weight's gradient (the input's is unused).
        assert len(dots) == 2, dots
        f8_operands = [d.operands[0][0].startswith("f8E") for d in dots]
        assert f8_operands == [form == "float8"] * 2, dots
        loss, grads, _ = jax.jit(step)(w, x)
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grads)).all()
        np.testing.assert_allclose(float(loss), float(jnp.sum(x @ w)), rtol=1e-2)


def test_no_module_emulates_a_dtype_by_casting_there_and_back():
    """The source-level half of the check: no ``.astype(a).astype(b)`` chain in
    the package (a cast round trip XLA:GPU may remove)."""
    import pathlib

    package = pathlib.Path(jxs.__file__).resolve().parent
    chain = re.compile(r"\.astype\([^()]*\)\s*\.astype\(")
    found = [
        f"{p.name}: {line.strip()}"
        for p in package.rglob("*.py")
        for line in p.read_text().splitlines()
        if chain.search(line)
    ]
    assert not found, found


def test_the_sensor_rounds_through_a_barrier_xla_keeps():
    """The precision sensor rounds operands and results to 16 bits with
    ``rounded`` (a cast, an optimization barrier, a cast back): lowered for
    CUDA the barrier stands between the casts, which XLA:GPU's deviceless
    compile then keeps (a plain cast there and back it removes: the sketch of
    a weight gradient's error would read zero)."""
    from jaxscale.precision._stats import rounded

    x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32)
    text = _cuda_text(lambda v: rounded(v, jnp.bfloat16), x)
    barrier = text.index("stablehlo.optimization_barrier")
    narrow = [m.start() for m in re.finditer(r"stablehlo\.convert.*bf16", text)]
    assert narrow and min(narrow) < barrier
    got = np.asarray(jax.jit(lambda v: rounded(v, jnp.bfloat16))(x))
    want = np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, want)
