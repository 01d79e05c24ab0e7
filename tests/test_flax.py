"""Flax: the stock linen TrainState with dynamic_scaling, jaxscale.flax.TrainState
(step counts applied updates), and nnx.Optimizer with an nnx.jit step in float16."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
from jaxscale.testing import assert_bit_identical

pytestmark = pytest.mark.core

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxscale.flax as jxf  # noqa: E402


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, :3].sum(axis=1) > 0).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


# --------------------------------------------------------------------------- #
# Linen
# --------------------------------------------------------------------------- #


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dtype=jnp.float16, param_dtype=jnp.float32)(x)
        x = nn.relu(x)
        return nn.Dense(2, dtype=jnp.float16, param_dtype=jnp.float32)(x)


def linen_state(cls, tx):
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 6)))["params"]
    return cls.create(apply_fn=model.apply, params=params, tx=tx)


def linen_loss(params, apply_fn, x, y):
    logits = apply_fn({"params": params}, x.astype(jnp.float16))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y
    ).mean()


traces = []


@jax.jit
def linen_step(state, x, y):
    traces.append(1)
    loss, grads = jxs.value_and_grad(linen_loss, state)(
        state.params, state.apply_fn, x, y
    )
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("cls", [train_state.TrainState, jxf.TrainState])
def test_linen_train_state_trains_under_jit(cls):
    state = linen_state(cls, jxs.dynamic_scaling(relaxed(optax.adamw(1e-2))))
    x, y = data()
    losses = []
    for _ in range(30):
        state, loss = linen_step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    assert jxs.loss_scale_of(state).loss_scale.dtype == jnp.float32
    applied = int(state.opt_state.steps) - int(state.opt_state.skipped_steps)
    # The stock class counts attempts; jaxscale.flax.TrainState applied updates.
    expected = 30 if cls is train_state.TrainState else applied
    assert int(state.step) == expected
    # optax's own count (what drives a schedule) agrees with jxf.TrainState.step
    assert int(optax.tree.get(state.opt_state, "count")) == applied


@pytest.mark.parametrize("cls", [train_state.TrainState, jxf.TrainState])
def test_linen_skipped_step_leaves_params_and_inner_state_bit_identical(cls):
    state = linen_state(cls, jxs.dynamic_scaling(relaxed(optax.adamw(1e-2))))
    x, y = data()
    for _ in range(3):
        state, _ = linen_step(state, x, y)
    bad_x = x.at[3, 1].set(jnp.inf)
    new, _ = linen_step(state, bad_x, y)
    assert not bool(new.opt_state.last_step_finite)
    assert_bit_identical(new.params, state.params)
    assert_bit_identical(new.opt_state.inner_state, state.opt_state.inner_state)
    assert int(new.opt_state.skipped_steps) == int(state.opt_state.skipped_steps) + 1
    # The policy: the stock step counts the attempt, jxf.TrainState does not.
    step_delta = int(new.step) - int(state.step)
    assert step_delta == (1 if cls is train_state.TrainState else 0)
    # The next step trains normally.
    newer, _ = linen_step(new, x, y)
    assert bool(newer.opt_state.last_step_finite)
    assert int(newer.step) == int(new.step) + 1


def test_jxf_train_state_does_not_retrace():
    state = linen_state(jxf.TrainState, jxs.dynamic_scaling(optax.sgd(0.1)))
    x, y = data()
    state, _ = linen_step(state, x, y)  # step: Python int -> weak int32
    n = len(traces)
    for i in range(4):
        state, _ = linen_step(state, x.at[0, 0].set(jnp.inf) if i == 1 else x, y)
    assert len(traces) == n
    assert int(state.opt_state.skipped_steps) >= 1


def test_jxf_train_state_with_accumulate_counts_effective_steps():
    k = 3
    tx = jxs.accumulate(jxs.dynamic_scaling(relaxed(optax.adamw(1e-2))), k)
    state = linen_state(jxf.TrainState, tx)
    stock = linen_state(train_state.TrainState, tx)
    x, y = data()
    for _ in range(2 * k):
        state, _ = linen_step(state, x, y)
        stock, _ = linen_step(stock, x, y)
    inner = state.opt_state.inner_state
    assert int(inner.steps) == 2
    assert int(state.step) == 2 - int(inner.skipped_steps)
    assert int(stock.step) == 2 * k
    assert_bit_identical(state.params, stock.params)


def test_jxf_train_state_with_clipping_chain_and_subclass_fields():
    class StateWithStats(jxf.TrainState):
        extra: jax.Array

    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 6)))["params"]
    tx = optax.chain(
        jxs.dynamic_scaling(optax.chain(jxs.clip_by_global_norm(1.0), optax.sgd(0.1))),
        optax.identity(),
    )
    state = StateWithStats.create(
        apply_fn=model.apply, params=params, tx=tx, extra=jnp.zeros(())
    )
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g, extra=jnp.ones(())))(
        state, grads
    )
    assert int(new.step) == 0
    assert float(new.extra) == 0.0  # a skipped step keeps the other fields too
    assert_bit_identical(new.params, state.params)
    assert isinstance(new, StateWithStats)


def test_update_applied():
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    s0 = tx.init({"w": jnp.zeros(2)})
    _, s1 = tx.update({"w": jnp.ones(2)}, s0)
    _, s2 = tx.update({"w": jnp.array([jnp.nan, 1.0])}, s1)
    assert bool(jxf.update_applied(s0, s1))
    assert not bool(jxf.update_applied(s1, s2))
    assert not bool(jxf.update_applied(s1, s1))  # no update call in between


def test_create_rejects_tx_without_dynamic_scaling():
    with pytest.raises(ValueError, match="`tx` must contain exactly one"):
        linen_state(jxf.TrainState, optax.sgd(0.1))
    two = optax.chain(
        jxs.dynamic_scaling(optax.sgd(0.1)), jxs.dynamic_scaling(optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match="`tx` must contain exactly one .* got 2"):
        linen_state(jxf.TrainState, two)


def test_update_applied_rejects_states_without_scaling():
    s = jxs.dynamic_scaling(optax.sgd(0.1)).init(jnp.zeros(2))
    with pytest.raises(
        ValueError, match="`old_opt_state` contains no jxs.DynamicScalingState"
    ):
        jxf.update_applied(optax.sgd(0.1).init(jnp.zeros(2)), s)
    with pytest.raises(
        ValueError, match="`new_opt_state` contains no jxs.DynamicScalingState"
    ):
        jxf.update_applied(s, ())


def test_import_jaxscale_does_not_import_flax_integration():
    code = (
        "import sys, jaxscale; "
        "assert 'jaxscale.flax' not in sys.modules; "
        "assert 'flax' not in sys.modules, 'flax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# --------------------------------------------------------------------------- #
# NNX
# --------------------------------------------------------------------------- #


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        kw = {"dtype": jnp.float16, "param_dtype": jnp.float32, "rngs": rngs}
        self.l1 = nnx.Linear(6, 16, **kw)
        self.l2 = nnx.Linear(16, 2, **kw)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x.astype(jnp.float16))))


def nnx_loss(model, x, y):
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def nnx_step(model, optimizer, x, y):
    loss, grads = jxs.value_and_grad(nnx_loss, optimizer)(model, x, y)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def nnx_step_filtered(model, optimizer, x, y):
    ls = jxs.loss_scale_of(optimizer)

    def scaled_loss(model):
        loss = nnx_loss(model, x, y)
        return ls.scale(loss), loss

    (_, loss), grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


def nnx_setup():
    model = NNXMLP(nnx.Rngs(0))
    tx = jxs.dynamic_scaling(relaxed(optax.adamw(1e-2)))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize("step", [nnx_step, nnx_step_filtered])
def test_nnx_optimizer_trains_in_float16(step):
    model, optimizer = nnx_setup()
    x, y = data()
    losses = [float(step(model, optimizer, x, y)) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    state = optimizer.opt_state
    assert int(state.steps[...]) == 30
    # nnx.Optimizer.step counts update calls (attempts), skipped or not.
    assert int(optimizer.step[...]) == 30
    summary = jxs.diagnostics.summary(optimizer)
    assert int(summary["steps"]) == 30
    assert int(optimizer.step[...]) - int(summary["skipped_steps"]) == int(
        optax.tree.get(nnx.to_pure_dict(nnx.state(optimizer.opt_state)), "count")
    )


def test_loss_scale_of_sees_through_opt_array():
    model, optimizer = nnx_setup()
    leaf = optimizer.opt_state.loss_scale.loss_scale
    assert isinstance(leaf, nnx.OptArray)
    for holder in (optimizer, optimizer.opt_state):
        ls = jxs.loss_scale_of(holder)
        assert isinstance(ls, jxs.DynamicLossScale)
        assert isinstance(ls.loss_scale, jax.Array)
        assert ls.loss_scale.dtype == jnp.float32
        assert float(ls.loss_scale) == 2.0**16
    x, y = data()
    nnx_step(model, optimizer, x, y)
    assert isinstance(jxs.loss_scale_of(optimizer).loss_scale, jax.Array)


def test_nnx_skipped_step_leaves_model_and_optimizer_bit_identical():
    model, optimizer = nnx_setup()
    x, y = data()
    for _ in range(3):
        nnx_step(model, optimizer, x, y)
    before_params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    before_opt = jax.tree.map(jnp.copy, nnx.state(optimizer.opt_state))
    scale = float(jxs.loss_scale_of(optimizer).loss_scale)
    skipped = int(optimizer.opt_state.skipped_steps[...])

    nnx_step(model, optimizer, x.at[5, 2].set(jnp.nan), y)

    assert not bool(optimizer.opt_state.last_step_finite[...])
    assert int(optimizer.opt_state.skipped_steps[...]) == skipped + 1
    assert float(jxs.loss_scale_of(optimizer).loss_scale) == scale / 2
    assert_bit_identical(nnx.state(model, nnx.Param), before_params)
    after_opt = nnx.state(optimizer.opt_state)
    assert_bit_identical(after_opt["inner_state"], before_opt["inner_state"])
    # The next step trains normally.
    nnx_step(model, optimizer, x, y)
    assert bool(optimizer.opt_state.last_step_finite[...])
    after = nnx.state(model, nnx.Param)
    assert not all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(after), jax.tree.leaves(before_params), strict=True
        )
    )


def test_nnx_with_accumulate_and_split_model():
    """A lax.scan over micro-batches on a split NNX model, one update per step."""
    model = NNXMLP(nnx.Rngs(1))
    tx = jxs.dynamic_scaling(
        optax.chain(jxs.clip_by_global_norm(1.0), relaxed(optax.adamw(1e-2)))
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params, x, y):
            return nnx_loss(nnx.merge(graphdef, params, rest), x, y)

        grad_fn = jxs.accumulate_value_and_grad(loss_fn, optimizer, num_microbatches=4)
        loss, grads = grad_fn(params, x, y)
        optimizer.update(model, grads)
        return loss

    x, y = data(32)
    losses = [float(step(model, optimizer, x, y)) for _ in range(25)]
    assert losses[-1] < 0.7 * losses[0]
    assert int(optimizer.opt_state.steps[...]) == 25


def test_nnx_split_state_with_a_stateless_inner_optimizer():
    """An nnx.State from ``nnx.split`` keeps the arrays (here with an empty
    inner state, which the split drops): summary and validate_state read it;
    loss_scale_of, which needs the configuration from the GraphDef, says to
    merge first."""
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jxs.dynamic_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    assert int(jxs.diagnostics.summary(state)["steps"]) == 0
    assert float(jxs.diagnostics.summary(state)["loss_scale"]) == 2.0**16
    assert jxs.validate_state(state) is state
    with pytest.raises(ValueError, match=r"nnx.merge\(graphdef, state\)"):
        jxs.loss_scale_of(state)
    _, merged = nnx.merge(graphdef, state)
    assert float(jxs.loss_scale_of(merged).loss_scale) == 2.0**16
    assert jxs.validate_state(merged) is merged
