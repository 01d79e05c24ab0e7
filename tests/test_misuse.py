"""Holding the library wrong, the ways the 0.2.0 trial did: each is loud now.

* gradients of the *unscaled* loss handed to ``update`` (nothing overflows,
  the scale grows, training stalls): ``summary``'s ``growths_without_overflow``
  and the monitor's ``warn_no_overflow_after``;
* a state restored without a target (plain dicts) handed to ``update``;
* a float16 or bfloat16 loss; a forgotten ``has_aux=True``; a non-scalar loss.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import jaxscale as jxs
import jaxscale.flax  # noqa: F401  (registers the states with flax serialization)

pytestmark = pytest.mark.core

X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)
Y = X @ jnp.array([1.0, -2.0, 0.5, 3.0])


def loss_fn(w):
    return jnp.mean((X @ w - Y) ** 2)


def train(grads_of, steps, interval, monitor=None):
    """SGD on a float32 regression; ``grads_of(w, state)`` gives the gradients
    handed to ``update``."""
    ls = jxs.DynamicLossScale.create(init_scale=2.0**10, growth_interval=interval)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    if monitor is not None:
        tx = jxs.diagnostics.monitor(tx, **monitor)
    w = jnp.zeros(4)
    state = tx.init(w)

    @jax.jit
    def step(w, state):
        updates, state = tx.update(grads_of(w, state), state, w)
        return optax.apply_updates(w, updates), state

    for _ in range(steps):
        w, state = step(w, state)
    jax.effects_barrier()
    return w, state


def scaled(w, state):
    return jxs.value_and_grad(loss_fn, state)(w)[1]


def unscaled(w, state):
    del state
    return jax.grad(loss_fn)(w)


def test_unscaled_gradients_show_in_summary_and_do_not_train():
    w_ok, s_ok = train(scaled, 100, 10)
    w_bad, s_bad = train(unscaled, 100, 10)
    assert float(loss_fn(w_ok)) < 1e-3 < float(loss_fn(w_bad))
    # Both never overflow here (float32 compute): the count says so, for both.
    for s in (s_ok, s_bad):
        summary = jxs.diagnostics.summary(s)
        assert int(summary["growths_without_overflow"]) == 10
        assert int(summary["skipped_steps"]) == 0


def test_an_overflow_resets_the_count_for_good():
    def one_inf(w, state):
        g = scaled(w, state)
        return jnp.where(state.steps == 3, jnp.inf, g)

    _, state = train(one_inf, 40, 5)
    summary = jxs.diagnostics.summary(state)
    assert int(summary["skipped_steps"]) == 1
    assert int(summary["growths_without_overflow"]) == 0


def test_monitor_warns_once_when_nothing_ever_overflows():
    with pytest.warns(jxs.diagnostics.NoOverflowWarning) as record:
        train(unscaled, 50, 5, monitor={"warn_no_overflow_after": 4})
    assert len(record) == 1
    text = str(record[0].message)
    assert "no step has overflowed in 20 steps" in text
    assert "grew 4 times" in text and "jxs.value_and_grad" in text


def test_monitor_is_silent_after_an_overflow():
    def early_inf(w, state):
        return jnp.where(state.steps == 1, jnp.inf, scaled(w, state))

    with warnings.catch_warnings():
        warnings.simplefilter("error", jxs.diagnostics.NoOverflowWarning)
        train(early_inf, 50, 5, monitor={"warn_no_overflow_after": 4})


def test_no_overflow_warning_needs_a_growing_scale():
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), jxs.StaticLossScale.create(8.0)),
        warn_no_overflow_after=4,
    )
    w = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"warn_no_overflow_after.*StaticLossScale"):
        tx.update(jnp.ones(2), tx.init(w), w)
    with pytest.raises(ValueError, match=r"warn_no_overflow_after"):
        jxs.diagnostics.monitor(
            jxs.dynamic_scaling(optax.sgd(0.1)), warn_no_overflow_after=0
        )


# --------------------------------------------------------------------------- #
# Messages that name the cause.
# --------------------------------------------------------------------------- #


def without_target(state):
    """What a checkpoint restored without a target gives: nested plain dicts."""
    return serialization.msgpack_restore(serialization.to_bytes(state))


def test_update_on_a_restored_dict_says_restore_with_a_target():
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    w = jnp.zeros(2)
    state = tx.init(w)
    restored = without_target(state)
    with pytest.raises(TypeError, match=r"got dict\. A checkpoint restored without"):
        tx.update(jnp.ones(2), restored, w)
    with pytest.raises(TypeError, match=r"DynamicScalingState .* got tuple\. Pass"):
        tx.update(jnp.ones(2), optax.sgd(0.1).init(w), w)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_loss_warns_at_trace_time(dtype):
    ls = jxs.StaticLossScale.create(2.0**4)

    def half_loss(w):
        return jnp.mean((w * w).astype(dtype))

    with pytest.warns(jxs.HalfPrecisionLossWarning, match=r"jnp.mean\(x, dtype=jnp"):
        jax.jit(jxs.value_and_grad(half_loss, ls)).lower(jnp.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jxs.value_and_grad(loss_fn, ls)(jnp.ones(4))  # float32: silent


def test_forgotten_has_aux_shows_unscaled_values_and_says_has_aux():
    ls = jxs.StaticLossScale.create(2.0**16)

    def with_aux(w):
        return jnp.sum(w), {"a": jnp.ones(())}

    has_aux = r"returned a tuple of 2 .*has_aux=True.*not scaled them"
    with pytest.raises(TypeError, match=has_aux):
        jxs.value_and_grad(with_aux, ls)(jnp.ones(3))
    with pytest.raises(TypeError, match=r"must return a pair"):
        jxs.value_and_grad(lambda w: jnp.sum(w), ls, has_aux=True)(jnp.ones(3))
    with pytest.raises(TypeError, match=r"scalar loss, got an array of shape \(3,\)"):
        jxs.value_and_grad(lambda w: w * 2, ls)(jnp.ones(3))


def test_init_on_a_module_with_non_array_leaves_says_filter():
    # An equinox module keeps strings (BatchNorm's axis_name), functions and
    # ints as leaves; 0.2.0 failed with numpy's "data type 'batch' not understood".
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    filtered = r"got str 'batch' at \['axis_name'\].*eqx\.filter"
    with pytest.raises(TypeError, match=filtered):
        tx.init({"w": jnp.ones(2), "axis_name": "batch"})
    with pytest.raises(TypeError, match=r"got custom_jvp .* at \['act'\]"):
        tx.init({"w": jnp.ones(2), "act": jax.nn.relu})
    state = tx.init({"w": jnp.ones(2), "n": None, "step": 3, "lr": 0.5})
    assert int(state.steps) == 0


def test_value_and_grad_on_a_restored_dict_says_restore_with_a_target():
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    w = jnp.zeros(4)
    # What a restore without a target gives: nested plain dicts.
    restored = {"opt_state": without_target(tx.init(w))}
    for call in (
        lambda: jxs.value_and_grad(loss_fn, restored["opt_state"]),
        lambda: jxs.loss_scale_of(restored),
        lambda: jxs.validate_state(restored["opt_state"]),
    ):
        with pytest.raises(
            ValueError, match=r"as plain dicts: was it restored without a target"
        ):
            call()


def test_complex_params_are_unscaled_and_checked_directly_and_through_the_split():
    # 0.2.0 neither unscaled nor checked complex leaves: an update 65536 times
    # too large, and an inf gradient applied as NaN. Later releases refused them
    # and advised the split, which turns adam into adam on the real and the
    # imaginary parts separately (tests/test_complex.py); both routes unscale.
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    z = jnp.array([1.0 + 2.0j])
    updates, state = tx.update(z * 2.0**16, tx.init(z), z)  # the default scale
    np.testing.assert_allclose(np.asarray(updates), [-0.1 - 0.2j], rtol=1e-6)
    updates, state = tx.update(jnp.array([complex(1.0, np.inf)]), state, z)
    assert int(state.skipped_steps) == 1
    assert np.signbit(np.asarray(updates).view(np.float32)).all()  # -0 - 0j
    split = optax.contrib.split_real_and_imaginary(tx)
    with jax.numpy_dtype_promotion("standard"):  # optax's split promotes
        state = split.init(z)
        updates, _ = split.update(z * 2.0**16, state, z)
    np.testing.assert_allclose(np.asarray(updates), [-0.1 - 0.2j], rtol=1e-6)
