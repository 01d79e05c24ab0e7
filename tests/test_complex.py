"""Complex parameters: ``dynamic_scaling`` unscales, checks and skips complex
leaves itself, and optax's complex-aware optimizers keep their update (adam's
second moment is ``|g|**2``; around the split wrapper it would be adam on the
real and imaginary parts separately).

The model is a complex linear layer ``x @ w + b`` (complex64 weights) fitted to
noisy targets with a float32 loss, trained as optax says complex parameters are
trained: the gradients of ``jax.grad`` conjugated before ``update``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed, with_promotion
from jax import lax

import jaxscale as jxs
import jaxscale.testing as jxt

pytestmark = pytest.mark.core

LR = 0.05
STEPS = 50
SCALE = 2.0**10  # a power of two: scaling and unscaling are exact


def complex_normal(key, shape):
    re, im = jax.random.normal(key, (2, *shape))
    return lax.complex(re, im)


def problem():
    """``(x, y, params)``: 64 complex samples of 8 features, a complex64 layer.

    ``b`` starts at ``-0 - 0j``, so that a skipped first step must keep the
    signs of both parts of a zero.
    """
    kx, kw, kn, k0 = jax.random.split(jax.random.key(0), 4)
    x = complex_normal(kx, (64, 8))
    y = x @ complex_normal(kw, (8, 8)) + 0.1 * complex_normal(kn, (64, 8))
    params = {
        "w": 0.1 * complex_normal(k0, (8, 8)),
        "b": jnp.full(8, complex(-0.0, -0.0), jnp.complex64),
    }
    return x, y, params


def loss_fn(p, x, y):
    r = x @ p["w"] + p["b"][None, :] - y
    return jnp.mean(jnp.abs(r) ** 2)  # f32[]


def adam():
    return relaxed(optax.adam(LR))  # optax's adam promotes: relaxed for it only


# A transformation is a tuple of functions: static for ``jit``.
@functools.partial(jax.jit, static_argnums=0)
def plain_step(tx, p, s, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    u, s = tx.update(optax.tree.conj(g), s, p)
    return optax.apply_updates(p, u), s, loss


@functools.partial(jax.jit, static_argnums=0)
def scaled_step(tx, p, s, x, y, fault):
    """The documented step; ``fault`` (``c64[]``, ``0j`` on a good step) is
    added to ``w[0, 0]`` of the scaled gradients, one part or both."""
    loss, g = jxs.value_and_grad(loss_fn, s)(p, x, y)
    g = optax.tree.conj(g)
    g = {**g, "w": g["w"].at[0, 0].add(fault)}
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


GOOD = jnp.complex64(0j)


def train(tx, steps=STEPS, scaled=True):
    x, y, p = problem()
    s = tx.init(p)
    for _ in range(steps):
        if scaled:
            p, s, _ = scaled_step(tx, p, s, x, y, GOOD)
        else:
            p, s, _ = plain_step(tx, p, s, x, y)
    return p, s, float(loss_fn(p, x, y))


def ds_adam(scale=SCALE):
    return jxs.dynamic_scaling(adam(), jxs.StaticLossScale.create(scale))


# One transformation object per configuration, so that the jitted steps (static
# on it) compile once for the whole file.
DS_ADAM = ds_adam()
DYNAMIC = jxs.dynamic_scaling(
    adam(), jxs.DynamicLossScale.create(init_scale=SCALE, growth_interval=3)
)


# --------------------------------------------------------------------------- #
# (a) adam on complex parameters is adam
# --------------------------------------------------------------------------- #


def test_dynamic_scaling_adam_reaches_plain_adams_loss_and_split_does_not():
    """Measured on XLA:CPU: initial loss 32.48; after 50 steps plain adam 0.5852,
    dynamic_scaling(adam) at 2**10 0.5852 (the same, in every bit there),
    split(dynamic_scaling(adam)) 0.2209 (another optimizer: adam on the real and
    imaginary parts)."""
    p_plain, _, plain = train(adam(), scaled=False)
    p_ds, _, scaled = train(DS_ADAM)
    split = with_promotion(ds_adam(), "strict")  # optax's split promotes
    split = relaxed(optax.contrib.split_real_and_imaginary(split))
    _, _, split_loss = train(split)
    x, y, p0 = problem()
    assert float(loss_fn(p0, x, y)) > 30 * plain  # it trains
    np.testing.assert_allclose(scaled, plain, rtol=1e-5)
    for k in p_plain:
        np.testing.assert_allclose(p_ds[k], p_plain[k], rtol=1e-5, atol=1e-6)
    assert abs(split_loss - plain) > 0.2 * plain, (split_loss, plain)


def test_a_power_of_two_scale_changes_nothing_bit_for_bit():
    """One compiled step (the scale is data), scale 1 and ``2**10``: the scaled
    gradients are exact multiples and unscale exactly, so 50 steps agree in
    every bit, parameters and adam's moments."""
    p1, s1, _ = train(ds_adam(1.0))
    p2, s2, _ = train(ds_adam(SCALE))
    jxt.assert_bit_identical(p1, p2, nan_bits=True)
    jxt.assert_bit_identical(s1.inner_state, s2.inner_state, nan_bits=True)


@pytest.mark.parametrize("scale", [1.0, SCALE])
def test_inner_gets_the_complex_gradients_exactly(scale):
    """What ``inner`` sees is ``grads / scale`` in every bit of both parts
    (signed zeros, extremes, each sign): compared with exact values, not with
    another program."""
    parts = np.array([0.0, -0.0, 1.5, -3.0, 1e-30, -6e34, 0.1, 7.0], np.float32)
    z = parts + 1j * parts[::-1]
    grads = {"z": jnp.asarray((z * scale).astype(np.complex64))}
    tx = jxs.dynamic_scaling(optax.identity(), jxs.StaticLossScale.create(scale))
    p = {"z": jnp.zeros(8, jnp.complex64)}
    u, _ = jax.jit(tx.update)(grads, tx.init(p), p)
    jxt.assert_bit_identical({"z": z.astype(np.complex64)}, u, nan_bits=True)


@pytest.mark.parametrize("scale", [1.0, SCALE])
def test_updates_are_optax_adams(scale):
    """Three updates of ``dynamic_scaling(adam)`` on ``scale`` times the
    gradients against ``optax.adam``'s on the gradients, both jitted: to a few
    float32 ulps, as two differently compiled programs can differ (on XLA:CPU
    they agree in every bit, as do 50 steps of the trajectory)."""
    x, y, p = problem()
    tx, ref = ds_adam(scale), adam()
    s, r = tx.init(p), ref.init(p)
    for _ in range(3):
        g = optax.tree.conj(jax.grad(loss_fn)(p, x, y))
        scaled = jax.tree.map(lambda z: lax.complex(z.real * scale, z.imag * scale), g)
        u, s = jax.jit(tx.update)(scaled, s, p)
        want, r = jax.jit(ref.update)(g, r, p)
        assert u["w"].dtype == jnp.complex64
        expected = jax.tree.leaves((want, r))
        for a, b in zip(expected, jax.tree.leaves((u, s.inner_state)), strict=True):
            np.testing.assert_allclose(b, a, rtol=4e-7, atol=0)
        p = optax.apply_updates(p, u)


def test_value_and_grad_scales_a_complex_parameters_gradient():
    x, y, p = problem()
    s = DS_ADAM.init(p)
    loss, g = jax.jit(jxs.value_and_grad(loss_fn, s))(p, x, y)
    want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(p, x, y)
    assert loss.dtype == jnp.float32 and g["w"].dtype == jnp.complex64
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(g["w"] / SCALE, want["w"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- #
# (b), (c) an inf or NaN in either part skips the step; the scale backs off
# --------------------------------------------------------------------------- #

FAULTS = {
    f"{v} in {part}": complex(v, 0.0) if part == "real" else complex(0.0, v)
    for v in (np.inf, -np.inf, np.nan)
    for part in ("real", "imag")
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("at", [0, 2])
def test_a_nonfinite_part_skips_the_step_bit_identically(fault, at):
    x, y, p0 = problem()
    s0 = DS_ADAM.init(p0)
    for _ in range(at):  # ``at = 2``: adam's moments are not zero
        p0, s0, _ = scaled_step(DS_ADAM, p0, s0, x, y, GOOD)
    bad = jnp.complex64(FAULTS[fault])
    p1, s1, _ = scaled_step(DS_ADAM, p0, s0, x, y, bad)
    jxt.assert_skipped(p0, s0, p1, s1)  # params and inner state, every bit
    assert jxs.diagnostics.nonfinite_paths(s1) == ["w"]
    p2, s2, _ = scaled_step(DS_ADAM, p1, s1, x, y, GOOD)  # and then trains on
    jxt.assert_applied(p1, s1, p2, s2)


def test_the_scale_halves_on_either_parts_overflow_and_grows_as_configured():
    x, y, p = problem()
    s = DYNAMIC.init(p)
    seen = []
    faults = [GOOD] * 3 + [jnp.complex64(complex(0.0, np.inf))]
    faults += [jnp.complex64(complex(np.nan, 0.0))] + [GOOD] * 3
    for fault in faults:
        p, s, _ = scaled_step(DYNAMIC, p, s, x, y, fault)
        seen.append(float(s.loss_scale.loss_scale))
    k = SCALE
    assert seen == [k, k, 2 * k, k, k / 2, k / 2, k / 2, k], seen
    assert int(s.skipped_steps) == 2 and int(s.steps) == 8


def test_all_finite_and_select_tree_see_both_parts():
    z = jnp.array([1 + 2j, -0.0 - 0.0j], jnp.complex64)
    assert bool(jxs.all_finite({"z": z}))
    for bad in (complex(np.inf, 0.0), complex(0.0, np.nan)):
        assert not bool(jxs.all_finite({"z": z.at[0].set(bad)}))
    other = jnp.full(2, 5 + 5j, jnp.complex64)
    picked = jax.jit(jxs.select_tree)(jnp.bool_(False), {"z": other}, {"z": z})
    jxt.assert_bit_identical({"z": z}, picked, nan_bits=True)


# --------------------------------------------------------------------------- #
# (d) clipping counts |g|**2
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("max_norm", [1.0, 1e3])
def test_clipping_a_complex_gradient_is_optaxs(max_norm):
    x, y, p = problem()
    g = optax.tree.conj(jax.grad(loss_fn)(p, x, y))
    norm = jax.jit(jxs.global_norm)(g)
    np.testing.assert_allclose(norm, optax.tree.norm(g), rtol=1e-6)
    assert norm.dtype == jnp.float32 and float(norm) < 1e3
    ours, _ = jax.jit(jxs.clip_by_global_norm(max_norm).update)(g, optax.EmptyState())
    with jax.numpy_dtype_promotion("standard"):  # optax's clip promotes
        want, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
    for k in g:
        assert ours[k].dtype == jnp.complex64
        np.testing.assert_allclose(ours[k], want[k], rtol=1e-6, atol=1e-7)
    if max_norm == 1.0:
        np.testing.assert_allclose(jxs.global_norm(ours), 1.0, rtol=1e-6)
    else:
        jxt.assert_bit_identical(g, ours, nan_bits=True)


def test_clipping_inside_dynamic_scaling_sees_unscaled_complex_gradients():
    tx = jxs.dynamic_scaling(
        optax.chain(jxs.clip_by_global_norm(1.0), optax.sgd(1.0)),
        jxs.StaticLossScale.create(SCALE),
    )
    x, y, p = problem()
    p1, _, _ = scaled_step(tx, p, tx.init(p), x, y, GOOD)
    step = jax.tree.map(lambda a, b: a - b, p1, p)
    np.testing.assert_allclose(jxs.global_norm(step), 1.0, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Accumulation and the diagnostics
# --------------------------------------------------------------------------- #


def test_accumulate_averages_complex_gradients():
    """Two micro-steps of ``accumulate(dynamic_scaling(sgd))`` apply the mean of
    both gradients (before, a complex leaf got the last micro-step's only)."""
    tx = jxs.accumulate(
        jxs.dynamic_scaling(optax.sgd(1.0), jxs.StaticLossScale.create(SCALE)), 2
    )
    p = {"z": jnp.array([1 + 2j, -3 + 0.5j], jnp.complex64)}
    g1 = {"z": jnp.array([2 + 4j, 8 - 2j], jnp.complex64) * SCALE}
    g2 = {"z": jnp.array([4 - 8j, 0 + 2j], jnp.complex64) * SCALE}
    s = tx.init(p)
    u1, s = jax.jit(tx.update)(g1, s, p)
    u2, s = jax.jit(tx.update)(g2, s, p)
    minus_zero = jnp.full(2, complex(-0.0, -0.0), jnp.complex64)
    jxt.assert_bit_identical({"z": minus_zero}, u1)  # applies as no change
    np.testing.assert_array_equal(u2["z"], np.array([-3 + 2j, -4 + 0j]))


def test_accumulate_value_and_grad_averages_complex_gradients():
    x, y, p = problem()
    ls = jxs.StaticLossScale.create(SCALE)
    fn = jxs.accumulate_value_and_grad(loss_fn, ls, num_microbatches=4)
    loss, g = jax.jit(fn)(p, x, y)
    want_loss, want = jax.jit(jxs.value_and_grad(loss_fn, ls))(p, x, y)
    assert g["w"].dtype == jnp.complex64
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for k in g:
        np.testing.assert_allclose(g[k], want[k], rtol=1e-4, atol=1e-2)


def test_layer_norms_count_complex_leaves():
    norms = jxs.diagnostics.layer_norms({"z": jnp.array([3 + 4j], jnp.complex64)})
    assert float(norms["z"]) == 5.0


def test_fault_injection_reaches_complex_leaves():
    g = {"z": jnp.ones(2, jnp.complex64), "n": jnp.int32(3)}
    out = jxt.inject_nonfinite(g, step=jnp.int32(1), at_steps=[1], value=np.nan)
    assert np.isnan(np.asarray(out["z"]).real).all()
    assert out["z"].dtype == jnp.complex64 and not bool(jxs.all_finite(out))
