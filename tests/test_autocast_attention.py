"""Attention under autocast (issue 47). A float16 product whose result is
scaled on its way to a softmax (scores ``q @ k.T * scale``) accumulates and
takes its scale in float32 and is rounded to float16 once, after the scale: a
score overflows only where the *scaled* score exceeds 65504, and the step keeps
16-bit scores, as a hand-cast one does. bfloat16 products are never widened
(float32's range). ``rules={"dot_general": "wide"}`` keeps every score in
float32 (the 0.3.0 rule). ``jax.nn.dot_product_attention`` runs cuDNN's fused
kernel where the step is lowered for CUDA; its backward stays in the autocast
dtype."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns

import jaxscale as jxs

pytestmark = pytest.mark.core

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")
B, T, N, H = 2, 16, 2, 64
WIDE = {"dot_general": "wide"}


def qkv(peak, seed=0):
    """q, k, v (float32 values that float16 holds exactly) whose largest score
    ``|q . k|`` is ``peak``."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, T, N, H)) for _ in range(3))
    top = np.abs(np.einsum("btnh,bsnh->bnts", q, k)).max()
    q, k = q * np.sqrt(peak / top), k * np.sqrt(peak / top)
    return [jnp.asarray(x, jnp.float16).astype(jnp.float32) for x in (q, k, v)]


def score_dtypes(fn, *args):
    """The output dtypes of the matmuls whose operands are (B, T, N, H)-like:
    the scores (q . k) and the weighted values (p . v)."""
    return [
        np.dtype(e.outvars[0].aval.dtype)
        for e in all_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == "dot_general"
    ]


def softmax_input_dtypes(fn, *args):
    """The dtypes of the values the softmaxes' row maxima read."""
    return [
        np.dtype(e.invars[0].aval.dtype)
        for e in all_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == "reduce_max"
    ]


@pytest.mark.parametrize("impl", [None, "xla"], ids=str)
@pytest.mark.parametrize("peak", [7e4, 1e5, 5e5])
def test_dot_product_attention_stays_finite_where_the_scaled_scores_fit(impl, peak):
    """``|q . k|`` above float16's 65504 (the issue's case: 66,000) up to 5e5:
    with jax's scale 1/8 the scaled scores fit float16, and the product is
    rounded only after the scale."""
    q, k, v = qkv(peak)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation=impl)

    ref = jax.jit(f)(q, k, v)
    got = jax.jit(jxs.autocast(f, jnp.float16))(q, k, v)
    assert got.dtype == F32
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=0.02 * float(np.abs(ref).max()))
    assert float(jnp.abs(jnp.einsum("btnh,bsnh->bnts", q, k)).max()) > 0.99 * peak


@pytest.mark.parametrize("peak", [7e4, 1e6, 1e9])
def test_wide_rule_keeps_unscaled_scores_finite_up_to_float32(peak):
    """``scale=1.0`` and scores up to 1e9 (float16 operands hold 2e5 each; only
    float32 holds their product): the default rounds the scaled score to
    float16 (inf above 65504, as a hand-cast step), ``"wide"`` keeps it."""
    q, k, v = qkv(peak)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0)

    ref = jax.jit(f)(q, k, v)
    assert np.isfinite(ref).all()
    got = jax.jit(jxs.autocast(f, jnp.float16, rules=WIDE))(q, k, v)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=0.02 * float(np.abs(ref).max()))
    default = jax.jit(jxs.autocast(f, jnp.float16))(q, k, v)
    assert not np.isfinite(default).all()  # the documented limit, loud (NaN)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_scores_reach_the_softmax_in_the_compute_dtype(dtype):
    """float16: the score product accumulates in float32 and is rounded after
    jax's scale; bfloat16: a plain bfloat16 product. Either way the softmax
    reads 16-bit scores (the hand-cast step's memory), and both matmuls take
    operands in the compute dtype."""
    q, k, v = qkv(100.0)
    f = jxs.autocast(jax.nn.dot_product_attention, dtype)
    assert score_dtypes(f, q, k, v) == [F32 if dtype == F16 else dtype, dtype]
    assert softmax_input_dtypes(f, q, k, v) == [dtype]
    dots = [
        e
        for e in all_eqns(jax.make_jaxpr(f)(q, k, v))
        if e.primitive.name == "dot_general"
    ]
    for e in dots:  # operands in the compute dtype, both matmuls
        assert {np.dtype(x.aval.dtype) for x in e.invars} == {dtype}, e
    wide = jxs.autocast(jax.nn.dot_product_attention, dtype, rules=WIDE)
    assert score_dtypes(wide, q, k, v) == [F32, dtype]
    assert softmax_input_dtypes(wide, q, k, v) == [F32]


def test_an_unscaled_float16_product_is_not_widened():
    """No scale follows: nothing to take in float32, the product is float16."""
    q, k, v = qkv(100.0)

    def attend(q, k, v):
        p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    assert score_dtypes(jxs.autocast(attend, jnp.float16), q, k, v) == [F16, F16]


def test_the_backward_matmuls_stay_in_float16():
    """The gradient of the scores reaches the matmul's backward in float16 (as
    through the cast that float16 scores needed before), so the backward's
    products are float16 GEMMs, not float32 ones."""
    q, k, v = qkv(7e4)
    # q, k and v are inputs here (in a model they are activations): with the
    # default float32 gradient products of inputs, v's would be float32.
    f = jxs.autocast(
        jax.nn.dot_product_attention, jnp.float16, gradient_dtype=jnp.float16
    )

    def loss(q, k, v):
        return jnp.sum(f(q, k, v) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    dots = [
        e
        for e in all_eqns(jax.make_jaxpr(grad)(q, k, v))
        if e.primitive.name == "dot_general"
    ]
    assert len(dots) == 6  # two forward products, two backward each
    for e in dots:
        assert {np.dtype(x.aval.dtype) for x in e.invars} == {F16}, e
    grads = grad(q, k, v)
    ref = jax.grad(
        lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v) ** 2),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, r in zip(grads, ref, strict=True):
        assert g.dtype == F32 and np.isfinite(g).all()
        np.testing.assert_allclose(g, r, atol=0.02 * float(np.abs(r).max()) + 1e-3)


def test_forward_mode_through_wide_scores():
    q, k, v = qkv(100.0)
    f = jxs.autocast(jax.nn.dot_product_attention, jnp.float16)
    ones = jnp.ones_like(q)
    out, tangent = jax.jvp(lambda q: f(q, k, v), (q,), (ones,))
    _, ref = jax.jvp(lambda q: jax.nn.dot_product_attention(q, k, v), (q,), (ones,))
    assert np.isfinite(tangent).all()
    np.testing.assert_allclose(tangent, ref, atol=0.05 * float(np.abs(ref).max()))


@pytest.mark.parametrize("rules", [None, WIDE], ids=["default", "wide"])
def test_hand_written_attention_with_a_mask_stays_finite(rules):
    """Scores ``|q . k|`` of 3e5 scaled by 1/8 (37,500: float16 holds it) stay
    finite by default; ``"wide"`` also keeps them unscaled (3e5)."""
    q, k, v = qkv(3e5)
    mask = jnp.tril(jnp.ones((T, T), bool))
    scale = 0.125 if rules is None else 1.0

    def attend(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    got = jax.jit(jxs.autocast(attend, jnp.float16, rules=rules))(q, k, v)
    ref = jax.jit(attend)(q, k, v)
    kept = jnp.where(mask, jnp.einsum("btnh,bsnh->bnts", q, k), 0.0)
    assert float(jnp.abs(kept).max()) > 65504  # beyond float16
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=0.02 * float(np.abs(ref).max()))


@pytest.mark.parametrize(
    ("factor", "rules"), [(40.0, None), (150.0, WIDE)], ids=["default", "wide"]
)
def test_flax_attention_with_a_mask_stays_finite(factor, rules):
    """Flax scales the query before the product: scores near 4e4 (default) fit
    float16; near 1e5 they need ``"wide"``."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, 32)), jnp.float32)
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
    variables = mha.init(jax.random.key(0), x)
    big = jax.tree.map(lambda a: a, variables)
    big["params"]["query"]["kernel"] = variables["params"]["query"]["kernel"] * factor
    big["params"]["key"]["kernel"] = variables["params"]["key"]["kernel"] * factor
    mask = nn.make_causal_mask(jnp.ones((B, T)))

    def f(variables, x):
        return mha.apply(variables, x, mask=mask)

    ref = jax.jit(f)(big, x)
    assert np.isfinite(ref).all()
    p = big["params"]
    qh = (
        jnp.einsum("btd,dnh->btnh", x, p["query"]["kernel"])
        + p["query"]["bias"][None, None]
    )
    kh = (
        jnp.einsum("btd,dnh->btnh", x, p["key"]["kernel"])
        + p["key"]["bias"][None, None]
    )
    scores = jnp.einsum("btnh,bsnh->bnts", qh / np.sqrt(qh.shape[-1]), kh)
    top = float(jnp.abs(scores).max())
    assert (top > 65504) == (rules is not None), top
    got = jax.jit(jxs.autocast(f, jnp.float16, rules=rules))(big, x)
    assert np.isfinite(got).all()
    # Large scores: float16 projections move a score by ~1e2, which may flip a
    # softmax between near-tied keys (as bfloat16 would): the mean deviation,
    # not the largest, is the measure.
    scale = float(jnp.mean(jnp.abs(ref)))
    assert float(jnp.mean(jnp.abs(got - ref))) < 0.05 * scale


def test_scores_that_are_also_used_in_low_precision_stay_low():
    """A product used by another matmul (or returned) is not widened: its
    float16 copy is used."""
    q, k, v = qkv(100.0)
    qs, ks = q[0, :, 0], k[0, :, 0]

    def f(q, k):
        s = q @ k.T
        return jax.nn.softmax(s), s @ k

    assert (
        score_dtypes(jxs.autocast(f, jnp.float16, cast_outputs=False), qs, ks)[0] == F16
    )

    def g(q, k):
        s = q @ k.T
        return jax.nn.softmax(s), s

    assert score_dtypes(jxs.autocast(g, jnp.float16, cast_outputs=False), qs, ks) == [
        F16
    ]


def test_a_product_into_a_sum_of_squares_is_not_widened():
    """Only float32-rule work widens: a matmul feeding ``tanh`` and then another
    matmul stays float16."""
    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))

    def f(x, w):
        return jnp.tanh(x @ w) @ w

    assert score_dtypes(jxs.autocast(f, jnp.float16), x, w) == [F16, F16]


# --------------------------------------------------------------------------- #
# Fused attention: jax.nn.dot_product_attention, and written-out attention
# --------------------------------------------------------------------------- #


def written_out(q, k, v, *, causal=True, scale=0.125):
    """benchmarks/gpu.py's attention: einsum, scale, causal where, softmax."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def test_jax_nn_attention_is_restored_after_tracing():
    original = jax.nn.dot_product_attention
    q, k, v = qkv(10.0)

    def boom(q, k, v):
        jax.nn.dot_product_attention(q, k, v)
        raise RuntimeError("the user's error")

    with pytest.raises(RuntimeError, match="the user's error"):
        jax.jit(jxs.autocast(boom))(q, k, v)
    jax.jit(jxs.autocast(lambda q, k, v: jax.nn.dot_product_attention(q, k, v)))(
        q, k, v
    )
    assert jax.nn.dot_product_attention is original


def test_no_marker_is_left_in_the_autocast_program():
    """The call jaxscale records while tracing is replaced: the program holds
    the attention autocast ran (here, with no cuDNN, by the rules)."""
    q, k, v = qkv(10.0)
    f = jxs.autocast(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    names = [
        str(e.params.get("name", ""))
        for e in all_eqns(jax.make_jaxpr(f)(q, k, v))
        if e.primitive.name == "jit"
    ]
    assert not [n for n in names if n.startswith("jaxscale_attention")], names


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize(
    "fn",
    [
        written_out,
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    ],
    ids=["written", "jax.nn"],
)
def test_where_cudnn_cannot_run_the_rules_give_the_unfused_program(fn, dtype):
    """Without cuDNN (a CPU host), the recognised attention runs by the rules:
    bit for bit what ``fuse_attention=False`` gives; on a GPU, cuDNN's kernel,
    within 16-bit rounding of it. Either way close to float32."""
    q, k, v = qkv(300.0)
    fused = jax.jit(jxs.autocast(fn, dtype))(q, k, v)
    rules = jax.jit(jxs.autocast(fn, dtype, fuse_attention=False))(q, k, v)
    if jax.default_backend() == "gpu":
        np.testing.assert_allclose(fused, rules, atol=0.02 * float(np.abs(rules).max()))
    else:
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(rules))
    ref = jax.jit(fn)(q, k, v)
    np.testing.assert_allclose(fused, ref, atol=0.03 * float(np.abs(ref).max()))
    grad = jax.grad(lambda q: jnp.sum(jxs.autocast(fn, dtype)(q, k, v) ** 2))(q)
    assert grad.dtype == F32 and np.isfinite(grad).all()


def test_fuse_attention_must_be_a_bool():
    with pytest.raises(TypeError, match="`fuse_attention` must be a Python bool"):
        jxs.autocast(written_out, fuse_attention="yes")


def test_asking_for_cudnn_without_cudnn_is_jax_s_error():
    """``implementation="cudnn"`` is passed on: on a host where jax cannot trace
    cuDNN's attention, jax's own error, not a silent XLA form."""
    pytest.importorskip("jax")
    try:
        jax.eval_shape(
            lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"),
            jax.ShapeDtypeStruct((B, T, N, H), jnp.float16),
        )
    except Exception:  # noqa: BLE001 - the host has no cuDNN: jax refuses
        pass
    else:
        pytest.skip("jax traces cuDNN attention here")
    q, k, v = qkv(10.0)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    with pytest.raises(Exception):  # noqa: B017 - jax's, whatever its type
        jax.jit(jxs.autocast(f))(q, k, v)


def test_an_additive_mask_bias_is_saturated_not_infinite():
    """``bias=-1e9`` masking whole rows: float16 would make it ``-inf`` (NaN
    rows); the bias is saturated to -65504, so every row stays finite."""
    q, k, v = qkv(10.0)
    bias = jnp.where(jnp.arange(T)[None, None, :, None] < 4, -1e9, 0.0)
    bias = jnp.broadcast_to(bias, (B, N, T, T)).astype(jnp.float32)

    def f(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias)

    got = jax.jit(jxs.autocast(f, jnp.float16))(q, k, v, bias)
    ref = jax.jit(f)(q, k, v, bias)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=0.02 * float(np.abs(ref).max()))


def test_a_float8_recipe_runs_jax_nn_attention_and_its_projections():
    """A float8 recipe's context answers every interpreter hook: the
    projections in float8, ``jax.nn.dot_product_attention`` as without one
    (its batched products are no float8 sites)."""

    def f(p, x):
        q, k, v = ((x @ p[n]).reshape(2, 16, 4, 16) for n in ("wq", "wk", "wv"))
        return jnp.mean(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)

    keys = jax.random.split(jax.random.key(0), 4)
    p = {
        n: jax.random.normal(k, (64, 64)) / 8
        for n, k in zip(("wq", "wk", "wv"), keys[:3], strict=True)
    }
    x = jax.random.normal(keys[3], (2, 16, 64))
    recipe = jxs.float8.CurrentScaling(min_dim=0)
    run = jxs.autocast(f, jnp.float16, float8=recipe)
    with jax.numpy_dtype_promotion("strict"):
        grads = jax.jit(jax.grad(run))(p, x)
        traced = jax.make_jaxpr(run)(p, x)
    eights = {
        str(v.aval.dtype)
        for e in all_eqns(traced.jaxpr)
        if e.primitive.name == "dot_general"
        for v in e.invars
    }
    assert any("float8" in d for d in eights), eights
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads.values())
