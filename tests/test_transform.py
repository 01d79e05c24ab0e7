"""The dynamic_scaling transformation: skip semantics, counters, jit/scan/donation,
loss_scale_of, value_and_grad, and a contract test over every variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
from jaxscale.testing import assert_bit_identical

pytestmark = pytest.mark.core


def make_params(dtype=jnp.float32):
    return {
        "dense": {
            "kernel": jnp.array([[0.5, -1.0], [2.0, -0.0]], dtype),
            "bias": jnp.array([0.0, 1.0], dtype),
        },
        "scale": jnp.array(3.0, dtype),
    }


def grads_like(params, value=1.0):
    return jax.tree.map(lambda p: jnp.full_like(p, value), params)


# --------------------------------------------------------------------------- #
# Skip semantics
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_skipped_step_leaves_params_and_inner_state_bit_identical(bad):
    params = make_params()
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    state = tx.init(params)
    step = jax.jit(tx.update)
    # One good step first, so the inner state is not trivially zero.
    _, state = step(grads_like(params, 2.0**16), state, params)
    grads = grads_like(params, 2.0**16)
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[0, 1].set(bad)
    updates, new_state = step(grads, state, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    for u in jax.tree.leaves(updates):
        assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))
    new_params = optax.apply_updates(params, updates)
    assert_bit_identical(new_params, params)  # -0.0 kernel entry stays -0.0
    assert int(new_state.skipped_steps) == 1
    assert int(new_state.consecutive_skips) == 1
    assert not bool(new_state.last_step_finite)
    assert float(new_state.loss_scale.loss_scale) == 2.0**15


@pytest.mark.isa
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_finite_step_equals_inner_on_unscaled_grads(momentum):
    # Against optax run eagerly: one multiply per element (plain sgd) is bit
    # for bit; with momentum XLA may contract ``g + 0.9 * t`` into an FMA
    # inside the jitted step, so equal to rounding (STYLE.md, "Lessons").
    params = make_params()
    inner = optax.sgd(0.1, momentum=momentum)
    tx = jxs.dynamic_scaling(inner, jxs.StaticLossScale.create(1024.0))
    state, ref_state = tx.init(params), inner.init(params)
    rng = np.random.default_rng(0)
    same = (
        assert_bit_identical
        if momentum is None
        else lambda a, b: jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), a, b
        )
    )
    for _ in range(3):
        g = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        scaled = jax.tree.map(lambda x: x * 1024.0, g)
        updates, state = jax.jit(tx.update)(scaled, state, params)
        ref_updates, ref_state = inner.update(g, ref_state, params)
        same(updates, ref_updates)
    same(state.inner_state, ref_state)


@pytest.mark.isa
def test_unscaled_overflow_is_skipped_even_if_scaled_grads_are_finite():
    # torch checks the *scaled* gradients; at a scale below 1 the unscaled ones
    # can overflow while the scaled ones are finite (pytorch#99640 family).
    params = {"w": jnp.ones(2, jnp.float16)}
    ls = jxs.StaticLossScale.create(2.0**-10)
    tx = jxs.dynamic_scaling(optax.sgd(1.0), ls)
    state = tx.init(params)
    grads = {"w": jnp.array([100.0, 1.0], jnp.float16)}  # 100 * 2**10 > f16 max
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert not bool(state.last_step_finite)
    assert_bit_identical(optax.apply_updates(params, updates), params)


def test_counters_and_recovery():
    params = make_params()
    ls = jxs.DynamicLossScale.create(init_scale=8.0, growth_interval=2)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    state = tx.init(params)
    step = jax.jit(tx.update)
    pattern = [True, False, False, True, True, True, False, True]
    scales = []
    for finite in pattern:
        g = grads_like(params, 1.0 if finite else np.nan)
        _, state = step(g, state, params)
        scales.append(float(state.loss_scale.loss_scale))
    assert int(state.steps) == 8
    assert int(state.skipped_steps) == 3
    assert int(state.consecutive_skips) == 0
    assert bool(state.last_step_finite)
    assert scales == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 2.0, 2.0]


def test_integer_and_none_leaves_pass_through():
    params = {"w": jnp.ones(2), "count": jnp.int32(3), "frozen": None}
    seen = {}

    def init(p):
        return optax.EmptyState()

    def update(u, s, p=None):
        seen.update(jax.tree.map(lambda x: x.dtype, u))
        return jax.tree.map(jnp.zeros_like, u), s

    tx = jxs.dynamic_scaling(
        optax.GradientTransformation(init, update), jxs.StaticLossScale.create(4.0)
    )
    grads = {"w": jnp.array([4.0, 8.0]), "count": jnp.int32(5), "frozen": None}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert seen == {
        "w": np.dtype("float32"),
        "count": np.dtype("int32"),
        "frozen": None,
    }
    assert updates["frozen"] is None and bool(state.last_step_finite)


def test_extra_args_are_forwarded():
    got = []

    def init(p):
        return optax.EmptyState()

    def update(u, s, p=None, *, value=None, **extra):
        got.append(value)
        return jax.tree.map(lambda x: x * value, u), s

    tx = jxs.dynamic_scaling(
        optax.GradientTransformationExtraArgs(init, update),
        jxs.StaticLossScale.create(2.0),
    )
    params = {"w": jnp.ones(2)}
    updates, _ = tx.update(
        {"w": jnp.full(2, 2.0)}, tx.init(params), params, value=jnp.float32(3.0)
    )
    np.testing.assert_array_equal(updates["w"], [3.0, 3.0])
    assert len(got) >= 1


def test_bad_arguments():
    with pytest.raises(TypeError, match="`inner` must be an optax.Gradient"):
        jxs.dynamic_scaling(lambda g: g)
    with pytest.raises(TypeError, match="`loss_scale` must be a jxs.LossScale"):
        jxs.dynamic_scaling(optax.sgd(0.1), loss_scale=2.0**16)


# --------------------------------------------------------------------------- #
# jit, scan, transfers, donation
# --------------------------------------------------------------------------- #


def _loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 16)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((16, 1)) * 0.3, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 1)), jnp.float32)
    return params, (x, y)


def test_train_step_no_host_sync_no_retrace_and_donation():
    params, batch = _problem()
    ls = jxs.DynamicLossScale.create(init_scale=2.0**24, growth_interval=3)
    tx = jxs.dynamic_scaling(optax.sgd(0.05, momentum=0.9), ls)
    traces = []

    @jax.jit
    def train_step(params, opt_state, batch):
        traces.append(1)
        loss, grads = jxs.value_and_grad(_loss_fn, opt_state)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    donated = jax.jit(train_step.__wrapped__, donate_argnums=(1,))
    opt_state = tx.init(params)
    with jax.transfer_guard("disallow"):
        for _ in range(12):
            params, opt_state, loss = train_step(params, opt_state, batch)
    assert len(traces) == 1
    scale = float(jxs.loss_scale_of(opt_state).loss_scale)
    assert scale < 2.0**24  # backed off at least once, without retracing
    assert int(opt_state.skipped_steps) >= 1
    assert np.isfinite(float(loss))
    # Donation: the state passed to the factory and earlier states stay usable.
    s1 = tx.init(params)
    donated(params, s1, batch)
    assert s1.loss_scale.loss_scale.is_deleted()  # donation really happened
    s2 = tx.init(params)  # fresh buffers, not the donated ones
    assert not s2.loss_scale.loss_scale.is_deleted()
    assert float(s2.loss_scale.loss_scale) == 2.0**24
    assert float(ls.loss_scale) == 2.0**24


@pytest.mark.isa
def test_whole_training_loop_in_lax_scan_matches_python_loop():
    params, batch = _problem(1)
    tx = jxs.dynamic_scaling(
        optax.sgd(0.05),
        jxs.DynamicLossScale.create(init_scale=2.0**20, growth_interval=4),
    )

    def step(carry, _):
        p, s = carry
        loss, g = jxs.value_and_grad(_loss_fn, s)(p, batch)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), (loss, s.loss_scale.loss_scale)

    (p_scan, s_scan), (losses, scales) = jax.jit(
        lambda p, s: jax.lax.scan(step, (p, s), length=20)
    )(params, tx.init(params))
    carry = (params, tx.init(params))
    step_jit = jax.jit(step)
    for _ in range(20):
        carry, _ = step_jit(carry, None)
    assert_bit_identical(carry, (p_scan, s_scan))
    assert losses[-1] < losses[0]
    assert len(set(np.asarray(scales).tolist())) > 1


# --------------------------------------------------------------------------- #
# loss_scale_of and value_and_grad
# --------------------------------------------------------------------------- #


def test_loss_scale_of_finds_it_everywhere():
    params = make_params()
    ls = jxs.DynamicLossScale.create(init_scale=512.0)
    base = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    wrapped = {
        "plain": base,
        "chain_after": optax.chain(base, optax.clip(1.0)),
        "accumulate": jxs.accumulate(base, every_k=2),
    }
    for name, tx in wrapped.items():
        found = jxs.loss_scale_of(tx.init(params))
        assert isinstance(found, jxs.DynamicLossScale), name
        assert float(found.loss_scale) == 512.0, name


def test_loss_scale_of_flax_train_state_and_nnx_optimizer():
    pytest.importorskip("flax")
    from flax import nnx
    from flax.training import train_state

    tx = jxs.dynamic_scaling(optax.sgd(0.1), jxs.StaticLossScale.create(64.0))
    ts = train_state.TrainState.create(
        apply_fn=lambda p, x: x, params=make_params(), tx=tx
    )
    assert float(jxs.loss_scale_of(ts).loss_scale) == 64.0

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    found = jxs.loss_scale_of(opt)
    assert isinstance(found.loss_scale, jax.Array)
    assert float(found.loss_scale) == 64.0
    assert float(jxs.loss_scale_of(opt.opt_state).loss_scale) == 64.0


def test_loss_scale_of_errors():
    with pytest.raises(ValueError, match="contains no jxs.LossScale"):
        jxs.loss_scale_of(optax.sgd(0.1).init(make_params()))
    two = optax.chain(
        jxs.dynamic_scaling(optax.sgd(0.1)), jxs.dynamic_scaling(optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match="contains 2 jxs.LossScale"):
        jxs.loss_scale_of(two.init(make_params()))


@pytest.mark.isa
def test_value_and_grad_returns_unscaled_loss_and_scaled_grads():
    ls = jxs.StaticLossScale.create(256.0)
    params, batch = _problem()
    loss, grads = jax.jit(lambda p: jxs.value_and_grad(_loss_fn, ls)(p, batch))(params)
    # The reference is compiled the same way (jitted too): XLA:CPU compiles f16
    # arithmetic per instruction set, so a jitted result and an eager one may
    # differ in the last bits (AVX512-FP16 vs AVX2); two jitted programs of the
    # same computation do not.
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda p: _loss_fn(p, batch) * jnp.float32(256.0))
    )(params)
    assert float(loss) == pytest.approx(float(ref_loss) / 256.0, rel=1e-6)
    assert_bit_identical(grads, ref_grads)

    def with_aux(w, x):
        return jnp.sum(w * x), {"n": x.shape[0]}

    (value, aux), g = jxs.value_and_grad(with_aux, ls, argnums=(0, 1), has_aux=True)(
        jnp.ones(3), jnp.full(3, 2.0)
    )
    assert float(value) == 6.0 and aux == {"n": 3}
    np.testing.assert_array_equal(g[0], [512.0] * 3)
    np.testing.assert_array_equal(g[1], [256.0] * 3)


# --------------------------------------------------------------------------- #
# Contract: every loss-scale kind x inner optimizers x dtypes
# --------------------------------------------------------------------------- #

LOSS_SCALES = {
    "noop": jxs.NoOpLossScale,
    "static": lambda: jxs.StaticLossScale.create(2.0**8),
    "dynamic": lambda: jxs.DynamicLossScale.create(
        init_scale=2.0**8, growth_interval=2
    ),
    "hysteresis": lambda: jxs.DynamicLossScale.create(
        init_scale=2.0**8, growth_interval=2, hysteresis=2
    ),
}
INNERS = {
    "sgd_momentum": lambda: optax.sgd(0.01, momentum=0.9),
    "adam": lambda: relaxed(optax.adam(1e-3)),
    "clip_adamw": lambda: relaxed(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    ),
    "lion": lambda: optax.lion(1e-4),
}
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


def _shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("inner_name", list(INNERS))
@pytest.mark.parametrize("ls_name", list(LOSS_SCALES))
def test_contract(ls_name, inner_name, dtype):
    ls = LOSS_SCALES[ls_name]()
    tx = jxs.dynamic_scaling(INNERS[inner_name](), ls)
    params = make_params(dtype)
    state = tx.init(params)
    spec = _shapes(state)
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    scale = float(jxs.loss_scale_of(state).loss_scale)
    for finite in [True, False, True, True, True]:
        grads = grads_like(params, 0.25 * scale if finite else np.inf)
        new_params, new_state, updates = step(params, state, grads)
        assert _shapes(new_state) == spec
        assert _shapes(updates) == _shapes(params)
        assert _shapes(new_params) == _shapes(params)
        if finite:
            assert all(
                np.all(np.isfinite(np.asarray(x, np.float32)))
                for x in jax.tree.leaves(new_params)
            )
        else:
            assert_bit_identical(new_params, params)
            assert_bit_identical(new_state.inner_state, state.inner_state)
        params, state = new_params, new_state
    assert len(traces) == 1
    assert int(state.skipped_steps) == 1

    # lax.scan over the same steps.
    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    gs = jax.tree.map(lambda x: jnp.stack([x] * 3), grads_like(params, 0.25))
    (p2, s2), _ = jax.jit(lambda c, g: jax.lax.scan(body, c, g))((params, state), gs)
    assert _shapes(s2) == spec and _shapes(p2) == _shapes(params)

    # Inside optax.MultiSteps (accumulation) the state stays stable too.
    ms = optax.MultiSteps(tx, every_k_schedule=2)
    ms_state = ms.init(params)
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps promotes itself
        _, ms_state2 = jax.jit(ms.update)(grads_like(params, 0.25), ms_state, params)
    assert _shapes(ms_state2) == _shapes(ms_state)
