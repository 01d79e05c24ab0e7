"""The finite check in groups (``jaxscale/_finite.py``): leaves of one role
(the same parameter of every layer) share one reduction, and every leaf's own
flag stays exact, in every dtype and for every scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale as jxs
from jaxscale._finite import MAX_GROUP, leaf_flags
from jaxscale._loss_scale import reciprocal_parts
from jaxscale.testing import assert_bit_identical

pytestmark = pytest.mark.core


def reference(tree, scale):
    """Per leaf, one element at a time: is it non-finite once unscaled, in the
    leaf's dtype (real and imaginary parts apart)?"""
    hi, lo = reciprocal_parts(jnp.float32(scale))
    out = []
    for leaf in jax.tree.leaves(tree):
        x = np.asarray(leaf)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            out.append(False)
            continue
        parts = [x.real, x.imag] if np.iscomplexobj(x) else [x]
        bad = False
        for p in parts:
            wide = np.float64 if p.dtype == np.float64 else np.float32
            with np.errstate(over="ignore", invalid="ignore"):
                u = (p.astype(wide) * wide(hi) * wide(lo)).astype(p.dtype)
            bad |= not np.all(np.isfinite(u.astype(np.float64)))
        out.append(bad)
    return out


def flags(tree, scale):
    hi, lo = reciprocal_parts(jnp.float32(scale))
    return [bool(b) for b in jax.jit(leaf_flags)(tree, hi, lo)]


def layers(n, shape=(3, 4), dtype=jnp.float32):
    """``n`` layers of one role each: a kernel and a bias."""
    return {
        f"layer_{i}": {
            "kernel": jnp.full(shape, 1.0 + i, dtype),
            "bias": jnp.full(shape[-1:], 0.5, dtype),
        }
        for i in range(n)
    }


def put(tree, path, index, value):
    """``tree`` with ``value`` at ``index`` of the leaf at ``path`` (a/b)."""
    a, b = path.split("/")
    tree = jax.tree.map(lambda x: x, tree)
    tree[a][b] = tree[a][b].at[index].set(value)
    return tree


# More layers than one group holds: the check splits them in two.
N = MAX_GROUP + 6


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["layer_0/kernel", "layer_65/bias", "layer_4/kernel"])
def test_one_bad_leaf_among_many_of_its_role_is_the_only_one_flagged(value, where):
    tree = put(layers(N), where, 0, value)
    got = flags(tree, 2.0**10)
    assert got == reference(tree, 2.0**10)
    assert sum(got) == 1


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_overflow_when_unscaled_below_a_scale_of_one(dtype):
    big = float(jnp.finfo(dtype).max) / 1.5
    tree = put(layers(5, dtype=dtype), "layer_3/kernel", (1, 2), big)
    for scale in (0.5, 1.0, 2.0**10, 2.0**127):
        got = flags(tree, scale)
        assert got == reference(tree, scale), scale
        assert got[7] == (scale == 0.5), scale  # layer_3/kernel: overflows at 0.5


def test_complex_and_integer_and_empty_leaves():
    tree = {
        f"block_{i}": {
            "z": jnp.full((2, 3), 1 + 2j, jnp.complex64),
            "n": jnp.int32(i),
            "e": jnp.zeros((0, 3), jnp.float32),
            "s": jnp.float32(1.0),
        }
        for i in range(4)
    }
    tree["block_2"]["z"] = tree["block_2"]["z"].at[1, 1].set(complex(1.0, np.inf))
    tree["block_1"]["z"] = tree["block_1"]["z"].at[0, 0].set(complex(np.nan, 0.0))
    tree["block_3"]["s"] = jnp.float32(np.inf)
    got = flags(tree, 4.0)
    assert got == reference(tree, 4.0)
    assert sum(got) == 3


def test_mixed_dtypes_and_shapes_of_one_role():
    tree = {
        "a_0": {"w": jnp.ones((2, 2), jnp.float16)},
        "a_1": {"w": jnp.ones((2, 2), jnp.float32)},
        "a_2": {"w": jnp.ones((3,), jnp.float16)},
        "a_3": {"w": jnp.ones((2, 2), jnp.float16).at[0, 1].set(jnp.inf)},
    }
    assert flags(tree, 2.0) == [False, False, False, True]


def test_a_skipped_step_names_the_leaf_and_changes_nothing():
    params = layers(N)
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = jax.tree.map(jnp.ones_like, params)
    params, state = step(params, state, grads)
    bad = put(grads, "layer_66/kernel", (2, 3), np.inf)
    new_params, new_state = step(params, state, bad)
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert int(new_state.skipped_steps) == 1
    assert jxs.diagnostics.nonfinite_paths(new_state) == ["layer_66/kernel"]
