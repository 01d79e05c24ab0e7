"""Property-based tests (hypothesis): random valid configurations and random
finite / non-finite schedules.

Compilation is kept out of the examples: the static configuration of a loss scale
is drawn from a fixed set of buckets (each bucket compiles once), everything
else (initial scale, trackers, schedules, gradients) is data fed to one jitted
``lax.scan`` per bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import jaxscale as jxs
import jaxscale.flax as jxf
import jaxscale.testing as jxt

pytestmark = pytest.mark.integration

TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)

# Fixed, derandomised profile: the same examples on every run, no database
# written into the checkout, no deadline (the first example of a bucket compiles).
PROFILE = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
CHEAP = settings(max_examples=100, **PROFILE)
COMPILED = settings(max_examples=60, **PROFILE)

# Static configurations (each compiles once): powers of two and not, tight and
# default bounds, every hysteresis, intervals from 1.
CONFIGS = [
    {"growth_interval": 1},
    {"growth_interval": 3, "hysteresis": 2, "min_scale": 1.0, "max_scale": 2.0**12},
    {
        "growth_factor": 3.0,
        "backoff_factor": 0.3,
        "growth_interval": 5,
        "min_scale": 0.5,
        "max_scale": 1000.0,
    },
    {
        "growth_factor": 1.5,
        "backoff_factor": 0.75,
        "growth_interval": 2,
        "hysteresis": 4,
    },
    {"growth_interval": 7, "hysteresis": 3},
    {
        "growth_factor": 2.0**10,
        "backoff_factor": 2.0**-10,
        "growth_interval": 2,
        "max_scale": 2.0**126 * 3.0,
    },
]
# The whole transformation compiles for ~3 s per (config, optimizer): two configs
# (tight bounds with hysteresis 2; non-power-of-two factors with hysteresis 4).
TRAIN_BUCKETS = (1, 3)
STATE_LENGTH = 256  # steps per example, scale state machine only
TRAIN_LENGTH = 64  # steps per example, whole transformation


def base_loss_scale(i: int) -> jxs.DynamicLossScale:
    return jxs.DynamicLossScale.create(init_scale=1.0, **CONFIGS[i])


@st.composite
def loss_scales(draw, buckets=None):
    """``(bucket, loss scale)``: a bucketed config with random (valid) leaves."""
    i = draw(st.sampled_from(buckets or range(len(CONFIGS))))
    ls = base_loss_scale(i)
    log_lo, log_hi = math.log2(ls.min_scale), math.log2(ls.max_scale)
    scale = float(np.float32(2.0 ** draw(st.floats(log_lo, log_hi))))
    scale = min(max(scale, ls.min_scale), ls.max_scale)
    if draw(st.booleans()):  # start on a bound
        scale = draw(st.sampled_from([ls.min_scale, ls.max_scale]))
    return i, dataclasses.replace(
        ls,
        loss_scale=jnp.asarray(scale, jnp.float32),
        growth_tracker=jnp.asarray(
            draw(st.integers(0, ls.growth_interval - 1)), jnp.int32
        ),
        hysteresis_tracker=jnp.asarray(draw(st.integers(1, ls.hysteresis)), jnp.int32),
    )


@st.composite
def schedules(draw, length):
    """Finite (True) / overflow (False) steps as runs: shrinks to short runs."""
    runs = draw(
        st.lists(
            st.tuples(st.integers(0, 16), st.integers(0, 6)), min_size=1, max_size=40
        )
    )
    seq = [ok for good, bad in runs for ok in [True] * good + [False] * bad]
    tail = draw(st.booleans())
    return np.array((seq + [tail] * length)[:length])


@jax.jit
def run_adjust(ls, finite):
    return jax.lax.scan(lambda s, f: (s.adjust(f),) * 2, ls, finite)[1]


def _in_bounds(scales, ls):
    s = np.asarray(scales, np.float32)
    return np.all(
        (s >= np.float32(ls.min_scale))
        & (s <= np.float32(ls.max_scale))
        & np.isfinite(s)
        & (s >= np.float32(TINY))
    )


def _events(scales, ls):
    """Coverage, shown by ``pytest --hypothesis-show-statistics``."""
    s = np.concatenate([[np.float32(ls.loss_scale)], np.asarray(scales, np.float32)])
    event(f"grew: {bool((s[1:] > s[:-1]).any())}")
    event(f"backed off: {bool((s[1:] < s[:-1]).any())}")
    event(f"at floor: {bool((s == np.float32(ls.min_scale)).any())}")
    event(f"at ceiling: {bool((s == np.float32(ls.max_scale)).any())}")


# --------------------------------------------------------------------------- #
# Property 1: the scale state machine.
# --------------------------------------------------------------------------- #


@CHEAP
@given(bucket_ls=loss_scales(), finite=schedules(STATE_LENGTH))
def test_scale_stays_in_bounds_and_equals_the_reference(bucket_ls, finite):
    _, ls = bucket_ls
    run = run_adjust(ls, jnp.asarray(finite))
    assert _in_bounds(run.loss_scale, ls)
    trackers = np.asarray(run.growth_tracker)
    budgets = np.asarray(run.hysteresis_tracker)
    assert trackers.min() >= 0 and trackers.max() < ls.growth_interval
    assert budgets.min() >= 1 and budgets.max() <= ls.hysteresis
    jxt.assert_trajectory_matches(run, jxt.simulate(ls, finite.tolist()))
    _events(np.asarray(run.loss_scale), ls)
    # Every state the machine reaches passes validate_state unchanged.
    last = jax.tree.map(lambda x: x[-1], run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jxs.validate_state(last) is last


# --------------------------------------------------------------------------- #
# Property 2: the whole transformation on mixed-dtype params.
# --------------------------------------------------------------------------- #

PARAMS = {
    "w": jnp.array([0.5, -1.0, 2.0, -0.0], jnp.float32),
    "h": jnp.array([1.0, -0.25], jnp.float16),
    "b": jnp.array([0.75, 3.0], jnp.bfloat16),
}
FLOAT_LEAVES = ("b", "h", "w")  # jax.tree order of the floating leaves
INNERS = {
    "sgd": lambda: optax.sgd(0.05, momentum=0.9),
    # eps=1e-3, not 1e-8: 1e-8 is 0 in float16, and optax.adam then turns a zero
    # gradient of an f16 parameter into 0/0 = NaN by itself (see test_bad_input).
    "adam": lambda: relaxed(optax.adam(1e-2, eps=1e-3)),
}
BAD_VALUES = np.array([np.inf, -np.inf, np.nan], np.float32)


@functools.cache
def train_runner(config_index: int, inner: str):
    """One jitted scan per (config, optimizer): compiled once per bucket."""
    tx = jxs.dynamic_scaling(INNERS[inner](), base_loss_scale(config_index))

    def step(carry, xs):
        params, state = carry
        grads, poison, bad = xs
        scaled = state.loss_scale.scale(grads)
        # Poison element 0 of the chosen float leaves with inf / -inf / NaN.
        for i, name in enumerate(FLOAT_LEAVES):
            leaf = scaled[name]
            value = jnp.where(poison[i], bad, leaf[0].astype(jnp.float32))
            scaled = {**scaled, name: leaf.at[0].set(value.astype(leaf.dtype))}
        independent = jxs.all_finite(state.loss_scale.unscale(scaled))
        updates, new_state = tx.update(scaled, state, params)
        new_params = optax.apply_updates(params, updates)
        return (new_params, new_state), (new_params, new_state, independent)

    @jax.jit
    def run(state, grads, poison, bad):
        carry = (PARAMS, state)
        return jax.lax.scan(step, carry, (grads, poison, bad))[1]

    return tx, run


@st.composite
def train_inputs(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(-6, 3, size=(TRAIN_LENGTH, 1))
    grads = {
        "w": (rng.standard_normal((TRAIN_LENGTH, 4)) * magnitude).astype(np.float32),
        "h": (rng.standard_normal((TRAIN_LENGTH, 2)) * magnitude).astype(np.float16),
        "b": (rng.standard_normal((TRAIN_LENGTH, 2)) * magnitude).astype(jnp.bfloat16),
    }
    finite = draw(schedules(TRAIN_LENGTH))
    # On each overflow step poison at least one leaf (which ones: random).
    which = rng.random((TRAIN_LENGTH, len(FLOAT_LEAVES))) < 0.5
    which[np.arange(TRAIN_LENGTH), rng.integers(0, len(FLOAT_LEAVES), TRAIN_LENGTH)] = (
        True
    )
    poison = which & ~finite[:, None]
    bad = BAD_VALUES[rng.integers(0, 3, TRAIN_LENGTH)]
    return grads, poison, bad


def _bits(tree):
    return [
        (np.asarray(x).dtype.name, np.asarray(x).tobytes())
        for x in jax.tree.leaves(tree)
    ]


def _at(tree, t):
    return jax.tree.map(lambda x: x[t], tree)


@COMPILED
@given(
    bucket_ls=loss_scales(buckets=TRAIN_BUCKETS),
    inner=st.sampled_from(sorted(INNERS)),
    inputs=train_inputs(),
)
def test_skip_and_apply_properties_of_the_transformation(bucket_ls, inner, inputs):
    i, ls = bucket_ls
    grads, poison, bad = inputs
    tx, run = train_runner(i, inner)
    state0 = tx.init(PARAMS)._replace(loss_scale=ls)
    # One transfer to host; everything below is NumPy.
    params, states, independent = jax.device_get(run(state0, grads, poison, bad))
    applied = states.last_step_finite
    # The decision equals an independent finiteness check, and poison always skips.
    np.testing.assert_array_equal(applied, independent)
    assert not applied[poison.any(axis=1)].any()
    before_params, before_inner = jax.device_get((PARAMS, state0.inner_state))
    for t in range(TRAIN_LENGTH):
        after_params = _at(params, t)
        after_inner = _at(states.inner_state, t)
        if applied[t]:
            # An applied step never makes a parameter non-finite.
            assert all(
                np.isfinite(x.astype(np.float32)).all()
                for x in jax.tree.leaves(after_params)
            ), t
        else:
            # A skipped step leaves params and inner state bit-identical.
            assert _bits(after_params) == _bits(before_params), t
            assert _bits(after_inner) == _bits(before_inner), t
        before_params, before_inner = after_params, after_inner
    # The scale follows the reference on the observed decisions, in bounds.
    jxt.assert_trajectory_matches(states, jxt.simulate(ls, applied.tolist()))
    _events(states.loss_scale.loss_scale, ls)
    event(f"natural overflows: {bool((~applied & ~poison.any(axis=1)).any())}")
    assert _in_bounds(states.loss_scale.loss_scale, ls)
    # Counters agree with the decisions.
    skipped = np.cumsum(~applied)
    np.testing.assert_array_equal(states.skipped_steps, skipped)
    np.testing.assert_array_equal(states.steps, np.arange(1, TRAIN_LENGTH + 1))
    last = _at(states, TRAIN_LENGTH - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jxs.validate_state(last) is last


# --------------------------------------------------------------------------- #
# Property 3: conversions and repairs (host only, no compilation).
# --------------------------------------------------------------------------- #

POW2 = st.integers(-100, 100).map(lambda k: 2.0**k)


@CHEAP
@given(
    scale=POW2 | st.floats(1e-30, 1e30).map(lambda x: float(np.float32(x))),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5, 1.25, 10.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75, 0.125]),
    interval_tracker=st.integers(1, 10**6).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n - 1))
    ),
)
def test_torch_state_dict_round_trips(
    scale, growth_factor, backoff_factor, interval_tracker
):
    interval, tracker = interval_tracker
    sd = {
        "scale": scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": interval,
        "_growth_tracker": tracker,
    }
    ls = jxs.from_torch_state_dict(sd)
    out = jxs.to_torch_state_dict(ls)
    assert out == sd
    assert {k: type(v) for k, v in out.items()} == {k: type(v) for k, v in sd.items()}
    back = jxs.from_torch_state_dict(out)
    assert _bits(back) == _bits(ls) and back.growth_interval == ls.growth_interval


positive = st.floats(
    min_value=0.0, max_value=math.inf, exclude_min=True
) | st.sampled_from([math.inf, 1e-45, 2.0**-149, F32_MAX])


@CHEAP
@given(
    config=st.integers(0, len(CONFIGS) - 1),
    scale=positive,
    tracker=st.integers(-(2**31), 2**31 - 1),
    budget=st.integers(-(2**31), 2**31 - 1),
    wide=st.booleans(),
)
def test_repair_always_yields_a_valid_state(config, scale, tracker, budget, wide):
    # A positive float32 leaf is never 0 (that is garbage, never repaired).
    with np.errstate(over="ignore"):
        assume(wide or np.float32(scale) > 0)
    ls = base_loss_scale(config)
    int_t = np.int64 if wide else np.int32
    with np.errstate(over="ignore"):
        bad = dataclasses.replace(
            ls,
            loss_scale=np.float64(scale) if wide else np.float32(scale),
            growth_tracker=int_t(tracker),
            hysteresis_tracker=int_t(budget),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fixed = jxs.validate_state(bad, repair=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jxs.validate_state(fixed) is fixed  # valid, nothing left to repair
    assert _in_bounds([fixed.loss_scale], ls)
    assert jax.tree.structure(fixed) == jax.tree.structure(ls)


@CHEAP
@given(bucket_ls=loss_scales())
def test_flax_serialization_round_trips_any_valid_state(bucket_ls):
    serialization = pytest.importorskip("flax.serialization")
    jxf.register_flax_serialization()
    i, ls = bucket_ls
    target = base_loss_scale(i)
    back = serialization.from_bytes(target, serialization.to_bytes(ls))
    assert _bits(back) == _bits(ls)
    assert jxs.validate_state(back) is back
