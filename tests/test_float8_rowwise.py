"""``jxs.float8.RowwiseScaling``: one scale per row of each operand along the
product's contraction, in the forward and in both backward products."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_eqns, relaxed, unpriced_kind_warns

import jaxscale as jxs
from jaxscale.float8 import _numerics as numerics

pytestmark = [pytest.mark.core, pytest.mark.construct]

ROWWISE = jxs.float8.RowwiseScaling(min_dim=0)
TENSORWISE = jxs.float8.CurrentScaling(min_dim=0)
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)


def problem(seed=0, m=64, k=128, n=96):
    """x whose rows span 2**-8 .. 2**8 in magnitude (what tensorwise scaling
    handles worst: the small rows fall to float8's subnormals), w and a
    cotangent of ordinary size."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    rows = 2.0 ** jnp.linspace(-8, 8, m)[:, None]
    x = jax.random.normal(kx, (m, k)) * rows
    w = jax.random.normal(kw, (k, n)) / np.sqrt(k)
    g = jax.random.normal(kg, (m, n)) * rows
    return x, w, g


def matmul(x, w):
    return x @ w


def rel_rows(got, want):
    """The worst relative error of any row (norm of the row's error over the
    norm of the row)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(
        np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1))
    )


def grads(recipe, x, w, g):
    f = jxs.autocast(matmul, jnp.bfloat16, float8=recipe)
    y, vjp = jax.vjp(jax.jit(f), x, w)
    return (y, *vjp(g.astype(y.dtype)))


def test_every_row_keeps_float8_precision_where_tensorwise_loses_the_small_ones():
    x, w, g = problem()
    want_y, want_dx, want_dw = (np.asarray(v) for v in (x @ w, g @ w.T, x.T @ g))
    y, dx, dw = grads(ROWWISE, x, w, g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32
    # e4m3 rounds to 2**-4 relative, e5m2 to 2**-3; products of many terms
    # average their errors (measured: 4.6-4.8%, 7.2-7.7%, 7.3-7.7% over three
    # seeds).
    assert rel_rows(y, want_y) < 0.06
    assert rel_rows(dx, want_dx) < 0.1
    assert rel_rows(dw.T, want_dw.T) < 0.1
    # Tensorwise scaling puts the smallest rows of x in e4m3's subnormals
    # (19-25%); e5m2's range holds g's rows either way.
    ty, _, _ = grads(TENSORWISE, x, w, g)
    assert rel_rows(ty, want_y) > 3 * rel_rows(y, want_y)


def quantised(fun, *args):
    """The float8 casts in the jaxpr of ``fun`` (value and gradients), by
    dtype and the number of scales the cast divides by."""
    c = collections.Counter()
    for e in all_eqns(jax.make_jaxpr(fun)(*args)):
        out = e.outvars[0].aval if e.outvars else None
        if e.primitive.name == "convert_element_type" and "float8" in str(out.dtype):
            c[str(out.dtype)] += 1
    return dict(c)


def test_the_backward_quantises_along_its_own_contractions():
    x, w, g = problem(m=32, k=64, n=48)

    def loss(x, w):
        return jnp.sum(matmul(x, w) * g)

    vg = jax.grad(jxs.autocast(loss, jnp.bfloat16, float8=ROWWISE), (0, 1))
    # Forward x and w; backward w and x again, and g twice (once per product).
    assert quantised(vg, x, w) == {"float8_e4m3fn": 4, "float8_e5m2": 2}
    vt = jax.grad(jxs.autocast(loss, jnp.bfloat16, float8=TENSORWISE), (0, 1))
    assert quantised(vt, x, w) == {"float8_e4m3fn": 2, "float8_e5m2": 1}
    # Gradients close to float32's.
    for got, want in zip(vg(x, w), jax.grad(loss, (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=0.1, atol=0.06 * np.abs(want).max())


def test_rowwise_by_name_in_a_jitted_train_step():
    x, w, _ = problem(m=16, k=32, n=16)
    x = x / 256  # a loss that the first loss scale (2**15) keeps finite
    tx = jxs.dynamic_scaling(relaxed(optax.sgd(0.1)))
    f = jxs.autocast(lambda w, x: jnp.mean((x @ w) ** 2), jnp.float16, float8=ROWWISE)

    @jax.jit
    def step(w, opt_state):
        loss, grads = jxs.value_and_grad(f, opt_state)(w, x)
        updates, opt_state = tx.update(grads, opt_state, w)
        return w + updates, opt_state, loss

    w1, state, loss = step(w, tx.init(w))
    assert np.isfinite(float(loss)) and int(state.skipped_steps) == 0
    assert not np.array_equal(np.asarray(w1), np.asarray(w))
    # By name: "rowwise" is this class with its defaults (the cost model
    # leaves so small a product in 16 bits, and says so).
    named = jxs.autocast(matmul, jnp.bfloat16, float8="rowwise")
    with (
        unpriced_kind_warns(),
        pytest.warns(jxs.AutocastWarning, match="nothing runs in float8"),
    ):
        jax.make_jaxpr(named)(x, w)


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_a_non_finite_operand_makes_the_product_non_finite(bad):
    x, w, g = problem(m=16, k=32, n=16)
    x = x.at[3, 5].set(bad)
    y, dx, dw = grads(ROWWISE, x, w, g)
    assert not np.isfinite(np.asarray(y)[3]).any()  # the row that holds it
    assert np.isfinite(np.asarray(y)[np.arange(16) != 3]).all()  # others: exact rows
    assert not np.isfinite(np.asarray(dw)).all()


def test_amax_along_an_axis_is_exact_and_keeps_nan_over_inf():
    x = jnp.array([[1.0, -3.0, 2.0], [np.inf, 1.0, np.nan], [np.inf, 0.0, 1.0]])
    got = np.asarray(jax.jit(numerics.amax, static_argnums=1)(x, 1))
    assert got.shape == (3, 1)
    assert got[0, 0] == 3.0 and np.isnan(got[1, 0]) and got[2, 0] == np.inf
    assert numerics.amax(jnp.zeros((0, 4)), 0).shape == (1, 4)


def test_an_axiswise_recipe_with_state_is_refused():
    import dataclasses
    from typing import ClassVar

    @dataclasses.dataclass(frozen=True)
    class Stateful(jxs.float8.RowwiseScaling):
        needs_state: ClassVar[bool] = True

    with pytest.raises(TypeError, match="axiswise recipe.*needs_state"):
        Stateful(min_dim=0)


def test_remat_with_the_float8_policy_recomputes_no_rowwise_quantisation():
    x, w, g = problem(m=32, k=64, n=48)

    def loss(w, x):
        return jnp.sum(jnp.tanh(matmul(x, w)) * g)

    f = jxs.autocast(loss, jnp.bfloat16, float8=ROWWISE)
    plain = quantised(jax.grad(f), w, x)
    saved = jax.checkpoint(f, policy=jxs.float8.checkpoint_policy())
    assert quantised(jax.grad(saved), w, x) == plain
    # Any policy that saves what the site's backward reads gives the same
    # gradient; one that saves nothing recomputes the forward's casts too.
    everything = jax.checkpoint(f, policy=jax.checkpoint_policies.everything_saveable)
    nothing = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    want = jax.jit(jax.grad(f))(w, x)
    for g_ in (saved, everything, nothing):
        np.testing.assert_array_equal(jax.jit(jax.grad(g_))(w, x), want)
    assert sum(quantised(jax.grad(nothing), w, x).values()) > sum(plain.values())


def test_rowwise_in_a_scan_over_layers_and_in_the_report():
    # One site, run once per layer; the report counts it as float8.
    x = jax.random.normal(jax.random.key(0), (32, 64))
    ws = jax.random.normal(jax.random.key(1), (3, 64, 64)) / 8

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h**2)

    f = jxs.autocast(loss, jnp.bfloat16, float8=ROWWISE)
    got = jax.jit(jax.grad(f))(ws, x)
    want = jax.grad(loss)(ws, x)
    # Three float8 layers: 9.6% from float32's gradient (tensorwise: 9.7%).
    rel = np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want)
    assert rel < 0.15, rel
    report = jxs.diagnostics.autocast_report(loss, jnp.bfloat16, float8=ROWWISE)(ws, x)
    assert report.by_primitive["dot_general"] == {"float8": 1}  # one site, in scan
