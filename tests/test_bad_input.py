"""Bad input: each kind has a documented behaviour (docs/checkpointing.md), tested
here. The whole suite runs with strict dtype promotion (tests/conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import enable_x64
from helpers import relaxed

import jaxscale as jxs
import jaxscale.testing as jxt

TINY = float(np.finfo(np.float32).tiny)


def train_step(tx, loss_fn):
    @jax.jit
    def step(params, state, *args):
        loss, grads = jxs.value_and_grad(loss_fn, state)(params, *args)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def quadratic(params, x):
    return jnp.sum((params["w"] * x - 1.0) ** 2) + jnp.sum(params["b"] ** 2)


PARAMS = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array([0.25])}
X = jnp.array([1.0, 2.0, 3.0])


# --------------------------------------------------------------------------- #
# NaN / inf loss
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.core
def test_non_finite_loss_skips_the_step(bad):
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    step = train_step(tx, lambda p, x: quadratic(p, x) * bad)
    state = tx.init(PARAMS)
    params, new_state, loss = step(PARAMS, state, X)
    assert not np.isfinite(float(loss))
    jxt.assert_skipped(PARAMS, state, params, new_state)
    assert float(new_state.loss_scale.loss_scale) == 2.0**15  # backed off


@pytest.mark.core
def test_nan_loss_with_finite_gradients_is_applied():
    """The decision is made on the gradients (as torch does), not on the loss."""
    tx = jxs.dynamic_scaling(optax.sgd(0.1))

    def loss_fn(p, x):
        return quadratic(p, x) + jax.lax.stop_gradient(jnp.float32(jnp.nan))

    params, state, loss = train_step(tx, loss_fn)(PARAMS, tx.init(PARAMS), X)
    assert np.isnan(float(loss))
    jxt.assert_applied(PARAMS, tx.init(PARAMS), params, state)


# --------------------------------------------------------------------------- #
# Parameters that are already non-finite: never silently "recovered".
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
@pytest.mark.core
def test_non_finite_params_used_by_the_loss_are_reported_not_recovered(bad):
    params = {"w": PARAMS["w"].at[1].set(bad), "b": PARAMS["b"]}
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    step = train_step(tx, quadratic)
    state = tx.init(params)

    def body(carry, _):
        p, s = carry
        p, s, _ = step(p, s, X)
        return (p, s), s.loss_scale.loss_scale

    (final, state), scales = jax.lax.scan(body, (params, state), length=200)
    # Every step skipped; params bit-identical (still non-finite), never changed.
    jxt.assert_bit_identical(params, final)
    assert int(state.skipped_steps) == int(state.consecutive_skips) == 200
    assert not bool(jxs.all_finite(final))  # how a user sees it
    # The scale backs off to its floor and stays there: never 0, never NaN.
    assert float(scales.min()) == TINY and float(scales[-1]) == TINY
    assert bool(state.loss_scale.at_floor())
    # A restored state with this history is still a valid state.
    assert jxs.validate_state(state) is state


@pytest.mark.core
def test_nan_in_an_unused_param_stays_nan():
    params = {**PARAMS, "unused": jnp.array([jnp.nan, 1.0])}
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    step = train_step(tx, quadratic)
    state = tx.init(params)
    new_params, new_state, _ = step(params, state, X)
    # Its gradient is 0 (finite), so the step is applied; the NaN is not touched.
    assert bool(new_state.last_step_finite)
    assert np.isnan(float(new_params["unused"][0]))
    assert float(new_params["unused"][1]) == 1.0
    assert not bool(jxs.all_finite(new_params))


# --------------------------------------------------------------------------- #
# All-zero gradients
# --------------------------------------------------------------------------- #


@pytest.mark.core
def test_all_zero_gradients_are_finite_steps_that_count_towards_growth():
    ls = jxs.DynamicLossScale.create(init_scale=4.0, growth_interval=3)
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)), ls)
    state = tx.init(PARAMS)
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)
    step = jax.jit(tx.update)
    for _ in range(3):
        updates, new_state = step(zeros, state, PARAMS)
        jxt.assert_applied(
            PARAMS, state, optax.apply_updates(PARAMS, updates), new_state
        )
        state = new_state
    assert float(state.loss_scale.loss_scale) == 8.0  # grew on schedule
    assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))  # +-0


@pytest.mark.core
def test_zero_gradients_of_float16_params_with_adam_are_finite():
    """optax.adam's eps=1e-8 is 0 in float16, so optax alone turns a zero
    gradient of an f16 parameter into 0/0 = NaN. Inside ``dynamic_scaling`` the
    inner optimizer computes half-precision leaves in float32 (0.1.0 passed the
    NaN on): the update is adam's on float32 copies, cast to float16."""
    params = {"h": jnp.array([1.0, -2.0], jnp.float16)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    plain = relaxed(optax.adam(1e-2))
    u_plain, _ = plain.update(zeros, plain.init(params), params)
    assert np.isnan(np.asarray(u_plain["h"], np.float32)).all()
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    u, state = tx.update(zeros, tx.init(params), params)
    assert bool(state.last_step_finite)
    assert u["h"].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(u["h"], np.float32), 0.0)


# --------------------------------------------------------------------------- #
# Empty pytrees
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("empty", [{}, [], ()], ids=["dict", "list", "tuple"])
@pytest.mark.core
def test_empty_pytrees(empty):
    ls = jxs.DynamicLossScale.create(init_scale=2.0, growth_interval=2)
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)), ls)
    state = tx.init(empty)
    step = jax.jit(tx.update)
    for _ in range(4):
        updates, state = step(empty, state, empty)
    assert updates == empty
    assert int(state.steps) == 4 and int(state.skipped_steps) == 0
    assert float(state.loss_scale.loss_scale) == 8.0
    assert bool(jxs.all_finite(empty))
    assert jxs.validate_state(state) is state


# --------------------------------------------------------------------------- #
# Mixed dtypes, float64 under x64
# --------------------------------------------------------------------------- #

MIXED = {
    "h": jnp.array([1.0, -2.0], jnp.float16),
    "b": jnp.array([0.5, 4.0], jnp.bfloat16),
    "w": jnp.array([3.0, -0.0], jnp.float32),
}


@pytest.mark.core
def test_mixed_dtypes_preserved_and_each_leaf_checked_in_its_own_dtype():
    ls = jxs.DynamicLossScale.create(init_scale=2.0**10)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    state = tx.init(MIXED)
    step = jax.jit(tx.update)
    grads = ls.scale(jax.tree.map(jnp.ones_like, MIXED))
    updates, new_state = step(grads, state, MIXED)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
        lambda p: p.dtype, MIXED
    )
    params = optax.apply_updates(MIXED, updates)
    jxt.assert_applied(MIXED, state, params, new_state)
    np.testing.assert_array_equal(updates["h"], np.float16(-0.1))  # -lr * 1 in f16
    # 100 * 2**10 fits float32 and bfloat16 but overflows float16 (max 65504):
    # only the f16 leaf is inf, and that skips the whole step.
    big = ls.scale(jax.tree.map(lambda p: jnp.full_like(p, 100.0), MIXED))
    assert np.isinf(np.asarray(big["h"], np.float32)).all()
    assert bool(jxs.all_finite({"b": big["b"], "w": big["w"]}))
    updates, skipped = step(big, state, MIXED)
    jxt.assert_skipped(MIXED, state, optax.apply_updates(MIXED, updates), skipped)


@pytest.mark.core
def test_float64_under_x64():
    with enable_x64():
        params = {
            "d": jnp.array([1.0, 2.0], jnp.float64),
            "s": jnp.array([1.0], jnp.float32),
        }
        tx = jxs.dynamic_scaling(optax.sgd(0.5))
        state = tx.init(params)
        assert state.loss_scale.loss_scale.dtype == jnp.float32
        assert state.steps.dtype == jnp.int32
        step = jax.jit(tx.update)
        # 1e39 is beyond float32 but finite in float64: not an overflow.
        grads = {
            "d": jnp.array([1e39, 1.0], jnp.float64) * 2.0**16,
            "s": jnp.array([2.0**16], jnp.float32),
        }
        updates, state = step(grads, state, params)
        assert bool(state.last_step_finite)
        assert updates["d"].dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(updates["d"]), [-0.5e39, -0.5])
        assert state.loss_scale.loss_scale.dtype == jnp.float32
        # An inf in float64 is.
        grads["d"] = grads["d"].at[1].set(jnp.inf)
        _, state = step(grads, state, params)
        assert not bool(state.last_step_finite)
        assert jxs.validate_state(state) is state


# --------------------------------------------------------------------------- #
# Integer and None leaves
# --------------------------------------------------------------------------- #


@pytest.mark.core
def test_integer_and_none_leaves_pass_through():
    params = {"w": jnp.array([1.0, 2.0]), "count": jnp.int32(7), "frozen": None}
    labels = {"w": "float", "count": "int", "frozen": None}
    inner = optax.multi_transform(
        {"float": optax.sgd(0.5), "int": optax.set_to_zero()}, labels
    )
    tx = jxs.dynamic_scaling(inner, jxs.StaticLossScale.create(4.0))
    step = jax.jit(tx.update)
    grads = {"w": jnp.array([4.0, 8.0]), "count": jnp.int32(0), "frozen": None}
    updates, state = step(grads, tx.init(params), params)
    assert bool(state.last_step_finite)
    assert updates["frozen"] is None
    assert updates["count"].dtype == jnp.int32 and int(updates["count"]) == 0
    np.testing.assert_array_equal(updates["w"], [-0.5, -1.0])  # unscaled by 4
    # An overflow in the float leaf skips; int and None leaves are never checked.
    grads["w"] = grads["w"].at[0].set(jnp.nan)
    updates, state = step(grads, state, params)
    assert not bool(state.last_step_finite)
    assert int(updates["count"]) == 0 and updates["frozen"] is None
    assert bool(jxs.all_finite({"count": jnp.int32(-1), "frozen": None}))


@pytest.mark.unit
def test_integer_leaf_with_adam_gives_a_clear_error():
    params = {"w": jnp.ones(2), "step": jnp.int32(0)}
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    with pytest.raises(TypeError, match=r"integer leaf in `params`.*set_to_zero"):
        tx.update(params, tx.init(params), params)


# --------------------------------------------------------------------------- #
# Gradients whose structure differs from the state's
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("grads", "match"),
    [
        (
            {"w": jnp.ones(3)},
            r"tree structure of `params`, got updates: PyTreeDef\(\{'w': \*\}\) and "
            r"params: PyTreeDef\(\{'b': \*, 'w': \*\}\).*only in `params`: "
            r"\[\['b'\]\]",
        ),
        (
            {"w": jnp.ones(3), "b": jnp.ones(1), "c": jnp.ones(1)},
            r"only in `updates`: \[\['c'\]\]",
        ),
        ([jnp.ones(3), jnp.ones(1)], r"got updates: PyTreeDef\(\[\*, \*\]\)"),
        (
            {"w": jnp.ones(4), "b": jnp.ones(1)},
            r"shapes of `params`.*\['w'\]: \(4,\) vs \(3,\)",
        ),
    ],
    ids=["missing", "extra", "list", "shape"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.unit
def test_structure_mismatch_with_params_names_both(grads, match, jit):
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=match):
        update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.unit
def test_structure_mismatch_without_params_names_both():
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    with pytest.raises(
        ValueError,
        match=r"structure the inner optimizer's state was built for.*got updates "
        r"PyTreeDef\(\{'w': \*\}\), inner state PyTreeDef\(.*'b'.*Pass `params`",
    ):
        tx.update({"w": jnp.ones(3)}, tx.init(PARAMS))


@pytest.mark.unit
def test_structure_mismatch_with_a_stateless_optimizer_and_no_params():
    """Nothing to compare against: like optax.sgd itself, it works."""
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    updates, _ = tx.update({"other": jnp.ones(2)}, tx.init(PARAMS))
    assert set(updates) == {"other"}


# --------------------------------------------------------------------------- #
# Python floats (and other scalars) where arrays are expected
# --------------------------------------------------------------------------- #


@pytest.mark.core
def test_python_float_leaves_are_float32_scalars():
    params = {"a": 1.0, "b": 2.0}
    tx = jxs.dynamic_scaling(optax.sgd(0.5), jxs.StaticLossScale.create(4.0))
    state = tx.init(params)
    for update in (tx.update, jax.jit(tx.update)):
        updates, new_state = update({"a": 4.0, "b": 8.0}, state, params)
        assert bool(new_state.last_step_finite)
        assert {k: (v.dtype, v.shape) for k, v in updates.items()} == {
            "a": (jnp.float32, ()),
            "b": (jnp.float32, ()),
        }
        np.testing.assert_array_equal([updates["a"], updates["b"]], [-0.5, -1.0])
        _, skipped = update({"a": float("inf"), "b": 8.0}, state, params)
        assert not bool(skipped.last_step_finite)


@pytest.mark.unit
def test_python_float_parameter_in_value_and_grad():
    ls = jxs.StaticLossScale.create(8.0)
    loss, grad = jxs.value_and_grad(lambda w: w * w, ls)(3.0)
    assert float(loss) == 9.0 and float(grad) == 48.0


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: jxs.DynamicLossScale.create().adjust(1.0),
            TypeError,
            r"`grads_finite` must be a boolean scalar",
        ),
        (
            lambda: jxs.DynamicLossScale.create(growth_interval=2000.0),
            TypeError,
            r"`growth_interval` must be an int, got 2000\.0",
        ),
        (
            lambda: jxs.value_and_grad(lambda w: w, 1024.0),
            TypeError,
            r"`loss_scale` must be a jxs.LossScale.*StaticLossScale.create\(1024.0\)",
        ),
        (
            lambda: jxs.value_and_grad(lambda w: w, jnp.float32(1024.0)),
            TypeError,
            r"got the number Array\(1024.*StaticLossScale.create\(1024.0\)`",
        ),
        (
            lambda: jax.jit(lambda s: jxs.value_and_grad(lambda w: w, s))(2.0),
            TypeError,
            r"`loss_scale` must be a jxs.LossScale or an optimizer state holding one",
        ),
        (
            lambda: jxs.dynamic_scaling(optax.sgd(0.1), 1024.0),
            TypeError,
            r"`loss_scale` must be a jxs.LossScale",
        ),
        (
            lambda: jxs.select_tree(1.0, {"a": 1.0}, {"a": 2.0}),
            TypeError,
            r"`pred` must be a boolean scalar",
        ),
        (
            lambda: jxs.from_torch_state_dict(
                {
                    "scale": "65536",
                    "growth_factor": 2.0,
                    "backoff_factor": 0.5,
                    "growth_interval": 2000,
                    "_growth_tracker": 0,
                }
            ),
            TypeError,
            r"`state_dict\['scale'\]` must be a float",
        ),
    ],
    ids=[
        "adjust",
        "interval",
        "value_and_grad",
        "value_and_grad_array",
        "value_and_grad_traced",
        "dynamic_scaling",
        "select",
        "torch",
    ],
)
@pytest.mark.unit
def test_wrong_kinds_of_scalars_are_rejected_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.unit
def test_python_float_in_a_restored_state_is_reported():
    state = jxs.dynamic_scaling(optax.sgd(0.1)).init(PARAMS)
    ls = state.loss_scale
    bad = state._replace(
        loss_scale=type(ls)(
            loss_scale=65536.0,
            growth_tracker=0,
            hysteresis_tracker=1,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            hysteresis=ls.hysteresis,
            min_scale=ls.min_scale,
            max_scale=ls.max_scale,
        )
    )
    with pytest.raises(ValueError, match=r"`loss_scale.loss_scale` must be float32"):
        jxs.validate_state(bad)
    with pytest.warns(UserWarning, match="repaired"):
        fixed = jxs.validate_state(bad, repair=True)
    assert fixed.loss_scale.loss_scale.dtype == jnp.float32
    assert fixed.loss_scale.growth_tracker.dtype == jnp.int32


# --------------------------------------------------------------------------- #
# Strict dtype promotion
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.core
def test_strict_promotion_whole_train_step(dtype):
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    params = {"w": jnp.array([0.5, -1.0], dtype), "b": jnp.array([0.25], dtype)}

    def loss_fn(p, x):
        pred = p["w"] * x + p["b"]
        return jnp.mean(pred.astype(jnp.float32) ** 2)

    with jax.numpy_dtype_promotion("strict"):
        # 2**8: float16 backward passes overflow at torch's default 2**16.
        tx = jxs.dynamic_scaling(
            optax.sgd(0.1), jxs.DynamicLossScale.create(init_scale=2.0**8)
        )
        step = train_step(tx, loss_fn)
        state = tx.init(params)
        new_params, state, loss = step(params, state, jnp.array([1.0, 2.0], dtype))
    assert bool(state.last_step_finite)
    assert jax.tree.map(lambda p: p.dtype, new_params) == {"w": dtype, "b": dtype}
    assert loss.dtype == jnp.float32
