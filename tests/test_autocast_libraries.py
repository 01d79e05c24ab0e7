"""jxs.autocast on models nobody in this project wrote: attention with masks from
Flax linen, ``jax.nn`` and Equinox, stateful layers (BatchNorm, SpectralNorm)
from Flax and Equinox, normalisation layers, the ``dtype`` argument and a
primitive autocast has never heard of.

The contract these tests hold autocast to:

1. A floating constant that is finite in float32 (``-1e9``,
   ``jnp.finfo(jnp.float32).min``, ``-0.7 * finfo.max``, a closed-over array or a
   broadcast of one) never becomes inf because autocast narrowed it: a selection
   (``select_n``, ``max``, ``min``, ``pad``, ``concatenate``) saturates it to the
   compute dtype's finite extreme (-65504 in float16); arithmetic with it runs in
   float32. A nonzero constant that would round to 0 makes its op run in float32.
   ``-jnp.inf`` stays ``-inf``. (A closed-over array may instead widen its
   selection to float32, as any float32 array operand does.)
2. ``jax.eval_shape(jxs.autocast(f), *a) == jax.eval_shape(f, *a)``, weak types
   included (a weakly typed counter that comes back strong retraces a jitted step).
3. Normalisation layers return activations in the compute dtype (their
   statistics are reduced in float32; ``(x - mean) * scale + bias`` may be
   computed in float32 and rounded, as torch's ``batch_norm`` does).
4. ``dtype`` accepts the usual spellings; float32 turns autocast off; float8 and
   integers are refused.
5. An unknown first-order primitive runs at its inputs' dtypes, silently.

Tolerances against the float32 program, on values of order 1. float16 has a
10-bit mantissa (a rounding is 2**-11 ~ 4.9e-4 relative); the attention here
rounds q, k, v, the scores and the probabilities once each before
float32-accumulated matmuls over 16 terms: the largest error seen is 1.1e-3, so
2e-2 leaves a margin of 20. bfloat16 has 3 fewer mantissa bits (2**-8 ~ 3.9e-3,
8x coarser): the largest error seen is 1.1e-2, and 1e-1 leaves a margin of 10.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_eqns, relaxed
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import mlir

import jaxscale as jxs

pytestmark = [pytest.mark.integration, pytest.mark.libraries]

nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

F16, BF16, F32 = (np.dtype(d) for d in ("float16", jnp.bfloat16, "float32"))
LOW = [pytest.param(F16, id="float16"), pytest.param(BF16, id="bfloat16")]
TOL = {F16: 2e-2, BF16: 1e-1}  # see the module docstring
RNG = np.random.default_rng(0)


def key(seed):
    """A PRNG key for initialising parameters. "rbg" compiles in a fraction of the
    time threefry takes on XLA:CPU (seconds per shape on 2 cores)."""
    return jax.random.key(seed, impl="rbg")


def normal(*shape, rng=RNG):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def shapes(tree):
    """Path, shape, dtype and weak type of every leaf, as ``ShapeDtypeStruct``
    compares them (a list: some pytree nodes, e.g. ``eqx.nn.State``, compare by
    identity). A weak type that changes makes a jitted step compile again."""
    return [
        (jax.tree_util.keystr(path), tuple(s.shape), np.dtype(s.dtype), s.weak_type)
        for path, s in jax.tree_util.tree_leaves_with_path(tree)
    ]


def assert_finite(tree, what="output"):
    for leaf in jax.tree.leaves(tree):
        assert bool(jnp.all(jnp.isfinite(leaf))), f"{what} not finite: {leaf}"


def saturate(x, dtype):
    """``x`` (float32) as the contract narrows a constant: clipped to ``dtype``'s
    finite range instead of rounded to inf."""
    info = jnp.finfo(dtype)
    return np.clip(np.asarray(x, F32), float(info.min), float(info.max))


# --------------------------------------------------------------------------- #
# 1. Masked attention: a padding token's query row is masked everywhere
# --------------------------------------------------------------------------- #

BATCH, SEQ, DIM, HEADS = 2, 5, 16, 2
TOK = jnp.array([[3, 1, 4, 0, 0], [5, 9, 2, 6, 0]], jnp.int32)  # 0 is padding
VALID = np.asarray(TOK > 0)  # query rows that see at least one key
X = normal(BATCH, SEQ, DIM)


class FlaxAttention(nn.Module):
    @nn.compact
    def __call__(self, x, tok):
        mask = nn.make_attention_mask(tok > 0, tok > 0)  # float32 [b, 1, q, k]
        return nn.MultiHeadDotProductAttention(num_heads=HEADS)(x, x, mask=mask)


def flax_mha():
    model = FlaxAttention()
    return model.apply, jax.jit(model.init)(key(1), X, TOK)


def qkv_params(shape):
    rng = np.random.default_rng(2)  # the same for every call
    return {n: normal(*shape, rng=rng) / np.float32(np.sqrt(DIM)) for n in "qkv"}


def project_heads(p, x):
    return [jnp.einsum("btd,dnh->btnh", x, p[n]) for n in "qkv"]


def jax_dpa_mask():
    def f(p, x, tok):
        q, k, v = project_heads(p, x)
        valid = tok > 0
        mask = (valid[:, :, None] & valid[:, None, :])[:, None]  # [b, 1, q, k]
        return jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(x.shape)

    return f, qkv_params((DIM, HEADS, DIM // HEADS))


def jax_dpa_seq_lengths():
    def f(p, x, tok):
        q, k, v = project_heads(p, x)
        lengths = jnp.sum(tok > 0, axis=1, dtype=jnp.int32)  # padding at the end
        out = jax.nn.dot_product_attention(
            q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths
        )
        return out.reshape(x.shape)

    return f, qkv_params((DIM, HEADS, DIM // HEADS))


def equinox_mha():
    mha = eqx.nn.MultiheadAttention(HEADS, DIM, key=key(3))
    params, static = eqx.partition(mha, eqx.is_inexact_array)

    def f(p, x, tok):
        mha = eqx.combine(p, static)
        valid = tok > 0
        mask = valid[:, :, None] & valid[:, None, :]  # [b, q, k]
        # Equinox modules act on one example: vmap over the batch.
        return jax.vmap(lambda x, m: mha(x, x, x, mask=m))(x, mask)

    return f, params


def hand_written(fill):
    def f(p, x, tok):
        q, k, v = (x @ p[n] for n in "qkv")
        s = jnp.einsum("bqd,bkd->bqk", q, k) / np.float32(np.sqrt(DIM))
        valid = tok > 0
        s = fill(valid[:, :, None] & valid[:, None, :], s)
        return jax.nn.softmax(s, axis=-1) @ v

    return lambda: (f, qkv_params((DIM, DIM)))


ATTENTION = {
    "flax_MultiHeadDotProductAttention": flax_mha,
    "jax_nn_dot_product_attention_mask": jax_dpa_mask,
    "jax_nn_dot_product_attention_seq_lengths": jax_dpa_seq_lengths,
    "equinox_MultiheadAttention": equinox_mha,
    "where_minus_1e9": hand_written(lambda m, s: jnp.where(m, s, -1e9)),
    "where_finfo_float32_min": hand_written(
        lambda m, s: jnp.where(m, s, jnp.finfo(jnp.float32).min)
    ),
}


@functools.cache
def attention_reference(name):
    f, params = ATTENTION[name]()
    return np.asarray(jax.jit(f)(params, X, TOK))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", list(ATTENTION))
def test_masked_attention_and_its_gradients_stay_finite(name, dtype):
    """In float16 the gradients too, from the same program (backward programs
    compile slowly on XLA:CPU). bfloat16 has float32's range: what overflows there
    is the forward's constant, which the output shows."""
    f, params = ATTENTION[name]()

    def loss(p, x, tok):
        out = f(p, x, tok)
        return jnp.mean(out**2), out

    if dtype == F16:
        # The parameters' gradients (q, k and v's flow through the masked scores).
        grad_fn = jax.grad(jxs.autocast(loss, dtype), has_aux=True)
        grads, out = jax.jit(grad_fn)(params, X, TOK)
    else:
        grads, out = None, jax.jit(jxs.autocast(f, dtype))(params, X, TOK)
    assert_finite(out)  # the fully masked rows included
    tol = TOL[dtype]
    np.testing.assert_allclose(
        np.asarray(out, F32)[VALID],
        attention_reference(name)[VALID],
        rtol=tol,
        atol=tol,
    )
    if grads is not None:
        assert_finite(grads, "gradients")
        assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))


# Selections with a constant: the constant saturates, the op stays in `dtype`.
M = RNG.random((4, 8)) < 0.6
M[1] = False  # a row masked everywhere
W = normal(8, 8) * 0.3
XW = normal(4, 8)
NEG_NUMPY = np.full((4, 8), -1e9, np.float32)
NEG_JAX = jnp.full((4, 8), -1e9)

SELECTIONS = {
    # name: (function of the float16 matmul output h, the primitive that selects)
    "where_literal": (lambda h: jnp.where(M, h, -1e9), "select_n"),
    "where_finfo_min": (
        lambda h: jnp.where(M, h, jnp.finfo(jnp.float32).min),
        "select_n",
    ),
    "where_0.7_finfo_max": (  # jax.nn.dot_product_attention's constant
        lambda h: jnp.where(M, h, -0.7 * jnp.finfo(jnp.float32).max),
        "select_n",
    ),
    "where_broadcast": (lambda h: jnp.where(M, h, jnp.full(h.shape, -1e9)), "select_n"),
    "max_of_masked_row": (
        lambda h: jnp.max(jnp.where(M, h, -1e9), axis=-1),
        "reduce_max",
    ),
    # Probes: the bound is the result everywhere.
    "maximum": (lambda h: jnp.maximum(h, 1e9), "max"),
    "minimum": (lambda h: jnp.minimum(h, -1e9), "min"),
    "clip": (lambda h: jnp.clip(h, 1e9), "max"),
    "pad": (lambda h: jnp.pad(h, ((0, 0), (0, 2)), constant_values=-1e9), "pad"),
    "concatenate": (
        lambda h: jnp.concatenate([h, jnp.full((4, 2), -1e9)], axis=1),
        "concatenate",
    ),
}


@pytest.mark.parametrize(
    "name, dtype",
    [pytest.param(n, F16, id=f"{n}-float16") for n in SELECTIONS]
    # bfloat16 where the constant overflows it (-1e9 and 0.7 * max fit).
    + [pytest.param("where_finfo_min", BF16, id="where_finfo_min-bfloat16")],
)
def test_selection_saturates_a_constant_to_the_finite_extreme(name, dtype):
    select, prim = SELECTIONS[name]

    def f(x, w):
        return select(x @ w)

    fn = jxs.autocast(f, dtype)
    out = fn(XW, W)  # eager: faster than compiling
    assert_finite(out)
    eqns = [e for e in all_eqns(jax.make_jaxpr(fn)(XW, W)) if e.primitive.name == prim]
    assert eqns and all(e.outvars[0].aval.dtype == dtype for e in eqns), (
        f"the selection should run in {dtype}",
        eqns,
    )
    tol = TOL[dtype]
    np.testing.assert_allclose(
        np.asarray(out, F32), saturate(f(XW, W), dtype), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("const", [NEG_NUMPY, NEG_JAX], ids=["numpy", "jax"])
def test_selection_with_a_closed_over_array_is_finite(const, dtype):
    """An array constant may widen the selection to float32 (as an array operand
    does) or be narrowed with it; either way it does not become -inf."""

    def f(x, w):
        return jnp.where(M, x @ w, const)

    fn = jxs.autocast(f, dtype)
    out = np.asarray(fn(XW, W), F32)
    assert np.isfinite(out).all(), out
    (eqn,) = [
        e for e in all_eqns(jax.make_jaxpr(fn)(XW, W)) if e.primitive.name == "select_n"
    ]
    ran_in = eqn.outvars[0].aval.dtype
    assert ran_in in (dtype, F32), eqn
    ref = f(XW, W)
    expected = saturate(ref, dtype) if ran_in == dtype else ref
    tol = TOL[dtype]
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


def test_minus_inf_stays_minus_inf():
    def f(x, w):
        s = jnp.where(M, x @ w, -jnp.inf)
        return s, jnp.max(s, axis=-1), jax.nn.softmax(s[0])

    s, row_max, p = jxs.autocast(f)(XW, W)
    assert bool(jnp.all(jnp.asarray(s)[~M] == -jnp.inf))
    assert float(row_max[1]) == -np.inf  # the row masked everywhere
    np.testing.assert_allclose(np.asarray(p, F32), f(XW, W)[2], rtol=2e-2, atol=2e-2)


ARITHMETIC = {
    # name: (function of the matmul output h, the constant, the arithmetic prim)
    "mul_literal_1e5": (lambda h: h * 1e5, 1e5, "mul"),
    "sub_literal_1e9": (lambda h: h - 1e9, 1e9, "sub"),
    "add_closed_over_numpy_bias": (
        lambda h: h + np.where(M, 0.0, -1e9).astype(np.float32),
        -1e9,
        "add",
    ),
    "add_literal_1e-8": (lambda h: jax.nn.relu(h) + 1e-8, 1e-8, "add"),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", list(ARITHMETIC))
def test_arithmetic_with_a_constant_that_does_not_fit_runs_in_float32(name, dtype):
    arith, const, prim = ARITHMETIC[name]

    def f(x, w):
        return arith(x @ w)

    fn = jxs.autocast(f, dtype)
    out = fn(XW, W)
    assert_finite(out)
    # The matmul's output as autocast computes it; the rest in float32.
    h = jnp.dot(XW.astype(dtype), W.astype(dtype), preferred_element_type=F32)
    ref = arith(h.astype(dtype).astype(F32))
    with np.errstate(over="ignore", under="ignore"):
        narrowed = np.float32(const).astype(dtype)
    if np.isinf(narrowed) or narrowed == 0:  # `const` does not fit `dtype`
        eqns = [
            e for e in all_eqns(jax.make_jaxpr(fn)(XW, W)) if e.primitive.name == prim
        ]
        assert eqns and all(e.outvars[0].aval.dtype == F32 for e in eqns), (
            "the op should run in float32",
            eqns,
        )
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-12)
    else:  # it may run in `dtype`
        np.testing.assert_allclose(np.asarray(out, F32), ref, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", LOW)
def test_log_of_relu_plus_epsilon_is_not_minus_inf(dtype):
    def f(x, w):
        return jnp.log(jax.nn.relu(x @ w) + 1e-8)

    out = np.asarray(jxs.autocast(f, dtype)(XW, W), F32)
    ref, pre = np.asarray(f(XW, W)), np.asarray(XW @ W)
    assert np.isfinite(out).all(), out
    dead = pre < -0.1  # clearly negative also after rounding the operands
    assert dead.any()
    # log(1e-8) = -18.42; bfloat16 may keep 1e-8 (it fits): 9.98e-9, -18.42 too.
    np.testing.assert_allclose(out[dead], np.log(1e-8), atol=1e-2)
    alive = pre > 0.1
    np.testing.assert_allclose(out[alive], ref[alive], atol=TOL[dtype])


# --------------------------------------------------------------------------- #
# 2. Outputs come back in the dtypes `f` gives them
# --------------------------------------------------------------------------- #


class SpectralBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.SpectralNorm(nn.Dense(16))(x, update_stats=train)
        h = nn.BatchNorm(use_running_average=not train)(h)
        return nn.Dense(1)(jax.nn.relu(h))


def test_linen_spectral_and_batch_norm_collections_stay_float32():
    dtype = F16
    model = SpectralBatchNorm()
    x = normal(16, 8)
    variables = jax.jit(model.init, static_argnames="train")(key(8), x, train=False)
    # SpectralNorm keeps `u` and `sigma` in the "batch_stats" collection too.
    names = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(variables["batch_stats"])
    ]
    assert [n for n in names if n.endswith("/u']") or n.endswith("/sigma']")], names
    assert [n for n in names if n.endswith("['mean']")], names

    def train(apply):
        return lambda v, x: apply(v, x, train=True, mutable=["batch_stats"])

    fn, ref_fn = train(jxs.autocast(model.apply, dtype)), train(model.apply)
    step, ref_step = jax.jit(fn), jax.jit(ref_fn)
    v, ref_v = variables, variables
    for _ in range(3):  # each step feeds the last one's statistics back
        (out, upd), (_, ref_upd) = step(v, x), ref_step(ref_v, x)
        wrong = [
            f"{jax.tree_util.keystr(path)}: {leaf.dtype}"
            for path, leaf in jax.tree_util.tree_leaves_with_path(upd)
            if leaf.dtype != F32
        ]
        assert not wrong, wrong
        assert shapes(upd) == shapes(ref_upd)
        tol = TOL[dtype]
        for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(ref_upd), strict=True):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
        v = {"params": variables["params"], **upd}
        ref_v = {"params": variables["params"], **ref_upd}
    assert out.dtype == F32, "the output, float32 in the model, comes back float32"
    assert shapes(jax.eval_shape(fn, variables, x)) == shapes(
        jax.eval_shape(ref_fn, variables, x)
    )


class EqxNet(eqx.Module):
    l1: eqx.nn.SpectralNorm
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, seed):
        k1, k2, k3 = jax.random.split(seed, 3)
        self.l1 = eqx.nn.SpectralNorm(eqx.nn.Linear(8, 32, key=k1), "weight", key=k2)
        self.bn = eqx.nn.BatchNorm(32, axis_name="batch", mode="batch")
        self.l2 = eqx.nn.Linear(32, 1, key=k3)

    def __call__(self, x, state):
        h, state = self.l1(x, state)
        h, state = self.bn(h, state)
        return self.l2(jax.nn.relu(h)), state


def test_equinox_stateful_model_trains_with_float32_state():
    model, state = eqx.nn.make_with_state(EqxNet)(key(9))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = normal(64, 8)
    y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]

    def loss_fn(params, state, x, y):  # no cast anywhere
        model = eqx.combine(params, static)
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        pred, state = batched(x, state)
        return jnp.mean((pred - y) ** 2), state

    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    opt_state = tx.init(params)
    loss16 = jxs.autocast(loss_fn)
    contract = shapes(jax.eval_shape(loss_fn, params, state, x, y))
    traces = []

    @jax.jit
    def step(params, state, opt_state):
        traces.append(1)
        vg = jxs.value_and_grad(loss16, opt_state, has_aux=True)
        (loss, state), grads = vg(params, state, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss

    state0 = shapes(state)  # float32 statistics and vectors, an int32 counter
    losses = []
    for _ in range(100):
        params, state, opt_state, loss = step(params, state, opt_state)
        assert [s[:3] for s in shapes(state)] == [s[:3] for s in state0]  # dtypes
        losses.append(loss)  # no float(): a sync per step costs more than the step
    losses = np.asarray(jax.device_get(losses))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.1 * losses[0], losses[::10]
    assert_finite(params)
    assert {p.dtype for p in jax.tree.leaves(params)} == {F32}
    assert int(jxs.diagnostics.summary(opt_state)["skipped_steps"]) <= 5
    # The counter is weakly typed (`jnp.array(0)`): losing that retraces the step.
    assert shapes(state) == state0
    assert len(traces) == 1
    assert shapes(jax.eval_shape(loss16, params, state, x, y)) == contract


def test_scan_carry_and_stacked_outputs_come_back_in_their_traced_dtypes():
    def f(c, xs, w):
        def body(c, x):
            return jnp.tanh(c @ w + x), c @ w  # y: float16 under autocast

        return lax.scan(body, c, xs)

    c0 = jnp.zeros((2, 8))
    xs = normal(3, 2, 8)
    fn = jxs.autocast(f)
    assert shapes(jax.eval_shape(fn, c0, xs, W)) == shapes(jax.eval_shape(f, c0, xs, W))
    c, ys = jax.jit(fn)(c0, xs, W)
    assert c.dtype == ys.dtype == F32
    ref_c, ref_ys = f(c0, xs, W)
    np.testing.assert_allclose(c, ref_c, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(ys, ref_ys, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- #
# 3. Normalisation layers give activations in the compute dtype
# --------------------------------------------------------------------------- #


def relu_onwards(jaxpr, shape):
    """The arithmetic of activation ``shape`` from the ReLU (``max``) after a norm
    layer on, in program order (the ReLU, then a residual add), and all equations."""
    eqns = list(all_eqns(jaxpr))
    acts = [
        e
        for e in eqns
        if e.primitive.name in {"add", "sub", "mul", "div", "max"}
        and tuple(e.outvars[0].aval.shape) == shape
    ]
    first = next(i for i, e in enumerate(acts) if e.primitive.name == "max")
    return acts[first:], eqns


def wrong_dtypes(eqns, dtype):
    """Operands and results of ``eqns`` (literals aside) not in ``dtype``."""
    return [
        (e, v.aval.dtype)
        for e in eqns
        for v in [*e.invars, *e.outvars]
        if not isinstance(v, jcore.Literal) and v.aval.dtype != dtype
    ]


class ResidualBN(nn.Module):
    conv: bool

    @nn.compact
    def __call__(self, x):
        layer = (lambda: nn.Conv(8, (3, 3))) if self.conv else (lambda: nn.Dense(8))
        h0 = layer()(x)  # float16 under autocast
        h = nn.BatchNorm(use_running_average=False)(layer()(h0))
        return jax.nn.relu(h) + h0


@pytest.mark.parametrize(
    "conv, dtype",
    [
        pytest.param(True, F16, id="conv-float16"),
        pytest.param(False, BF16, id="dense-bfloat16"),
    ],
)
def test_batch_norm_in_training_gives_activations_in_the_compute_dtype(conv, dtype):
    """BatchNorm may compute ``(x - mean) * scale + bias`` in float32 (as torch's
    batch_norm and Flax's ``dtype=float16`` do) but its output, the ReLU and the
    residual add are in ``dtype``; its mean and variance are reduced in float32."""
    model = ResidualBN(conv)
    x = normal(*((2, 6, 6, 8) if conv else (12, 8)))
    variables = jax.jit(model.init)(key(13), x)

    def f(variables, x):
        return model.apply(variables, x, mutable=["batch_stats"])

    fn = jxs.autocast(f, dtype)
    after, eqns = relu_onwards(jax.make_jaxpr(fn)(variables, x), x.shape)
    assert [e.primitive.name for e in after] == ["max", "add"], after
    assert not wrong_dtypes(after, dtype), wrong_dtypes(after, dtype)
    sums = [e for e in eqns if e.primitive.name == "reduce_sum"]
    assert len(sums) >= 2  # the mean and the mean of squares
    assert all(e.invars[0].aval.dtype == F32 for e in sums), sums
    (out, upd), (ref, ref_upd) = jax.jit(fn)(variables, x), jax.jit(f)(variables, x)
    assert out.dtype == F32  # contract 2: f returns float32
    assert {leaf.dtype for leaf in jax.tree.leaves(upd)} == {F32}
    tol = TOL[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(ref_upd), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    raw = jax.eval_shape(jxs.autocast(f, dtype, cast_outputs=False), variables, x)
    assert raw[0].dtype == dtype  # the residual stream, as computed


@pytest.mark.parametrize("dtype", LOW)
def test_layer_norm_of_a_low_precision_activation_is_low_precision(dtype):
    ln = nn.LayerNorm()
    variables = jax.jit(ln.init)(key(14), XW)

    def f(variables, x, w):
        return ln.apply(variables, x @ w)

    # What follows it (a ReLU) runs in `dtype`; the reductions in float32.
    fn = jxs.autocast(lambda v, x, w: jax.nn.relu(f(v, x, w)), dtype)
    after, eqns = relu_onwards(jax.make_jaxpr(fn)(variables, XW, W), (4, 8))
    assert [e.primitive.name for e in after] == ["max"], after
    assert not wrong_dtypes(after, dtype), wrong_dtypes(after, dtype)
    sums = [e for e in eqns if e.primitive.name == "reduce_sum"]
    assert sums and all(e.invars[0].aval.dtype == F32 for e in sums), sums
    # As computed (the output contract would cast it back to float32):
    raw = jax.eval_shape(jxs.autocast(f, dtype, cast_outputs=False), variables, XW, W)
    assert raw.dtype == dtype
    out = jax.jit(jxs.autocast(f, dtype))(variables, XW, W)
    assert out.dtype == F32  # contract 2
    np.testing.assert_allclose(out, f(variables, XW, W), atol=TOL[dtype])


# --------------------------------------------------------------------------- #
# 4. The dtype argument
# --------------------------------------------------------------------------- #


def dot_dtypes(fn, *args):
    dots = [
        e
        for e in all_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == "dot_general"
    ]
    return [tuple(v.aval.dtype for v in e.invars) for e in dots]


@pytest.mark.parametrize(
    "spelling, dtype",
    [
        pytest.param("bf16", BF16, id="bf16"),
        pytest.param("bfloat16", BF16, id="bfloat16"),
        pytest.param("fp16", F16, id="fp16"),
        pytest.param("float16", F16, id="float16"),
        pytest.param("half", F16, id="half"),
        pytest.param(jnp.float16, F16, id="jnp.float16"),
        pytest.param(np.float16, F16, id="np.float16"),
        pytest.param(jnp.bfloat16, BF16, id="jnp.bfloat16"),
        pytest.param(np.dtype("float16"), F16, id="np.dtype(float16)"),
    ],
)
def test_dtype_spellings(spelling, dtype):
    fn = jxs.autocast(lambda x, w: jnp.tanh(x @ w), dtype=spelling)
    assert dot_dtypes(fn, XW, W) == [(dtype, dtype)]


def signature(fn, *args):
    """Primitives and their dtypes, wrappers (jit, calls) left out."""
    wrappers = {"pjit", "jit", "closed_call", "core_call"}
    return [
        (
            e.primitive.name,
            [getattr(v.aval, "dtype", None) for v in e.invars],
            [v.aval.dtype for v in e.outvars],
        )
        for e in all_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name not in wrappers
    ]


@pytest.mark.parametrize(
    "spelling",
    [jnp.float32, np.float32, "float32", "fp32"],
    ids=["jnp.float32", "np.float32", "float32", "fp32"],
)
def test_float32_dtype_turns_autocast_off(spelling):
    def f(x, w):
        h = jax.nn.relu(x @ w)
        return jnp.log(h + 1e-8), jnp.where(M, h, -1e9)

    fn = jxs.autocast(f, dtype=spelling)
    assert signature(fn, XW, W) == signature(f, XW, W)
    for out, ref in zip(fn(XW, W), f(XW, W), strict=True):
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize(
    "dtype, match",
    [
        pytest.param(jnp.float8_e4m3fn, "float8", id="jnp.float8_e4m3fn"),
        pytest.param(jnp.float8_e5m2, "float8", id="jnp.float8_e5m2"),
        pytest.param("float8_e4m3fn", "float8", id="float8_e4m3fn"),
        pytest.param(jnp.int8, "`dtype`", id="jnp.int8"),
        pytest.param("int8", "`dtype`", id="int8"),
    ],
)
def test_float8_and_integer_dtypes_are_refused(dtype, match):
    with pytest.raises(ValueError, match=match):
        jxs.autocast(jnp.exp, dtype=dtype)


# --------------------------------------------------------------------------- #
# 5. A primitive autocast does not know
# --------------------------------------------------------------------------- #

_halve_p = jcore.Primitive("jxs_test_libraries_halve")
_halve_p.def_impl(lambda x: x * 0.5)
_halve_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_halve_p, mlir.lower_fun(lambda x: x * 0.5, False))


@pytest.mark.parametrize("dtype", LOW)
def test_unknown_primitive_runs_at_its_inputs_dtype_silently(dtype):
    def f(x, w):
        return jnp.tanh(_halve_p.bind(x @ w))

    fn = jxs.autocast(f, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (eqn,) = [
            e for e in all_eqns(jax.make_jaxpr(fn)(XW, W)) if e.primitive is _halve_p
        ]
        out = jax.jit(fn)(XW, W)
    assert eqn.invars[0].aval.dtype == dtype
    assert eqn.outvars[0].aval.dtype == dtype
    assert out.dtype == F32  # contract 2
    tol = TOL[dtype]
    np.testing.assert_allclose(out, f(XW, W), rtol=tol, atol=tol)
