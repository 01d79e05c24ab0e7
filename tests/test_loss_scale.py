"""Loss-scale state: validation, update rule, bounds, dtypes, pytree behaviour."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import enable_x64

import jaxscale as jxs
from jaxscale.testing import simulate

pytestmark = pytest.mark.unit

F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)


def run_adjust(ls, finite_seq):
    step = jax.jit(lambda s, f: s.adjust(f))
    out = []
    for finite in finite_seq:
        ls = step(ls, jnp.bool_(finite))
        out.append(
            (
                float(ls.loss_scale),
                int(ls.growth_tracker),
                int(ls.hysteresis_tracker),
            )
        )
    return out


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"growth_factor": 1.0}, ValueError, r"`growth_factor` must be > 1.*1\.0"),
        ({"growth_factor": 0.5}, ValueError, r"`growth_factor` must be > 1.*0\.5"),
        (
            {"growth_factor": 1 + 1e-12},
            ValueError,
            r"`growth_factor` must be > 1 \(in float32\)",
        ),
        ({"growth_factor": math.inf}, ValueError, r"`growth_factor` must be finite"),
        ({"backoff_factor": 1.0}, ValueError, r"`backoff_factor` must be in \(0, 1\)"),
        ({"backoff_factor": 0.0}, ValueError, r"`backoff_factor` must be in \(0, 1\)"),
        ({"backoff_factor": -0.5}, ValueError, r"`backoff_factor`.*-0\.5"),
        ({"growth_interval": 0}, ValueError, r"`growth_interval` must be >= 1.*0"),
        ({"growth_interval": 2.0}, TypeError, r"`growth_interval` must be an int"),
        ({"growth_interval": True}, TypeError, r"`growth_interval` must be an int"),
        ({"hysteresis": 0}, ValueError, r"`hysteresis` must be >= 1, got 0"),
        ({"init_scale": 0.0}, ValueError, r"`init_scale` must be > 0"),
        ({"init_scale": -1.0}, ValueError, r"`init_scale` must be > 0"),
        ({"init_scale": math.nan}, ValueError, r"`init_scale` must be finite"),
        ({"init_scale": math.inf}, ValueError, r"`init_scale` must be finite"),
        ({"init_scale": 1e39}, ValueError, r"`init_scale` must be representable"),
        ({"init_scale": "1024"}, TypeError, r"`init_scale` must be a real number"),
        (
            {"init_scale": 8.0, "min_scale": 16.0},
            ValueError,
            r"`init_scale` must lie in \[min_scale, max_scale\]",
        ),
        (
            {"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0},
            ValueError,
            r"`min_scale` must be <= `max_scale`.*4\.0.*2\.0",
        ),
        ({"min_scale": 0.0}, ValueError, r"`min_scale` must be >= 1\.17"),
        ({"min_scale": 1e-40}, ValueError, r"smallest normal"),
    ],
)
def test_create_rejects_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        jxs.DynamicLossScale.create(**kwargs)


def test_create_rejects_traced_values():
    @jax.jit
    def f(x):
        return jxs.DynamicLossScale.create(init_scale=x).loss_scale

    with pytest.raises(TypeError, match="`init_scale` must be a concrete number"):
        f(jnp.float32(2.0))


def test_create_accepts_numpy_and_concrete_scalars():
    ls = jxs.DynamicLossScale.create(init_scale=np.float64(512.0), growth_interval=7)
    assert ls.loss_scale.dtype == jnp.float32 and float(ls.loss_scale) == 512.0
    ls = jxs.DynamicLossScale.create(init_scale=jnp.float32(256.0))
    assert float(ls.loss_scale) == 256.0


def test_static_create_validates():
    with pytest.raises(ValueError, match="`scale` must be finite"):
        jxs.StaticLossScale.create(math.inf)
    with pytest.raises(ValueError, match="`scale` must be >= "):
        jxs.StaticLossScale.create(0.0)
    with pytest.raises(TypeError, match="`scale` must be a real number"):
        jxs.StaticLossScale.create(None)


@pytest.mark.parametrize(
    "ls",
    [
        jxs.NoOpLossScale(),
        jxs.StaticLossScale.create(4.0),
        jxs.DynamicLossScale.create(),
    ],
)
@pytest.mark.parametrize("bad", [jnp.float32(1.0), jnp.ones(2, bool), 1])
def test_adjust_rejects_non_boolean_scalars(ls, bad):
    with pytest.raises(TypeError, match=r"`grads_finite` must be a boolean scalar"):
        ls.adjust(bad)


def test_classes_are_abstract_and_frozen():
    with pytest.raises(TypeError):
        jxs.LossScale()  # abstract
    ls = jxs.DynamicLossScale.create()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ls.loss_scale = jnp.float32(1.0)


# --------------------------------------------------------------------------- #
# Update rule
# --------------------------------------------------------------------------- #

SEQUENCES = {
    "growth": [True] * 9,
    "mixed": [True, True, False, True, True, True, False, False, True, True, True],
    "streak": [False] * 12 + [True] * 7,
    "alternating": [True, False] * 8,
}
CONFIGS = [
    {"growth_interval": 3},
    {"growth_interval": 1, "growth_factor": 3.0, "backoff_factor": 0.25},
    {"growth_interval": 2, "init_scale": 1000.0, "backoff_factor": 0.3},
    {"growth_interval": 2, "hysteresis": 3},
    {"growth_interval": 3, "hysteresis": 2, "min_scale": 2.0**10},
    {"growth_interval": 1, "init_scale": 2.0**120, "max_scale": 2.0**122},
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seq", list(SEQUENCES))
def test_adjust_follows_documented_rule(config, seq):
    finite = SEQUENCES[seq]
    ls = jxs.DynamicLossScale.create(**config)
    expected = [s[:3] for s in simulate(ls, finite)]  # the public reference
    assert run_adjust(ls, finite) == expected


def test_torch_rule_grows_on_interval_th_finite_step():
    ls = jxs.DynamicLossScale.create(init_scale=4.0, growth_interval=3)
    scales = [s for s, _, _ in run_adjust(ls, [True] * 7)]
    # Flax's DynamicScale would grow one step later (on the 4th).
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_hysteresis_tolerates_n_minus_one_consecutive_overflows():
    ls = jxs.DynamicLossScale.create(init_scale=64.0, hysteresis=3)
    scales = [s for s, _, _ in run_adjust(ls, [False] * 5)]
    assert scales == [64.0, 64.0, 32.0, 16.0, 8.0]
    # A finite step refills the budget: isolated overflows never back off.
    scales = [s for s, _, _ in run_adjust(ls, [False, False, True] * 4)]
    assert scales == [64.0] * 12


def test_growth_that_would_overflow_is_dropped_and_tracker_resets():
    ls = jxs.DynamicLossScale.create(init_scale=2.0**127, growth_interval=1)
    got = run_adjust(ls, [True] * 3)
    assert got == [(2.0**127, 0, 1)] * 3


def test_ceiling_and_floor_hold_under_jit():
    ls = jxs.DynamicLossScale.create(
        init_scale=8.0, min_scale=2.0, max_scale=32.0, growth_interval=1
    )
    up = run_adjust(ls, [True] * 5)
    assert [s for s, _, _ in up] == [16.0, 32.0, 32.0, 32.0, 32.0]
    down = run_adjust(ls, [False] * 5)
    # jmp drops its floor under jit; ours is a static field and holds.
    assert [s for s, _, _ in down] == [4.0, 2.0, 2.0, 2.0, 2.0]


def test_default_floor_never_zero_or_subnormal():
    ls = jxs.DynamicLossScale.create(init_scale=1.0)

    def body(s, _):
        s = s.adjust(jnp.bool_(False))
        return s, s.loss_scale

    _, scales = jax.lax.scan(body, ls, length=300)
    scales = np.asarray(scales)
    assert scales.min() == np.float32(TINY) and np.all(np.isfinite(1.0 / scales))
    assert scales[125] == np.float32(2.0**-126)


def test_static_and_noop_never_change():
    s = jxs.StaticLossScale.create(128.0)
    assert jax.jit(lambda x: x.adjust(jnp.bool_(False)))(s).loss_scale == 128.0
    n = jxs.NoOpLossScale()
    assert jax.tree.leaves(n) == []
    assert float(n.loss_scale) == 1.0


# --------------------------------------------------------------------------- #
# scale / unscale dtype rules
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_and_unscale_preserve_dtype(dtype):
    ls = jxs.DynamicLossScale.create(init_scale=2.0**10)
    tree = {
        "x": jnp.array([0.5, -3.0, 1e-3], dtype),
        "i": jnp.arange(3, dtype=jnp.int32),
        "none": None,
        "b": jnp.array([True, False]),
    }
    scaled = jax.jit(ls.scale)(tree)
    assert scaled["x"].dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(scaled["x"], np.float32),
        np.asarray(tree["x"], np.float32) * 2.0**10,
    )
    assert scaled["i"] is not None and scaled["i"].dtype == jnp.int32
    np.testing.assert_array_equal(scaled["i"], tree["i"])
    assert scaled["none"] is None
    np.testing.assert_array_equal(scaled["b"], tree["b"])
    back = jax.jit(ls.unscale)(scaled)
    assert back["x"].dtype == dtype
    np.testing.assert_array_equal(back["x"], tree["x"])  # powers of two: exact
    np.testing.assert_array_equal(back["i"], tree["i"])


def test_scale_f16_computes_in_f32_before_casting():
    # 2**16 is not representable in f16; the product 0.25 * 2**16 = 2**14 is.
    ls = jxs.DynamicLossScale.create(init_scale=2.0**16)
    out = ls.scale(jnp.float16(0.25))
    assert out.dtype == jnp.float16 and float(out) == 2.0**14


def test_unscale_float64_under_x64():
    with enable_x64():
        ls = jxs.StaticLossScale.create(3.0)
        x = jnp.array([1.0, 2.0], jnp.float64)
        out = jax.jit(ls.unscale)(x)
        assert out.dtype == jnp.float64
        # torch multiplies by the float32 reciprocal, promoted to float64.
        inv = np.float64(np.float32(1.0) / np.float32(3.0))
        np.testing.assert_array_equal(out, np.array([1.0, 2.0]) * inv)


@pytest.mark.parametrize("scale", [2.0**126, 2.0**127, 1.5 * 2.0**127])
def test_unscale_is_exact_above_2_pow_126(scale):
    # Plain ``g * (1/scale)`` would flush 1/scale to zero on XLA:CPU.
    ls = jxs.StaticLossScale.create(scale)
    g = jnp.array([2.0**120, 3.0 * 2.0**100, 2.0**127], jnp.float32)
    out = jax.jit(lambda s, x: s.unscale(x))(ls, g)
    exact = np.asarray(g, np.float64) / scale
    if math.log2(scale).is_integer():
        np.testing.assert_array_equal(out, exact)
    else:  # one float32 rounding of the reciprocal, one of the product
        np.testing.assert_allclose(out, exact, rtol=2.0**-23, atol=0)
    assert np.all(np.asarray(out) > 0)


def test_unscale_matches_reciprocal_multiply_bitwise():
    # For a scale below 2**126, unscale == x * f32(1/scale), as torch does.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32) * 1e4
    for scale in [1000.0, 3.0, 0.3, 65536.0, 2.0**-100]:
        ls = jxs.StaticLossScale.create(scale)
        out = np.asarray(jax.jit(lambda s, v: s.unscale(v))(ls, x))
        inv = np.float32(1.0) / np.float32(scale)
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(out, x * inv)


# --------------------------------------------------------------------------- #
# Pytree behaviour
# --------------------------------------------------------------------------- #


def test_config_is_static_and_values_are_leaves():
    ls = jxs.DynamicLossScale.create(
        growth_interval=5, hysteresis=2, min_scale=0.5, max_scale=2.0**20
    )
    leaves, treedef = jax.tree.flatten(ls)
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32, jnp.int32]
    assert all(x.shape == () for x in leaves)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.min_scale == 0.5 and rebuilt.growth_interval == 5

    @jax.jit
    def roundtrip(s):
        return s

    out = roundtrip(ls)
    assert (out.min_scale, out.max_scale, out.hysteresis) == (0.5, 2.0**20, 2)


def test_no_retrace_when_scale_value_changes():
    traces = []

    @jax.jit
    def step(ls, finite):
        traces.append(1)
        return ls.adjust(finite)

    ls = jxs.DynamicLossScale.create(growth_interval=1)
    for finite in [True, False, False, True, True]:
        ls = step(ls, jnp.bool_(finite))
    assert len(traces) == 1


def test_adjust_under_vmap_keeps_shapes_batched():
    ls = jxs.DynamicLossScale.create(growth_interval=1)
    batched = jax.tree.map(lambda x: jnp.stack([x, x]), ls)
    out = jax.vmap(lambda s, f: s.adjust(f))(batched, jnp.array([True, False]))
    np.testing.assert_array_equal(out.loss_scale, [2.0**17, 2.0**15])


# --------------------------------------------------------------------------- #
# Tree helpers
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_all_finite_detects_every_kind(dtype, bad):
    good = {"a": jnp.ones((3, 2), dtype), "i": jnp.int32(7)}
    assert bool(jax.jit(jxs.all_finite)(good))
    poisoned = {"a": good["a"].at[2, 1].set(bad), "i": good["i"]}
    assert not bool(jax.jit(jxs.all_finite)(poisoned))


def test_all_finite_empty_and_non_float():
    assert bool(jxs.all_finite({}))
    assert bool(jxs.all_finite([jnp.arange(3), None]))


def test_select_tree_and_errors():
    a = {"w": jnp.ones(2), "n": jnp.int32(1)}
    b = {"w": jnp.zeros(2), "n": jnp.int32(2)}
    out = jax.jit(jxs.select_tree)(jnp.bool_(True), a, b)
    np.testing.assert_array_equal(out["w"], a["w"])
    assert int(out["n"]) == 1
    with pytest.raises(TypeError, match="`pred` must be a boolean scalar"):
        jxs.select_tree(jnp.float32(1.0), a, b)
    with pytest.raises(ValueError, match="same tree structure"):
        jxs.select_tree(True, a, {"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"\['w'\] differ"):
        jxs.select_tree(True, a, {"w": jnp.zeros(3), "n": jnp.int32(2)})


def test_max_scale_inf_means_no_ceiling():
    """torch users say "no ceiling" with ``inf``: the same as the default."""
    ls = jxs.DynamicLossScale.create(max_scale=float("inf"))
    assert ls.max_scale == jxs.DynamicLossScale.create().max_scale
    assert ls.max_scale == float(np.finfo(np.float32).max)
    with pytest.raises(ValueError, match=r"`max_scale` must be finite|`min_scale`"):
        jxs.DynamicLossScale.create(max_scale=-float("inf"))
    with pytest.raises(ValueError, match="smallest normal float32: XLA:CPU flushes"):
        jxs.DynamicLossScale.create(min_scale=2.0**-140, init_scale=1.0)


@pytest.mark.parametrize("floor", [1e-40, 1e-46, 0.0, -1.0])
def test_floor_below_the_smallest_normal_says_why_with_the_value_given(floor):
    """The message shows the floor as passed (1e-46 rounds to 0 in float32) and
    why (0.1.0 showed the float32-rounded value, e.g. 9.99994610111476e-41)."""
    with pytest.raises(
        ValueError,
        match=r"`min_scale` must be >= 1\.17549\d*e-38 \(2\*\*-126, the smallest "
        r"normal float32: XLA:CPU flushes a subnormal scale to 0, and below 2\*\*-128 "
        rf"1/scale overflows to inf\), got {re.escape(repr(floor))}\.",
    ):
        jxs.DynamicLossScale.create(min_scale=floor, init_scale=1.0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU fact")
def test_a_subnormal_scale_is_zero_on_xla_cpu():
    """The facts behind the floor's message."""
    tiny = jnp.asarray(2.0**-127, jnp.float32)
    assert float(jax.jit(lambda s: s * 2)(tiny)) == 0.0
    assert float(jax.jit(lambda s: 1 / s)(tiny)) == math.inf
    with np.errstate(over="ignore"):  # without the flush too: 2**128 > f32 max
        assert np.isinf(np.float32(1) / np.float32(2.0**-128))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU fact")
def test_unscale_flushes_subnormal_results_and_keeps_normal_ones():
    """The documented limit of the bit-for-bit claim (README, docs/semantics.md):
    equal to IEEE ``grad * (1/scale)`` (what torch computes) for normal results;
    a subnormal result is 0 on XLA:CPU (e.g. ``1e-7 / 2**126``)."""
    ls = jxs.StaticLossScale.create(2.0**126)
    g = np.array([1e-7, 1.0, 3e-3, -1.5], np.float32)
    ieee = g * (np.float32(1) / np.float32(2.0**126))  # NumPy keeps subnormals
    got = np.asarray(jax.jit(ls.unscale)(jnp.asarray(g)))
    normal = np.abs(ieee) >= np.finfo(np.float32).tiny
    assert list(normal) == [False, True, False, True]
    np.testing.assert_array_equal(
        got[normal].view(np.int32), ieee[normal].view(np.int32)
    )
    assert ieee[0] == np.float32(1.4e-45) and got[0] == 0.0 and got[2] == 0.0
