"""Float8 autocast on models nobody here wrote, as installed: Flax linen
attention with a padding mask, Equinox ``Linear`` under ``jax.vmap``, and
``nn.scan`` over layers trained with delayed scaling (a state for another depth
refused; the GEMM check of a step with nothing in float8 not ok)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_eqns, relaxed, unpriced_kind_warns

import jaxscale as jxs

pytestmark = pytest.mark.integration

nn = pytest.importorskip("flax.linen")

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F8 = {E4M3, E5M2}
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype("float32")


def _normal(seed, shape, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(x, jnp.float32)


def _dots(fun, *args):
    eqns = all_eqns(jax.make_jaxpr(fun)(*args))
    return [e for e in eqns if e.primitive.name == "dot_general"]


def _dtypes(eqn):
    return tuple(np.dtype(v.aval.dtype) for v in eqn.invars)


def _batched(eqn):
    (_, _), (bl, br) = eqn.params["dimension_numbers"]
    return bool(bl or br)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Block(nn.Module):
    """Self-attention with a padding mask, then an MLP, in float32."""

    heads: int = 2

    @nn.compact
    def __call__(self, x, mask):
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(x, x, mask=mask)
        h = nn.LayerNorm()(x + h)
        return h + nn.Dense(x.shape[-1])(jax.nn.relu(nn.Dense(64)(h)))


def test_flax_attention_block_projections_in_float8_scores_in_16_bit():
    B, S, D = 2, 16, 32
    x = _normal(0, (B, S, D))
    valid = jnp.arange(S)[None, :] < jnp.array([[S], [9]])  # the second is padded
    mask = nn.make_attention_mask(valid, valid)
    model = Block()
    params = jax.jit(model.init)(jax.random.key(1), x, mask)
    recipe = jxs.float8.CurrentScaling(min_dim=16)

    def loss(params, x, mask):
        y = model.apply(params, x, mask)
        y = jnp.where(valid[..., None], y, 0.0)
        return jnp.sum(y * y) / jnp.sum(valid).astype(jnp.float32)

    grad_fn = jax.value_and_grad(jxs.autocast(loss, jnp.bfloat16, float8=recipe))

    @jax.jit
    def run(params, x, mask):
        out = jxs.autocast(model.apply, jnp.bfloat16, float8=recipe)(params, x, mask)
        ref = model.apply(params, x, mask)
        return out, ref, grad_fn(params, x, mask), jax.grad(loss)(params, x, mask)

    out, ref, (value, grads), ref_grads = run(params, x, mask)
    assert out.dtype == F32 and np.isfinite(np.asarray(out)).all()  # padded too
    assert _rel_err(out, ref) < 0.1  # e4m3 operands: a few percent
    assert np.isfinite(float(value))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert g.dtype == F32 and np.isfinite(np.asarray(g)).all(), path
        assert np.asarray(g).any(), path  # every parameter is trained
    # Each float8 backward product adds the error of an e5m2 gradient (2
    # mantissa bits: about 7% rms); the attention projections' gradients pass
    # through up to three of them, and compound to about 15%.
    errs = jax.tree.map(_rel_err, grads, ref_grads)
    del errs["params"]["MultiHeadDotProductAttention_0"]["key"]["bias"]  # 0 in f32
    for path, err in jax.tree_util.tree_leaves_with_path(errs):
        assert err < 0.25, (path, err)

    dots = _dots(grad_fn, params, x, mask)
    sites = [e for e in dots if set(_dtypes(e)) & F8]
    # Forward: query, key, value, out (DenseGeneral) and the two Dense layers;
    # backward: two products each, with an e5m2 gradient.
    assert sum(_dtypes(e) == (E4M3, E4M3) for e in sites) == 6
    assert sum(E5M2 in _dtypes(e) for e in sites) == 12
    assert not any(_batched(e) for e in sites)
    scores = [e for e in dots if _batched(e)]
    assert len(scores) == 6  # q.k and p.v, forward and both backward products
    assert all(_dtypes(e) == (BF16, BF16) for e in scores)


eqx = pytest.importorskip("equinox")


def test_equinox_linear_under_vmap_is_a_site_with_the_weight_as_lhs():
    lin = eqx.nn.Linear(32, 48, key=jax.random.key(0))
    x = _normal(1, (40, 32))
    recipe = jxs.float8.CurrentScaling(min_dim=16)
    f = jxs.autocast(jax.vmap(lin), jnp.bfloat16, float8=recipe, cast_outputs=False)
    (site,) = _dots(f, x)
    # eqx computes weight @ x: under vmap, the weight [out, in] is the lhs.
    assert _dtypes(site) == (E4M3, E4M3)
    assert [v.aval.shape for v in site.invars] == [(48, 32), (32, 40)]
    y = jax.jit(f)(x)
    assert y.dtype == BF16 and y.shape == (40, 48)
    assert _rel_err(y, jax.vmap(lin)(x)) < 0.1

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(model, x):
        y = jxs.autocast(jax.vmap(model), jnp.bfloat16, float8=recipe)(x)
        return jnp.mean(y * y)

    g8 = grads(lin, x)
    g32 = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(lin, x)
    assert _rel_err(g8.weight, g32.weight) < 0.15
    assert _rel_err(g8.bias, g32.bias) < 0.15
    # vmap outside autocast traces one example: a matrix-vector product, no
    # site, and a warning that says so.
    per_example = jax.vmap(jxs.autocast(lin, jnp.bfloat16, float8=recipe))
    with pytest.warns(jxs.AutocastWarning, match="nothing runs in float8.*N=1"):
        found = _dots(per_example, x)
    assert found and all(not set(_dtypes(e)) & F8 for e in found)


def test_equinox_delayed_state_rows_are_the_dots_operands():
    # Rows are the dot's left operand, right operand and gradient (documented
    # so): equinox's Linear computes ``weight @ x``, so row 0 is the weight.
    lin = eqx.nn.Linear(32, 48, key=jax.random.key(0))
    x = _normal(1, (40, 32), 3.0)
    params, static = eqx.partition(lin, eqx.is_inexact_array)
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)

    def loss(params, x):
        model = eqx.combine(params, static)
        y = jxs.autocast(jax.vmap(model), jnp.bfloat16, float8=recipe)(x)
        return jnp.mean(y * y)

    state = jxs.float8.init(loss, params, x)
    _, _, state = jax.jit(lambda p, s, x: jxs.float8.value_and_grad(loss, s)(p, x))(
        params, state, x
    )
    lhs, rhs = np.asarray(state.history[0][:2, 0])
    assert lhs == np.abs(np.asarray(lin.weight)).max()
    assert rhs == np.abs(np.asarray(x)).max()


D = 32


class Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(D)(h)), None


class Stack(nn.Module):
    """An input projection, ``layers`` layers under ``nn.scan``, a scalar head."""

    layers: int = 3

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            Layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        h, _ = layers()(nn.Dense(D)(x), None)
        return nn.Dense(1)(h)


def test_linen_scan_over_layers_trains_with_delayed_scaling():
    model = Stack()
    x = _normal(0, (64, 16))
    y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    params = jax.jit(model.init)(jax.random.key(1), x)
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)

    def loss(params, x, y):
        out = jxs.autocast(model.apply, jnp.bfloat16, float8=recipe)(params, x)
        return jnp.mean((out - y) ** 2)

    state = jxs.float8.init(loss, params, x, y)
    # The input projection and the scanned layer (the 1-wide head is too small).
    assert len(state.sites) == 2
    assert any("Dense_0" in s and "contracting 16" in s for s in state.sites)
    assert any("contracting 32" in s for s in state.sites)
    tx = relaxed(optax.adam(1e-2))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, state, x, y):
        value, grads, state = jxs.float8.value_and_grad(loss, state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    losses = []
    for _ in range(15):
        before = params
        params, opt_state, state, value = step(params, opt_state, state, x, y)
        losses.append(float(value))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses
    assert step._cache_size() == 1
    for h, s in zip(state.history, state.scale, strict=True):
        assert (np.asarray(h) > 0).all()  # four steps recorded in every row
        assert np.isfinite(np.asarray(s)).all() and (np.asarray(s) > 0).all()
    # The scanned site's weight row holds the max over the three layers'
    # kernels (as they were in the last step), not one layer's, not a sum.
    kernels = np.asarray(before["params"]["ScanLayer_0"]["Dense_0"]["kernel"])
    per_layer = np.abs(kernels).max(axis=(1, 2))
    assert kernels.shape == (3, D, D) and len(set(per_layer.tolist())) == 3
    scan_site = next(i for i, s in enumerate(state.sites) if "contracting 32" in s)
    assert state.history[scan_site].shape == (3, 4)
    assert float(state.history[scan_site][1, 0]) == per_layer.max()


def _stack_loss(model, recipe):
    def loss(params, x, y):
        out = jxs.autocast(model.apply, jnp.bfloat16, float8=recipe)(params, x)
        return jnp.mean((out - y) ** 2)

    return loss


def test_linen_scan_state_for_three_layers_is_refused_by_two_under_jit():
    x = _normal(0, (64, 16))
    y = jnp.sin(x[:, :1])
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)
    three, two = Stack(layers=3), Stack(layers=2)
    p3 = jax.jit(three.init)(jax.random.key(1), x)
    p2 = jax.jit(two.init)(jax.random.key(1), x)
    loss3, loss2 = _stack_loss(three, recipe), _stack_loss(two, recipe)
    s3 = jxs.float8.init(loss3, p3, x, y)
    assert s3.sites[1].endswith("contracting 32, in a scan of length 3"), s3.sites

    def step(loss):
        return jax.jit(lambda p, s, x, y: jxs.float8.value_and_grad(loss, s)(p, x, y))

    # Site 0 (the input projection) matches; the scanned layer does not.
    want = r"site 1: state '.*length 3', function '.*length 2'\).*another length"
    with pytest.raises(ValueError, match=want):
        step(loss2)(p2, s3, x, y)
    with pytest.raises(ValueError, match=want):
        jax.jit(jxs.float8.apply(loss2, s3))(p2, x, y)
    s2 = jxs.float8.init(loss2, p2, x, y)
    _, _, s2 = step(loss2)(p2, s2, x, y)
    assert all((np.asarray(h)[:, 0] > 0).all() for h in s2.history)


def test_gemm_report_of_a_linen_step_with_nothing_in_float8_is_not_ok():
    # float8=True: the cost model declines this model's products (on any
    # kind), and the check must not pass vacuously.
    model = Stack()
    x = _normal(0, (64, 16))
    y = jnp.sin(x[:, :1])
    params = jax.jit(model.init)(jax.random.key(1), x)

    def step(recipe):
        return jax.jit(jax.value_and_grad(_stack_loss(model, recipe)))

    with (
        unpriced_kind_warns(),
        pytest.warns(jxs.AutocastWarning, match="nothing runs in float8"),
    ):
        report = jxs.float8.gemm_report(step(True), params, x, y)
    assert report.float8_dots == 0 and not report.ok
    assert "NOT ok" in str(report) and "lower it" in str(report)
    report = jxs.float8.gemm_report(
        step(jxs.float8.CurrentScaling(min_dim=16)), params, x, y
    )
    assert report.ok, report
    # The input projection and the scanned layer: the input's gradient is not
    # needed, so five products.
    assert report.float8_dots == report.rewritable == 5
