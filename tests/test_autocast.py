"""jxs.autocast: the API, the rule table and the dtype each rule gives.

Constructs (jit, scan, custom derivatives, shard_map...), gradients and training
are in test_autocast_constructs.py; the comparison with torch.autocast in
test_autocast_torch.py.
"""

import functools
import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import enable_x64
from helpers import all_eqns
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import mlir

import jaxscale as jxs

pytestmark = pytest.mark.integration

F16, BF16, F32, F64 = (
    np.dtype(d) for d in ("float16", jnp.bfloat16, "float32", "float64")
)

W = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8))
B = jax.random.normal(jax.random.key(2), (8,))
Y = jax.random.normal(jax.random.key(3), (4, 8))


def eqns_named(fun, name, *args):
    return [e for e in all_eqns(jax.make_jaxpr(fun)(*args)) if e.primitive.name == name]


# --------------------------------------------------------------------------- #
# The table and its validation
# --------------------------------------------------------------------------- #


def test_table_classes():
    table = jxs.autocast_rules()
    assert list(table) == sorted(table)
    lower = {n for n, r in table.items() if r is jxs.AutocastRule.LOWER}
    assert lower == {"dot_general", "conv_general_dilated", "ragged_dot_general"}
    for name in ("exp", "log", "log1p", "expm1", "pow", "rsqrt", "reduce_sum"):
        assert table[name] == "float32", name
    for name in ("reduce_prod", "cumsum", "cumlogsumexp", "erf_inv", "square"):
        assert table[name] == "float32", name
    for name in (
        "concatenate",
        "select_n",
        "max",
        "scatter-add",
        "dynamic_update_slice",
    ):
        assert table[name] == "promote", name
    # add and sub: the bias rule and its norm case; mul and div: the norm case.
    for name in ("add", "sub", "mul", "div"):
        assert table[name] == "bias", name
    for name in ("tanh", "logistic", "reshape", "reduce_max", "convert_element_type"):
        assert table[name] == "keep", name
    # x ** n is a product (x ** -n, a reciprocal, runs in float32 all the same).
    assert table["integer_pow"] == "keep"
    assert table["bitcast_convert_type"] == "traced"
    # Higher-order primitives are recursed into, not looked up.
    assert not {"jit", "scan", "while", "cond", "custom_jvp_call"} & set(table)
    with pytest.raises(TypeError):
        table["exp"] = "keep"  # read-only


def test_overrides_by_name_primitive_or_member():
    table = jxs.autocast_rules(
        {"exp": "keep", lax.log_p: jxs.AutocastRule.LOWER, "my_op": "promote"}
    )
    assert table["exp"] is jxs.AutocastRule.KEEP
    assert table["log"] is jxs.AutocastRule.LOWER
    assert table["my_op"] is jxs.AutocastRule.PROMOTE
    assert jxs.autocast_rules()["exp"] is jxs.AutocastRule.FLOAT32  # not mutated


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ({"exp": "half"}, ValueError, r"`rules\['exp'\]` must be one of 'lower', "),
        (
            {"scan": "lower"},
            ValueError,
            r"`scan` is a higher-order primitive.*'traced'",
        ),
        ([("exp", "keep")], TypeError, r"`rules` must be a mapping.*got list"),
        ({3: "keep"}, TypeError, r"`rules` keys must be primitive names.*got 3"),
        (jnp.float16, TypeError, r"got _ScalarMeta \(the table takes no dtype"),
    ],
)
def test_bad_rules(rules, error, match):
    with pytest.raises(error, match=match):
        jxs.autocast(jnp.exp, rules=rules)
    with pytest.raises(error, match=match):
        jxs.autocast_rules(rules)


@pytest.mark.parametrize(
    "dtype", [jnp.int8, "float64", "int16", "f64", jnp.complex64, None, "fp8"]
)
def test_bad_dtype(dtype):
    with pytest.raises(
        ValueError,
        match=r"`dtype` must be float16 \(.*'fp16'.*\), bfloat16 \(.*'bf16'.*\), "
        r"or float32 \('fp32': autocast off\), got ",
    ):
        jxs.autocast(jnp.exp, dtype)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, "float8_e5m2"])
def test_float8_dtype_points_at_the_float8_argument(dtype):
    # float8 is for matmul operands only (with a scale per tensor): the compute
    # dtype stays 16-bit, and the message names the argument that does it.
    with pytest.raises(ValueError, match=r"`dtype` is the compute dtype.*float8=True"):
        jxs.autocast(jnp.exp, dtype)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (jnp.float16, F16),
        ("float16", F16),
        ("fp16", F16),
        ("f16", F16),
        ("half", F16),
        (jnp.bfloat16, BF16),
        ("bfloat16", BF16),
        ("bf16", BF16),
    ],
)
def test_dtype_aliases(dtype, expected):
    fn = jxs.autocast(lambda x, w: x @ w, dtype, cast_outputs=False)
    assert fn(X, W).dtype == expected


@pytest.mark.parametrize("dtype", [jnp.float32, "float32", "fp32", np.float32])
def test_float32_dtype_switches_autocast_off(dtype):
    fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    off = jxs.autocast(fn, dtype, cast_outputs=False)
    assert off(X, W).dtype == F32
    (d,) = eqns_named(off, "dot_general", X, W)
    assert [v.aval.dtype for v in d.invars] == [F32, F32]
    np.testing.assert_array_equal(off(X, W), fn(X, W))

    # Inside another autocast it runs as traced, as enabled=False does.
    @functools.partial(jxs.autocast, cast_outputs=False)
    def f(x, w):
        return off(x, w), fn(x, w)

    assert [o.dtype for o in f(X, W)] == [F32, F16]
    dots = eqns_named(f, "dot_general", X, W)
    assert [d.invars[0].aval.dtype for d in dots] == [F32, F16]


def test_bad_fun_and_enabled():
    with pytest.raises(TypeError, match=r"`fun` must be callable, got int"):
        jxs.autocast(3)
    with pytest.raises(TypeError, match=r"`enabled` must be a Python bool, got"):
        jxs.autocast(jnp.exp, enabled=jnp.array(True))
    with pytest.raises(TypeError, match=r"`cast_outputs` must be a Python bool, got"):
        jxs.autocast(jnp.exp, cast_outputs=jnp.array(True))


def test_decorator_forms_and_signature():
    def f(x, w, *, scale=1.0):
        return (x @ w) * scale

    forms = [
        jxs.autocast(f, cast_outputs=False),
        jxs.autocast(dtype=jnp.float16, cast_outputs=False)(f),
        functools.partial(jxs.autocast, dtype=jnp.bfloat16, cast_outputs=False)(f),
        jxs.autocast(f, "bfloat16", cast_outputs=False),
        jxs.autocast(f),
        jxs.autocast(dtype=jnp.bfloat16)(f),
    ]
    dtypes = [F16, F16, BF16, BF16, F32, F32]  # computed in; by default as f's
    for g, dt in zip(forms, dtypes, strict=True):
        assert g(X, W, scale=2.0).dtype == dt
        assert inspect.signature(g) == inspect.signature(f)
        assert g.__name__ == "f"


# --------------------------------------------------------------------------- #
# What each rule gives (forward dtype, forward value)
# --------------------------------------------------------------------------- #

IMG = jax.random.normal(jax.random.key(4), (2, 6, 6, 3))
KER = jax.random.normal(jax.random.key(5), (3, 3, 3, 4)) * 0.3


def conv(img, ker):
    return lax.conv_general_dilated(
        img, ker, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


CASES = {
    # lower
    "matmul": (lambda x, w, b, y: x @ w, F16),
    "einsum": (lambda x, w, b, y: jnp.einsum("ij,jk->ik", x, w), F16),
    # float32: on a float16 value (a matmul's output) as on a float32 one
    "exp": (lambda x, w, b, y: jnp.exp(x @ w), F32),
    "exp_of_input": (lambda x, w, b, y: jnp.exp(x), F32),
    "log1p": (lambda x, w, b, y: jnp.log1p(jnp.abs(x @ w)), F32),
    "square": (lambda x, w, b, y: jnp.square(x @ w), F32),
    "reciprocal_power": (lambda x, w, b, y: (x @ w + 3.0) ** -2, F32),
    "rsqrt": (lambda x, w, b, y: lax.rsqrt(jnp.abs(x @ w) + 1.0), F32),
    "sum": (lambda x, w, b, y: jnp.sum(x @ w), F32),
    "mean": (lambda x, w, b, y: jnp.mean(x @ w, axis=0), F32),
    "cumsum": (lambda x, w, b, y: jnp.cumsum(x @ w, axis=1), F32),
    "softmax": (lambda x, w, b, y: jax.nn.softmax(x @ w), F32),
    "logsumexp": (lambda x, w, b, y: jax.nn.logsumexp(x @ w, axis=1), F32),
    # keep
    "tanh": (lambda x, w, b, y: jnp.tanh(x @ w), F16),
    "max": (lambda x, w, b, y: jnp.max(x @ w, axis=1), F16),
    "reshape": (lambda x, w, b, y: (x @ w).reshape(-1), F16),
    "relu": (lambda x, w, b, y: jax.nn.relu(x @ w), F16),
    "sigmoid": (lambda x, w, b, y: jax.nn.sigmoid(x @ w), F16),
    "gelu_exact": (lambda x, w, b, y: jax.nn.gelu(x @ w, approximate=False), F16),
    "cube": (lambda x, w, b, y: (x @ w) ** 3, F16),  # integer_pow: a product
    # promote: scalars do not widen arrays, full-shape float32 operands do
    "times_python_scalar": (lambda x, w, b, y: (x @ w) * 2.0, F16),
    "times_rank0_input": (lambda x, w, b, y: (x @ w) * y[0, 0], F16),
    "where_scalar": (lambda x, w, b, y: jnp.where(x > 0, x @ w, 0.0), F16),
    "plus_zeros": (lambda x, w, b, y: (x @ w) + jnp.zeros((4, 8)), F16),
    "times_full": (lambda x, w, b, y: (x @ w) * y, F32),
    "where_full": (lambda x, w, b, y: jnp.where(x > 0, x @ w, y), F32),
    "concatenate": (lambda x, w, b, y: jnp.concatenate([x @ w, y]), F32),
    "maximum_full": (lambda x, w, b, y: jnp.maximum(x @ w, y), F32),
    # bias: a float32 vector parameter added to a matmul's output
    "bias": (lambda x, w, b, y: x @ w + b[None], F16),
    "bias_first": (lambda x, w, b, y: b[None] + x @ w, F16),
    "bias_sub": (lambda x, w, b, y: x @ w - b[None], F16),
    "bias_reshaped": (lambda x, w, b, y: x @ w + b.reshape(1, 8), F16),
    "full_shape_add": (lambda x, w, b, y: x @ w + y, F32),
    # a vector computed from a parameter alone is one (issue 40: ``1 + scale``)
    "computed_vector_add": (lambda x, w, b, y: x @ w + jnp.sin(b)[None], F16),
    "mixed_vector_add": (
        lambda x, w, b, y: x @ w + (b[None] * jnp.exp(x @ w))[:1],
        F32,
    ),
    # norm: a float16 activation with a float32 parameter or statistic broadcast
    # from fewer elements: computed in float32, rounded to float16
    # (test_norm_case_computes_in_float32_and_rounds)
    "bias_then_bias": (lambda x, w, b, y: (x @ w + b[None]) + b[None], F16),
    "bias_on_tanh": (lambda x, w, b, y: jnp.tanh(x @ w) + b[None], F16),
    "vector_times": (lambda x, w, b, y: (x @ w) * b[None], F16),
    "dense_relu_dense": (
        lambda x, w, b, y: jax.nn.relu(x @ w + b[None]) @ w + b[None],
        F16,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_dtypes_and_values(name):
    fn, expected = CASES[name]
    out = jax.jit(jxs.autocast(fn, cast_outputs=False))(X, W, B, Y)
    assert out.dtype == expected  # the dtype the last operation computed
    ref = fn(X, W, B, Y)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2
    )
    # The output contract: by default, the dtype fn gives it, same values.
    default = jax.jit(jxs.autocast(fn))(X, W, B, Y)
    assert default.dtype == jax.eval_shape(fn, X, W, B, Y).dtype == F32
    # (within one float16 rounding: the two programs are compiled differently)
    np.testing.assert_allclose(default, np.asarray(out, F32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda x, w, b: (x @ w + b[None]) + b[None], "add"),
        (lambda x, w, b: jnp.tanh(x @ w) + b[None], "add"),
        (lambda x, w, b: (x @ w) * b[None], "mul"),
        (lambda x, w, b: (x @ w) / b[None], "div"),
        (lambda x, w, b: (x @ w) - jnp.mean(x @ w, axis=1, keepdims=True), "sub"),
    ],
)
def test_norm_case_applies_the_float32_value_in_float16(fn, op):
    """A float32 parameter or statistic broadcast onto a float16 activation (not
    only a matmul's bias) is cast to float16, saturating at float16's range, and
    the operation runs in float16: the activation stays float16."""
    g = jxs.autocast(fn, cast_outputs=False)
    last = eqns_named(g, op, X, W, B)[-1]
    assert [v.aval.dtype for v in last.invars] == [F16, F16]
    assert g(X, W, B).dtype == F16
    np.testing.assert_allclose(
        np.asarray(g(X, W, B), np.float32), fn(X, W, B), rtol=2e-2, atol=2e-2
    )
    (bias,) = eqns_named(jxs.autocast(lambda x, w, b: x @ w + b[None]), "add", X, W, B)
    assert [v.aval.dtype for v in bias.invars] == [F16, F16]


def test_norm_case_saturates_a_statistic_beyond_float16():
    """``rsqrt(var + eps)`` of a constant row with a tiny ``eps`` is beyond
    float16's range: it saturates to 65504, so ``(x - mean) * rsqrt`` is 0 there,
    not ``0 * inf = nan``; an infinite statistic stays infinite."""

    def norm(x, w, eps):
        h = x @ w
        mean = jnp.mean(h, axis=1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + eps)

    x = jnp.concatenate([jnp.ones((1, 4)), X[1:, :4]])  # row 0: every h equal
    w = jnp.ones((4, 8))
    out = jax.jit(jxs.autocast(norm))(x, w, jnp.float32(1e-12))
    assert not jnp.isnan(out).any()
    np.testing.assert_array_equal(out[0], 0.0)
    inf = jax.jit(jxs.autocast(norm))(x, w, jnp.float32(0.0))  # rsqrt(0) = inf
    assert jnp.isnan(inf[0]).all()  # 0 * inf, as in float32: nothing hidden


def test_conv_and_its_bias():
    bias = jnp.arange(4.0)
    fn = lambda i, k, b: conv(i, k) + b[None, None, None]  # noqa: E731
    out = jxs.autocast(fn, cast_outputs=False)(IMG, KER, bias)
    assert out.dtype == F16
    ref = conv(IMG, KER) + bias[None, None, None]
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    assert jxs.autocast(fn)(IMG, KER, bias).dtype == F32  # as fn gives it
    (c,) = eqns_named(jxs.autocast(conv), "conv_general_dilated", IMG, KER)
    assert [v.aval.dtype for v in c.invars] == [F16, F16]


def test_lower_ops_output_dtype_not_float32_accumulator():
    (d,) = eqns_named(jxs.autocast(lambda x, w: x @ w), "dot_general", X, W)
    assert [v.aval.dtype for v in d.invars] == [F16, F16]
    assert d.params["preferred_element_type"] == F16
    assert d.outvars[0].aval.dtype == F16
    # An explicit wider accumulator on low-precision operands is kept.
    x16 = X.astype(jnp.float16)
    fn = jxs.autocast(lambda x: lax.dot(x, x.T, preferred_element_type=jnp.float32))
    assert fn(x16).dtype == F32


def test_a_value_used_twice_is_cast_once():
    fn = lambda x, w, v: (x @ w, x @ v)  # noqa: E731
    # (The default wraps products of inputs for their float32 gradients, each
    # casting its inputs inside: the cache shows with float16 gradients.)
    cast = functools.partial(jxs.autocast, gradient_dtype=jnp.float16)
    converts = eqns_named(cast(fn, cast_outputs=False), "convert_element_type", X, W, W)
    assert len(converts) == 3  # x once, w once, v once
    converts = eqns_named(cast(fn), "convert_element_type", X, W, W)
    assert len(converts) == 5  # and each output back to float32


def test_explicit_casts_are_kept_and_weak_type_changes_stay_no_ops():
    out = jxs.autocast(lambda x: jnp.tanh(x.astype(jnp.float16)) * 2.0)(X)
    assert out.dtype == F16  # as traced, so with or without cast_outputs

    def hand_cast(x, w):
        bf = jnp.bfloat16
        return (x.astype(bf) @ w.astype(bf)).astype(jnp.float32)

    # a real cast: kept
    assert jxs.autocast(hand_cast, cast_outputs=False)(X, W).dtype == F32
    # A cast to the dtype a value already has when traced is no operation at
    # all: autocast cannot see it (docs/autocast.md, pitfalls); only the output
    # contract brings the result back to float32.
    to32 = lambda x, w: (x @ w).astype(jnp.float32)  # noqa: E731
    assert jxs.autocast(to32, cast_outputs=False)(X, W).dtype == F16
    assert jxs.autocast(to32)(X, W).dtype == F32

    def scan_with_weak_carry(x, w):  # the carry's weak-type strip is a no-op
        return lax.scan(lambda c, r: (c + jnp.sum(r @ w), c), 0.0, x)

    carry, ys = jxs.autocast(scan_with_weak_carry)(X, W)
    assert carry.dtype == ys.dtype == F32


def test_integers_booleans_keys_and_float64_are_never_cast():
    def f(x, n, mask, key):
        noise = jax.random.normal(key, x.shape)
        return x @ W + noise, n * 2, mask & True, jax.random.split(key)

    key = jax.random.key(0)
    out = jxs.autocast(f)(X, jnp.arange(3), jnp.ones(3, bool), key)
    assert [o.dtype for o in out[:3]] == [F32, np.dtype("int32"), np.dtype(bool)]
    assert jax.dtypes.issubdtype(out[3].dtype, jax.dtypes.prng_key)
    assert jxs.autocast(lambda k: jax.random.normal(k, (3,)))(key).dtype == F32
    np.testing.assert_allclose(
        jxs.autocast(lambda k: jax.random.uniform(k, (5,)))(key),
        jax.random.uniform(key, (5,)),
        rtol=0,
        atol=1e-6,
    )
    with enable_x64():
        x64, w64 = X.astype(jnp.float64), W.astype(jnp.float64)
        assert jxs.autocast(lambda x, w: x @ w)(x64, w64).dtype == F64
        assert jxs.autocast(lambda x: jnp.exp(x))(x64).dtype == F64
        assert jxs.autocast(lambda x, w: x @ w, cast_outputs=False)(X, W).dtype == F16


def test_outputs_keep_their_computed_dtype_and_structure():
    def f(params, x, *, training, name):
        assert training is True and name == "net"  # static: passed as is
        h = x @ params["w"] + params["b"][None]
        return {"logits": h, "loss": jnp.mean(h**2), "n": x.shape[0]}

    params = {"w": W, "b": B}
    out = jxs.autocast(f, cast_outputs=False)(params, X, training=True, name="net")
    assert set(out) == {"logits", "loss", "n"}
    assert out["logits"].dtype == F16 and out["loss"].dtype == F32
    assert int(out["n"]) == 4
    # By default: the output contract, every output in the dtype f gives it.
    out = jxs.autocast(f)(params, X, training=True, name="net")
    assert set(out) == {"logits", "loss", "n"} and int(out["n"]) == 4
    ref = jax.eval_shape(functools.partial(f, training=True, name="net"), params, X)
    assert out["logits"].dtype == ref["logits"].dtype == F32
    assert out["loss"].dtype == ref["loss"].dtype == F32


def test_closures_over_arrays_and_tracers():
    @jax.jit
    def outer(w, x):
        fn = lambda x: jnp.tanh(x @ w + B[None])  # noqa: E731  (w is a tracer)
        return jxs.autocast(fn, cast_outputs=False)(x), jxs.autocast(fn)(x)

    computed, default = outer(W, X)
    assert computed.dtype == F16 and default.dtype == F32
    np.testing.assert_allclose(default, computed.astype(F32), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(default, jnp.tanh(X @ W + B[None]), atol=2e-2)


# --------------------------------------------------------------------------- #
# Regions: enabled=False, nested autocast, overrides
# --------------------------------------------------------------------------- #


def test_enabled_false_runs_at_the_traced_dtypes():
    exact = jxs.autocast(lambda a, w: jnp.exp(a @ w), enabled=False)

    @jxs.autocast(cast_outputs=False)
    def f(x, w):
        h = jnp.tanh(x @ w)  # float16
        return exact(h, w), h @ w

    inner, outer = f(X, W)
    assert inner.dtype == F32 and outer.dtype == F16
    dots = eqns_named(f, "dot_general", X, W)
    assert [d.invars[0].aval.dtype for d in dots] == [F16, F32, F16]
    # Outside any autocast it changes nothing.
    np.testing.assert_array_equal(exact(X, W), jnp.exp(X @ W))


def test_nested_autocast_uses_its_own_dtype_and_a_reenabled_region_works():
    inner = jxs.autocast(lambda x, w: x @ w, jnp.bfloat16, cast_outputs=False)
    off = jxs.autocast(lambda x, w: (x @ w, inner(x, w)), enabled=False)

    @jxs.autocast(cast_outputs=False)
    def f(x, w):
        return x @ w, inner(x, w), *off(x, w)

    assert [o.dtype for o in f(X, W)] == [F16, BF16, F32, BF16]
    dots = eqns_named(f, "dot_general", X, W)
    assert [d.invars[0].aval.dtype for d in dots] == [F16, BF16, F32, BF16]
    # With the defaults every autocast returns what its function gives when
    # traced: float32 everywhere here, though the matmuls run as above.
    inner = jxs.autocast(lambda x, w: x @ w, jnp.bfloat16)
    g = jxs.autocast(lambda x, w: (x @ w, inner(x, w), *off(x, w)))
    assert [o.dtype for o in g(X, W)] == [F32, F32, F32, F32]
    dots = eqns_named(g, "dot_general", X, W)
    assert [d.invars[0].aval.dtype for d in dots] == [F16, BF16, F32, BF16]


def test_rules_override_changes_one_primitive():
    fn = lambda x, w: jnp.exp(x @ w)  # noqa: E731
    ac = functools.partial(jxs.autocast, cast_outputs=False)
    assert ac(fn, rules={"exp": "keep"})(X, W).dtype == F16
    assert ac(fn, rules={"dot_general": "float32"})(X, W).dtype == F32
    assert ac(fn, rules={"exp": "traced"})(X, W).dtype == F32
    assert ac(lambda x, w: x @ w + B[None])(X, W).dtype == F16  # the bias rule
    out = ac(lambda x, w: x @ w + B[None], rules={"add": "promote"})(X, W)
    assert out.dtype == F32  # no bias rule
    assert jxs.autocast(fn, rules={"exp": "keep"})(X, W).dtype == F32  # as fn's


# A first-order primitive autocast does not know: it runs at its inputs' dtypes.
_double_p = jcore.Primitive("jxs_test_double")
_double_p.def_impl(lambda x: 2 * x)
_double_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_double_p, mlir.lower_fun(lambda x: 2 * x, False))


def test_unknown_primitive_runs_at_its_inputs_dtypes_or_as_told():
    def f(x, w):
        return _double_p.bind(x @ w)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # first-order: no warning
        ac = functools.partial(jxs.autocast, cast_outputs=False)
        assert ac(f)(X, W).dtype == F16  # no cast: runs on the matmul's float16
        (eqn,) = eqns_named(ac(f), "jxs_test_double", X, W)
        assert eqn.invars[0].aval.dtype == F16
        assert ac(f, rules={"jxs_test_double": "keep"})(X, W).dtype == F16
        assert ac(f, rules={"jxs_test_double": "traced"})(X, W).dtype == F32
        (eqn,) = eqns_named(
            ac(f, rules={"jxs_test_double": "traced"}), "jxs_test_double", X, W
        )
        assert eqn.invars[0].aval.dtype == F32  # input cast back to float32
        assert jxs.autocast(f)(X, W).dtype == F32  # the output contract
        np.testing.assert_allclose(jxs.autocast(f)(X, W), 2 * X @ W, atol=2e-2)
        assert ac(lambda x: _double_p.bind(x))(X).dtype == F32  # not narrowed


def test_an_unknown_higher_order_primitive_is_rewritten_without_its_schema():
    """``custom_linear_solve`` has no handler: each jaxpr among its parameters
    (a named tuple of them, some None) is interpreted with its boundary dtypes
    kept, and the primitive re-bound with every other parameter unchanged."""
    a = jnp.eye(8) * 3.0 + 0.1

    def f(b):
        rhs = jnp.tanh(b @ W)  # float16 under autocast
        return lax.custom_linear_solve(
            lambda v: jnp.tanh(a @ v), rhs[0], lambda mv, r: jnp.linalg.solve(a, r)
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jax.jit(jxs.autocast(f))(X)
        jaxpr = jax.make_jaxpr(jxs.autocast(f))(X)
    assert out.dtype == F32
    np.testing.assert_allclose(out, f(X), atol=2e-2)
    (solve,) = [
        e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_linear_solve"
    ]
    assert solve.invars[-1].aval.dtype == F32  # its boundary: as traced
    inner = [e for e in all_eqns(solve.params["jaxprs"].matvec)]
    dots = [e for e in inner if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == F16 for e in dots)
    original = jax.make_jaxpr(f)(X).jaxpr.eqns[-1].params
    assert solve.params["const_lengths"] == original["const_lengths"]
    traced = jax.make_jaxpr(jxs.autocast(f, rules={"custom_linear_solve": "traced"}))(X)
    (kept,) = [
        e for e in traced.jaxpr.eqns if e.primitive.name == "custom_linear_solve"
    ]
    assert all(
        e.primitive.name != "convert_element_type"
        for e in all_eqns(kept.params["jaxprs"].matvec)
    )


# A higher-order primitive whose sub-computation is a Python function (as jax's
# ``jax_scan3``/``jax_custom_vjp3`` flags stage theirs): nothing to rewrite.
_apply_p = jcore.Primitive("jxs_test_apply")
_apply_p.def_impl(lambda x, *, fn: fn(x))
_apply_p.def_abstract_eval(lambda x, *, fn: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_apply_p, mlir.lower_fun(lambda x, *, fn: fn(x), False))


def test_a_primitive_staging_a_function_runs_as_traced_and_says_why():
    def f(x):
        return _apply_p.bind(jnp.tanh(x @ W), fn=jnp.sin)

    with pytest.warns(
        jxs.AutocastWarning,
        match=r"runs `jxs_test_apply` as traced \(its parameters 'fn' are functions",
    ):
        out = jax.jit(jxs.autocast(f))(X)
    assert out.dtype == F32
    np.testing.assert_allclose(out, f(X), atol=2e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jxs.autocast(f, rules={"jxs_test_apply": "traced"})(X)


# --------------------------------------------------------------------------- #
# The guide
# --------------------------------------------------------------------------- #


def test_the_guide_runs_as_written(capsys):
    """docs/autocast.md: every ``python`` block, in order, in one namespace (its
    ``py`` block is torch's side); the printed results are the ones it states."""
    from pathlib import Path

    pytest.importorskip("equinox")  # the guide's equinox model (an extra)

    text = (Path(__file__).resolve().parents[1] / "docs" / "autocast.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert len(blocks) >= 5
    scope = {}
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        for block in blocks:
            exec(compile(block, "docs/autocast.md", "exec"), scope)
    printed = capsys.readouterr().out.splitlines()
    loss = float(printed[0].removeprefix("loss "))
    assert loss < 0.05
    assert "['float32', 'float16']" in printed
    # the overflow pitfall: softmax scores widened, linear attention's not
    assert printed[-5:] == ["True", "False", "True", "True", "True"]
    jaxpr = scope["jaxpr"]
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(e.outvars[0].aval.dtype == F16 for e in dots)
