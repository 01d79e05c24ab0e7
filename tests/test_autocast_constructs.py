"""jxs.autocast through every JAX construct, differentiation and training.

Each construct is checked three ways: forward values against the float32 function
(within float16 tolerance), dtypes in the jaxpr (matmuls on float16 operands,
loop carries and branch outputs consistent), and gradients (in the inputs' dtypes,
against the float32 gradients, the backward matmuls in float16 too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_eqns
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
from jaxscale import _hlo

pytestmark = [pytest.mark.integration, pytest.mark.construct]

F16, F32 = np.dtype("float16"), np.dtype("float32")
TOL = dict(rtol=3e-2, atol=3e-2)

W = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8))
B = jax.random.normal(jax.random.key(2), (8,)) * 0.1


def dot_dtypes(fun, *args):
    """The operand dtypes of every dot_general in ``fun``'s jaxpr, recursively."""
    jaxpr = jax.make_jaxpr(fun)(*args)
    return {
        tuple(str(v.aval.dtype) for v in e.invars)
        for e in all_eqns(jaxpr)
        if e.primitive.name == "dot_general"
    }


def total(out):
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))


def dtypes(tree):
    return [leaf.dtype for leaf in jax.tree.leaves(tree)]


def check(fn, *args, grads=True, dots=(("float16", "float16"),)):
    """Forward values, forward and backward matmul dtypes, gradients. Returns the
    outputs in the dtypes they were computed in (``cast_outputs=False``); with
    the default, they come back in the dtypes ``fn`` gives them."""
    cast = jxs.autocast(fn)
    computed = jxs.autocast(fn, cast_outputs=False)
    out, ref = jax.jit(computed)(*args), jax.jit(fn)(*args)
    default = jax.jit(cast)(*args)
    assert dtypes(default) == dtypes(jax.eval_shape(fn, *args))  # the contract
    for o in (out, default):
        jax.tree.map(
            lambda o, r: np.testing.assert_allclose(np.asarray(o, F32), r, **TOL),
            o,
            ref,
        )
    assert dot_dtypes(cast, *args) == dot_dtypes(computed, *args) == set(dots)
    if not grads:
        return out
    argnums = tuple(range(len(args)))
    g = jax.jit(jax.grad(lambda *a: total(cast(*a)), argnums))(*args)
    g_ref = jax.jit(jax.grad(lambda *a: total(fn(*a)), argnums))(*args)
    for a, gi, ri in zip(args, g, g_ref, strict=True):
        assert gi.dtype == a.dtype
        np.testing.assert_allclose(gi, ri, rtol=5e-2, atol=5e-2)
    # The backward's products: in float16, but for the weight-gradient terms of
    # float32 inputs, which take a float32 tangent and give float32 (the
    # cotangent crosses devices in float32; jaxscale._autocast.gradients).
    backward = jax.grad(lambda *a: total(cast(*a)), argnums)
    # (jax < 0.8 widens the mixed operands when tracing: float32 x float32.)
    wide = {("float32", "float16"), ("float16", "float32"), ("float32", "float32")}
    assert dot_dtypes(backward, *args) - wide == set(dots)
    narrow = jxs.autocast(fn, gradient_dtype=jnp.float16)
    backward = jax.grad(lambda *a: total(narrow(*a)), argnums)
    assert dot_dtypes(backward, *args) == set(dots)
    return out


# --------------------------------------------------------------------------- #
# Constructs
# --------------------------------------------------------------------------- #


def test_nested_jit_keeps_its_boundary():
    def fn(x, w):
        return jax.jit(lambda y: jnp.tanh(y @ w + B[None]))(x)

    assert check(fn, X, W).dtype == F16
    jaxpr = jax.make_jaxpr(jxs.autocast(fn))(X, W)
    assert [e.primitive.name for e in jaxpr.eqns].count("jit") == 1


def test_scan_over_layers_keeps_the_carry_dtype():
    ws = jax.random.normal(jax.random.key(3), (3, 8, 8)) * 0.3
    bs = jax.random.normal(jax.random.key(4), (3, 8)) * 0.1

    def fn(x, ws, bs):
        def layer(h, wb):
            w, b = wb
            h = jnp.tanh(h @ w + b[None])  # float16 inside the body
            return h, jnp.sum(h, axis=1)

        return lax.scan(layer, x, (ws, bs))

    h, sums = check(fn, X, ws, bs)
    assert h.dtype == F32  # the carry keeps the dtype it was traced with
    assert sums.dtype == F32  # reduce_sum
    body = next(
        e
        for e in all_eqns(jax.make_jaxpr(jxs.autocast(fn))(X, ws, bs))
        if e.primitive.name == "scan"
    )
    adds = [e for e in all_eqns(body.params["jaxpr"]) if e.primitive.name == "add"]
    assert [e.outvars[0].aval.dtype for e in adds] == [F16]  # the bias rule in a scan


def test_scan_carry_widens_to_the_incoming_dtype():
    def fn(x16):  # traced with a float16 carry, fed a float32 one by autocast
        step = lambda c, _: (jnp.tanh(c) * 0.5, c)  # noqa: E731
        return lax.scan(step, jnp.exp(x16), None, length=2)

    x16 = X.astype(jnp.float16)
    carry, ys = fn(x16)
    assert carry.dtype == ys.dtype == F16
    carry, ys = jxs.autocast(fn, cast_outputs=False)(x16)
    assert carry.dtype == ys.dtype == F32  # computed in float32 throughout
    np.testing.assert_allclose(carry, fn(x16)[0], **TOL)
    carry, ys = jxs.autocast(fn)(x16)  # the output contract: as fn gives them
    assert carry.dtype == ys.dtype == F16
    np.testing.assert_allclose(np.asarray(carry, F32), fn(x16)[0], **TOL)


def test_while_loop_forward_and_jvp():
    def fn(x, w, n):
        return lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w), x)

    n = jnp.int32(3)
    cast = jxs.autocast(fn)
    out = jax.jit(cast)(X, W, n)
    assert out.dtype == F32  # the carry keeps the traced dtype
    np.testing.assert_allclose(out, fn(X, W, n), **TOL)
    assert dot_dtypes(cast, X, W, n) == {("float16", "float16")}
    tangent = jnp.ones_like(X)
    _, t = jax.jvp(lambda x: cast(x, W, n), (X,), (tangent,))
    _, t_ref = jax.jvp(lambda x: fn(x, W, n), (X,), (tangent,))
    assert t.dtype == F32
    np.testing.assert_allclose(t, t_ref, **TOL)


def test_cond_branches_agree_on_the_widest_dtype():
    def fn(x, w):
        return lax.cond(jnp.sum(x) > 0, lambda y: y @ w, lambda y: jnp.exp(y), x)

    for x in (X, -jnp.abs(X)):
        assert check(fn, x, W).dtype == F32  # float16 and float32 branches

    def three(x, w):
        index = jnp.argmax(jnp.sum(x, axis=1)) % 3
        branches = [lambda y: y @ w, lambda y: jnp.tanh(y @ w), lambda y: (y @ w) * 2]
        return lax.switch(index, branches, x)

    assert check(three, X, W).dtype == F16  # all branches float16


def test_checkpoint_is_kept_with_its_policy():
    policy = jax.checkpoint_policies.nothing_saveable

    def fn(x, w):
        return jax.checkpoint(lambda y: jnp.sin(y @ w) @ w, policy=policy)(x)

    assert check(fn, X, W).dtype == F16
    jaxpr = jax.make_jaxpr(jxs.autocast(fn))(X, W)
    (remat,) = [
        e
        for e in jaxpr.jaxpr.eqns
        if "remat" in e.primitive.name or e.primitive.name == "checkpoint"
    ]
    assert remat.params["policy"] is policy


def test_checkpoint_names_are_transparent():
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_only_these_names("h")

    def fn(x, w):
        def body(y):  # the named value stays float16, and so does the bias add
            return jnp.tanh(checkpoint_name(y @ w, "h") + B[None]) @ w

        return jax.checkpoint(body, policy=policy)(x)

    assert check(fn, X, W).dtype == F16
    jaxpr = jax.make_jaxpr(jxs.autocast(fn))(X, W)
    (name,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "name"]
    assert name.outvars[0].aval.dtype == F16


def test_custom_jvp_rules_are_kept():
    @jax.custom_jvp
    def odd(x):
        return jnp.sin(x)

    odd.defjvp(lambda p, t: (odd(p[0]), 3.0 * t[0]))  # deliberately not cos

    fn = jxs.autocast(lambda x, w: odd(x @ w))
    g = jax.grad(lambda x: total(fn(x, W)))(X)
    np.testing.assert_allclose(g, jnp.sum(3.0 * W, axis=1)[None].repeat(4, 0), **TOL)
    # jax.nn.relu's rule gives 0 at 0, where differentiating max(x, 0) gives 0.5.
    g0 = jax.grad(lambda x: total(jxs.autocast(jax.nn.relu)(x)))(jnp.zeros(3))
    np.testing.assert_array_equal(g0, jnp.zeros(3))
    assert jxs.autocast(jax.nn.relu)(X).dtype == F32  # keep: its input's dtype


@pytest.mark.parametrize(
    "name, fn, dtype",
    [
        ("relu", lambda x, w: jax.nn.relu(x @ w), F16),
        ("softmax", lambda x, w: jax.nn.softmax(x @ w), F32),
        ("log_softmax", lambda x, w: jax.nn.log_softmax(x @ w), F32),
        ("gelu", lambda x, w: jax.nn.gelu(x @ w), F16),  # x**3: integer_pow, keep
        ("gelu_exact", lambda x, w: jax.nn.gelu(x @ w, approximate=False), F16),
        ("logsumexp", lambda x, w: jax.nn.logsumexp(x @ w, axis=1), F32),
        ("silu", lambda x, w: jax.nn.silu(x @ w), F16),
    ],
)
def test_jax_nn_functions(name, fn, dtype):
    assert check(fn, X, W).dtype == dtype


def test_custom_vjp_rules_are_kept_and_their_backward_runs_in_float16():
    @jax.custom_vjp
    def project(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        return 0.5 * (g @ w.T), x.T @ g  # deliberately half the input gradient

    project.defvjp(fwd, bwd)
    fn = lambda x, w: jnp.tanh(project(x, w))  # noqa: E731
    cast = jxs.autocast(fn)
    assert jxs.autocast(fn, cast_outputs=False)(X, W).dtype == F16
    assert cast(X, W).dtype == F32  # the output contract
    gx, gw = jax.grad(lambda x, w: total(cast(x, w)), (0, 1))(X, W)
    ref = jax.grad(lambda x, w: total(jnp.tanh(x @ w)), (0, 1))(X, W)
    assert gx.dtype == gw.dtype == F32
    np.testing.assert_allclose(gx, 0.5 * ref[0], **TOL)
    np.testing.assert_allclose(gw, ref[1], **TOL)
    backward = jax.grad(lambda x, w: total(cast(x, w)), (0, 1))
    assert dot_dtypes(backward, X, W) == {("float16", "float16")}


def test_optax_losses_and_dot_product_attention():
    labels = jnp.array([0, 3, 5, 7])

    def fn(x, w, q):
        logits = x @ w + B[None]
        onehot = jax.nn.one_hot(labels, 8)
        return (
            optax.softmax_cross_entropy(logits, onehot).mean(),
            optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
            optax.sigmoid_binary_cross_entropy(logits, onehot).mean(),
            optax.l2_loss(logits, onehot).mean(),
            jax.nn.dot_product_attention(q @ w, q, q, is_causal=True),
        )

    q = jax.random.normal(jax.random.key(5), (2, 6, 2, 8))
    out = check(fn, X, W, q)
    assert [o.dtype for o in out] == [F32] * 4 + [F16]


def test_shard_map():
    mesh = jax.make_mesh(
        (8,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:8]
    )
    x = jax.random.normal(jax.random.key(6), (16, 8))

    def fn(x, w):
        body = lambda a, w: lax.psum(jnp.sum(jnp.tanh(a @ w)), "d")  # noqa: E731
        sm = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        return sm(x, w)

    assert check(fn, x, W).dtype == F32


def test_vmap_inside_and_outside():
    def per_example(x, w, b):  # rank-1: the bias is as wide as the output
        return jax.nn.relu(x @ w + b) @ w + b

    inside = check(
        lambda x, w, b: jax.vmap(per_example, (0, None, None))(x, w, b), X, W, B
    )
    assert inside.dtype == F16
    outside = jax.vmap(jxs.autocast(per_example, cast_outputs=False), (0, None, None))(
        X, W, B
    )
    assert outside.dtype == F16
    np.testing.assert_allclose(outside, inside, **TOL)
    default = jax.vmap(jxs.autocast(per_example), (0, None, None))(X, W, B)
    assert default.dtype == F32
    np.testing.assert_allclose(default, outside.astype(F32), rtol=1e-3, atol=1e-3)
    g = jax.grad(
        lambda w: total(jax.vmap(jxs.autocast(per_example), (0, None, None))(X, w, B))
    )(W)
    g_ref = jax.grad(lambda w: total(jax.vmap(per_example, (0, None, None))(X, w, B)))(
        W
    )
    np.testing.assert_allclose(g, g_ref, rtol=5e-2, atol=5e-2)


# --------------------------------------------------------------------------- #
# Differentiation
# --------------------------------------------------------------------------- #


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    logits = h @ params["w2"] + params["b2"][None]
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(4)).mean()


def mlp_by_hand(params, x):
    p = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    h = jax.nn.relu(x.astype(jnp.float16) @ p["w1"] + p["b1"][None])
    logits = (h @ p["w2"] + p["b2"][None]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(4)).mean()


PARAMS = {"w1": W, "b1": B, "w2": W[:, :6] * 2, "b2": B[:6]}


def test_gradients_match_the_hand_cast_function_and_run_in_float16():
    grad = jax.jit(jax.grad(jxs.autocast(mlp)))
    g, g_hand = grad(PARAMS, X), jax.jit(jax.grad(mlp_by_hand))(PARAMS, X)
    for k in PARAMS:
        assert g[k].dtype == F32
        np.testing.assert_allclose(g[k], g_hand[k], rtol=1e-2, atol=1e-3)
    # With `gradient_dtype=float16`, every matmul of the un-optimised program
    # (2 forward, 3 backward) has float16 operands and a float16 result.
    narrow = jxs.autocast(mlp, gradient_dtype=jnp.float16)
    hlo = jax.jit(jax.grad(narrow)).lower(PARAMS, X).as_text()
    dots = _hlo.stablehlo_dots(hlo)
    assert len(dots) == 5
    for dot in dots:
        assert [t for t, _ in (*dot.operands, dot.result)] == ["f16"] * 3, dot
    # By default the two weight gradients come out of their products in
    # float32, for a GPU from float16 operands (the dot algorithm); the
    # activation's gradient stays float16.
    hlo = (
        jax.jit(jax.grad(jxs.autocast(mlp)))
        .trace(PARAMS, X)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    dots = _hlo.stablehlo_dots(hlo)
    assert len(dots) == 5
    f16_f32 = [d for d in dots if "lhs_precision_type = f16" in d.attrs]
    assert len(f16_f32) == 2, dots
    for dot in f16_f32:
        assert "accumulation_type = f32" in dot.attrs and dot.result[0] == "f32", dot


def bias_stack(width=256, depth=4, batch=512):
    """A Dense stack ``tanh(h @ w + b)`` written in float32 (``cast_by_hand``:
    the same stack cast to float16 by hand), its parameters and a batch."""
    k = jax.random.split(jax.random.key(7), 8)
    params = [
        {"w": jax.random.normal(k[i], (width, width)) * 0.05, "b": jnp.zeros(width)}
        for i in range(depth)
    ]
    x = jax.random.normal(k[-1], (batch, width))

    def net(ps, x, cast_by_hand=False):
        h = x.astype(jnp.float16) if cast_by_hand else x
        for p in ps:
            w, b = (
                (p["w"].astype(h.dtype), p["b"].astype(h.dtype))
                if cast_by_hand
                else (p["w"], p["b"])
            )
            h = jnp.tanh(h @ w + b[None])
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return net, params, x


def test_float16_activations_with_the_bias_rule():
    """The bias rule keeps the activations of a Dense stack in float16 through
    the training step's gradient, where plain promotion turns every activation
    after a bias back to float32. (What XLA then allocates, against the
    hand-cast stack: tests/test_compiled_memory.py, on the default jax.)"""
    net, params, x = bias_stack()
    activation = x.size

    def activations(loss):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
        out = {}
        for e in all_eqns(jaxpr):
            if e.primitive.name == "tanh" and e.outvars[0].aval.size == activation:
                dtype = str(e.outvars[0].aval.dtype)
                out[dtype] = out.get(dtype, 0) + 1
        return out

    assert activations(jxs.autocast(net)) == {"float16": 4}
    assert activations(jxs.autocast(net, rules={"add": "promote"})) == {"float32": 4}
    assert activations(lambda ps, x: net(ps, x, cast_by_hand=True)) == {"float16": 4}
