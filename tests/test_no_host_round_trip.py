"""No host round trip on a GPU: the train step has no conditional.

XLA:GPU copies a ``conditional``'s predicate to the host and blocks the host
until it has arrived, unless the conditional runs inside a CUDA graph (jaxlib
>= 0.10.2, CUDA >= 12.3, no profiler): docs/performance.md. So the step that
``jxs.dynamic_scaling`` (alone, inside ``jxs.accumulate``, with
``jxs.clip_by_global_norm``, through ``jaxscale.flax``) builds must lower, for
CUDA, without ``stablehlo.case``/``stablehlo.if`` (or a ``while``). The module
is lowered for ``lowering_platforms=("cuda",)``, which needs no GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
from jaxscale import _hlo
from jaxscale.testing import assert_bit_identical

pytestmark = pytest.mark.core


def cuda_branches(fun, *args, platform: str = "cuda") -> list[str]:
    """The branching ops of ``fun``'s module lowered for ``platform``."""
    traced = jax.jit(fun).trace(*args)
    ops = _hlo.stablehlo_ops(traced.lower(lowering_platforms=(platform,)).as_text())
    return [op for op in ops if op in ("case", "if", "while")]


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (8, 4), jnp.float32),
        "b": jnp.zeros(4, jnp.float32),
        "h": jax.random.normal(k2, (4,), jnp.float32).astype(jnp.float16),
    }


def loss_fn(params, x):
    y = x @ params["w"] + (params["b"] + params["h"].astype(jnp.float32))[None]
    return jnp.mean(y**2)


def make_step(tx):
    def step(params, opt_state, x):
        _, grads = jxs.value_and_grad(loss_fn, opt_state)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


X = jnp.ones((2, 8), jnp.float32)

INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: relaxed(optax.adam(1e-3)),
    "clip+adamw": lambda: relaxed(
        optax.chain(jxs.clip_by_global_norm(1.0), optax.adamw(1e-3))
    ),
}
SCALES = {
    "dynamic": jxs.DynamicLossScale.create,
    "static": lambda: jxs.StaticLossScale.create(2.0**8),
    "noop": jxs.NoOpLossScale,
}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("inner", INNERS)
def test_dynamic_scaling_step_has_no_branch(inner, scale):
    tx = jxs.dynamic_scaling(INNERS[inner](), SCALES[scale]())
    params = init_params()
    assert cuda_branches(make_step(tx), params, tx.init(params), X) == []


def test_accumulate_micro_step_has_no_branch():
    tx = jxs.accumulate(jxs.dynamic_scaling(relaxed(optax.adam(1e-3))), 4)
    params = init_params()
    assert cuda_branches(make_step(tx), params, tx.init(params), X) == []


def test_global_norm_has_no_branch():
    assert cuda_branches(jxs.global_norm, init_params()) == []


def test_flax_train_state_step_has_no_branch():
    from jaxscale.flax import TrainState

    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-3)))
    state = TrainState.create(apply_fn=None, params=init_params(), tx=tx)

    def step(state, x):
        _, grads = jxs.value_and_grad(loss_fn, state)(state.params, x)
        return state.apply_gradients(grads=grads)

    assert cuda_branches(step, state, X) == []


def test_the_monitor_is_the_documented_exception():
    # Host hooks are host work: the monitor's callbacks sit in a lax.cond
    # (docs/diagnostics.md, docs/performance.md). A host callback lowers for
    # the backend at hand only, so this one is lowered for that backend (the
    # CPU here, CUDA on a GPU host).
    here = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    watched = jxs.diagnostics.monitor(tx, on_overflow=lambda event: None)
    params = init_params()
    step = make_step(watched)
    assert cuda_branches(step, params, watched.init(params), X, platform=here)
    assert not cuda_branches(make_step(tx), params, tx.init(params), X, platform=here)


# --------------------------------------------------------------------------- #
# Branch-free, and still: a skipped step changes nothing, bit for bit.
# --------------------------------------------------------------------------- #


def key_state_inner():
    """An inner optimizer whose state holds a typed PRNG key and a counter, and
    whose update on a non-finite gradient would write NaN into its state."""

    def init(params):
        return {
            "key": jax.random.key(1),
            "count": jnp.zeros((), jnp.int32),
            "acc": jax.tree.map(jnp.zeros_like, params),
        }

    def update(updates, state, params=None):
        del params
        key, sub = jax.random.split(state["key"])
        noise = jax.random.uniform(sub, ())
        acc = jax.tree.map(lambda a, g: a + g, state["acc"], updates)
        out = jax.tree.map(lambda g: -0.1 * g * noise.astype(g.dtype), updates)
        return out, {"key": key, "count": state["count"] + 1, "acc": acc}

    return optax.GradientTransformation(init, update)


def test_skipped_step_keeps_keys_counters_and_params_bit_identical():
    tx = jxs.dynamic_scaling(key_state_inner())
    params = {"w": jnp.array([1.0, -0.0, 2.0]), "h": jnp.ones(2, jnp.float16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    good = {"w": jnp.ones(3), "h": jnp.ones(2, jnp.float16)}
    bad = {"w": jnp.array([1.0, jnp.nan, 1.0]), "h": jnp.ones(2, jnp.float16)}
    u, state = update(good, state, params)
    params = optax.apply_updates(params, u)
    before = (params, state.inner_state)
    u, state = update(bad, state, params)
    after = optax.apply_updates(params, u)
    assert int(state.skipped_steps) == 1
    assert_bit_identical(after, before[0])
    np.testing.assert_array_equal(
        jax.random.key_data(state.inner_state["key"]),
        jax.random.key_data(before[1]["key"]),
    )
    assert int(state.inner_state["count"]) == 1
    assert_bit_identical(state.inner_state["acc"], before[1]["acc"])
    # And the next finite step goes on from there.
    _, state = update(good, state, after)
    assert int(state.inner_state["count"]) == 2
    assert int(state.skipped_steps) == 1


def odd_state_inner():
    """State leaves that are not computed by the update: one passed through
    from the input state, one a literal, one the gradient itself, and one
    value that is two leaves at once (optax.trace's shape: updates = state)."""

    def init(params):
        return {
            "same": jnp.ones(()),
            "const": jnp.zeros(()),
            "grad": jax.tree.map(jnp.zeros_like, params),
            "twice": (jax.tree.map(jnp.zeros_like, params),) * 2,
        }

    def update(updates, state, params=None):
        del params
        new = jax.tree.map(lambda t, g: 0.5 * t + g, state["twice"][0], updates)
        return new, {
            "same": state["same"],
            "const": jnp.zeros(()),
            "grad": updates,
            "twice": (new, new),
        }

    return optax.GradientTransformation(init, update)


def test_state_leaves_not_computed_by_the_update_are_kept_on_a_skip():
    tx = jxs.dynamic_scaling(odd_state_inner(), jxs.NoOpLossScale())
    params = {"w": jnp.array([1.0, 2.0])}
    update = jax.jit(tx.update)
    state = tx.init(params)
    u, state = update({"w": jnp.array([1.0, 1.0])}, state, params)
    np.testing.assert_array_equal(np.asarray(u["w"]), [1.0, 1.0])
    kept = state.inner_state
    u, state = update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    assert int(state.skipped_steps) == 1
    assert np.all(np.signbit(np.asarray(u["w"])))
    assert_bit_identical(state.inner_state, kept)
    u, state = update({"w": jnp.array([2.0, 2.0])}, state, params)
    np.testing.assert_array_equal(np.asarray(u["w"]), [2.5, 2.5])
    np.testing.assert_array_equal(np.asarray(state.inner_state["grad"]["w"]), [2, 2])
