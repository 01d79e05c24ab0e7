"""Remat sees float8: under ``jax.checkpoint``, ``flax.linen.remat`` and
``equinox.filter_checkpoint``, ``jxs.float8.checkpoint_policy()`` saves what a
float8 site's backward reads (its float8 operands and scales) so the backward
quantises nothing again; jax's ``dots_saveable`` alone saves the product but
quantises the operands again."""

from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns
from jax.ad_checkpoint import checkpoint_policies as cp

import jaxscale as jxs

pytestmark = [pytest.mark.core, pytest.mark.construct]

RECIPE = jxs.float8.CurrentScaling(min_dim=0)


def counts(fun, *args):
    """Float8 quantisations (casts to a float8 dtype), amaxes and matmuls in
    the jaxpr of ``fun``."""
    c = collections.Counter()
    for e in all_eqns(jax.make_jaxpr(fun)(*args)):
        name = e.primitive.name
        out = np.dtype(e.outvars[0].aval.dtype) if e.outvars else None
        if name == "convert_element_type" and out is not None and "float8" in out.name:
            c["quantise"] += 1
        elif name in ("reduce_max", "dot_general"):
            c[name] += 1
    return dict(c)


def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))


W, X = jnp.ones((64, 64)) / 8, jnp.ones((32, 64))


def test_the_policy_recomputes_nothing_of_a_site():
    f = jxs.autocast(loss, jnp.bfloat16, float8=RECIPE)
    plain = counts(jax.grad(f), W, X)
    assert plain == {"quantise": 3, "reduce_max": 3, "dot_general": 3}
    saved = jax.checkpoint(f, policy=jxs.float8.checkpoint_policy())
    assert counts(jax.grad(saved), W, X) == plain
    # jax's dots policy alone saves the product, not the operands: both are
    # quantised again in the backward (two amaxes, two casts).
    dots = jax.checkpoint(f, policy=cp.dots_saveable)
    assert counts(jax.grad(dots), W, X) == {
        "quantise": 5,
        "reduce_max": 5,
        "dot_general": 3,
    }
    np.testing.assert_allclose(
        jax.jit(jax.grad(saved))(W, X), jax.jit(jax.grad(f))(W, X), rtol=1e-6
    )


def test_the_policy_extends_any_policy():
    f = jxs.autocast(loss, jnp.bfloat16, float8=RECIPE)
    names_only = jax.checkpoint(
        f, policy=jxs.float8.checkpoint_policy(cp.nothing_saveable)
    )
    # The operands are saved; the product is recomputed from them (a float8
    # GEMM again, no quantisation).
    assert counts(jax.grad(names_only), W, X) == {
        "quantise": 3,
        "reduce_max": 3,
        "dot_general": 4,
    }
    with pytest.raises(TypeError, match="`policy` must be a jax.checkpoint policy"):
        jxs.float8.checkpoint_policy("dots")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(64, use_bias=False)(x))


class Net(nn.Module):
    policy: object = None

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block, policy=self.policy)
        for _ in range(2):
            x = block()(x)
        return jnp.sum(x)


def test_flax_remat_blocks_save_the_float8_operands():
    x = jnp.ones((32, 64))
    variables = Net().init(jax.random.key(0), x)

    def grad_of(policy):
        f = jxs.autocast(Net(policy).apply, jnp.bfloat16, float8=RECIPE)
        return jax.grad(lambda v: f(v, x))

    plain = counts(grad_of(None), variables)
    saved = counts(grad_of(jxs.float8.checkpoint_policy()), variables)
    dots = counts(grad_of(cp.dots_saveable), variables)
    assert saved["quantise"] == 6 and saved["dot_general"] == 6, saved
    assert dots["quantise"] > saved["quantise"], (dots, saved)
    assert plain["quantise"] > saved["quantise"]  # no policy: all recomputed
    a = jax.jit(grad_of(jxs.float8.checkpoint_policy()))(variables)
    b = jax.jit(grad_of(None))(variables)  # everything recomputed
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        # Different programs (what is saved, what recomputed): bfloat16
        # rounding may land elsewhere, so a tolerance, not bits.
        np.testing.assert_allclose(u, v, atol=0.02 * float(jnp.abs(v).max()))


def test_equinox_filter_checkpoint_saves_the_float8_operands():
    eqx = pytest.importorskip("equinox")  # not on the dependency floors
    lin = eqx.nn.Linear(64, 64, use_bias=False, key=jax.random.key(1))
    params, static = eqx.partition(lin, eqx.is_inexact_array)

    def f(params, x):
        model = eqx.combine(params, static)
        return jnp.sum(jnp.tanh(jax.vmap(model)(x)))

    fp8 = jxs.autocast(f, jnp.bfloat16, float8=RECIPE)
    plain = counts(jax.grad(fp8), params, X)
    saved = eqx.filter_checkpoint(fp8, policy=jxs.float8.checkpoint_policy())
    assert counts(jax.grad(saved), params, X) == plain


@pytest.mark.parametrize(
    "policy",
    [cp.everything_saveable, cp.dots_saveable, jxs.float8.checkpoint_policy()],
    ids=["everything_saveable", "dots_saveable", "float8.checkpoint_policy"],
)
def test_saved_float8_operands_keep_their_largest_values(policy):
    """A checkpoint that saves a value passes it through ``reduce_precision``
    with its dtype's bits, which for float8_e4m3fn (no infinity) turns 256 to
    448 into inf: the gradients were NaN under ``everything_saveable``. The
    operands cross the checkpoint as their bits."""
    f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16, float8=RECIPE)
    want = jax.jit(jax.grad(f))(W, X)  # every operand quantises to 448
    got = jax.jit(jax.grad(jax.checkpoint(f, policy=policy)))(W, X)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
