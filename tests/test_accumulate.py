"""Gradient accumulation: jxs.accumulate_value_and_grad (micro-batches in one
step, lax.scan) and jxs.accumulate (one update every k calls). One scale per
window, one check at the boundary, one inner update, recovery after overflow;
and optax.MultiSteps' accumulator poisoning, shown."""

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


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """The comparisons here (micro-batches against one large batch, at
    ``rtol=1e-5``) assume float32 matmuls at full precision: a GPU's default is
    TF32-like (about 5e-5 apart on an H200)."""
    with jax.default_matmul_precision("highest"):
        yield


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(6, 8)) * 0.3, jnp.float32),
        "b1": jnp.zeros(8, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)) * 0.3, jnp.float32),
    }


def make_batch(n, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def loss_fn(params, batch):
    """An MLP with float16 compute and a float32 mean."""
    x, y = batch
    h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    h = h + params["b1"].astype(jnp.float16)[None, :]
    pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def loss_fn_f32(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"]) + params["b1"][None, :]
    return jnp.mean((h @ params["w2"] - y) ** 2)


def counting():
    """A transformation whose state counts its own ``update`` calls."""

    def init(params):
        del params
        return {"calls": jnp.zeros((), jnp.int32)}

    def update(updates, state, params=None):
        del params
        return updates, {"calls": state["calls"] + 1}

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------- #
# accumulate_value_and_grad: micro-batches inside one step
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("fn", [loss_fn_f32, loss_fn], ids=["f32", "f16compute"])
@pytest.mark.isa
def test_microbatches_equal_one_large_batch(k, fn):
    params, batch = init_params(), make_batch(32)
    ls = jxs.StaticLossScale.create(2.0**10)
    big_loss, big_grads = jax.jit(jxs.value_and_grad(fn, ls))(params, batch)
    grad_fn = jxs.accumulate_value_and_grad(fn, ls, num_microbatches=k)
    loss, grads = jax.jit(grad_fn)(params, batch)
    tol = 1e-5 if fn is loss_fn_f32 else 2e-2
    assert loss.dtype == big_loss.dtype
    np.testing.assert_allclose(float(loss), float(big_loss), rtol=tol)
    for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(big_grads), strict=True):
        assert g.dtype == b.dtype and g.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(b), rtol=tol, atol=tol * 2.0**10
        )


@pytest.mark.isa
def test_presplit_leading_axis_equals_num_microbatches():
    params, (x, y) = init_params(), make_batch(24)
    ls = jxs.StaticLossScale.create(8.0)
    split = (x.reshape(3, 8, 6), y.reshape(3, 8, 1))
    a = jxs.accumulate_value_and_grad(loss_fn_f32, ls, num_microbatches=3)
    b = jxs.accumulate_value_and_grad(loss_fn_f32, ls)
    assert_bit_identical(jax.jit(a)(params, (x, y)), jax.jit(b)(params, split))


@pytest.mark.isa
def test_has_aux_stacks_aux_and_batch_argnums_keyword_args():
    params, (x, y) = init_params(), make_batch(12)

    def fn(params, scale_by, x, y, *, offset):
        loss = loss_fn_f32(params, (x, y)) * scale_by + offset
        return loss, {"n": jnp.float32(x.shape[0]), "first": x[0, 0]}

    ls = jxs.StaticLossScale.create(4.0)
    grad_fn = jxs.accumulate_value_and_grad(
        fn, ls, num_microbatches=3, batch_argnums=(2, 3), has_aux=True
    )
    (loss, aux), grads = jax.jit(grad_fn, static_argnames="offset")(
        params, jnp.float32(2.0), x, y, offset=1.0
    )
    ref_loss, ref_grads = jxs.value_and_grad(
        lambda p: fn(p, jnp.float32(2.0), x, y, offset=1.0)[0], ls
    )(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux["n"]), [4.0, 4.0, 4.0])
    np.testing.assert_array_equal(np.asarray(aux["first"]), np.asarray(x[::4, 0]))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.isa
def test_tuple_argnums():
    params, batch = init_params(), make_batch(8)
    fn = lambda w1, w2, batch: loss_fn_f32(  # noqa: E731
        {"w1": w1, "b1": params["b1"], "w2": w2}, batch
    )
    ls = jxs.StaticLossScale.create(2.0)
    loss, grads = jxs.accumulate_value_and_grad(
        fn, ls, num_microbatches=2, argnums=(0, 1)
    )(params["w1"], params["w2"], batch)
    _, ref = jxs.value_and_grad(fn, ls, argnums=(0, 1))(
        params["w1"], params["w2"], batch
    )
    assert isinstance(grads, tuple) and len(grads) == 2
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.isa
def test_f16_params_accumulate_in_f32_and_come_back_f16():
    # Micro-batch gradients of 40000 each: their f16 sum would overflow, the mean
    # does not.
    params = jnp.float16(1.0)
    x = jnp.full((4,), 40000.0, jnp.float16)

    def fn(w, x):
        return jnp.mean((w * x).astype(jnp.float32))

    loss, grads = jax.jit(
        jxs.accumulate_value_and_grad(fn, jxs.NoOpLossScale(), num_microbatches=4)
    )(params, x)
    assert grads.dtype == jnp.float16
    assert float(grads) == 40000.0
    assert float(loss) == 40000.0


def train_step_in_one(tx, k):
    @jax.jit
    def step(params, opt_state, batch):
        grad_fn = jxs.accumulate_value_and_grad(loss_fn, opt_state, num_microbatches=k)
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.mark.isa
def test_inf_in_one_microbatch_skips_the_whole_step():
    tx = jxs.dynamic_scaling(relaxed(optax.adamw(1e-2)))
    params, (x, y) = init_params(), make_batch(16)
    opt_state = tx.init(params)
    step = train_step_in_one(tx, 4)
    params, opt_state, _ = step(params, opt_state, (x, y))  # may overflow at 2**16
    scale = float(jxs.loss_scale_of(opt_state).loss_scale)
    skipped = int(opt_state.skipped_steps)

    bad_x = x.at[13, 2].set(jnp.inf)  # the fourth micro-batch only
    new_params, new_state, _ = step(params, opt_state, (bad_x, y))
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, opt_state.inner_state)
    assert int(new_state.skipped_steps) == skipped + 1
    assert float(jxs.loss_scale_of(new_state).loss_scale) == scale / 2

    # The next step trains normally.
    params2, state2, _ = step(new_params, new_state, (x, y))
    assert bool(state2.last_step_finite)
    assert not np.array_equal(np.asarray(params2["w1"]), np.asarray(params["w1"]))


def test_in_step_training_reduces_the_loss():
    tx = jxs.dynamic_scaling(relaxed(optax.adam(3e-2)))
    params, batch = init_params(), make_batch(32)
    opt_state = tx.init(params)
    step = train_step_in_one(tx, 4)
    losses = []
    for _ in range(40):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert int(opt_state.steps) == 40


# --------------------------------------------------------------------------- #
# accumulate: one update every k calls
# --------------------------------------------------------------------------- #


def run_windows(tx, params, micro_batches, *, grad_fn=loss_fn):
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jxs.value_and_grad(grad_fn, state)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    trace = []
    for mb in micro_batches:
        params, state, updates = step(params, state, mb)
        trace.append((params, state, updates))
    return params, state, trace


def micro_batches(n_windows, k, size=8, seed=1):
    x, y = make_batch(n_windows * k * size, seed=seed)
    return [
        (x[i * size : (i + 1) * size], y[i * size : (i + 1) * size])
        for i in range(n_windows * k)
    ]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.isa
def test_accumulate_equals_one_large_batch_per_window(k):
    """k calls of accumulate == one dynamic_scaling step on the k-times batch."""
    mbs = micro_batches(3, k)
    inner = lambda: jxs.dynamic_scaling(  # noqa: E731
        relaxed(optax.adam(1e-2)), jxs.StaticLossScale.create(2.0**8)
    )
    params, state, _ = run_windows(
        jxs.accumulate(inner(), k), init_params(), mbs, grad_fn=loss_fn_f32
    )
    big = [
        tuple(jnp.concatenate(parts) for parts in zip(*mbs[i : i + k], strict=True))
        for i in range(0, len(mbs), k)
    ]
    ref_params, ref_state, _ = run_windows(
        inner(), init_params(), big, grad_fn=loss_fn_f32
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert int(state.inner_state.steps) == 3
    assert int(ref_state.steps) == 3


@pytest.mark.isa
def test_k1_is_plain_dynamic_scaling():
    # The two programs differ in structure, so XLA fuses (and may contract to
    # FMAs) adam's arithmetic differently: equal to a few ulps, not bit for bit
    # (STYLE.md, "Lessons"); the scale and the counters are exact.
    mbs = micro_batches(4, 1)
    inner = lambda: jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))  # noqa: E731
    p1, s1, _ = run_windows(
        jxs.accumulate(inner(), 1), init_params(), mbs, grad_fn=loss_fn_f32
    )
    p2, s2, _ = run_windows(inner(), init_params(), mbs, grad_fn=loss_fn_f32)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)  # noqa: E731
    jax.tree.map(close, p1, p2)
    jax.tree.map(close, s1.inner_state, s2)
    assert_bit_identical(s1.inner_state.loss_scale, s2.loss_scale)
    assert int(s1.inner_state.steps) == int(s2.steps) == 4


@pytest.mark.isa
def test_scale_is_fixed_within_the_window_and_updates_are_negative_zero():
    k = 4
    tx = jxs.accumulate(jxs.dynamic_scaling(relaxed(optax.adam(1e-2))), k)
    params = init_params()
    _, _, trace = run_windows(tx, params, micro_batches(2, k))
    for i, (_, s, u) in enumerate(trace):
        if i % k == k - 1:
            assert int(s.micro_step) == 0
            continue
        assert int(s.micro_step) == i % k + 1
        for leaf in jax.tree.leaves(u):
            a = np.asarray(leaf)
            assert np.all(a == 0) and np.all(np.signbit(a))
        # inner state (loss scale included) equals the one before the window
        before = trace[i - i % k - 1][1].inner_state if i >= k else None
        if before is not None:
            assert_bit_identical(s.inner_state, before)


@pytest.mark.isa
def test_inf_microbatch_skips_window_and_next_window_trains():
    k = 3
    tx = jxs.accumulate(jxs.dynamic_scaling(relaxed(optax.adam(1e-2))), k)
    mbs = micro_batches(3, k)
    x, y = mbs[4]  # second micro-batch of the second window
    mbs[4] = (x.at[0, 0].set(jnp.nan), y)
    _, _, trace = run_windows(tx, init_params(), mbs)
    p1, s1, _ = trace[2]  # end of window 1
    p2, s2, _ = trace[5]  # end of window 2 (overflowed)
    p3, s3, _ = trace[8]  # end of window 3
    assert bool(s1.inner_state.last_step_finite)
    assert_bit_identical(p2, p1)
    assert_bit_identical(s2.inner_state.inner_state, s1.inner_state.inner_state)
    assert not bool(s2.inner_state.last_step_finite)
    assert int(s2.inner_state.skipped_steps) == 1
    assert float(s2.inner_state.loss_scale.loss_scale) == (
        float(s1.inner_state.loss_scale.loss_scale) / 2
    )
    # The accumulator is reset to real zeros, not 0 * nan.
    for leaf in jax.tree.leaves(s2.grad_sum):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)
    assert bool(s3.inner_state.last_step_finite)
    assert int(s3.inner_state.skipped_steps) == 1
    assert int(s3.inner_state.steps) == 3
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(p3))
    assert not np.array_equal(np.asarray(p3["w1"]), np.asarray(p1["w1"]))


def test_inner_runs_once_per_window_state_counter():
    k, windows = 4, 3
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.chain(counting(), optax.sgd(0.1))), k)
    _, state, trace = run_windows(tx, init_params(), micro_batches(windows, k))
    counts = [int(s.inner_state.inner_state[0]["calls"]) for _, s, _ in trace]
    assert counts == [(i + 1) // k for i in range(windows * k)]
    assert int(state.inner_state.steps) == windows


def test_inner_runs_on_every_call_and_counts_once_per_window():
    # Branch-free (no lax.cond, whose predicate XLA:GPU reads on the host):
    # ``inner`` runs on every call, as in optax.MultiSteps, but its effect
    # (state, updates) is kept on the k-th call only; extra args reach it on
    # every call.
    calls, seen = [], []

    def probe():
        def init(params):
            del params
            return {"calls": jnp.zeros((), jnp.int32)}

        def update(updates, state, params=None, *, value):
            jax.debug.callback(calls.append, value)
            return updates, {"calls": state["calls"] + 1}

        return optax.GradientTransformationExtraArgs(init, update)

    k = 3
    tx = jxs.accumulate(jxs.dynamic_scaling(probe()), k)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(2 * k):
        u, state = update({"w": jnp.ones(2)}, state, params, value=jnp.float32(i))
        seen.append(int(state.inner_state.inner_state["calls"]))
        if i % k != k - 1:
            assert np.all(np.signbit(np.asarray(u["w"])))
    jax.effects_barrier()
    assert [float(v) for v in calls] == [float(i) for i in range(2 * k)]
    assert seen == [0, 0, 1, 1, 1, 2]
    assert int(state.inner_state.steps) == 2

    # optax.MultiSteps around the wrapper is refused.
    ms = optax.MultiSteps(jxs.dynamic_scaling(optax.sgd(0.1)), k)
    with pytest.raises(ValueError, match="MultiStepsState"):
        run_windows(ms, init_params(), micro_batches(1, k))


@pytest.mark.isa
def test_half_leaves_accumulate_in_f32_and_updates_keep_dtype():
    params = {"h": jnp.zeros(3, jnp.float16), "b": jnp.zeros(2, jnp.bfloat16)}
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(1.0), jxs.NoOpLossScale()), 4)
    state = tx.init(params)
    assert state.grad_sum["h"].dtype == jnp.float32
    assert state.grad_sum["b"].dtype == jnp.float32
    update = jax.jit(tx.update)
    # Four gradients of 30000: the f16 sum (120000) would overflow, the mean not.
    grads = {"h": jnp.full(3, 30000.0, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)}
    for _ in range(4):
        updates, state = update(grads, state, params)
        assert updates["h"].dtype == jnp.float16
        assert updates["b"].dtype == jnp.bfloat16
    assert bool(state.inner_state.last_step_finite)
    np.testing.assert_array_equal(np.asarray(updates["h"], np.float32), -30000.0)


@pytest.mark.isa
def test_state_is_stable_under_scan_and_no_retrace():
    tx = jxs.accumulate(jxs.dynamic_scaling(relaxed(optax.adam(1e-2))), 2)
    params = init_params()
    state = tx.init(params)
    mbs = micro_batches(3, 2)
    xs = (jnp.stack([m[0] for m in mbs]), jnp.stack([m[1] for m in mbs]))
    traces = []

    def body(carry, mb):
        traces.append(1)
        params, state = carry
        _, grads = jxs.value_and_grad(loss_fn, state)(params, mb)
        updates, new_state = tx.update(grads, state, params)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(
            lambda a: (a.shape, a.dtype), state
        )
        return (optax.apply_updates(params, updates), new_state), None

    (p_scan, s_scan), _ = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(
        (params, state), xs
    )
    p_loop, s_loop, _ = run_windows(tx, params, mbs)
    for a, b in zip(jax.tree.leaves(p_scan), jax.tree.leaves(p_loop), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(s_scan.inner_state.steps) == 3

    step = jax.jit(body)
    carry = (params, state)
    n = len(traces)
    for mb in mbs:
        carry, _ = step(carry, mb)
    assert len(traces) == n + 1  # traced once, whatever the scale or micro_step


def test_init_hands_out_fresh_buffers_for_donation():
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), 2)
    params = {"w": jnp.ones(3)}
    step = jax.jit(tx.update, donate_argnums=1)
    for _ in range(2):
        state = tx.init(params)
        _, state = step({"w": jnp.ones(3)}, state, params)
        _, state = step({"w": jnp.ones(3)}, state, params)
        assert int(state.inner_state.steps) == 1


def test_loss_scale_of_and_optax_tree_get_see_inside():
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), 2)
    state = tx.init({"w": jnp.ones(3)})
    assert float(jxs.loss_scale_of(state).loss_scale) == 2.0**16
    assert int(optax.tree.get(state, "micro_step")) == 0


INNERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: relaxed(optax.adam(1e-2)),
    "clip+adamw": lambda: optax.chain(
        jxs.clip_by_global_norm(1.0), relaxed(optax.adamw(1e-2))
    ),
}


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_contract_dtypes_and_state_are_stable(inner, dtype):
    """accumulate(dynamic_scaling(inner)) over optimizers x param dtypes."""
    k = 2
    params = jax.tree.map(lambda p: p.astype(dtype), init_params())
    tx = jxs.accumulate(jxs.dynamic_scaling(INNERS[inner]()), k)
    state = tx.init(params)
    spec = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for i in range(3 * k):
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.normal(size=p.shape) * 2.0**10, p.dtype), params
        )
        if i == k:  # overflow in the second window
            grads["b1"] = grads["b1"].at[0].set(jnp.inf)
        updates, state = update(grads, state, params)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == spec
        assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
            lambda p: p.dtype, params
        )
        params = optax.apply_updates(params, updates)
    ds = state.inner_state
    assert (int(ds.steps), int(ds.skipped_steps)) == (3, 1)
    if not (dtype == jnp.float16 and "adam" in inner):
        # (adam in pure f16: eps=1e-8 and small second moments are 0 in f16, so it
        # divides by zero by itself; hence float32 master weights.)
        leaves = jax.tree.leaves(params)
        assert all(np.isfinite(np.asarray(p, np.float32)).all() for p in leaves)


# --------------------------------------------------------------------------- #
# optax.MultiSteps(dynamic_scaling(...)): poisoned after one overflow
# --------------------------------------------------------------------------- #


@pytest.mark.isa
def test_multisteps_is_poisoned_and_accumulate_recovers():
    k = 2
    params = {"w": jnp.zeros(3)}
    grads = [{"w": jnp.full(3, 1e4, jnp.float32)} for _ in range(2 * 4)]
    grads[1] = {"w": jnp.array([1e4, jnp.inf, 1e4], jnp.float32)}  # window 1

    def run(tx):
        state = tx.init(params)
        update = jax.jit(tx.update)
        states = []
        for g in grads:
            with jax.numpy_dtype_promotion("standard"):  # MultiSteps needs it
                _, state = update(g, state, params)
            states.append(state)
        return states[k - 1 :: k]  # the state at the end of each window

    ms = run(optax.MultiSteps(jxs.dynamic_scaling(optax.sgd(1.0)), k))
    ours = run(jxs.accumulate(jxs.dynamic_scaling(optax.sgd(1.0)), k))

    ms_skipped = [int(s.inner_opt_state.skipped_steps) for s in ms]
    ours_skipped = [int(s.inner_state.skipped_steps) for s in ours]
    # MultiSteps: (1 - emit) * inf = nan stays in its accumulator, every later
    # window is non-finite, and the scale halves each time.
    assert ms_skipped == [1, 2, 3, 4]
    assert all(np.isnan(np.asarray(s.acc_grads["w"])).any() for s in ms)
    # (jxs.loss_scale_of refuses this nesting; read the field directly.)
    ms_scales = [float(s.inner_opt_state.loss_scale.loss_scale) for s in ms]
    assert ms_scales == [2.0**15, 2.0**14, 2.0**13, 2.0**12]
    # jxs.accumulate: one skip, then training resumes.
    assert ours_skipped == [1, 1, 1, 1]
    for s in ours:
        np.testing.assert_array_equal(np.asarray(s.grad_sum["w"]), 0.0)
    assert float(jxs.loss_scale_of(ours[-1]).loss_scale) == 2.0**15


def test_multisteps_skip_not_finite_never_backs_off():
    """MultiSteps' own remedy drops the micro-batch before the scale sees it."""
    params = {"w": jnp.zeros(2)}
    tx = optax.MultiSteps(
        jxs.dynamic_scaling(optax.sgd(1.0)),
        2,
        should_skip_update_fn=optax.skip_not_finite,
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(6):  # a scale that always overflows
            _, state = update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    scale = state.inner_opt_state.loss_scale.loss_scale
    assert float(scale) == 2.0**16  # never backs off
    assert int(state.inner_opt_state.steps) == 0  # and never steps

    ours = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(1.0)), 2)
    state = ours.init(params)
    update = jax.jit(ours.update)
    for _ in range(6):
        _, state = update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    assert float(jxs.loss_scale_of(state).loss_scale) == 2.0**13  # once per window


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("every_k", [0, -1])
def test_every_k_value(every_k):
    with pytest.raises(ValueError, match=f"`every_k` must be >= 1, got {every_k}"):
        jxs.accumulate(optax.sgd(0.1), every_k)


@pytest.mark.parametrize("every_k", [1.5, True, "2", None])
def test_every_k_type(every_k):
    with pytest.raises(TypeError, match="`every_k` must be an int"):
        jxs.accumulate(optax.sgd(0.1), every_k)


def test_inner_type():
    with pytest.raises(TypeError, match="`inner` must be an optax"):
        jxs.accumulate(lambda g: g, 2)


def test_updates_structure_mismatch():
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), 2)
    state = tx.init({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="`updates`"):
        tx.update({"v": jnp.ones(3)}, state)
    with pytest.raises(ValueError, match="`updates`"):
        tx.update({"v": jnp.ones(3)}, state, {"w": jnp.ones(3)})


@pytest.mark.parametrize("n", [0, -2])
def test_num_microbatches_value(n):
    with pytest.raises(ValueError, match=f"`num_microbatches` must be >= 1, got {n}"):
        jxs.accumulate_value_and_grad(loss_fn, jxs.NoOpLossScale(), num_microbatches=n)


def test_num_microbatches_type():
    with pytest.raises(TypeError, match="`num_microbatches` must be an int"):
        jxs.accumulate_value_and_grad(
            loss_fn, jxs.NoOpLossScale(), num_microbatches=2.0
        )


def test_num_microbatches_must_divide_batch():
    fn = jxs.accumulate_value_and_grad(loss_fn, jxs.NoOpLossScale(), num_microbatches=3)
    with pytest.raises(ValueError, match="`num_microbatches` must divide .* got 3"):
        fn(init_params(), make_batch(10))


def test_batch_argnums_overlap_and_out_of_range():
    with pytest.raises(ValueError, match="`batch_argnums` must not overlap `argnums`"):
        jxs.accumulate_value_and_grad(loss_fn, jxs.NoOpLossScale(), batch_argnums=0)
    fn = jxs.accumulate_value_and_grad(
        loss_fn, jxs.NoOpLossScale(), num_microbatches=2, batch_argnums=5
    )
    with pytest.raises(ValueError, match="`batch_argnums` must name positional"):
        fn(init_params(), make_batch(4))
    fn = jxs.accumulate_value_and_grad(loss_fn, jxs.NoOpLossScale())
    with pytest.raises(ValueError, match="`batch_argnums` must name positional"):
        fn(init_params())  # no batch argument at all
    with pytest.raises(ValueError, match="`batch_argnums` must be a non-negative"):
        jxs.accumulate_value_and_grad(loss_fn, jxs.NoOpLossScale(), batch_argnums=-1)


def test_presplit_axes_must_agree_and_no_scalars():
    fn = jxs.accumulate_value_and_grad(loss_fn, jxs.NoOpLossScale())
    x, y = make_batch(12)
    with pytest.raises(ValueError, match="same leading micro-batch axis"):
        fn(init_params(), (x.reshape(3, 4, 6), y.reshape(4, 3, 1)))
    with pytest.raises(ValueError, match="leading batch axis, got a scalar"):
        jxs.accumulate_value_and_grad(
            lambda p, s: jnp.sum(p) * s, jxs.NoOpLossScale(), num_microbatches=1
        )(jnp.ones(2), jnp.float32(2.0))


def test_loss_scale_argument_must_hold_a_scale():
    with pytest.raises(ValueError, match="`opt_state` contains no jxs.LossScale"):
        jxs.accumulate_value_and_grad(loss_fn, optax.sgd(0.1).init({}))
