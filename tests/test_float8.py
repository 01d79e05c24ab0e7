"""Float8 matmuls under ``jxs.autocast(..., float8=...)``: the numerics against
ml_dtypes, the recipes' validation, which dots become float8 sites (jaxpr and
lowered StableHLO), and delayed scaling's state (histories, scales, scan, cond,
structure checks, loss scaling, donation, checkpoints).

Models written by others (Flax, Equinox) are in test_float8_models.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import all_eqns, relaxed
from jax import lax

import jaxscale as jxs
from jaxscale import _hlo

# Each test has its tier; all run on the floor and ceiling legs too.
pytestmark = pytest.mark.construct

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F8 = {E4M3, E5M2}
BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype("float16"), np.dtype("float32")
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def dots(fun, *args):
    """The ``dot_general`` equations of ``fun``'s jaxpr and its sub-jaxprs."""
    eqns = all_eqns(jax.make_jaxpr(fun)(*args))
    return [e for e in eqns if e.primitive.name == "dot_general"]


def operand_dtypes(eqn):
    return tuple(np.dtype(v.aval.dtype) for v in eqn.invars)


def all_dtypes(fun, *args):
    """Every dtype of every value in ``fun``'s jaxpr (sub-jaxprs included)."""
    out = set()
    for e in all_eqns(jax.make_jaxpr(fun)(*args)):
        for v in (*e.invars, *e.outvars):
            if hasattr(v.aval, "dtype"):
                out.add(np.dtype(v.aval.dtype))
    return out


def matmul(x, w):
    return x @ w


def bf16_of(a):
    """``a`` rounded to bfloat16 as float32 (ml_dtypes: round to nearest even)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rel_err(a, b):
    """Relative error in the Frobenius norm, in float32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------- #
# Numerics against ml_dtypes
# --------------------------------------------------------------------------- #

quantize = jax.jit(jxs.float8.quantize, static_argnums=2)
dequantize = jax.jit(jxs.float8.dequantize)


def _log_uniform(rng, lo, hi, n):
    mags = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    return (mags * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def _converts_in_one_rounding() -> bool:
    """Whether this XLA converts float32 to float8 with a single rounding:
    2.8740535 is nearer 2.75 than 3.0 in e4m3fn, but rounds to 2.875 in float16
    and then (a tie, to even) to 3.0."""
    x = jnp.asarray(np.float32(2.8740535))
    return float(jax.jit(lambda v: v.astype(E4M3))(x)) == 2.75


@pytest.mark.unit
@pytest.mark.isa  # float8 conversions compiled per instruction set: AVX2 too
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3, 2.0**-10, 5.0e3])
def test_quantize_dequantize_is_the_ml_dtypes_round_trip(dtype, scale):
    fi = ml_dtypes.finfo(dtype)
    rng = np.random.default_rng(0)
    # Normal float8 values, subnormal ones and zero, after division by the scale.
    y = np.concatenate(
        [
            _log_uniform(rng, float(fi.tiny), float(fi.max), 2048),
            _log_uniform(rng, float(fi.smallest_subnormal) / 4, float(fi.tiny), 256),
            [0.0, -0.0, float(fi.max), -float(fi.max)],
        ]
    ).astype(np.float32)
    s = np.float32(scale)
    x = y * s
    q = quantize(jnp.asarray(x), jnp.float32(s), dtype)
    assert q.dtype == dtype and q.shape == x.shape
    ref = (x / s).astype(dtype)  # numpy divides in float32, ml_dtypes rounds
    bits = np.asarray(q).view(np.uint8)
    if not _converts_in_one_rounding() and not np.array_equal(bits, ref.view(np.uint8)):
        # XLA:CPU of jax 0.7.0 and 0.7.1 converts float32 -> float8 through
        # float16: double rounding, one float8 ulp off near a midpoint. The
        # quantisation is then exactly that conversion of x / scale (on 0.7.0;
        # 0.7.1 fuses the quantisation's cast into one rounding).
        ref = (x / s).astype(np.float16).astype(dtype)
    np.testing.assert_array_equal(bits, ref.view(np.uint8))
    back = dequantize(q, jnp.float32(s))
    assert back.dtype == F32
    np.testing.assert_array_equal(back, ref.astype(np.float32) * s)
    assert jxs.float8.dequantize(q, jnp.float32(s), jnp.bfloat16).dtype == BF16


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
def test_quantize_saturates_finite_values_beyond_the_range(dtype):
    fmax = FMAX[dtype]
    # Beyond the range by more than half an ulp (ml_dtypes would give NaN / inf),
    # far beyond, and the largest float32.
    big = np.array([1.2 * fmax, 1e4 * fmax, 3.0e38], np.float32)
    x = np.concatenate([big, -big])
    q = np.asarray(quantize(jnp.asarray(x), jnp.float32(1.0), dtype), np.float32)
    np.testing.assert_array_equal(q, [fmax] * 3 + [-fmax] * 3)
    # With a scale: x / scale is what saturates; the dequantised value is the
    # largest the scale can represent.
    q = quantize(jnp.array([3.0 * fmax, -3.0 * fmax]), jnp.float32(0.5), dtype)
    np.testing.assert_array_equal(
        dequantize(q, jnp.float32(0.5)), [0.5 * fmax, -0.5 * fmax]
    )


@pytest.mark.unit
def test_quantize_keeps_infinities_and_nans_non_finite():
    x = jnp.array([np.inf, -np.inf, np.nan, 1.0])
    q = np.asarray(quantize(x, jnp.float32(1.0), E4M3), np.float32)
    assert np.isnan(q[:3]).all() and q[3] == 1.0  # e4m3fn has no infinity
    q = np.asarray(quantize(x, jnp.float32(1.0), E5M2), np.float32)
    np.testing.assert_array_equal(q[:2], [np.inf, -np.inf])
    assert np.isnan(q[2]) and q[3] == 1.0


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
def test_quantize_saturates_when_the_quotient_overflows_float32(dtype):
    x = jnp.array([1e30, -1e30])
    q = np.asarray(quantize(x, jnp.float32(1e-10), dtype), np.float32)
    np.testing.assert_array_equal(q, [FMAX[dtype], -FMAX[dtype]])


scale_from_amax = jax.jit(jxs.float8.scale_from_amax, static_argnums=(1, 2))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
def test_scale_from_amax(dtype):
    prev = jnp.float32(0.25)
    for bad in (0.0, np.inf, -np.inf, np.nan):
        out = scale_from_amax(jnp.float32(bad), dtype, 0.0, prev)
        assert out.dtype == F32 and float(out) == 0.25, bad
    # Without a previous scale: 1.
    assert float(scale_from_amax(jnp.float32(0.0), dtype, 0.0)) == 1.0
    assert float(scale_from_amax(jnp.float32(np.nan), dtype, 0.0)) == 1.0
    # The amax lands on the dtype's largest value: exact for a power of two times
    # the max, and the float32 quotient otherwise (within one ulp: XLA divides
    # by a constant as a product with its reciprocal).
    for margin in (0.0, 1.0, -2.0, 3.0):
        got = scale_from_amax(jnp.float32(2 * FMAX[dtype]), dtype, margin)
        assert float(got) == 2.0 ** (1 + margin)
    amaxes = np.array([3.7, 1e-3, 123.456, 6.5e4], np.float32)
    for margin in (0.0, 1.0, -2.0, 3.0):
        got = scale_from_amax(jnp.asarray(amaxes), dtype, margin, prev)
        want = amaxes / np.float32(FMAX[dtype]) * np.float32(2.0**margin)
        np.testing.assert_array_max_ulp(np.asarray(got), want, maxulp=1)
    # Elementwise, with a previous scale per element.
    got = scale_from_amax(
        jnp.array([0.0, FMAX[dtype]]), dtype, 0.0, jnp.array([0.5, 0.25])
    )
    np.testing.assert_array_equal(got, [0.5, 1.0])


# --------------------------------------------------------------------------- #
# Recipes and argument checks
# --------------------------------------------------------------------------- #


@pytest.mark.unit
@pytest.mark.parametrize(
    "recipe", [jxs.float8.CurrentScaling, jxs.float8.DelayedScaling]
)
@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(fwd_dtype=jnp.float16), ValueError, "fwd_dtype"),
        (dict(fwd_dtype=jnp.float8_e4m3fnuz), ValueError, "fwd_dtype"),
        (dict(bwd_dtype="e5m2"), ValueError, "bwd_dtype"),
        (dict(bwd_dtype=jnp.bfloat16), ValueError, "bwd_dtype"),
        (dict(min_dim=-1), ValueError, "min_dim"),
        (dict(min_dim=True), TypeError, "min_dim"),
        (dict(min_dim=2.0), TypeError, "min_dim"),
        (dict(margin=float("inf")), ValueError, "margin"),
        (dict(margin="1"), TypeError, "margin"),
        (dict(margin=True), TypeError, "margin"),
    ],
)
def test_recipe_validation_names_the_argument(recipe, kwargs, error, name):
    with pytest.raises(error, match=f"`{name}`"):
        recipe(**kwargs)


@pytest.mark.unit
@pytest.mark.parametrize(
    "recipe", [jxs.float8.CurrentScaling, jxs.float8.DelayedScaling]
)
def test_a_recipe_whose_forward_product_is_e5m2_by_e5m2_is_refused(recipe):
    with pytest.raises(ValueError, match="`fwd_dtype`"):
        recipe(fwd_dtype=jnp.float8_e5m2)


@pytest.mark.unit
@pytest.mark.parametrize("history_len", [0, -1, True, 2.0, None])
def test_history_len_validation(history_len):
    with pytest.raises(ValueError, match="`history_len` must be an int >= 1"):
        jxs.float8.DelayedScaling(history_len)


@pytest.mark.unit
def test_recipes_accept_dtype_names_and_defaults():
    r = jxs.float8.CurrentScaling(fwd_dtype="float8_e4m3fn", bwd_dtype="float8_e5m2")
    assert (r.fwd_dtype, r.bwd_dtype, r.margin) == (E4M3, E5M2, 0.0)
    # The default choice is the cost model's (min_dim None), with no patterns.
    assert r.min_dim is jxs.float8.DelayedScaling().min_dim is None
    assert r.sites == jxs.float8.DelayedScaling().sites == ()
    assert r == jxs.float8.CurrentScaling() and hash(r) == hash(
        jxs.float8.CurrentScaling()
    )
    d = jxs.float8.DelayedScaling(16, min_dim=0, margin=1)
    assert (d.history_len, d.min_dim, d.margin) == (16, 0, 1.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "junk",
    [
        1,
        1.0,
        "bf16",
        "Delayed",
        "e4m3",
        jnp.float8_e4m3fn,
        {},
        jxs.float8.CurrentScaling,
    ],
)
def test_autocast_refuses_junk_float8(junk):
    with pytest.raises(TypeError, match="`float8` must be None, True or 'current'"):
        jxs.autocast(matmul, jnp.bfloat16, float8=junk)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, "float8_e5m2"])
def test_float8_compute_dtype_points_at_the_float8_argument(dtype):
    with pytest.raises(ValueError, match="float8=True"):
        jxs.autocast(matmul, dtype)


@pytest.mark.unit
def test_float8_rule_needs_a_recipe():
    with pytest.raises(ValueError, match="`rules`: the 'float8' rule needs a float8"):
        jxs.autocast(matmul, jnp.bfloat16, rules={"dot_general": "float8"})


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


NOTHING_IN_FLOAT8 = r"nothing runs in float8: all 1 matmul\(s\).*below.*`min_dim`"


@pytest.mark.unit
@pytest.mark.parametrize("d", [4096, 64])  # 0.3's default, and a small one
@pytest.mark.parametrize(
    "m, k, n, site",
    [
        (0, 0, 0, True),
        (-1, 0, 0, False),
        (0, -1, 0, False),
        (0, 0, -1, False),
    ],
)
def test_min_dim_applies_to_each_of_m_k_n(d, m, k, n, site):
    """An integer ``min_dim`` (in place of the cost model), plus m, k, n."""
    m, k, n = m + d, k + d, n + d
    float8 = jxs.float8.CurrentScaling(min_dim=d)
    f = jxs.autocast(matmul, jnp.bfloat16, float8=float8)
    if site:
        (eqn,) = dots(f, _sds(m, k), _sds(k, n))
        assert operand_dtypes(eqn) == (E4M3, E4M3)
        return
    with pytest.warns(jxs.AutocastWarning, match=NOTHING_IN_FLOAT8) as record:
        (eqn,) = dots(f, _sds(m, k), _sds(k, n))
    assert operand_dtypes(eqn) == (BF16, BF16)
    assert f"M={m}, K={k}, N={n}" in str(record[0].message)


@pytest.mark.unit
def test_float8_with_float32_compute_is_refused():
    # float32 means "autocast off": silently dropping float8 would be the worst
    # outcome, so the combination is refused when autocast is called.
    with pytest.raises(ValueError, match=r"`float8` needs a 16-bit compute `dtype`"):
        jxs.autocast(matmul, jnp.float32, float8=jxs.float8.CurrentScaling(min_dim=0))
    with pytest.raises(ValueError, match=r"`float8` needs a 16-bit compute `dtype`"):
        jxs.autocast(matmul, "fp32", float8="delayed")


@pytest.mark.unit
def test_init_refuses_functions_without_delayed_sites():
    w, x = _sds(32, 32), _sds(16, 32)
    current = jxs.autocast(
        matmul, jnp.bfloat16, float8=jxs.float8.CurrentScaling(min_dim=0)
    )
    for f in (matmul, current, jxs.autocast(matmul, jnp.bfloat16)):
        with pytest.raises(ValueError, match="runs no `jxs.autocast"):
            jxs.float8.init(f, x, w)
    small = jxs.autocast(
        matmul, jnp.bfloat16, float8=jxs.float8.DelayedScaling(4, min_dim=64)
    )
    with pytest.raises(ValueError, match=r"no float8 site.*`min_dim` \(64\)"):
        jxs.float8.init(small, x, w)


@pytest.mark.unit
def test_delayed_scaling_without_state_points_at_value_and_grad():
    f = jxs.autocast(matmul, jnp.bfloat16, float8="delayed")
    with pytest.raises(ValueError, match=r"jxs\.float8\.value_and_grad\(f, state\)"):
        jax.eval_shape(f, _sds(16, 32), _sds(32, 16))


@pytest.mark.unit
def test_state_and_recipe_mismatches_are_refused():
    r4, r8 = (jxs.float8.DelayedScaling(h, min_dim=8) for h in (4, 8))

    def loss(recipe):
        def fn(w, x):
            return jnp.sum(jxs.autocast(matmul, jnp.bfloat16, float8=recipe)(x, w))

        return fn

    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    state = jxs.float8.init(loss(r4), w, x)
    with pytest.raises(ValueError, match="is not the one the state in scope"):
        jxs.float8.value_and_grad(loss(r8), state)(w, x)
    with pytest.raises(TypeError, match="`state` must be a `jxs.float8.Float8State`"):
        jxs.float8.value_and_grad(loss(r4), {"history": ()})
    with pytest.raises(TypeError, match="`has_aux` must be a bool"):
        jxs.float8.value_and_grad(loss(r4), state, has_aux=1)


# --------------------------------------------------------------------------- #
# Sites: which dots become float8, and in which form
# --------------------------------------------------------------------------- #

CURRENT = jxs.float8.CurrentScaling(min_dim=16)


def _normal(seed, shape, scale=1.0):
    """Standard normal float32 data (numpy's generator: jax.random compiles a
    program per shape)."""
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(x, jnp.float32)


@pytest.mark.core
def test_dense_layer_is_a_float8_site_under_jit():
    x, w = _normal(0, (2, 8, 32)), _normal(1, (32, 24), 0.2)
    f = jax.jit(jxs.autocast(matmul, jnp.bfloat16, float8=CURRENT, cast_outputs=False))
    y = f(x, w)
    assert y.dtype == BF16 and y.shape == (2, 8, 24)
    # Close to float32 (3 mantissa bits per operand: a few percent).
    assert rel_err(y, x @ w) < 0.1
    eqns = list(all_eqns(jax.make_jaxpr(f)(x, w)))
    (call,) = [e for e in eqns if e.primitive.name == "custom_vjp_call"]
    inner = [e for e in all_eqns(call.params["call_jaxpr"])]
    (dot,) = [e for e in inner if e.primitive.name == "dot_general"]
    assert operand_dtypes(dot) == (E4M3, E4M3)
    assert [v.aval.shape for v in dot.invars] == [(16, 32), (32, 24)]
    assert np.dtype(dot.params["preferred_element_type"]) == F32
    # No 16-bit product anywhere: the float8 one is the only dot.
    assert len([e for e in eqns if e.primitive.name == "dot_general"]) == 1


def _mlp_problem():
    D, H = 64, 128
    params = {
        "w1": _normal(0, (D, H), D**-0.5),
        "b1": jnp.zeros((1, 1, H)),
        "w2": _normal(1, (H, D), H**-0.5),
    }
    return params, _normal(2, (4, 16, D)), _normal(3, (4, 16, D))


def _mlp(params, x):
    return jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"]


def _mlp_loss(params, x, t):
    return jnp.mean((_mlp(params, x) - t) ** 2)


@pytest.mark.core
def test_float32_mlp_in_float8_is_close_to_float32_and_not_bf16():
    params, x, t = _mlp_problem()
    recipe = jxs.float8.CurrentScaling(min_dim=32)
    ref_out = jax.jit(_mlp)(params, x)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_mlp_loss))(params, x, t)

    def run(float8):
        out = jax.jit(
            jxs.autocast(_mlp, jnp.bfloat16, float8=float8, cast_outputs=False)
        )(params, x)
        loss, grads = jax.jit(
            jax.value_and_grad(jxs.autocast(_mlp_loss, jnp.bfloat16, float8=float8))
        )(params, x, t)
        return out, loss, grads

    out8, loss8, grads8 = run(recipe)
    out16, loss16, grads16 = run(None)
    assert out8.dtype == BF16
    assert {g.dtype for g in jax.tree.leaves(grads8)} == {F32}
    # e4m3 keeps 3 mantissa bits: each operand is off by up to 2**-4 relative
    # (about 3.6% rms), so a product of two is off by about 5% rms; the
    # gradients go through e5m2 (2 mantissa bits, 2**-3, about 7% rms).
    # bfloat16 alone is ten times closer.
    assert rel_err(out8, ref_out) < 0.1
    np.testing.assert_allclose(loss8, ref_loss, rtol=0.02)
    for name in ref_grads:
        assert rel_err(grads8[name], ref_grads[name]) < 0.15, name
    # float8 really ran: its error is well above bfloat16's, and the results
    # differ from the bfloat16 autocast's.
    assert rel_err(out8, ref_out) > 3 * rel_err(out16, ref_out)
    assert rel_err(grads8["w1"], ref_grads["w1"]) > 3 * rel_err(
        grads16["w1"], ref_grads["w1"]
    )
    assert not np.array_equal(np.asarray(out8), np.asarray(out16))
    for name in ("w1", "w2"):
        assert not np.array_equal(grads8[name], grads16[name]), name


def _scores(q, k):
    return jnp.einsum("bqd,bkd->bqk", q, k)


@pytest.mark.core
@pytest.mark.parametrize(
    "fun, shapes, warns",
    [
        (matmul, [(8, 32), (32, 32)], True),  # M below min_dim
        (matmul, [(32, 8), (8, 32)], True),  # K below
        (matmul, [(2, 16, 32), (32, 8)], True),  # N below
        (_scores, [(2, 32, 32), (2, 32, 32)], False),  # batched: attention scores
        (
            lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k),
            [(2, 2, 32, 32)] * 2,
            False,
        ),
    ],
    ids=["small-m", "small-k", "small-n", "scores", "heads"],
)
def test_small_and_batched_dots_stay_16_bit(fun, shapes, warns):
    """16-bit products; a warning when float8 was asked for and every matmul
    is too small (not for batched products, which are never float8)."""
    args = [_normal(i, s) for i, s in enumerate(shapes)]

    def loss(*args):
        y = fun(*args)
        return jnp.sum(y * y)

    f = jax.value_and_grad(
        # (bf16 gradient products: the default float32 weight-gradient terms
        # are tests/test_autocast_gradients.py's)
        jxs.autocast(loss, jnp.bfloat16, float8=CURRENT, gradient_dtype=jnp.bfloat16),
        argnums=(0, 1),
    )
    with (
        pytest.warns(jxs.AutocastWarning, match=NOTHING_IN_FLOAT8)
        if warns
        else contextlib.nullcontext()
    ):
        assert not all_dtypes(f, *args) & F8
        found = dots(f, *args)
        value, _ = jax.jit(f)(*args)
    assert len(found) == 3  # forward and both backward products
    assert all(operand_dtypes(e) == (BF16, BF16) for e in found)
    np.testing.assert_allclose(value, loss(*args), rtol=0.02)


@pytest.mark.core
def test_custom_derivatives_written_by_the_user_stay_16_bit():
    @jax.custom_vjp
    def mm(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        return g @ w.T, x.T @ g

    mm.defvjp(fwd, bwd)
    x, w = _normal(0, (32, 32)), _normal(1, (32, 32))
    f = jax.grad(
        jxs.autocast(lambda x, w: jnp.sum(mm(x, w)), jnp.bfloat16, float8=CURRENT),
        argnums=(0, 1),
    )
    assert not all_dtypes(f, x, w) & F8
    assert {operand_dtypes(e) for e in dots(f, x, w)} == {(BF16, BF16)}


@pytest.mark.unit
def test_a_gemm_report_without_float8_dots_is_not_ok_and_says_why():
    empty = jxs.float8.Float8GemmReport("cpu", 0, 0, None, ())
    assert not empty.ok
    assert "NOT ok" in str(empty) and "no float8 matmul at all" in str(empty)
    assert "`min_dim`" in str(empty)
    assert jxs.float8.Float8GemmReport("cpu", 3, 3, None, ()).ok
    assert not jxs.float8.Float8GemmReport("gpu", 3, 3, 0, ()).ok  # fell back
    assert not jxs.float8.Float8GemmReport("cpu", 3, 2, None, ("x",)).ok


@pytest.mark.core
def test_gemm_report_of_a_step_with_float8_below_min_dim_is_not_ok():
    # The cost model's choice on a small model: no site, and the report says so
    # instead of being vacuously ok.
    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ params["w1"]) @ params["w2"])

    params = {"w1": _normal(0, (64, 64)), "w2": _normal(1, (64, 32))}
    x = _normal(2, (32, 64))
    chosen = jxs.float8.CurrentScaling(device_kind="NVIDIA H200")
    step = jax.jit(jax.value_and_grad(jxs.autocast(loss, jnp.bfloat16, float8=chosen)))
    with pytest.warns(jxs.AutocastWarning, match="nothing runs in float8"):
        report = jxs.float8.gemm_report(step, params, x)
    assert report.float8_dots == 0 and not report.ok
    assert "`min_dim`" in str(report)
    recipe = jxs.float8.CurrentScaling(min_dim=32)
    step = jax.jit(jax.value_and_grad(jxs.autocast(loss, jnp.bfloat16, float8=recipe)))
    report = jxs.float8.gemm_report(step, params, x)
    # Two sites, three products each, but for the first one's input gradient
    # (x is not differentiated).
    assert (report.float8_dots, report.rewritable) == (5, 5) and report.ok, report
    assert "no float8 matmul" not in str(report)


# Trimmed from XLA:GPU's module for an H200 (jax 0.10.2, deviceless): a Triton
# GEMM fusion of two float8 operands, one of a float8 parameter converted to
# bfloat16 inside it (not a float8 GEMM), one bfloat16 fusion, a cuBLASLt call.
_GPU_MODULE = """HloModule m

%f8_computation (p0: f8e4m3fn[32,64], p1: f8e5m2[32,64]) -> f32[64,64] {
  %p0 = f8e4m3fn[32,64]{1,0} parameter(0)
  %p1 = f8e5m2[32,64]{1,0} parameter(1)
  ROOT %dot.3 = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%widened_computation (q0: f8e4m3fn[32,64], q1: bf16[64,32]) -> bf16[32,32] {
  %q0 = f8e4m3fn[32,64]{1,0} parameter(0)
  %c = bf16[32,64]{1,0} convert(%q0)
  %q1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.4 = bf16[32,32]{1,0} dot(%c, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%bf16_computation (r0: bf16[32,64], r1: bf16[64,32]) -> bf16[32,32] {
  %r0 = bf16[32,64]{1,0} parameter(0)
  %r1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.5 = bf16[32,32]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[32,64], b: f8e5m2[32,64], x: bf16[32,64], w: bf16[64,32]) -> f32[64,64] {
  %a = f8e4m3fn[32,64]{1,0} parameter(0)
  %b = f8e5m2[32,64]{1,0} parameter(1)
  %x = bf16[32,64]{1,0} parameter(2)
  %w = bf16[64,32]{1,0} parameter(3)
  %g1 = f32[64,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%f8_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %g2 = bf16[32,32]{1,0} fusion(%a, %w), kind=kCustom, calls=%widened_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %g3 = bf16[32,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%bf16_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %c1 = (f32[64,64]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  ROOT %r = f32[64,64]{1,0} add(%g1, %g1)
}
"""  # noqa: E501


@pytest.mark.unit
def test_compiled_float8_gemms_count_cublas_calls_and_triton_fusions():
    """XLA:GPU gives small float8 products to Triton, not cuBLASLt (an H200's
    gemm_report of a 32x64 model counted 0 GEMMs before): both are counted,
    a fusion whose dot widens its float8 operand first is not."""
    from jaxscale.float8._check import float8_gemms, summarize

    assert float8_gemms(_GPU_MODULE) == 2
    lowered = (
        "%0 = stablehlo.dot_general %a, %b, contracting_dims = [0] x [0] : "
        "(tensor<32x64xf8E4M3FN>, tensor<32x64xf8E5M2>) -> tensor<64x64xf32>"
    )
    report = summarize(lowered, _GPU_MODULE, "gpu")
    assert (report.float8_dots, report.rewritable, report.float8_gemms) == (1, 1, 2)
    assert report.ok and "2 float8 GEMM(s) compiled" in str(report)
    assert not summarize(lowered, "HloModule m", "gpu").ok


@pytest.mark.core
def test_lowered_stablehlo_has_three_float8_gemms_in_gemm_rewriter_form():
    M, K, N = 16, 32, 24
    x, w = _normal(0, (2, 8, K)), _normal(1, (K, N))

    def loss(x, w):
        y = jxs.autocast(matmul, jnp.bfloat16, float8=CURRENT)(x, w)
        return jnp.sum(y * y)

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    gemms = {}
    for dot in _hlo.stablehlo_dots(text):
        assert dot.batching is None, dot
        (lt, lhs), (rt, rhs) = dot.operands
        ot, out = dot.result
        assert ot == "f32", dot  # float8 products accumulate in float32
        (cl, cr) = dot.contracting
        assert len(cl) == len(cr) == 1, dot  # exactly one contracting dimension each
        gemms[(lt, rt)] = (lhs, rhs, out, (cl[0], cr[0]))
    assert gemms == {
        # forward: [M, K] x [K, N]
        ("f8E4M3FN", "f8E4M3FN"): ((M, K), (K, N), (M, N), (1, 0)),
        # dx: g [M, N] (e5m2) x w [K, N]^T
        ("f8E5M2", "f8E4M3FN"): ((M, N), (K, N), (M, K), (1, 1)),
        # dw: x [M, K]^T x g [M, N]
        ("f8E4M3FN", "f8E5M2"): ((M, K), (M, N), (K, N), (0, 0)),
    }


# --------------------------------------------------------------------------- #
# Delayed scaling: the state
# --------------------------------------------------------------------------- #


def _dense_loss(recipe):
    """``sum(y * t)`` with ``y = x @ w`` a float8 site, ``y`` as aux: the
    gradient reaching the site is ``t`` in bfloat16."""

    def loss(w, x, t):
        y = jxs.autocast(matmul, jnp.bfloat16, float8=recipe, cast_outputs=False)(x, w)
        return jnp.sum(y.astype(jnp.float32) * t), y

    return loss


def _amaxes(x, w, t):
    """Activation, weight and gradient amaxes of :func:`_dense_loss`, in numpy."""
    return np.array(
        [np.abs(x).max(), np.abs(w).max(), np.abs(bf16_of(t)).max()], np.float32
    )


def _want_scale(history, recipe):
    fmax = np.array([FMAX[recipe.fwd_dtype]] * 2 + [FMAX[recipe.bwd_dtype]])
    peak = np.asarray(history).max(axis=1)
    return peak / fmax.astype(np.float32) * np.float32(2.0**recipe.margin)


def assert_scale(got, history, recipe):
    """``got`` is the scale of ``history``'s max, within one float32 ulp (see
    test_scale_from_amax)."""
    np.testing.assert_array_max_ulp(
        np.asarray(got), _want_scale(history, recipe), maxulp=1
    )


def _step(loss):
    @jax.jit
    def step(w, state, *args):
        return jxs.float8.value_and_grad(loss, state, has_aux=True)(w, *args)

    return step


@pytest.mark.core
@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_history_and_scales_after_1_2_and_h_plus_1_steps(margin):
    H = 3
    recipe = jxs.float8.DelayedScaling(H, min_dim=16, margin=margin)
    loss = _dense_loss(recipe)
    w = _normal(0, (32, 24), 0.3)
    state = jxs.float8.init(loss, w, _sds(2, 8, 32), _sds(2, 8, 24))
    assert state.sites == ("(top level): dot_general contracting 32",)
    assert state.recipe == recipe
    np.testing.assert_array_equal(state.history[0], np.zeros((3, H)))
    np.testing.assert_array_equal(state.scale[0], np.ones(3))
    step = _step(loss)
    seen = []
    for i in range(H + 1):
        x = _normal(10 + i, (2, 8, 32), 1.0 + i)
        t = _normal(20 + i, (2, 8, 24), 0.5 + 2 * i)
        (value, y), grads, state = step(w, state, x, t)
        assert grads.shape == w.shape and y.dtype == BF16
        seen.insert(0, _amaxes(x, w, t))
        want = np.zeros((3, H), np.float32)
        for j, a in enumerate(seen[:H]):  # newest first; the oldest dropped
            want[:, j] = a
        np.testing.assert_array_equal(state.history[0], want, err_msg=f"step {i}")
        assert_scale(state.scale[0], want, recipe)
        assert state.history[0].dtype == state.scale[0].dtype == F32
        w = w - 1e-3 * grads  # the weight's amax changes too
    assert step._cache_size() == 1  # the state's types never change


@pytest.mark.core
def test_step_two_quantises_with_step_one_scales():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _dense_loss(recipe)
    w = jnp.eye(32, 16)  # y = x[..., :16], through float8
    x1 = _normal(0, (2, 8, 32))
    t = jnp.ones((2, 8, 16))
    a1 = float(jnp.max(jnp.abs(x1)))
    state = jxs.float8.init(loss, w, x1, t)
    step = _step(loss)
    (_, y1), _, state = step(w, state, x1, t)
    # Step 1 has no history: scaled by its own amax (current scaling).
    np.testing.assert_allclose(y1, x1[..., :16], rtol=2**-3)
    np.testing.assert_allclose(state.scale[0][0], a1 / 448, rtol=1e-6)
    # Step 2's input is 10 times larger: quantised with step 1's scale, it
    # saturates at 448 * scale = a1 (current scaling would not).
    x2 = 10 * x1
    (_, y2), _, state = step(w, state, x2, t)
    y2 = np.asarray(y2, np.float32)
    assert np.abs(y2).max() == bf16_of(a1)  # 448 * (a1 / 448) * 448 * (1 / 448)
    np.testing.assert_allclose(
        y2, np.clip(x2[..., :16], -a1, a1), rtol=2**-3, atol=a1 * 2**-6
    )
    # The history records the tensor's amax, not the saturated one.
    np.testing.assert_allclose(state.history[0][0, :2], [10 * a1, a1], rtol=1e-6)
    np.testing.assert_allclose(state.scale[0][0], 10 * a1 / 448, rtol=1e-6)
    current = jxs.autocast(matmul, jnp.bfloat16, float8=CURRENT, cast_outputs=False)
    assert float(jnp.max(jnp.abs(current(x2, w).astype(jnp.float32)))) > 5 * a1


@pytest.mark.core
def test_an_all_zero_tensor_keeps_the_scale():
    recipe = jxs.float8.DelayedScaling(1, min_dim=16)
    loss = _dense_loss(recipe)
    w, x, t = _normal(0, (32, 16)), _normal(1, (2, 8, 32)), _normal(2, (2, 8, 16))
    state = jxs.float8.init(loss, w, x, t)
    step = _step(loss)
    _, _, state = step(w, state, x, t)
    before = np.asarray(state.scale[0])
    assert_scale(before, _amaxes(x, w, t)[:, None], recipe)
    (_, y), grads, state = step(w, state, jnp.zeros_like(x), t)
    np.testing.assert_array_equal(state.history[0][:, 0], _amaxes(0 * x, w, t))
    np.testing.assert_array_equal(state.scale[0], before)  # every row kept
    assert not np.asarray(y).any() and not np.asarray(grads).any()
    assert np.isfinite(np.asarray(state.scale[0])).all()


@pytest.mark.core
def test_a_site_in_scan_records_the_max_over_iterations():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)

    def loss(w, xs, ts):
        def body(total, xt):
            x, t = xt
            y = x @ w
            return total + jnp.sum(y.astype(jnp.float32) * t), None

        return lax.scan(body, jnp.float32(0), (xs, ts))[0]

    loss = jxs.autocast(loss, jnp.bfloat16, float8=recipe)
    w = _normal(0, (32, 16))
    # The largest input and gradient are in the middle iteration, and not the
    # same one (a sum, the first or the last would be wrong).
    xs = _normal(1, (3, 16, 32)) * jnp.array([1.0, 4.0, 2.0])[:, None, None]
    ts = _normal(2, (3, 16, 16)) * jnp.array([1.0, 0.5, 3.0])[:, None, None]
    state = jxs.float8.init(loss, w, xs, ts)
    assert len(state.sites) == 1
    _, _, state = jax.jit(
        lambda w, s, xs, ts: jxs.float8.value_and_grad(loss, s)(w, xs, ts)
    )(w, state, xs, ts)
    want = _amaxes(xs, w, ts)
    assert want[0] == np.abs(xs[1]).max() and want[2] == np.abs(bf16_of(ts[2])).max()
    np.testing.assert_array_equal(state.history[0][:, 0], want)
    np.testing.assert_array_equal(state.history[0][:, 1:], 0)
    assert_scale(state.scale[0], want[:, None], recipe)


@pytest.mark.core
def test_a_site_in_an_untaken_cond_branch_keeps_its_state():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)

    def model(w, x, pred):
        h = x @ w["a"]
        return lax.cond(pred, lambda h: h @ w["b"], lambda h: h[..., :16], h)

    def loss(w, x, pred):
        return jnp.sum(jxs.autocast(model, jnp.bfloat16, float8=recipe)(w, x, pred))

    w = {"a": _normal(0, (32, 32), 0.2), "b": _normal(1, (32, 16), 0.2)}
    x = _normal(2, (16, 32))
    state = jxs.float8.init(loss, w, x, True)
    assert len(state.sites) == 2
    step = jax.jit(lambda w, s, x, p: jxs.float8.value_and_grad(loss, s)(w, x, p))

    _, _, s1 = step(w, state, x, True)  # both sites run
    assert all((np.asarray(h)[:, 0] > 0).all() for h in s1.history)
    _, grads, s2 = step(w, s1, 2 * x, False)  # the branch's site does not
    assert not np.asarray(grads["b"]).any()
    np.testing.assert_array_equal(s2.history[0][:, 1], s1.history[0][:, 0])
    assert s2.history[0][0, 0] == 2 * s1.history[0][0, 0]
    np.testing.assert_array_equal(s2.history[1], s1.history[1])  # not rolled
    np.testing.assert_array_equal(s2.scale[1], s1.scale[1])
    _, _, s3 = step(w, s2, x, True)  # runs again: rolled from step 1's entry
    np.testing.assert_array_equal(s3.history[1][:, 1], s1.history[1][:, 0])
    np.testing.assert_array_equal(s3.history[1][:, 2], 0)


@pytest.mark.core
def test_a_changed_function_is_refused_by_name():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)

    def loss(layers):
        def fn(w, x):
            h = x
            for _ in range(layers):
                h = h @ w
            return jnp.sum(h)

        return jxs.autocast(fn, jnp.bfloat16, float8=recipe)

    def vag(layers, state, w, x):  # traced only: the errors come at trace time
        return jax.eval_shape(jxs.float8.value_and_grad(loss(layers), state), w, x)

    w, x = _sds(32, 32), _sds(16, 32)
    state = jxs.float8.init(loss(1), w, x)
    site = r"'\(top level\): dot_general contracting 32'"
    with pytest.raises(ValueError, match=rf"structure changed.*site 1: .*{site}"):
        vag(2, state, w, x)
    with pytest.raises(ValueError, match="structure changed"):
        jax.eval_shape(jxs.float8.apply(loss(2), state), w, x)
    with pytest.raises(ValueError, match="contracting 48"):  # another width
        vag(1, state, _sds(48, 48), _sds(16, 48))
    two = jxs.float8.init(loss(2), w, x)
    with pytest.raises(ValueError, match=r"structure changed.*\(no more sites\)"):
        vag(1, two, w, x)
    # Another batch size is the same function.
    _, _, new = vag(1, state, w, _sds(64, 32))
    assert jax.tree.structure(new) == jax.tree.structure(state)


def _scanned(recipe, nested=False):
    """A stack of layers under ``lax.scan`` over stacked weights ``ws`` (a
    ``[L, 32, 32]`` array); ``nested``: ``ws`` is ``[L1, L2, 32, 32]``, scanned
    twice."""

    def layer(h, w):
        return jnp.tanh(h @ w), None

    def fn(ws, x):
        if nested:
            h = lax.scan(lambda h, w2: lax.scan(layer, h, w2), x, ws)[0]
        else:
            h = lax.scan(layer, x, ws)[0]
        return jnp.sum(h)

    return jxs.autocast(fn, jnp.bfloat16, float8=recipe)


@pytest.mark.core
def test_a_scan_of_another_length_is_refused_by_name_under_jit():
    # One history serves every iteration of a scanned site: a state made for
    # three scanned layers holds the amaxes of three other layers than a
    # two-layer model's. The scan lengths are part of the site.
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _scanned(recipe)
    ws3, ws2, x = (
        _normal(0, (3, 32, 32), 0.2),
        _normal(1, (2, 32, 32), 0.2),
        _normal(2, (16, 32)),
    )
    three = jxs.float8.init(loss, ws3, x)
    assert three.sites == (
        "(top level): dot_general contracting 32, in a scan of length 3",
    )
    step = jax.jit(lambda ws, s, x: jxs.float8.value_and_grad(loss, s)(ws, x))
    want = (
        r"site 0: state '.*length 3', function '.*length 2'\).*`scan` of another length"
    )
    with pytest.raises(ValueError, match=want):
        step(ws2, three, x)
    with pytest.raises(ValueError, match=want):
        jax.jit(jxs.float8.apply(loss, three))(ws2, x)
    # The state made for two layers runs; another batch size is the same site.
    two = jxs.float8.init(loss, ws2, x)
    _, _, two = step(ws2, two, _normal(3, (48, 32)))
    assert (np.asarray(two.history[0])[:, 0] > 0).all()
    _, _, three = step(ws3, three, x)
    # Nested scans: both lengths, outermost first.
    nested = _scanned(recipe, nested=True)
    s23 = jxs.float8.init(nested, _sds(2, 3, 32, 32), _sds(16, 32))
    assert s23.sites[0].endswith(", in scans of lengths 2, 3 (outermost first)")
    with pytest.raises(ValueError, match=r"lengths 2, 3 .*lengths 3, 2 "):
        jax.eval_shape(
            jxs.float8.value_and_grad(nested, s23), _sds(3, 2, 32, 32), _sds(16, 32)
        )


@pytest.mark.core
def test_a_scanned_state_from_before_scan_lengths_restores_or_fails_loudly():
    # States made before the scan lengths were part of a site name its scanned
    # sites without them. A checkpoint holds only the arrays, so it restores
    # into a target from `init` and trains on; the old object itself is refused
    # with a message that says so.
    serialization = pytest.importorskip("flax.serialization")
    import dataclasses

    import jaxscale.flax as jxf

    jxf.register_flax_serialization()
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _scanned(recipe)
    ws, x = _normal(0, (3, 32, 32), 0.2), _normal(1, (16, 32))
    step = jax.jit(lambda ws, s, x: jxs.float8.value_and_grad(loss, s)(ws, x))
    _, _, trained = step(ws, jxs.float8.init(loss, ws, x), x)
    old = dataclasses.replace(
        trained, sites=tuple(s.split(", in a scan")[0] for s in trained.sites)
    )
    assert old.sites == ("(top level): dot_general contracting 32",)
    with pytest.raises(
        ValueError, match=r"records no scan length.*earlier jaxscale.*restore"
    ):
        step(ws, old, x)
    restored = serialization.from_bytes(
        jxs.float8.init(loss, ws, x), serialization.to_bytes(old)
    )
    assert restored.sites == trained.sites
    _, _, after = step(ws, restored, x)
    _, _, want = step(ws, trained, x)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.core
def test_apply_uses_the_state_and_matches_the_training_forward():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _dense_loss(recipe)
    w, x, t = jnp.eye(32, 16), _normal(1, (2, 8, 32)), _normal(2, (2, 8, 16))
    state = jxs.float8.init(loss, w, x, t)
    step = _step(loss)
    _, _, state = step(w, state, x, t)
    kept = jax.tree.map(np.asarray, state)
    a1 = float(kept.history[0][0, 0])
    x2 = 3 * x  # saturates under step 1's scales
    (value, y), _, _ = step(w, state, x2, t)
    (value_a, y_a) = jax.jit(jxs.float8.apply(loss, state))(w, x2, t)
    np.testing.assert_allclose(
        np.asarray(y_a, np.float32), np.asarray(y, np.float32), rtol=2**-7
    )
    np.testing.assert_allclose(value_a, value, rtol=1e-3)
    assert float(jnp.max(jnp.abs(y_a.astype(jnp.float32)))) == bf16_of(a1)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.core
def test_value_and_grad_without_aux_and_with_aux():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _dense_loss(recipe)
    w, x, t = _normal(0, (32, 16)), _normal(1, (2, 8, 32)), _normal(2, (2, 8, 16))
    state = jxs.float8.init(loss, w, x, t)
    (value, y), grads, s_aux = _step(loss)(w, state, x, t)

    @jax.jit
    def plain(w, state, x, t):
        return jxs.float8.value_and_grad(lambda *a: loss(*a)[0], state)(w, x, t)

    value2, grads2, s_plain = plain(w, state, x, t)
    assert y.shape == (2, 8, 16) and value.shape == () == value2.shape
    # Two programs compiled apart: on a GPU their bfloat16 outputs (spacing
    # 2**-8) and cuBLASLt's fast float8 accumulation differ by up to ~0.4%.
    np.testing.assert_allclose(value2, value, rtol=1e-2)
    np.testing.assert_allclose(grads2, grads, rtol=1e-2, atol=1e-3)
    for a, b in zip(jax.tree.leaves(s_aux), jax.tree.leaves(s_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2)
    with pytest.raises(TypeError, match="scalar"):  # aux without has_aux
        jax.eval_shape(jxs.float8.value_and_grad(loss, state), w, x, t)


# --------------------------------------------------------------------------- #
# Loss scaling and non-finite steps (float16 compute)
# --------------------------------------------------------------------------- #


def _f16_problem():
    params = {"w1": _normal(0, (32, 64), 1 / 6), "w2": _normal(1, (64, 32), 1 / 8)}
    return params, _normal(2, (2, 16, 32)), _normal(3, (2, 16, 32))


def _f16_loss(recipe):
    def model(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    def loss(p, x, t):
        y = jxs.autocast(model, jnp.float16, float8=recipe)(p, x)
        return jnp.mean((y - t) ** 2)

    return loss


@pytest.mark.core
def test_loss_scale_gives_scaled_gradients_and_scaled_gradient_amaxes():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _f16_loss(recipe)
    params, x, t = _f16_problem()
    state = jxs.float8.init(loss, params, x, t)
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    opt_state = tx.init(params)
    S = float(opt_state.loss_scale.loss_scale)
    assert S == 2.0**16

    @jax.jit
    def both(params, state, opt_state, x, t):
        plain = jxs.float8.value_and_grad(loss, state)(params, x, t)
        scaled = jxs.float8.value_and_grad(loss, state, loss_scale=opt_state)(
            params, x, t
        )
        return plain, scaled

    (v1, g1, s1), (v2, g2, s2) = both(params, state, opt_state, x, t)
    np.testing.assert_allclose(v2, v1, rtol=1e-6)  # the unscaled loss
    for name in g1:
        want = S * np.asarray(g1[name])
        assert np.isfinite(np.asarray(g2[name])).all()
        # A power-of-two scale is exact through the float8 gradient (its scale
        # follows the amax); float16 elsewhere may round differently.
        np.testing.assert_allclose(g2[name], want, atol=1e-3 * np.abs(want).max())
    for h1, h2 in zip(s1.history, s2.history, strict=True):
        np.testing.assert_allclose(h2[:2, 0], h1[:2, 0], rtol=1e-3)
        np.testing.assert_allclose(h2[2, 0], S * h1[2, 0], rtol=1e-3)
    # The whole step: dynamic_scaling unscales, the step is taken.
    updates, new_opt = jax.jit(tx.update)(g2, opt_state, params)
    assert int(new_opt.skipped_steps) == 0
    assert all(np.asarray(u).any() for u in jax.tree.leaves(updates))


@pytest.mark.core
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_a_non_finite_step_is_skipped_not_saturated(delayed, bad):
    recipe = (
        jxs.float8.DelayedScaling(4, min_dim=16)
        if delayed
        else jxs.float8.CurrentScaling(min_dim=16)
    )
    loss = _f16_loss(recipe)
    params, x, t = _f16_problem()
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    opt_state = tx.init(params)
    x_bad = x.at[0, 3, 5].set(bad)  # e.g. a float16 overflow upstream
    state = jxs.float8.init(loss, params, x, t) if delayed else None

    @jax.jit
    def step(params, opt_state, state, x, t):
        if delayed:
            value, grads, state = jxs.float8.value_and_grad(
                loss, state, loss_scale=opt_state
            )(params, x, t)
        else:
            value, grads = jxs.value_and_grad(loss, opt_state)(params, x, t)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value, grads

    if delayed:  # from a state that has seen a finite step
        params, opt_state, state, _, _ = step(params, opt_state, state, x, t)
    new_params, new_opt, _, value, grads = step(params, opt_state, state, x_bad, t)
    assert not all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert int(new_opt.skipped_steps) == 1
    for name in params:
        np.testing.assert_array_equal(new_params[name], params[name])
    assert float(new_opt.loss_scale.loss_scale) < float(opt_state.loss_scale.loss_scale)


@pytest.mark.core
def test_after_a_non_finite_first_step_a_site_is_still_fresh():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    loss = _dense_loss(recipe)
    w, t = jnp.eye(32, 16), jnp.ones((2, 8, 16))
    x = _normal(1, (2, 8, 32))
    state = jxs.float8.init(loss, w, x, t)
    _, _, state = _step(loss)(w, state, x.at[0, 0, 0].set(jnp.inf), t)
    big = 1000 * x  # amax far above 448: fine with a fresh (current) scale
    _, y = jax.jit(jxs.float8.apply(loss, state))(w, big, t)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), big[..., :16], rtol=2**-3, atol=2**-3
    )


# --------------------------------------------------------------------------- #
# The state as a pytree: donation, flatten, checkpoints
# --------------------------------------------------------------------------- #


def _train_setup():
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    params, x, t = _mlp_problem()

    def loss(p, x, t):
        return jxs.autocast(_mlp_loss, jnp.bfloat16, float8=recipe)(p, x, t)

    tx = relaxed(optax.adam(1e-2))

    def step(params, opt_state, state, x, t):
        value, grads, state = jxs.float8.value_and_grad(loss, state)(params, x, t)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    return loss, tx, step, params, x, t


@pytest.mark.core
def test_the_state_survives_a_donated_jitted_step():
    loss, tx, step, params, x, t = _train_setup()
    donated = jax.jit(step, donate_argnums=(0, 1, 2))
    plain = jax.jit(step)

    def fresh():
        p = jax.tree.map(jnp.copy, params)
        return p, tx.init(p), jxs.float8.init(loss, p, x, t)

    a, b = fresh(), fresh()
    for _ in range(2):
        old_state = a[2]
        *a, va = donated(*a, x, t)
        *b, vb = plain(*b, x, t)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old_state))
        np.testing.assert_allclose(va, vb, rtol=1e-5)
    assert donated._cache_size() == 1
    for got, want in zip(jax.tree.leaves(a[2]), jax.tree.leaves(b[2]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert all(np.asarray(h)[:, :2].all() for h in a[2].history)
    # init hands out fresh arrays every time (none deleted by the donation).
    again = jxs.float8.init(loss, params, x, t)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(again))
    jax.block_until_ready(donated(*fresh(), x, t))


@pytest.fixture(scope="module")
def trained():
    """A state after two training steps, and what made it."""
    loss, tx, step, params, x, t = _train_setup()
    state = jxs.float8.init(loss, params, x, t)
    opt_state = tx.init(params)
    step = jax.jit(step)
    for _ in range(2):
        params, opt_state, state, _ = step(params, opt_state, state, x, t)
    return loss, params, x, t, state


def _assert_same_state(got, want):
    assert type(got) is jxs.float8.Float8State
    assert got.recipe == want.recipe and got.sites == want.sites
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.dtype(a.dtype) == F32 and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.core
def test_the_state_is_a_pytree_of_arrays_with_static_recipe_and_sites(trained):
    loss, params, x, t, state = trained
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 2 * len(state.sites) == 4
    assert {(np.dtype(leaf.dtype), leaf.shape) for leaf in leaves} == {
        (F32, (3, 4)),
        (F32, (3,)),
    }
    _assert_same_state(jax.tree.unflatten(treedef, leaves), state)
    # Same structure as a fresh state: a jitted step does not retrace.
    assert treedef == jax.tree.structure(jxs.float8.init(loss, params, x, t))
    doubled = jax.tree.map(lambda a: 2 * a, state)
    assert doubled.sites == state.sites and doubled.recipe == state.recipe


@pytest.mark.core
def test_the_state_round_trips_through_orbax(trained, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    loss, params, x, t, state = trained
    target = jxs.float8.init(loss, params, x, t)  # from fresh code
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt", abstract)
    _assert_same_state(restored, state)
    step = jax.jit(lambda p, s: jxs.float8.value_and_grad(loss, s)(p, x, t))
    _, _, s1 = step(params, state)
    _, _, s2 = step(params, restored)
    _assert_same_state(s2, s1)


@pytest.mark.core
def test_the_state_round_trips_through_flax_serialization(trained):
    serialization = pytest.importorskip("flax.serialization")
    import jaxscale.flax as jxf

    jxf.register_flax_serialization()
    loss, params, x, t, state = trained
    target = jxs.float8.init(loss, params, x, t)
    restored = serialization.from_bytes(target, serialization.to_bytes(state))
    _assert_same_state(restored, state)


@pytest.mark.unit
def test_a_state_with_another_history_len_is_refused():
    # A state restored from a run with another `history_len` (or another
    # structure) would roll histories of the wrong length: refused, named.
    import dataclasses

    f = jxs.autocast(
        matmul, jnp.bfloat16, float8=jxs.float8.DelayedScaling(4, min_dim=0)
    )
    state = jxs.float8.init(f, _sds(16, 32), _sds(32, 16))
    longer = dataclasses.replace(state, history=(jnp.zeros((3, 16)),))
    with pytest.raises(ValueError, match=r"site 0 .*`history_len` is 4"):
        jxs.float8.value_and_grad(f, longer)
    with pytest.raises(ValueError, match=r"1 histories and 0 scales for 1 sites"):
        jxs.float8.apply(f, dataclasses.replace(state, scale=()))
