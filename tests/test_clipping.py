"""jxs.clip_by_global_norm and jxs.global_norm: float16 gradients whose norm
overflows float16 are clipped correctly (optax's are silently zeroed), float32
results equal optax's bit for bit, and clipping inside dynamic_scaling sees the
unscaled gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs

pytestmark = pytest.mark.core


def f64_norm(tree):
    return float(
        np.sqrt(
            sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))
        )
    )


def random_tree(dtype, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "kernel": jnp.asarray(rng.normal(size=(16, 8)) * scale, dtype),
            "bias": jnp.asarray(rng.normal(size=(8,)) * scale, dtype),
        },
        "out": jnp.asarray(rng.normal(size=(8, 3)) * scale, dtype),
    }


def clip(tx, grads):
    return jax.jit(tx.update)(grads, tx.init(grads))[0]


# --------------------------------------------------------------------------- #
# float16 gradients whose norm overflows float16
# --------------------------------------------------------------------------- #


@pytest.mark.isa
def test_f16_norm_overflow_optax_zeroes_the_update_jaxscale_clips():
    # Every element is finite in f16, but the global norm (~8e4) is not, and
    # already most single squares overflow f16.
    grads = random_tree(jnp.float16, scale=6000.0)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))
    true_norm = f64_norm(grads)
    assert true_norm > float(jnp.finfo(jnp.float16).max)

    with jax.numpy_dtype_promotion("standard"):
        assert not np.isfinite(float(optax.tree.norm(grads)))
        ours_wrong = clip(optax.clip_by_global_norm(1.0), grads)
    # optax: every gradient is divided by an f16 inf: the update is silently zero.
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(ours_wrong))

    clipped = clip(jxs.clip_by_global_norm(1.0), grads)
    for g, c in zip(jax.tree.leaves(grads), jax.tree.leaves(clipped), strict=True):
        assert c.dtype == jnp.float16 and c.shape == g.shape
        np.testing.assert_allclose(
            np.asarray(c, np.float64),
            np.asarray(g, np.float64) / true_norm,
            rtol=2e-3,
            atol=1e-6,
        )
    np.testing.assert_allclose(f64_norm(clipped), 1.0, rtol=2e-3)


@pytest.mark.isa
def test_global_norm_of_f16_tree_is_f32_and_exact():
    grads = random_tree(jnp.float16, scale=600.0)
    norm = jax.jit(jxs.global_norm)(grads)
    assert norm.dtype == jnp.float32 and norm.shape == ()
    np.testing.assert_allclose(float(norm), f64_norm(grads), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.isa
def test_half_precision_below_max_norm_is_untouched(dtype):
    grads = random_tree(dtype, scale=1e-2)
    clipped = clip(jxs.clip_by_global_norm(10.0), grads)
    for g, c in zip(jax.tree.leaves(grads), jax.tree.leaves(clipped), strict=True):
        assert c.dtype == dtype
        np.testing.assert_array_equal(np.asarray(c), np.asarray(g))


@pytest.mark.isa
def test_bf16_clipping_matches_f64_reference():
    grads = random_tree(jnp.bfloat16, scale=1e3)
    clipped = clip(jxs.clip_by_global_norm(2.0), grads)
    ref = f64_norm(grads)
    for g, c in zip(jax.tree.leaves(grads), jax.tree.leaves(clipped), strict=True):
        assert c.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(c, np.float64),
            np.asarray(g, np.float64) * 2.0 / ref,
            rtol=1e-2,
            atol=1e-6,
        )


@pytest.mark.isa
def test_mixed_dtype_tree_keeps_each_dtype():
    grads = {
        "h": jnp.full((4,), 300.0, jnp.float16),
        "b": jnp.full((3,), -2.0, jnp.bfloat16),
        "f": jnp.full((2,), 5.0, jnp.float32),
        "step": jnp.int32(7),
    }
    clipped = clip(jxs.clip_by_global_norm(1.0), grads)
    assert {k: v.dtype for k, v in clipped.items()} == {
        k: v.dtype for k, v in grads.items()
    }
    assert int(clipped["step"]) == 7  # integer leaves pass through
    floats = {k: v for k, v in grads.items() if k != "step"}
    ref = f64_norm(floats)
    np.testing.assert_allclose(float(jxs.global_norm(grads)), ref, rtol=1e-6)
    np.testing.assert_allclose(
        f64_norm({k: v for k, v in clipped.items() if k != "step"}), 1.0, rtol=5e-3
    )


# --------------------------------------------------------------------------- #
# float32: a drop-in for optax
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("max_norm", [0.5, 1.0, 100.0])
@pytest.mark.isa
def test_f32_equals_optax_bit_for_bit(scale, max_norm):
    grads = random_tree(jnp.float32, scale=scale, seed=1)
    ours = clip(jxs.clip_by_global_norm(max_norm), grads)
    theirs = clip(optax.clip_by_global_norm(max_norm), grads)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_same_state_as_optax():
    params = random_tree(jnp.float32)
    ours = jxs.clip_by_global_norm(1.0).init(params)
    assert ours == optax.clip_by_global_norm(1.0).init(params)
    assert isinstance(ours, optax.EmptyState)


@pytest.mark.isa
def test_f32_norm_overflow_takes_the_rescaled_sum():
    # The float32 sum of squares overflows (1e30**2), the norm itself does not.
    grads = {"a": jnp.full((3,), 1e30, jnp.float32), "b": jnp.ones(2, jnp.float32)}
    norm = jax.jit(jxs.global_norm)(grads)
    np.testing.assert_allclose(float(norm), np.sqrt(3) * 1e30, rtol=1e-6)
    # Up to the largest float32 norm: four elements of max/4 have norm max/2.
    fmax = np.finfo(np.float32).max
    big = {"a": jnp.full((4,), fmax / 4, jnp.float32), "b": jnp.ones(3)}
    np.testing.assert_allclose(
        float(jax.jit(jxs.global_norm)(big)), fmax / 2, rtol=1e-6
    )
    clipped = clip(jxs.clip_by_global_norm(1.0), grads)
    np.testing.assert_allclose(np.asarray(clipped["a"]), 1 / np.sqrt(3), rtol=1e-6)
    assert np.all(np.asarray(clipped["b"]) > 0)  # tiny, but not flushed to zero
    with jax.numpy_dtype_promotion("standard"):
        theirs = clip(optax.clip_by_global_norm(1.0), grads)
    assert np.all(np.asarray(theirs["a"]) == 0)  # optax: inf norm, zero update


@pytest.mark.parametrize(
    "bad, expected",
    [(np.inf, np.inf), (-np.inf, np.inf), (np.nan, np.nan)],
)
@pytest.mark.isa
def test_global_norm_of_nonfinite_tree(bad, expected):
    tree = {"a": jnp.array([1.0, bad], jnp.float16), "b": jnp.ones(2)}
    norm = float(jax.jit(jxs.global_norm)(tree))
    if np.isnan(expected):
        assert np.isnan(norm)
    else:
        assert norm == expected


@pytest.mark.isa
def test_global_norm_edge_cases():
    assert float(jxs.global_norm({})) == 0.0
    assert float(jxs.global_norm({"i": jnp.arange(3), "n": None})) == 0.0
    assert float(jxs.global_norm(jnp.zeros((0, 4), jnp.float16))) == 0.0
    assert float(jxs.global_norm(jnp.zeros(5, jnp.float16))) == 0.0


@pytest.mark.isa
def test_traced_max_norm_with_inject_hyperparams():
    tx = optax.inject_hyperparams(jxs.clip_by_global_norm)(max_norm=1.0)
    grads = {"w": jnp.full((4,), 40000.0, jnp.float16)}
    state = tx.init(grads)
    clipped, _ = jax.jit(tx.update)(grads, state)
    np.testing.assert_allclose(np.asarray(clipped["w"], np.float32), 0.5)


# --------------------------------------------------------------------------- #
# Inside dynamic_scaling: clipping sees unscaled gradients
# --------------------------------------------------------------------------- #


@pytest.mark.isa
def test_clip_inside_dynamic_scaling_uses_unscaled_norm_f16():
    params = {"w": jnp.zeros(4, jnp.float16)}
    scale = 2.0**6
    # Norm 600; 300**2 = 90000 overflows f16. Scaled: 19200, finite in f16.
    unscaled = {"w": jnp.full((4,), 300.0, jnp.float16)}
    scaled = jax.tree.map(lambda g: (g * scale).astype(jnp.float16), unscaled)

    ours = jxs.dynamic_scaling(
        optax.chain(jxs.clip_by_global_norm(1.0), optax.sgd(1.0)),
        jxs.StaticLossScale.create(scale),
    )
    updates, state = jax.jit(ours.update)(scaled, ours.init(params), params)
    assert bool(state.last_step_finite)
    assert updates["w"].dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -0.5, rtol=1e-3)
    assert np.all(np.isfinite(np.asarray(scaled["w"])))

    theirs = jxs.dynamic_scaling(
        relaxed(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))),
        jxs.StaticLossScale.create(scale),
    )
    updates, state = jax.jit(theirs.update)(scaled, theirs.init(params), params)
    # optax's clip alone overflows in float16 (0.1.0 gave a silent all-zero
    # update here); inside dynamic_scaling it now runs in float32 and agrees.
    assert bool(state.last_step_finite)
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -0.5, rtol=1e-3)


@pytest.mark.parametrize(
    "clipper", [jxs.clip_by_global_norm, optax.clip_by_global_norm]
)
@pytest.mark.isa
def test_clip_inside_dynamic_scaling_sees_unscaled_f32_gradients(clipper):
    params = random_tree(jnp.float32)
    unscaled = random_tree(jnp.float32, scale=0.3, seed=3)  # norm ~ 4
    scale = 2.0**12
    scaled = jax.tree.map(lambda g: g * scale, unscaled)
    tx = jxs.dynamic_scaling(
        optax.chain(clipper(1.0), optax.sgd(1.0)), jxs.StaticLossScale.create(scale)
    )
    updates, _ = jax.jit(tx.update)(scaled, tx.init(params), params)
    expected, _ = optax.clip_by_global_norm(1.0).update(unscaled, optax.EmptyState())
    for u, e in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(u), -np.asarray(e), rtol=1e-6)
    np.testing.assert_allclose(f64_norm(updates), 1.0, rtol=1e-5)


def test_clip_inside_dynamic_scaling_then_adamw_trains():
    params = random_tree(jnp.float32)
    tx = jxs.dynamic_scaling(
        optax.chain(jxs.clip_by_global_norm(1.0), relaxed(optax.adamw(1e-2)))
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss_fn = lambda p: jax.tree.reduce(  # noqa: E731
            jnp.add, jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float16) ** 2), p)
        ).astype(jnp.float32)
        loss, grads = jxs.value_and_grad(loss_fn, state)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(20):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("max_norm", [0, 0.0, -1.0, np.inf, np.nan])
def test_bad_max_norm_value(max_norm):
    with pytest.raises(ValueError, match="`max_norm` must be finite and > 0"):
        jxs.clip_by_global_norm(max_norm)


@pytest.mark.parametrize("max_norm", ["1.0", True, None, [1.0], jnp.ones(2)])
def test_bad_max_norm_type(max_norm):
    with pytest.raises(TypeError, match="`max_norm` must be a real scalar"):
        jxs.clip_by_global_norm(max_norm)
