"""Stock optax inside ``dynamic_scaling`` is right on half-precision leaves.

In jaxscale 0.1.0 the inner optimizer ran in the leaves' own dtype: float16
params with ``optax.adam`` were NaN after one step (``eps=1e-8`` is 0 in
float16) and ``optax.clip_by_global_norm`` on float16 gradients whose unscaled
norm exceeds 65504 returned zero updates on a step counted finite. Now ``inner``
computes in float32 for every leaf narrower than float32 and the updates come
back in each parameter's dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
from jaxscale.testing import assert_bit_identical

pytestmark = pytest.mark.core

HALF = [jnp.float16, jnp.bfloat16]


def step(tx, params, grads, state=None):
    state = tx.init(params) if state is None else state

    @jax.jit
    def run(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return updates, optax.apply_updates(params, updates), state

    return run(params, state, grads)


@pytest.mark.isa
def test_clip_by_global_norm_on_float16_norm_beyond_float16_range():
    # Scale 16, 1000 gradients of 48000 (scaled): unscaled 3000 each, global
    # norm 94868 > 65504, the largest float16.
    ls = jxs.StaticLossScale.create(16.0)
    tx = jxs.dynamic_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), ls
    )
    params = jnp.zeros(1000, jnp.float16)
    grads = jnp.full(1000, 48000.0, jnp.float16)
    updates, new_params, state = step(tx, params, grads)
    assert bool(state.last_step_finite)
    assert updates.dtype == jnp.float16
    np.testing.assert_allclose(
        np.asarray(updates, np.float32), -1 / np.sqrt(1000), rtol=1e-3
    )
    assert float(jnp.linalg.norm(new_params.astype(jnp.float32))) == pytest.approx(
        1.0, rel=1e-3
    )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.isa
def test_adam_on_half_precision_params_is_finite_and_right(dtype, name):
    make = {"adam": optax.adam, "adamw": optax.adamw}[name]
    tx = jxs.dynamic_scaling(relaxed(make(1e-2)))
    params = {"w": jnp.linspace(-1, 1, 64, dtype=dtype), "b": jnp.zeros(3, dtype)}
    scale = float(jxs.loss_scale_of(tx.init(params)).loss_scale)
    grads = jax.tree.map(
        lambda p: (jnp.full(p.shape, 1e-3, jnp.float32) * scale).astype(dtype),
        params,
    )
    state = None
    p = params
    for _ in range(3):
        updates, p, state = step(tx, p, grads, state)
        assert bool(state.last_step_finite)
        assert bool(jxs.all_finite(p)), "half-precision params must stay finite"
    # Reference: the same optimizer on float32 copies (first steps of adam move
    # every coordinate by about -lr; adamw also decays the weights).
    ref_tx = relaxed(make(1e-2))
    ref_p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref_state = ref_tx.init(ref_p)
    ref_g = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, jnp.float32), params)
    for _ in range(3):
        u, ref_state = ref_tx.update(ref_g, ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    for key in params:
        assert p[key].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(p[key], np.float32), np.asarray(ref_p[key]), atol=2e-2
        )


@pytest.mark.parametrize("dtype", HALF)
def test_inner_state_is_float32_for_half_leaves_only(dtype):
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    params = {"half": jnp.ones(4, dtype), "f32": jnp.ones(4, jnp.float32)}
    state = tx.init(params)
    mu = state.inner_state[0].mu
    assert mu["half"].dtype == jnp.float32
    assert mu["f32"].dtype == jnp.float32
    grads = {"half": jnp.ones(4, dtype), "f32": jnp.ones(4, jnp.float32)}
    updates, _, new_state = step(tx, params, grads, state)
    assert updates["half"].dtype == dtype and updates["f32"].dtype == jnp.float32
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(
        lambda x: x.dtype, state
    )


@pytest.mark.isa
def test_skipped_step_leaves_half_params_and_state_bit_identical():
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    params = {"w": jnp.array([-0.0, 1.5, -2.25], jnp.float16)}
    _, params, state = step(tx, params, {"w": jnp.ones(3, jnp.float16)})
    bad = {"w": jnp.array([jnp.inf, 1.0, 1.0], jnp.float16)}
    updates, new_params, new_state = step(tx, params, bad, state)
    assert not bool(new_state.last_step_finite)
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert jxs.diagnostics.nonfinite_paths(new_state) == ["w"]


@pytest.mark.isa
def test_updates_take_the_gradient_dtype_without_params():
    tx = jxs.dynamic_scaling(optax.sgd(1.0), jxs.StaticLossScale.create(4.0))
    updates, _ = tx.update(jnp.full(3, 8.0, jnp.float16), tx.init(jnp.zeros(3)))
    assert updates.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(updates, np.float32), -2.0)
