"""jaxscale.testing: the reference simulator, fault injection and assertions."""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
import jaxscale.testing as jxt

pytestmark = pytest.mark.core

TINY = float(np.finfo(np.float32).tiny)

CONFIGS = [
    {"growth_interval": 3},
    {"growth_interval": 1, "growth_factor": 3.0, "backoff_factor": 0.25},
    {"growth_interval": 2, "init_scale": 1000.0, "backoff_factor": 0.3},
    {"growth_interval": 2, "growth_factor": 1.7, "init_scale": 3.0},
    {"growth_interval": 2, "hysteresis": 3},
    {"growth_interval": 3, "hysteresis": 2, "min_scale": 2.0**10},
    {"growth_interval": 1, "init_scale": 2.0**120, "max_scale": 2.0**122},
    {"growth_interval": 1, "init_scale": 2.0**-120},
]


def random_sequences(seed, n=6, length=60):
    rng = np.random.default_rng(seed)
    out = [[False] * 40 + [True] * 20, [True] * 50]
    for p in np.linspace(0.1, 0.9, n):
        out.append((rng.random(length) > p).tolist())
    return out


def run_adjust(ls, finite):
    step = jax.jit(lambda s, f: s.adjust(f))
    states = []
    for f in finite:
        ls = step(ls, jnp.bool_(f))
        states.append(ls)
    return states


# --------------------------------------------------------------------------- #
# simulate
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_jaxscale_rule_matches_adjust_under_jit(config):
    ls = jxs.DynamicLossScale.create(**config)
    for finite in random_sequences(hash(str(config)) % 1000):
        expected = jxt.simulate(ls, finite)
        jxt.assert_trajectory_matches(run_adjust(ls, finite), expected)
        assert [s.applied for s in expected] == finite


def test_simulate_starts_from_the_current_leaves():
    ls = jxs.DynamicLossScale.create(init_scale=64.0, growth_interval=3, hysteresis=3)
    mid = run_adjust(ls, [True, True, False])[-1]  # tracker 0, budget 2
    finite = [True, False, False, True, True, True]
    jxt.assert_trajectory_matches(run_adjust(mid, finite), jxt.simulate(mid, finite))
    assert jxt.simulate(mid, [False])[0] == jxt.SimStep(64.0, 0, 1, False)


def test_rules_differ_where_documented():
    # Hysteresis: jaxscale refills the budget on every finite step, Megatron only
    # on growth; so isolated overflows back off under Megatron's rule only.
    ls = jxs.DynamicLossScale.create(init_scale=64.0, growth_interval=100, hysteresis=2)
    finite = [False, True, False, True, False, True]
    ours = [s.loss_scale for s in jxt.simulate(ls, finite)]
    megatron = jxt.simulate(ls, finite, rule="megatron")
    assert ours == [64.0] * 6
    assert [s.loss_scale for s in megatron] == [64.0, 64.0, 32.0, 32.0, 16.0, 16.0]
    assert [s.hysteresis_tracker for s in megatron] == [1, 1, 0, 0, -1, -1]
    # Megatron refills on growth.
    grow = jxs.DynamicLossScale.create(init_scale=8.0, growth_interval=1, hysteresis=2)
    steps = jxt.simulate(grow, [False, True, False], rule="megatron")
    assert [(s.loss_scale, s.hysteresis_tracker) for s in steps] == [
        (8.0, 1),
        (16.0, 2),
        (16.0, 1),
    ]
    # Floor: torch has none, jaxscale and Megatron stop at min_scale.
    low = jxs.DynamicLossScale.create(init_scale=4.0, min_scale=1.0)
    assert jxt.simulate(low, [False] * 5)[-1].loss_scale == 1.0
    assert jxt.simulate(low, [False] * 5, rule="megatron")[-1].loss_scale == 1.0
    torch_rule = jxt.simulate(low, [False] * 160, rule="torch")
    assert torch_rule[2].loss_scale == 0.5  # below min_scale
    assert 0.0 < torch_rule[130].loss_scale < TINY  # subnormal
    assert torch_rule[-1].loss_scale == 0.0
    # Ceiling: Megatron grows to inf, torch drops the growth, jaxscale caps.
    high = jxs.DynamicLossScale.create(
        init_scale=2.0**127, growth_interval=1, max_scale=2.0**127
    )
    assert jxt.simulate(high, [True], rule="megatron")[0].loss_scale == math.inf
    assert jxt.simulate(high, [True], rule="torch")[0].loss_scale == 2.0**127
    assert jxt.simulate(high, [True])[0].loss_scale == 2.0**127


def test_torch_rule_matches_amp_update_scale():
    torch = pytest.importorskip("torch")
    configs = [
        {"growth_interval": 3},
        {"growth_interval": 2, "init_scale": 1000.0, "backoff_factor": 0.3},
        {"growth_interval": 2, "growth_factor": 1.7, "init_scale": 3.0},
        {"growth_interval": 1, "init_scale": 2.0**-120},
        {"growth_interval": 1, "init_scale": 2.0**125},
    ]
    for config in configs:
        ls = jxs.DynamicLossScale.create(**config)
        for finite in random_sequences(7) + [[False] * 200]:
            scale = torch.full((), float(ls.loss_scale), dtype=torch.float32)
            tracker = torch.zeros((), dtype=torch.int32)
            for f, sim in zip(
                finite, jxt.simulate(ls, finite, rule="torch"), strict=True
            ):
                found_inf = torch.full((), 0.0 if f else 1.0)
                torch._amp_update_scale_(
                    scale,
                    tracker,
                    found_inf,
                    ls.growth_factor,
                    ls.backoff_factor,
                    ls.growth_interval,
                )
                got = np.float32(scale.item()).view(np.uint32)
                assert got == np.float32(sim.loss_scale).view(np.uint32), config
                assert int(tracker.item()) == sim.growth_tracker


class _MegatronScaler:
    """Megatron-LM's DynamicGradScaler.update, with torch float32 CPU tensors."""

    def __init__(self, torch, ls):
        def f32(v):
            return torch.tensor([v], dtype=torch.float)

        self.torch = torch
        self.scale = f32(float(ls.loss_scale))
        self.min_scale = f32(ls.min_scale)
        self.growth_factor = f32(ls.growth_factor)
        self.backoff_factor = f32(ls.backoff_factor)
        self.interval = ls.growth_interval
        self.hysteresis = ls.hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = ls.hysteresis

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = self.torch.max(
                    self.scale * self.backoff_factor, self.min_scale
                )
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


def test_megatron_rule_matches_its_update():
    torch = pytest.importorskip("torch")
    for config in CONFIGS:
        ls = jxs.DynamicLossScale.create(**config)
        for finite in random_sequences(3):
            ref = _MegatronScaler(torch, ls)
            for f, sim in zip(
                finite, jxt.simulate(ls, finite, rule="megatron"), strict=True
            ):
                ref.update(not f)
                got = np.float32(ref.scale.item()).view(np.uint32)
                assert got == np.float32(sim.loss_scale).view(np.uint32), config
                assert (ref.growth_tracker, ref.hysteresis_tracker) == (
                    sim.growth_tracker,
                    sim.hysteresis_tracker,
                )


def test_simulate_errors():
    ls = jxs.DynamicLossScale.create()
    with pytest.raises(TypeError, match="`loss_scale` must be a jxs.DynamicLossScale"):
        jxt.simulate(jxs.StaticLossScale.create(2.0), [True])
    with pytest.raises(ValueError, match=r"`rule` must be one of .*'torch'.*'pytorch'"):
        jxt.simulate(ls, [True], rule="pytorch")
    with pytest.raises(ValueError, match="hysteresis=1 for rule='torch'.*got hyst"):
        jxt.simulate(jxs.DynamicLossScale.create(hysteresis=2), [True], rule="torch")
    with pytest.raises(TypeError, match=r"`finite` must be a sequence of booleans.*1"):
        jxt.simulate(ls, [True, 1])
    with pytest.raises(TypeError, match="`finite` must be a sequence of booleans"):
        jxt.simulate(ls, "TFT")

    @jax.jit
    def traced(s):
        return jxt.simulate(s, [True])

    with pytest.raises(TypeError, match="`loss_scale` must hold concrete values"):
        traced(ls)


def test_simulate_accepts_numpy_bools():
    ls = jxs.DynamicLossScale.create(init_scale=4.0, growth_interval=1)
    got = jxt.simulate(ls, np.array([True, False]))
    assert [s.loss_scale for s in got] == [8.0, 4.0]


# --------------------------------------------------------------------------- #
# inject_nonfinite and nonfinite_at
# --------------------------------------------------------------------------- #


def tree(dtype=jnp.float32):
    return {
        "encoder": {"kernel": jnp.ones((2, 2), dtype), "bias": jnp.ones(2, dtype)},
        "head": {"kernel": jnp.ones(3, dtype)},
        "count": jnp.int32(5),
        "frozen": None,
    }


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e30])
def test_inject_at_chosen_steps_and_paths_inside_jit(dtype, value):
    @jax.jit
    def f(t, step):
        return jxt.inject_nonfinite(
            t, step=step, at_steps=[2, 5], paths="encoder/kernel", value=value
        )

    t = tree(dtype)
    steps = [jnp.int32(s) for s in range(7)]
    with jax.transfer_guard("disallow"):
        outs = [f(t, s) for s in steps]
    for s, out in enumerate(outs):
        assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(
            lambda x: x.dtype, t
        )
        kernel = np.asarray(out["encoder"]["kernel"], np.float32)
        if s in (2, 5):
            with np.errstate(over="ignore"):
                expected = np.full((2, 2), value).astype(dtype).astype(np.float32)
            np.testing.assert_array_equal(kernel, expected)
            if value == 1e30 and dtype == jnp.float16:
                assert np.all(np.isinf(kernel))
        else:
            np.testing.assert_array_equal(kernel, np.ones((2, 2)))
        for path in (("encoder", "bias"), ("head", "kernel")):
            np.testing.assert_array_equal(out[path[0]][path[1]], t[path[0]][path[1]])
        assert int(out["count"]) == 5 and out["frozen"] is None


def test_inject_is_branch_free():
    jaxpr = str(
        jax.make_jaxpr(lambda t, s: jxt.inject_nonfinite(t, step=s, at_steps=[1, 3]))(
            tree(), jnp.int32(0)
        )
    )
    assert "cond" not in jaxpr and "callback" not in jaxpr
    assert "select_n" in jaxpr


@pytest.mark.parametrize(
    ("paths", "hit"),
    [
        (None, {"encoder/kernel", "encoder/bias", "head/kernel"}),
        ("kernel", {"encoder/kernel", "head/kernel"}),
        (["bias", "head"], {"encoder/bias", "head/kernel"}),
        (lambda name: name.startswith("head"), {"head/kernel"}),
    ],
)
def test_inject_path_selection(paths, hit):
    out = jxt.inject_nonfinite(tree(), step=0, at_steps=0, paths=paths)
    flagged = {
        jax.tree_util.keystr(p, simple=True, separator="/")
        for p, x in jax.tree_util.tree_flatten_with_path(out)[0]
        if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jxs.all_finite(x))
    }
    assert flagged == hit


def test_inject_errors():
    t = tree()
    with pytest.raises(
        ValueError, match=r"`paths` must match .*'decoder'.*head/kernel"
    ):
        jxt.inject_nonfinite(t, step=0, at_steps=[0], paths="decoder")
    with pytest.raises(TypeError, match=r"`step` must be an integer scalar.*float32"):
        jxt.inject_nonfinite(t, step=jnp.float32(0), at_steps=[0])
    with pytest.raises(TypeError, match=r"`step` must be an integer scalar.*\[2\]"):
        jxt.inject_nonfinite(t, step=jnp.zeros(2, jnp.int32), at_steps=[0])
    with pytest.raises(TypeError, match="`at_steps` must be a sequence of ints"):
        jxt.inject_nonfinite(t, step=0, at_steps=[1.5])
    with pytest.raises(TypeError, match="`at_steps` must be a sequence of ints"):
        jxt.inject_nonfinite(t, step=0, at_steps="3")
    with pytest.raises(ValueError, match=r"`at_steps` must be in \[0, .*got -1"):
        jxt.inject_nonfinite(t, step=0, at_steps=[-1])
    with pytest.raises(TypeError, match="`value` must be a real number"):
        jxt.inject_nonfinite(t, step=0, at_steps=[0], value="inf")
    with pytest.raises(TypeError, match="`paths` must be None, a path substring"):
        jxt.inject_nonfinite(t, step=0, at_steps=[0], paths=3)
    with pytest.raises(TypeError, match="`at_steps` must be a sequence of ints"):
        jxt.nonfinite_at([True])


def _problem():
    params = {
        "dense": {
            "kernel": jnp.array([[0.5, -1.0], [2.0, -0.0]]),
            "bias": jnp.array([0.0, 1.0]),
        },
        "out": jnp.array(3.0),
    }
    return params


def test_nonfinite_at_drives_dynamic_scaling_in_scan():
    params = _problem()
    ls = jxs.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    at = [1, 2, 6]
    tx = optax.chain(
        jxt.nonfinite_at(at, paths="dense/bias", value=math.nan),
        jxs.dynamic_scaling(optax.sgd(0.01), ls),
    )

    def body(carry, _):
        p, s = carry
        g = jax.tree.map(lambda x: jnp.full_like(x, 2.0**10), p)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), s

    n = 10
    (_, final), states = jax.jit(lambda c: jax.lax.scan(body, c, length=n))(
        (params, tx.init(params))
    )
    finite = [t not in at for t in range(n)]
    jxt.assert_trajectory_matches(states, jxt.simulate(ls, finite))
    assert int(jxs.diagnostics.summary(final)["skipped_steps"]) == 3
    # The flags of a skipped step name the injected leaf.
    step_two = jax.tree.map(lambda x: x[2], states)
    assert jxs.diagnostics.nonfinite_paths(step_two) == ["dense/bias"]


# --------------------------------------------------------------------------- #
# Assertions
# --------------------------------------------------------------------------- #


def _step(tx, params, state, grads):
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    return optax.apply_updates(params, updates), new_state


def _adam_setup():
    params = _problem()
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    state = tx.init(params)
    good = jax.tree.map(lambda x: jnp.full_like(x, 2.0**15), params)
    params, state = _step(tx, params, state, good)  # non-trivial inner state
    return tx, params, state, good


def test_assert_skipped_passes_on_real_skip_and_applied_on_real_step():
    tx, params, state, good = _adam_setup()
    bad = jxt.inject_nonfinite(good, step=0, at_steps=[0], paths="kernel")
    new_params, new_state = _step(tx, params, state, bad)
    jxt.assert_skipped(params, state, new_params, new_state)
    with pytest.raises(AssertionError, match="the step was skipped, not applied"):
        jxt.assert_applied(params, state, new_params, new_state)
    new_params, new_state = _step(tx, params, state, good)
    jxt.assert_applied(params, state, new_params, new_state)
    with pytest.raises(AssertionError, match="the step was applied, not skipped"):
        jxt.assert_skipped(params, state, new_params, new_state)


def test_assert_skipped_names_the_changed_leaf():
    params = _problem()  # holds a -0.0
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    state = tx.init(params)
    bad = jax.tree.map(lambda x: jnp.full_like(x, math.inf), params)
    new_params, new_state = _step(tx, params, state, bad)
    jxt.assert_skipped(params, state, new_params, new_state)
    # -0.0 turned into +0.0: equal as numbers, different bits.
    flipped = jax.tree.map(lambda x: x, new_params)
    flipped["dense"]["kernel"] = flipped["dense"]["kernel"].at[1, 1].set(0.0)
    with pytest.raises(
        AssertionError,
        match=r"leaf 'dense/kernel' of `after_params` differs from `before_params` "
        r"in 1 of 4 elements; first at index \(1, 1\): 0\.0 \(0x00000000\) vs "
        r"-0\.0 \(0x80000000\)",
    ):
        jxt.assert_skipped(params, state, flipped, new_state)
    # A change in the inner state (Adam's first moment) is named by path.
    tx, params, state, good = _adam_setup()
    bad = jxt.inject_nonfinite(good, step=0, at_steps=[0])
    new_params, new_state = _step(tx, params, state, bad)
    mu = new_state.inner_state[0].mu
    changed = new_state._replace(
        inner_state=(
            new_state.inner_state[0]._replace(mu={**mu, "out": mu["out"] + 1.0}),
            *new_state.inner_state[1:],
        )
    )
    with pytest.raises(AssertionError, match=r"leaf '0/mu/out' of `after_state"):
        jxt.assert_skipped(params, state, new_params, changed)
    # Counters: the skip must be counted.
    uncounted = new_state._replace(skipped_steps=state.skipped_steps)
    with pytest.raises(AssertionError, match=r"`after_state.skipped_steps` is 0, exp"):
        jxt.assert_skipped(params, state, new_params, uncounted)


def test_assert_bit_identical_sees_nans_their_payloads_if_asked_and_structure():
    a = {"w": np.array([np.nan], np.float32)}
    b = {"w": np.array([0x7FC00001], np.uint32).view(np.float32)}  # another NaN
    jxt.assert_bit_identical(a, {"w": np.array([np.nan], np.float32)})
    jxt.assert_bit_identical(a, b)  # a NaN is a NaN: what a skip promises
    with pytest.raises(AssertionError, match=r"0x7fc00001\) vs nan \(0x7fc00000\)"):
        jxt.assert_bit_identical(a, b, nan_bits=True)
    with pytest.raises(AssertionError, match=r"index \(0,\)"):  # NaN is not inf
        jxt.assert_bit_identical(a, {"w": np.array([np.inf], np.float32)})
    with pytest.raises(AssertionError, match="`actual` has tree structure"):
        jxt.assert_bit_identical(a, [a["w"]])
    with pytest.raises(AssertionError, match=r"leaf 'w' of `actual` is float16\[1\]"):
        jxt.assert_bit_identical(a, {"w": np.array([np.nan], np.float16)})
    bf = jnp.array([1.0, -0.0], jnp.bfloat16)
    jxt.assert_bit_identical({"x": bf}, {"x": bf})
    with pytest.raises(AssertionError, match=r"'x'.*index \(1,\)"):
        jxt.assert_bit_identical({"x": bf}, {"x": jnp.abs(bf)})


def test_assert_applied_checks_params():
    tx, params, state, good = _adam_setup()
    new_params, new_state = _step(tx, params, state, good)
    poisoned = {**new_params, "out": jnp.array(np.nan, jnp.float32)}
    with pytest.raises(AssertionError, match=r"leaf 'out' of `after_params` has 1 non"):
        jxt.assert_applied(params, state, poisoned, new_state)
    cast = {**new_params, "out": new_params["out"].astype(jnp.float16)}
    with pytest.raises(AssertionError, match=r"'out' of `after_params` is float16"):
        jxt.assert_applied(params, state, cast, new_state)
    with pytest.raises(ValueError, match="`before_state` contains no jxs.Dynamic"):
        jxt.assert_applied(params, optax.sgd(0.1).init(params), new_params, new_state)


def test_assert_trajectory_matches_inputs_and_messages():
    ls = jxs.DynamicLossScale.create(init_scale=4.0, growth_interval=2)
    finite = [True, True, False, True]
    expected = jxt.simulate(ls, finite)
    states = run_adjust(ls, finite)
    jxt.assert_trajectory_matches(states, expected)
    jxt.assert_trajectory_matches([s.loss_scale for s in expected], expected)
    jxt.assert_trajectory_matches(jnp.stack([s.loss_scale for s in states]), expected)
    with pytest.raises(AssertionError, match="the run has 3 steps, the expectation 4"):
        jxt.assert_trajectory_matches(states[:3], expected)
    with pytest.raises(
        AssertionError,
        match=r"step 2: loss_scale is 4\.0, expected 8\.0 \(bits 0x40800000 vs",
    ):
        jxt.assert_trajectory_matches(
            states, jxt.simulate(ls, [True, True, True, True])
        )
    off = [s._replace(growth_tracker=s.growth_tracker + 1) for s in expected]
    with pytest.raises(AssertionError, match="step 0: growth_tracker is 1, expected 2"):
        jxt.assert_trajectory_matches(states, off)
    with pytest.raises(TypeError, match="`expected` must be a list of SimStep"):
        jxt.assert_trajectory_matches(states, [(4.0, 0, 1, True)])


def test_assert_trajectory_checks_applied_from_scaling_states():
    params = {"w": jnp.ones(2)}
    ls = jxs.DynamicLossScale.create(init_scale=8.0, growth_interval=3)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    state = tx.init(params)
    states, finite = [], [True, False, True]
    for f in finite:
        g = {"w": jnp.full(2, 1.0 if f else math.inf)}
        _, state = jax.jit(tx.update)(g, state, params)
        states.append(state)
    jxt.assert_trajectory_matches(states, jxt.simulate(ls, finite))
    lying = [s._replace(applied=not s.applied) for s in jxt.simulate(ls, finite)]
    with pytest.raises(AssertionError, match="step 0: applied is True, expected F"):
        jxt.assert_trajectory_matches(states, lying)


def test_testing_is_not_imported_by_jaxscale():
    import subprocess
    import sys

    code = "import sys, jaxscale; print('jaxscale.testing' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_the_guide_example_runs():
    """The unit test shown in docs/diagnostics.md passes as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "diagnostics.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    example = next(b for b in blocks if "def test_my_train_step" in b)
    namespace: dict = {}
    exec(compile(example, "docs/diagnostics.md", "exec"), namespace)
    namespace["test_my_train_step_survives_overflow"]()
