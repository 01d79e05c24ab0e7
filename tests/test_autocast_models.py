"""jxs.autocast on real models: a transformer block's jaxpr, and Flax linen and
NNX models written in float32 trained through autocast + dynamic_scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_eqns, relaxed

import jaxscale as jxs

pytestmark = pytest.mark.integration

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

F16, F32 = np.dtype("float16"), np.dtype("float32")
SUMS = {"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"}


class Block(nn.Module):
    """A pre-norm transformer block in plain float32 (flax's default dtype)."""

    heads: int = 2

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * x.shape[-1])(h)
        return x + nn.Dense(x.shape[-1])(jax.nn.gelu(h))


def test_transformer_block_matmuls_in_float16_sums_in_float32():
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    model = Block()
    params = model.init(jax.random.key(1), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    out = jax.jit(jxs.autocast(model.apply, cast_outputs=False))(params, x)
    assert out.dtype == F32  # the residual stream: x + float16
    ref = jax.jit(model.apply)(params, x)
    np.testing.assert_allclose(out, ref, rtol=5e-2, atol=5e-2)
    assert jax.eval_shape(jxs.autocast(model.apply), params, x).dtype == F32
    narrow = jxs.autocast(loss, gradient_dtype=jnp.float16)  # 16-bit dW products
    for fn in (jxs.autocast(loss), jax.grad(narrow)):
        eqns = list(all_eqns(jax.make_jaxpr(fn)(params, x)))
        dots = [e for e in eqns if e.primitive.name == "dot_general"]
        assert len(dots) >= 6
        for e in dots:
            assert [v.aval.dtype for v in e.invars] == [F16, F16], e
    forward = list(all_eqns(jax.make_jaxpr(jxs.autocast(loss))(params, x)))
    sums = [e for e in forward if e.primitive.name in SUMS]
    assert len(sums) >= 5  # norms' means and variances, softmax, the loss
    for e in sums:
        assert e.invars[0].aval.dtype == F32, e
    exps = [e for e in forward if e.primitive.name in {"exp", "rsqrt"}]
    assert exps and all(e.invars[0].aval.dtype == F32 for e in exps)
    grads = jax.eval_shape(jax.grad(jxs.autocast(loss)), params, x)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(32)(x))
        x = jax.nn.relu(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def regression_data(n=128):
    x = jax.random.normal(jax.random.key(2), (n, 8))
    return x, jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]


def test_linen_model_with_default_dtype_trains_through_autocast():
    model = MLP()
    x, y = regression_data()
    params = model.init(jax.random.key(3), x)
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    def train(loss_fn, steps=40):
        p, opt_state = params, tx.init(params)

        @jax.jit
        def step(p, opt_state):
            loss, grads = jxs.value_and_grad(loss_fn, opt_state)(p, x, y)
            updates, opt_state = tx.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss

        losses = []
        for _ in range(steps):
            p, opt_state, loss = step(p, opt_state)
            losses.append(float(loss))
        return p, opt_state, losses

    p, opt_state, losses = train(jxs.autocast(loss_fn))
    _, _, losses32 = train(loss_fn)
    assert losses[-1] < 0.25 * losses[0]
    assert abs(losses[-1] - losses32[-1]) < 0.1 * losses32[-1] + 1e-3
    assert {leaf.dtype for leaf in jax.tree.leaves(p)} == {F32}
    assert int(jxs.diagnostics.summary(opt_state)["skipped_steps"]) <= 1
    jaxpr = jax.make_jaxpr(jxs.autocast(loss_fn))(params, x, y)
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(e.outvars[0].aval.dtype == F16 for e in dots)


class Net(nnx.Module):
    """Plain float32 NNX model with state besides the parameters."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def test_nnx_model_trains_through_autocast_and_keeps_its_state():
    x, y = regression_data()
    model = Net(nnx.Rngs(0, dropout=1))
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss_fn = jxs.autocast(nnx_loss)
        loss, grads = jxs.value_and_grad(loss_fn, optimizer)(model, x, y)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(40)]
    assert losses[-1] < 0.3 * losses[0]
    assert int(model.drop.rngs.count[...]) == 40  # Dropout's RNG count written back
    mean, var = model.bn.mean[...], model.bn.var[...]
    assert mean.dtype == var.dtype == F32  # BatchNorm statistics, in float32
    assert float(jnp.abs(mean).sum()) > 0 and bool(jnp.all(var != 1.0))
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}


def test_nnx_module_argument_gets_its_state_back_outside_grad():
    x, _ = regression_data(16)
    model = Net(nnx.Rngs(0, dropout=1))
    ref = Net(nnx.Rngs(0, dropout=1))
    out = jxs.autocast(lambda m, x: m(x), cast_outputs=False)(model, x)
    ref_out = ref(x)
    assert out.dtype == F16  # the last Linear's output, bias included
    np.testing.assert_allclose(out, ref_out, rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(
        model.bn.mean[...], ref.bn.mean[...], rtol=1e-2, atol=1e-3
    )
    assert model.bn.mean.dtype == F32
    assert int(model.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 1
    # By default the output comes back in the dtype the model gives it; the
    # state is written back the same way.
    out, ref_out = jxs.autocast(lambda m, x: m(x))(model, x), ref(x)
    assert out.dtype == ref_out.dtype == F32
    np.testing.assert_allclose(out, ref_out, rtol=5e-2, atol=5e-2)
    assert model.bn.mean.dtype == F32
    assert int(model.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 2
    # A pure call writes nothing back.
    model.eval()
    before = jax.tree.leaves(nnx.state(model))
    jxs.autocast(lambda m, x: m(x))(model, x)
    after = jax.tree.leaves(nnx.state(model))
    assert all(a is b for a, b in zip(after, before, strict=True))
