"""Diagnostics: summary, floor counter, overflowing leaves, hooks, underflow
analysis, per-layer norms, and zero cost when everything is off."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
import jaxscale.testing as jxt
from jaxscale import _hlo

pytestmark = pytest.mark.core


def make_params(dtype=jnp.float32):
    return {
        "dense": {
            "kernel": jnp.array([[0.5, -1.0], [2.0, -0.0]], dtype),
            "bias": jnp.array([0.0, 1.0], dtype),
        },
        "head": jnp.array(3.0, dtype),
    }


def grads_like(params, value):
    return jax.tree.map(lambda p: jnp.full_like(p, value), params)


# --------------------------------------------------------------------------- #
# summary and the floor counter
# --------------------------------------------------------------------------- #

KEYS = [
    "steps",
    "skipped_steps",
    "consecutive_skips",
    "last_step_finite",
    "loss_scale",
]


def test_summary_inside_jit_has_no_host_transfer():
    params = make_params()
    ls = jxs.DynamicLossScale.create(init_scale=8.0, growth_interval=2)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return (
            optax.apply_updates(params, updates),
            state,
            jxs.diagnostics.summary(state),
        )

    state = tx.init(params)
    good, bad = grads_like(params, 1.0), grads_like(params, math.nan)
    logs = []
    with jax.transfer_guard("disallow"):
        for g in [good, bad, bad, good]:
            params, state, summary = step(params, state, g)
            logs.append(summary)
        outside = jxs.diagnostics.summary(state)  # eager, still no transfer
    assert list(outside) == [
        *KEYS,
        "growth_tracker",
        "hysteresis_tracker",
        "growths_without_overflow",
        "nonfinite_leaves",
    ]
    assert set(logs[0]) == set(outside)
    assert all(isinstance(v, jax.Array) and v.shape == () for v in outside.values())
    last = jax.device_get(logs[-1])
    assert last == jax.device_get(outside)
    assert (int(last["steps"]), int(last["skipped_steps"])) == (4, 2)
    assert int(last["consecutive_skips"]) == 0 and bool(last["last_step_finite"])
    assert float(last["loss_scale"]) == 2.0
    assert int(jax.device_get(logs[2])["consecutive_skips"]) == 2
    dtypes = {k: v.dtype for k, v in outside.items()}
    assert dtypes["loss_scale"] == jnp.float32
    assert dtypes["last_step_finite"] == jnp.bool_
    ints = set(dtypes) - {"loss_scale", "last_step_finite"}
    assert all(dtypes[k] == jnp.int32 for k in ints)


def test_summary_finds_the_state_anywhere():
    params = make_params()
    base = jxs.dynamic_scaling(optax.sgd(0.1), jxs.StaticLossScale.create(4.0))
    for tx in [
        base,
        optax.chain(base, optax.clip(1.0)),
        jxs.accumulate(base, every_k=2),
    ]:
        s = jxs.diagnostics.summary(tx.init(params))
        assert list(s) == [*KEYS, "nonfinite_leaves"]  # static scale: no trackers
        assert float(s["loss_scale"]) == 4.0


def test_summary_errors():
    with pytest.raises(ValueError, match="`opt_state` contains no jxs.DynamicScal"):
        jxs.diagnostics.summary(optax.sgd(0.1).init(make_params()))
    two = optax.chain(
        jxs.dynamic_scaling(optax.sgd(0.1)), jxs.dynamic_scaling(optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match="`opt_state` contains 2 jxs.DynamicScal"):
        jxs.diagnostics.summary(two.init(make_params()))


def test_steps_at_floor_counts_consecutive_steps_at_min_scale():
    """The floor counter lives in the monitor's state (``MonitorState``), not
    in the core's."""
    params = make_params()
    ls = jxs.DynamicLossScale.create(init_scale=8.0, min_scale=2.0, growth_interval=3)
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), ls), warn_at_floor_after=100
    )
    state = tx.init(params)
    assert isinstance(state, jxs.diagnostics.MonitorState)
    step = jax.jit(tx.update)
    pattern = [False, False, False, True, False, True, True, True, False]
    got = []
    for finite in pattern:
        _, state = step(grads_like(params, 1.0 if finite else math.inf), state, params)
        scale = float(state.inner_state.loss_scale.loss_scale)
        got.append((scale, int(state.steps_at_floor)))
    # 8 -> 4 -> 2 (floor) -> 2 ... growth on the 3rd finite step in a row -> 4.
    assert got == [
        (4.0, 0),
        (2.0, 1),
        (2.0, 2),
        (2.0, 3),
        (2.0, 4),
        (2.0, 5),
        (2.0, 6),
        (4.0, 0),
        (2.0, 1),
    ]


def test_steps_at_floor_counts_scaling_steps_only_under_accumulate():
    params = make_params()
    ls = jxs.DynamicLossScale.create(init_scale=2.0, min_scale=2.0)
    tx = jxs.diagnostics.monitor(
        jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1), ls), every_k=2),
        warn_at_floor_after=100,
    )
    state = tx.init(params)
    counts = []
    for _ in range(4):
        _, state = jax.jit(tx.update)(grads_like(params, 1.0), state, params)
        counts.append(int(state.steps_at_floor))
    assert counts == [0, 1, 1, 2]


def test_only_a_dynamic_loss_scale_has_a_floor():
    for ls in [jxs.StaticLossScale.create(2.0**-126), jxs.NoOpLossScale()]:
        assert ls.floor is None and not bool(ls.at_floor())
    ls = jxs.DynamicLossScale.create(init_scale=4.0, min_scale=2.0)
    assert ls.floor == 2.0 and not bool(ls.at_floor())
    assert bool(ls.adjust(False).at_floor())


# --------------------------------------------------------------------------- #
# nonfinite_paths: the flags are always kept
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_flags_name_the_leaves_of_the_last_step(dtype, bad):
    params = make_params(dtype)
    params["count"] = jnp.int32(0)
    tx = jxs.dynamic_scaling(optax.identity(), jxs.StaticLossScale.create(4.0))
    state = tx.init(params)
    # One bool[n] array for all the leaves, their names static.
    flags = state.nonfinite_leaves
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(flags)] == [((4,), jnp.bool_)]
    assert flags.names == ("count", "dense/bias", "dense/kernel", "head")
    assert jxs.diagnostics.nonfinite_paths(state) == []
    step = jax.jit(tx.update)
    grads = grads_like(params, 4.0)
    grads["count"] = jnp.int32(7)
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[0, 1].set(bad)
    grads["head"] = jnp.array(bad, dtype)
    _, state = step(grads, state, params)
    assert jxs.diagnostics.nonfinite_paths(state) == ["dense/kernel", "head"]
    assert jxs.diagnostics.nonfinite_paths(state.nonfinite_leaves) == [
        "dense/kernel",
        "head",
    ]
    assert int(jxs.diagnostics.summary(state)["nonfinite_leaves"]) == 2
    _, state = step(grads_like(params, 4.0), state, params)  # finite: cleared
    assert jxs.diagnostics.nonfinite_paths(state) == []


def test_flags_see_overflow_of_the_unscaling():
    # The scaled gradient is finite in float16; unscaled by 2**-10 it is not.
    params = {"w": jnp.ones(2, jnp.float16), "b": jnp.ones(1, jnp.float16)}
    tx = jxs.dynamic_scaling(optax.sgd(1.0), jxs.StaticLossScale.create(2.0**-10))
    grads = {"w": jnp.array([100.0, 1.0], jnp.float16), "b": jnp.ones(1, jnp.float16)}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert jxs.diagnostics.nonfinite_paths(state) == ["w"]


def test_flags_state_is_stable_in_scan_and_works_nested():
    params = make_params()
    tx = optax.chain(
        jxt.nonfinite_at([2], paths="bias"),
        jxs.dynamic_scaling(relaxed(optax.adam(1e-3))),
    )

    def body(carry, _):
        p, s = carry
        u, s = tx.update(grads_like(p, 1.0), s, p)
        return (optax.apply_updates(p, u), s), jxs.diagnostics.summary(s)[
            "nonfinite_leaves"
        ]

    (_, state), counts = jax.jit(lambda c: jax.lax.scan(body, c, length=4))(
        (params, tx.init(params))
    )
    assert np.asarray(counts).tolist() == [0, 0, 1, 0]
    assert jxs.diagnostics.nonfinite_paths(state) == []


def test_nonfinite_paths_errors():
    params = make_params()
    with pytest.raises(TypeError, match=r"holding a jxs.DynamicScalingState.*dict"):
        jxs.diagnostics.nonfinite_paths({"a": jnp.ones(())})  # 0.1.0's layout
    tracked = jxs.dynamic_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match="cannot run inside `jax.jit`"):
        jax.jit(jxs.diagnostics.nonfinite_paths)(tracked.init(params))
    flags = tracked.init(params).nonfinite_leaves
    assert jxs.diagnostics.nonfinite_paths(flags) == []


# --------------------------------------------------------------------------- #
# jxs.diagnostics.monitor: on_overflow and warn_at_floor_after
# --------------------------------------------------------------------------- #


def test_on_overflow_fires_only_on_skipped_steps_with_paths():
    params = make_params()
    events = []
    ls = jxs.DynamicLossScale.create(init_scale=2.0**8, growth_interval=100)
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), ls), on_overflow=events.append
    )

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    at = {1: "dense/kernel", 4: "head", 5: ["dense/bias", "head"]}
    for t in range(7):
        g = grads_like(params, 1.0)
        if t in at:
            g = jxt.inject_nonfinite(g, step=t, at_steps=[t], paths=at[t])
        params, state = step(params, state, g)
    jax.effects_barrier()
    assert [e.step for e in events] == [1, 4, 5]
    assert [e.paths for e in events] == [
        ("dense/kernel",),
        ("head",),
        ("dense/bias", "head"),
    ]
    assert [(e.loss_scale, e.next_loss_scale) for e in events] == [
        (256.0, 128.0),
        (128.0, 64.0),
        (64.0, 32.0),
    ]
    assert [e.consecutive_skips for e in events] == [1, 1, 2]
    assert all(isinstance(e, jxs.diagnostics.OverflowEvent) for e in events)


def test_on_overflow_inside_scan():
    params = make_params()
    events = []
    tx = optax.chain(
        jxt.nonfinite_at([3, 7], paths="kernel", value=math.nan),
        jxs.diagnostics.monitor(
            jxs.dynamic_scaling(optax.sgd(0.1)), on_overflow=events.append
        ),
    )

    def body(carry, _):
        p, s = carry
        u, s = tx.update(grads_like(p, 1.0), s, p)
        return (optax.apply_updates(p, u), s), None

    jax.jit(lambda c: jax.lax.scan(body, c, length=10))((params, tx.init(params)))
    jax.effects_barrier()
    assert [(e.step, e.paths) for e in events] == [
        (3, ("dense/kernel",)),
        (7, ("dense/kernel",)),
    ]


def test_warn_at_floor_after_warns_once_per_stay():
    params = make_params()
    ls = jxs.DynamicLossScale.create(init_scale=4.0, min_scale=1.0, growth_interval=2)
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), ls), warn_at_floor_after=3
    )
    step = jax.jit(tx.update)
    state = tx.init(params)
    # 4 -> 2 -> 1 (floor: count 1) -> 2, 3 (warn), 4, 5, 6 -> grow -> 1 (count 1),
    # 2, 3 (warn again, on step 10).
    pattern = [False] * 6 + [True, True] + [False] * 3
    with pytest.warns(jxs.diagnostics.ScaleAtFloorWarning) as record:
        for finite in pattern:
            g = grads_like(params, 1.0 if finite else math.inf)
            _, state = step(g, state, params)
        jax.effects_barrier()
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages  # once per stay, not on every step
    assert "sat at its floor (min_scale=1.0) for 3 consecutive steps" in messages[0]
    assert "up to step 3" in messages[0] and "diverging" in messages[0]
    assert "up to step 10" in messages[1]
    # Below the threshold: silence.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = tx.init(params)
        for finite in [False, False, True]:  # at the floor for 2 steps only
            g = grads_like(params, 1.0 if finite else math.inf)
            _, state = step(g, state, params)
        jax.effects_barrier()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "needs at least one hook"),
        ({"on_overflow": "print"}, TypeError, "`on_overflow` must be None or a call"),
        ({"warn_at_floor_after": 0}, ValueError, "`warn_at_floor_after` must be >= 1"),
        ({"warn_at_floor_after": 2.0}, TypeError, "`warn_at_floor_after` must be an"),
        ({"warn_at_floor_after": True}, TypeError, "`warn_at_floor_after` must be an"),
    ],
)
def test_option_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        jxs.diagnostics.monitor(jxs.dynamic_scaling(optax.sgd(0.1)), **kwargs)
    with pytest.raises(TypeError, match="`tx` must be an optax.GradientTransformation"):
        jxs.diagnostics.monitor(lambda g: g, on_overflow=print)


def test_warn_at_floor_needs_a_floor():
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), jxs.StaticLossScale.create(2.0)),
        warn_at_floor_after=5,
    )
    params = make_params()
    with pytest.raises(ValueError, match="`warn_at_floor_after` needs a loss scale"):
        tx.update(grads_like(params, 1.0), tx.init(params), params)


def test_options_moved_out_of_the_core_raise():
    """0.1.0 keywords: Python's own TypeError (the CHANGELOG names the wrapper)."""
    for kwargs in [{"on_overflow": print}, {"track_nonfinite": True}]:
        with pytest.raises(TypeError, match="unexpected keyword"):
            jxs.dynamic_scaling(optax.sgd(0.1), **kwargs)


def test_monitor_under_accumulate_fires_once_per_window():
    events = []
    tx = jxs.accumulate(
        jxs.diagnostics.monitor(
            jxs.dynamic_scaling(optax.sgd(0.1)), on_overflow=events.append
        ),
        3,
    )
    params = make_params()
    state = tx.init(params)
    step = jax.jit(tx.update)
    for t in range(6):
        g = grads_like(params, math.inf if t == 1 else 1.0)
        _, state = step(g, state, params)
    jax.effects_barrier()
    assert [e.step for e in events] == [0]


# --------------------------------------------------------------------------- #
# Zero cost when off
# --------------------------------------------------------------------------- #


def hlo_op_count(text):
    """HLO instructions of a compiled module."""
    return len(_hlo.instructions(text))


def host_callbacks(text):
    """Custom calls into the host (``*_callback`` targets) of a compiled module:
    not every custom call, since XLA:GPU compiles a matmul to one (cuBLAS)."""
    return sum(
        "callback" in _hlo.attribute(i.attrs, "custom_call_target")
        for i in _hlo.instructions(text)
        if i.opcode == "custom-call"
    )


def compiled_train_step(tx):
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 16)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((16, 1)) * 0.3, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)

    def loss_fn(p):
        h = jnp.tanh(x.astype(jnp.float16) @ p["w1"].astype(jnp.float16))
        return jnp.mean((h @ p["w2"].astype(jnp.float16)).astype(jnp.float32) ** 2)

    def train_step(params, opt_state):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    lowered = jax.jit(train_step).lower(params, tx.init(params))
    return lowered.compile().as_text()


def test_hooks_are_a_wrapper_the_plain_step_has_none():
    inner = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731
    texts = {
        "plain": compiled_train_step(jxs.dynamic_scaling(inner())),
        "hooks": compiled_train_step(
            jxs.diagnostics.monitor(
                jxs.dynamic_scaling(inner()), on_overflow=print, warn_at_floor_after=10
            )
        ),
    }
    counts = {k: hlo_op_count(t) for k, t in texts.items()}
    calls = {k: host_callbacks(t) for k, t in texts.items()}
    print(f"\nHLO op counts: {counts}; host callbacks: {calls}")
    assert calls["plain"] == 0 and "callback" not in texts["plain"]
    assert calls["hooks"] >= 2 and counts["hooks"] > counts["plain"]


def test_state_structure_does_not_depend_on_diagnostics():
    params = make_params()
    plain = jxs.dynamic_scaling(optax.sgd(0.1))
    states = [
        plain.init(params),
        jxs.diagnostics.monitor(plain, on_overflow=print).init(params),
        jxs.diagnostics.monitor(plain, warn_at_floor_after=3).init(params).inner_state,
    ]
    structures = {jax.tree.structure(s) for s in states}
    assert len(structures) == 1
    flags = states[0].nonfinite_leaves
    assert flags.names == ("dense/bias", "dense/kernel", "head")
    assert np.asarray(flags.flags).tolist() == [False, False, False]


# --------------------------------------------------------------------------- #
# underflow_report
# --------------------------------------------------------------------------- #


def reference_report(leaves, dtype, scale):
    """numpy (ml_dtypes) statement of the fractions and the range."""
    x = np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in leaves])
    info = ml_dtypes.finfo(dtype)
    tiny, big = float(info.smallest_normal), float(info.max)

    def classify(s):
        with np.errstate(over="ignore"):
            y = (x * np.float32(s)).astype(dtype).astype(np.float32)
        cand = (x != 0) & np.isfinite(x)
        return (
            np.mean(cand & (y == 0)),
            np.mean((y != 0) & (np.abs(y) < tiny)),
            np.mean(cand & ~np.isfinite(y)),
        )

    a = np.abs(x[np.isfinite(x)]).astype(np.float64)
    nz = a[a > 0]
    low = next(2.0**k for k in range(-126, 128) if nz.min() * 2.0**k >= tiny)
    high = max(2.0**k for k in range(-126, 128) if a.max() * 2.0**k <= big)
    return classify(1.0), classify(scale), low, high


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**16, 2.0**-4])
def test_underflow_report_matches_numpy(dtype, scale):
    rng = np.random.default_rng(1)
    mags = 10.0 ** rng.uniform(-12, 4, 3000)
    signs = rng.choice([-1.0, 1.0], 3000)
    g = (mags * signs).astype(np.float32)
    g[:5] = 0.0
    grads = {"a": jnp.asarray(g[:1000]), "b": jnp.asarray(g[1000:], jnp.float32)}
    report = jax.jit(lambda t: jxs.diagnostics.underflow_report(t, dtype, scale))(grads)
    assert all(v.shape == () and v.dtype == jnp.float32 for v in report)
    (z0, s0, _), (z, s, o), low, high = reference_report(
        [g[:1000], g[1000:]], dtype, scale
    )
    np.testing.assert_allclose(
        [report.zero_fraction_unscaled, report.subnormal_fraction_unscaled],
        [z0, s0],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        [report.zero_fraction, report.subnormal_fraction, report.overflow_fraction],
        [z, s, o],
        rtol=1e-6,
    )
    assert float(report.init_scale_low) == low
    assert float(report.init_scale_high) == high
    big = float(jnp.finfo(dtype).max)
    assert float(report.headroom_log2) == pytest.approx(
        math.log2(big / (np.abs(g).max() * scale)), rel=1e-5
    )
    assert float(report.loss_scale) == scale


def test_underflow_report_example_and_scale_sources():
    grads = {"w": jnp.array([1e-9, 1e-6, 1e-3, 1.0], jnp.float32)}
    by_number = jxs.diagnostics.underflow_report(grads, jnp.float16, 2.0**10)
    ls = jxs.DynamicLossScale.create(init_scale=2.0**10)
    state = jxs.dynamic_scaling(optax.sgd(0.1), ls).init(grads)
    for source in [ls, state, jnp.float32(2.0**10), np.float32(2.0**10), 1024]:
        jxt.assert_bit_identical(
            by_number, jxs.diagnostics.underflow_report(grads, "float16", source)
        )
    # With a scale past init_scale_high the largest element overflows.
    over = jxs.diagnostics.underflow_report(grads, jnp.float16, 2.0**17)
    assert float(over.overflow_fraction) == 0.25 and float(over.headroom_log2) < 0


def test_underflow_report_edge_cases():
    zeros = jxs.diagnostics.underflow_report({"w": jnp.zeros(3), "i": jnp.arange(3)})
    assert float(zeros.zero_fraction_unscaled) == 0.0
    assert float(zeros.headroom_log2) == math.inf
    assert float(zeros.init_scale_low) == 2.0**-126
    assert float(zeros.init_scale_high) == 2.0**127
    bad = jxs.diagnostics.underflow_report({"w": jnp.array([jnp.inf, jnp.nan, 2.0])})
    assert float(bad.max_abs) == 2.0 and float(bad.min_nonzero_abs) == 2.0
    assert float(bad.overflow_fraction) == 0.0
    empty = jxs.diagnostics.underflow_report({})
    assert float(empty.zero_fraction) == 0.0


def test_underflow_report_errors():
    with pytest.raises(TypeError, match="`dtype` must be a floating dtype.*int32"):
        jxs.diagnostics.underflow_report({"w": jnp.ones(2)}, jnp.int32)
    with pytest.raises(TypeError, match="`dtype` must be a floating dtype"):
        jxs.diagnostics.underflow_report({"w": jnp.ones(2)}, "half-ish")
    with pytest.raises(TypeError, match=r"`loss_scale` must be a real scalar.*\[2\]"):
        jxs.diagnostics.underflow_report({"w": jnp.ones(2)}, jnp.float16, jnp.ones(2))
    with pytest.raises(TypeError, match="`loss_scale` must be a number or a state"):
        jxs.diagnostics.underflow_report({"w": jnp.ones(2)}, jnp.float16, True)
    with pytest.raises(ValueError, match="contains no jxs.LossScale"):
        jxs.diagnostics.underflow_report({"w": jnp.ones(2)}, jnp.float16, {"lr": 0.1})


# --------------------------------------------------------------------------- #
# layer_norms
# --------------------------------------------------------------------------- #


def test_layer_norms_match_float64_norms_inside_jit():
    rng = np.random.default_rng(0)
    tree = {
        "enc": {
            "kernel": rng.standard_normal((16, 8)).astype(np.float16),
            "bias": rng.standard_normal(8).astype(ml_dtypes.bfloat16),
        },
        "head": rng.standard_normal((8, 2)).astype(np.float32) * 1e3,
        "step": np.int32(3),
        "frozen": None,
    }
    tree = jax.tree.map(jnp.asarray, tree)
    with jax.transfer_guard("disallow"):
        norms = jax.jit(jxs.diagnostics.layer_norms)(tree)
    assert list(norms) == ["enc/bias", "enc/kernel", "head"]
    for key, path in [
        ("enc/bias", ("enc", "bias")),
        ("enc/kernel", ("enc", "kernel")),
        ("head", ("head",)),
    ]:
        leaf = tree
        for p in path:
            leaf = leaf[p]
        ref = np.linalg.norm(np.asarray(leaf, np.float64).reshape(-1))
        assert norms[key].dtype == jnp.float32 and norms[key].shape == ()
        assert float(norms[key]) == pytest.approx(ref, rel=2e-6)
    grouped = jxs.diagnostics.layer_norms(tree, depth=1)
    assert list(grouped) == ["enc", "head"]
    enc = math.hypot(float(norms["enc/bias"]), float(norms["enc/kernel"]))
    assert float(grouped["enc"]) == pytest.approx(enc, rel=2e-6)


def test_layer_norms_do_not_overflow_and_propagate_nonfinite():
    tree = {
        "f16": jnp.full(4, 300.0, jnp.float16),  # squares overflow float16
        "big": jnp.full(4, 1e20, jnp.float32),  # squares overflow float32
        "zero": jnp.zeros(3),
        "inf": jnp.array([1.0, -jnp.inf]),
        "nan": jnp.array([1.0, jnp.nan]),
        "empty": jnp.zeros((0,)),
    }
    norms = jax.device_get(jxs.diagnostics.layer_norms(tree))
    assert norms["f16"] == 600.0
    assert norms["big"] == pytest.approx(2e20, rel=1e-6)
    assert norms["zero"] == 0.0 and norms["empty"] == 0.0
    assert norms["inf"] == np.inf and np.isnan(norms["nan"])
    assert list(jxs.diagnostics.layer_norms(jnp.ones(4))) == ["<root>"]


def test_layer_norms_errors():
    with pytest.raises(TypeError, match="`depth` must be an int or None"):
        jxs.diagnostics.layer_norms({}, depth=1.0)
    with pytest.raises(ValueError, match="`depth` must be >= 1, got 0"):
        jxs.diagnostics.layer_norms({}, depth=0)


def test_floor_warning_as_error_stops_the_run_with_its_message():
    ls = jxs.DynamicLossScale.create(init_scale=2.0, min_scale=1.0)
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), ls), warn_at_floor_after=2
    )
    params = make_params()
    step = jax.jit(tx.update)
    state, done = tx.init(params), 0
    # What docs/diagnostics.md and the ScaleAtFloorWarning docstring describe: a
    # host-callback exception crosses the compiled step as jax's runtime error
    # (a ValueError from jit's fast path on some jax versions), its message ending
    # with the warning's text, and the run stops at the step that fired.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=jxs.diagnostics.ScaleAtFloorWarning)
        with pytest.raises(
            (jax.errors.JaxRuntimeError, ValueError),
            match=r"ScaleAtFloorWarning: jaxscale: the loss scale has sat at its "
            r"floor \(min_scale=1\.0\) for 2 consecutive steps, up to step 1\.",
        ):
            for _ in range(4):
                _, state = step(grads_like(params, math.inf), state, params)
                jax.block_until_ready(state)
                jax.effects_barrier()
                done += 1
    assert done == 1  # the second step reached the floor for the 2nd time


def test_scaling_state_has_the_same_buffers_for_any_number_of_leaves():
    # Every buffer of the state is an argument and a result of each jitted
    # step, and costs dispatch time on an accelerator: the per-leaf flags are
    # one bool[n] array, so the count does not grow with the leaves.
    def buffers(n):
        params = {f"w{i}": jnp.ones(3) for i in range(n)}
        state = jxs.dynamic_scaling(optax.sgd(0.1)).init(params)
        return len(jax.tree.leaves(state._replace(inner_state=None)))

    assert buffers(3) == buffers(40) == buffers(1)
    state = jxs.dynamic_scaling(optax.sgd(0.1)).init({})
    assert jax.tree.leaves(state.nonfinite_leaves) == []  # no zero-size array
