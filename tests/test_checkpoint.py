"""Checkpoints: orbax and flax.serialization round trips, mid-run resume that is
bit-identical to an uninterrupted run, and validate_state on restored state."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
import jaxscale.flax as jxf
from jaxscale.testing import assert_bit_identical

pytestmark = pytest.mark.core

ocp = pytest.importorskip("orbax.checkpoint")
serialization = pytest.importorskip("flax.serialization")

STEPS = 24
# Steps whose loss is poisoned with inf: a streak of three (hysteresis=2 tolerates
# the first, backs off on the second and third), isolated overflows, and long
# enough finite runs for growth (growth_interval=3).
POISON = frozenset({2, 3, 4, 9, 15, 16, 21})


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def problem():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 16)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((16, 1)) * 0.3, jnp.float32),
    }
    xs = jnp.asarray(rng.standard_normal((STEPS, 32, 8)), jnp.float32)
    ys = jnp.asarray(rng.standard_normal((STEPS, 32, 1)), jnp.float32)
    return params, (xs, ys)


def make_tx():
    ls = jxs.DynamicLossScale.create(
        init_scale=2.0**10, growth_interval=3, hysteresis=2
    )
    return jxs.dynamic_scaling(relaxed(optax.adam(1e-2)), ls)


@pytest.fixture(scope="module")
def run():
    """A jitted train step and the uninterrupted run's state after every step."""
    params0, (xs, ys) = problem()
    tx = make_tx()

    @jax.jit
    def step(params, opt_state, x, y, poison):
        def loss(p, batch):
            return loss_fn(p, batch) * jnp.where(poison, jnp.inf, 1.0)

        value, grads = jxs.value_and_grad(loss, opt_state)(params, (x, y))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def resume(params, opt_state, start, stop):
        for t in range(start, stop):
            params, opt_state = step(params, opt_state, xs[t], ys[t], t in POISON)
        return params, opt_state

    history = [(params0, tx.init(params0))]
    for t in range(STEPS):
        history.append(resume(*history[-1], t, t + 1))
    return tx, params0, resume, history


def test_the_run_exercises_every_field(run):
    *_, history = run
    final = history[-1][1]
    assert int(final.skipped_steps) == len(POISON)
    scales = {float(s.loss_scale.loss_scale) for _, s in history}
    trackers = {int(s.loss_scale.growth_tracker) for _, s in history}
    hyst = {int(s.loss_scale.hysteresis_tracker) for _, s in history}
    assert len(scales) > 2 and trackers == {0, 1, 2} and hyst == {1, 2}


# Resume points: mid-growth-window, mid-overflow-streak (hysteresis spent), right
# after a back-off, and after a growth.
RESUME_AT = [1, 3, 4, 8, 12]


def _orbax_roundtrip(tmp_path, tree, target):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", tree)
        ckpt.wait_until_finished()
        return ckpt.restore(tmp_path / "ckpt", abstract)


def _flax_roundtrip(tmp_path, tree, target):
    jxf.register_flax_serialization()
    path = tmp_path / "ckpt.msgpack"
    path.write_bytes(serialization.to_bytes(tree))
    return serialization.from_bytes(target, path.read_bytes())


def _flax_state_dict_roundtrip(tmp_path, tree, target):
    jxf.register_flax_serialization()
    state_dict = serialization.to_state_dict(tree)
    # The state dict holds arrays and plain containers only.
    assert not any(
        isinstance(x, jxs.LossScale)
        for x in jax.tree.leaves(state_dict, is_leaf=lambda x: True)
    )
    return serialization.from_state_dict(target, state_dict)


BACKENDS = {
    "orbax": _orbax_roundtrip,
    "flax_bytes": _flax_roundtrip,
    "flax_state_dict": _flax_state_dict_roundtrip,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("at", RESUME_AT)
def test_mid_run_resume_is_bit_identical(run, tmp_path, backend, at):
    tx, params0, resume, history = run
    params, opt_state = history[at]
    # The target comes from fresh code: new params, a new `tx.init`.
    target = {"params": params0, "opt_state": make_tx().init(params0)}
    restored = BACKENDS[backend](
        tmp_path, {"params": params, "opt_state": opt_state}, target
    )
    restored_state = jxs.validate_state(restored["opt_state"])
    assert isinstance(restored_state, jxs.DynamicScalingState)
    assert_bit_identical(restored_state, opt_state)
    assert restored_state.loss_scale.hysteresis == 2  # config from the target
    final = resume(restored["params"], restored_state, at, STEPS)
    assert_bit_identical(final, history[-1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "loss_scale",
    [jxs.NoOpLossScale(), jxs.StaticLossScale.create(512.0)],
    ids=["noop", "static"],
)
def test_other_loss_scales_round_trip(tmp_path, backend, loss_scale):
    tx = jxs.dynamic_scaling(optax.sgd(0.1), loss_scale)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])}, state, params)[1]
    restored = BACKENDS[backend](tmp_path, state, tx.init(params))
    assert_bit_identical(jxs.validate_state(restored), state)
    assert int(restored.skipped_steps) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_params_round_trip(tmp_path, backend):
    tx = make_tx()
    state = tx.update({}, tx.init({}), {})[1]
    restored = BACKENDS[backend](tmp_path, state, tx.init({}))
    assert_bit_identical(jxs.validate_state(restored), state)


def test_flax_train_state_round_trip(tmp_path):
    from flax.training import train_state

    params, _ = problem()
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=make_tx())
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
    ts = ts.apply_gradients(grads=grads)
    fresh = train_state.TrainState.create(apply_fn=None, params=params, tx=make_tx())
    for backend in BACKENDS.values():
        (tmp_path / backend.__name__).mkdir()
        restored = backend(tmp_path / backend.__name__, ts, fresh)
        restored = jxs.validate_state(restored)
        # `tx` is a static field of the TrainState: compare everything else.
        assert_bit_identical(jax.tree.leaves(ts), jax.tree.leaves(restored))
        assert jax.tree.structure(restored.opt_state) == jax.tree.structure(
            ts.opt_state
        )
        assert int(jxs.loss_scale_of(restored).hysteresis_tracker) == 1


def test_flax_registration_is_explicit_lazy_and_idempotent():
    """In a fresh process (registration is process-wide): importing jaxscale
    imports neither flax nor torch; unregistered, flax fails loudly (never a
    silent partial save); registering twice is fine and makes it work."""
    code = (
        "import sys, jax.numpy as jnp, optax, jaxscale as jxs\n"
        "assert 'flax' not in sys.modules and 'torch' not in sys.modules\n"
        "from flax import serialization\n"
        "s = jxs.dynamic_scaling(optax.sgd(0.1)).init({'w': jnp.ones(2)})\n"
        "try:\n"
        "    serialization.to_bytes(s)\n"
        "except TypeError as e:\n"
        "    assert 'DynamicLossScale' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('serialised without registration')\n"
        "import jaxscale.flax as jxf\n"  # registers on import
        "jxf.register_flax_serialization()\n"
        "r = serialization.from_bytes(s, serialization.to_bytes(s))\n"
        "assert float(r.loss_scale.loss_scale) == 2.0**16\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_flax_state_dict_keys_are_strict():
    jxf.register_flax_serialization()
    target = make_tx().init({"w": jnp.ones(2)})
    state_dict = serialization.to_state_dict(target)
    assert set(state_dict["loss_scale"]) == {
        "loss_scale",
        "growth_tracker",
        "hysteresis_tracker",
    }
    # NeMo's bug: a misspelled key silently reset the hysteresis tracker.
    misspelled = dict(state_dict["loss_scale"])
    misspelled["hysteresis_trackr"] = misspelled.pop("hysteresis_tracker")
    with pytest.raises(ValueError, match=r"missing \['hysteresis_tracker'\]"):
        serialization.from_state_dict(target, {**state_dict, "loss_scale": misspelled})
    extra = {**state_dict["loss_scale"], "extra": np.int32(0)}
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        serialization.from_state_dict(target, {**state_dict, "loss_scale": extra})
    with pytest.raises(ValueError, match="must be a dict"):
        serialization.from_state_dict(target, {**state_dict, "loss_scale": 3.0})


def test_config_comes_from_the_target_and_validate_catches_the_mismatch(tmp_path):
    """A checkpoint from a run with a longer growth_interval, restored into code
    with a shorter one: the tracker no longer fits, which validate_state reports,
    or repairs to what `adjust` would have done with it anyway."""
    params = {"w": jnp.ones(2)}
    long_tx = jxs.dynamic_scaling(
        optax.sgd(0.1), jxs.DynamicLossScale.create(growth_interval=100)
    )
    state = long_tx.init(params)
    step = jax.jit(long_tx.update)
    for _ in range(60):
        state = step({"w": jnp.ones(2)}, state, params)[1]
    assert int(state.loss_scale.growth_tracker) == 60
    short_tx = jxs.dynamic_scaling(
        optax.sgd(0.1), jxs.DynamicLossScale.create(growth_interval=50)
    )
    restored = _orbax_roundtrip(tmp_path, state, short_tx.init(params))
    assert restored.loss_scale.growth_interval == 50
    with pytest.raises(ValueError, match=r"`loss_scale.growth_tracker`.*\[0, 50\).*60"):
        jxs.validate_state(restored)
    with pytest.warns(UserWarning, match=r"growth_tracker` 60 -> 49"):
        repaired = jxs.validate_state(restored, repair=True)
    # Unrepaired, adjust grows on the next finite step; so does the repaired one.
    nxt = short_tx.update({"w": jnp.ones(2)}, repaired, params)[1]
    raw = short_tx.update({"w": jnp.ones(2)}, restored, params)[1]
    assert float(nxt.loss_scale.loss_scale) == 2.0**17
    assert_bit_identical(nxt.loss_scale, raw.loss_scale)


# --------------------------------------------------------------------------- #
# validate_state
# --------------------------------------------------------------------------- #


_TX = jxs.dynamic_scaling(
    optax.sgd(0.1),
    jxs.DynamicLossScale.create(
        init_scale=1024.0,
        growth_interval=10,
        hysteresis=3,
        min_scale=1.0,
        max_scale=2.0**20,
    ),
)
_STEP = jax.jit(_TX.update)


def _state(**loss_scale_fields):
    state = _TX.init({"w": jnp.ones(2)})
    # Two skipped steps: counters non-trivial and consistent.
    state = state._replace(
        steps=jnp.int32(7),
        skipped_steps=jnp.int32(2),
        consecutive_skips=jnp.int32(0),
    )
    ls = dataclasses.replace(state.loss_scale, **loss_scale_fields)
    return state._replace(loss_scale=ls)


BAD = [
    # (field overrides, state overrides, error regex)
    ({"loss_scale": jnp.float32(jnp.nan)}, {}, r"`loss_scale.loss_scale`.*> 0.*nan"),
    ({"loss_scale": jnp.float32(0.0)}, {}, r"`loss_scale.loss_scale`.*> 0.*0\.0"),
    ({"loss_scale": jnp.float32(-8.0)}, {}, r"`loss_scale.loss_scale`.*-8\.0"),
    (
        {"loss_scale": jnp.float32(jnp.inf)},
        {},
        r"`loss_scale.loss_scale` must be finite and in \[min_scale, max_scale\].*inf",
    ),
    (
        {"loss_scale": jnp.float32(0.5)},
        {},
        r"`loss_scale.loss_scale` must be in \[min_scale, max_scale\] = \[1\.0, "
        r"1048576\.0\], got 0\.5",
    ),
    (
        {"loss_scale": jnp.float32(2.0**21)},
        {},
        r"\[1\.0, 1048576\.0\], got 2097152\.0",
    ),
    (
        {"loss_scale": np.float64(1024.0)},
        {},
        r"`loss_scale.loss_scale` must be float32",
    ),
    ({"loss_scale": jnp.ones(2)}, {}, r"`loss_scale.loss_scale` must be a scalar"),
    ({"growth_tracker": jnp.int32(10)}, {}, r"growth_tracker` must be in \[0, growth"),
    ({"growth_tracker": jnp.int32(-1)}, {}, r"growth_tracker` must be in .*got -1"),
    ({"growth_tracker": np.int64(3)}, {}, r"growth_tracker` must be int32\[\]"),
    ({"growth_tracker": np.float32(3)}, {}, r"growth_tracker` must be int32\[\]"),
    ({"hysteresis_tracker": jnp.int32(0)}, {}, r"hysteresis_tracker` must be in \[1, "),
    ({"hysteresis_tracker": jnp.int32(4)}, {}, r"\[1, hysteresis\] = \[1, 3\], got 4"),
    ({}, {"steps": jnp.int32(-3)}, r"`steps` must be >= 0, got -3"),
    ({}, {"skipped_steps": jnp.int32(8)}, r"`skipped_steps` must be in \[0, steps\]"),
    ({}, {"consecutive_skips": jnp.int32(3)}, r"`consecutive_skips` must be in \[0, s"),
    (
        {},
        {"nonfinite_leaves": {"flags": jnp.zeros(3, jnp.bool_)}},
        r"`nonfinite_leaves` must be a LeafFlags .*upgrade_checkpoint.*got dict",
    ),
    ({}, {"steps": np.int64(2**40)}, r"`steps` must be int32\[\], got int64"),
    ({}, {"steps": None}, r"`steps` must be an int32\[\] array, got NoneType"),
]


@pytest.mark.parametrize(("ls_fields", "fields", "match"), BAD)
def test_validate_state_rejects(ls_fields, fields, match):
    state = _state(**ls_fields)._replace(**fields)
    with pytest.raises(ValueError, match=match):
        jxs.validate_state(state)


REPAIRS = [
    # (loss-scale overrides, state overrides, expected repaired values)
    ({"loss_scale": jnp.float32(jnp.inf)}, {}, {"scale": 2.0**20}),
    ({"loss_scale": jnp.float32(2.0**-140)}, {}, {"scale": 1.0}),  # subnormal
    ({"loss_scale": np.float64(2048.0)}, {}, {"scale": 2048.0}),
    ({"loss_scale": np.int32(16)}, {}, {"scale": 16.0}),
    ({"loss_scale": jnp.bfloat16(512.0)}, {}, {"scale": 512.0}),
    ({"growth_tracker": jnp.int32(25)}, {}, {"tracker": 9}),
    ({"growth_tracker": jnp.int32(-4)}, {}, {"tracker": 0}),
    ({"growth_tracker": np.int64(4)}, {}, {"tracker": 4}),
    ({"hysteresis_tracker": jnp.int32(0)}, {}, {"hyst": 1}),
    ({"hysteresis_tracker": jnp.int32(9)}, {}, {"hyst": 3}),
    ({}, {"skipped_steps": jnp.int32(9)}, {"skipped_steps": 7}),
    ({}, {"steps": jnp.int32(-1)}, {"steps": 0, "skipped_steps": 0}),
    (
        {},
        {"consecutive_skips": jnp.int32(5)},
        {"consecutive_skips": 2, "last_step_finite": False},
    ),
]


@pytest.mark.parametrize(("ls_fields", "fields", "expected"), REPAIRS)
def test_validate_state_repairs(ls_fields, fields, expected):
    state = _state(**ls_fields)._replace(**fields)
    with pytest.raises(ValueError, match="Pass `repair=True`"):
        jxs.validate_state(state)
    with pytest.warns(UserWarning, match="jxs.validate_state repaired"):
        out = jxs.validate_state(state, repair=True)
    ls = out.loss_scale
    got = {
        "scale": float(ls.loss_scale),
        "tracker": int(ls.growth_tracker),
        "hyst": int(ls.hysteresis_tracker),
        "steps": int(out.steps),
        "skipped_steps": int(out.skipped_steps),
        "consecutive_skips": int(out.consecutive_skips),
        "last_step_finite": bool(out.last_step_finite),
    }
    assert {k: got[k] for k in expected} == expected
    # The repaired state is valid, typed exactly like a fresh one, and usable.
    fresh = _state()
    assert jax.tree.map(lambda x: (x.shape, x.dtype), out) == jax.tree.map(
        lambda x: (x.shape, x.dtype), fresh
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jxs.validate_state(out) is out
    _STEP({"w": jnp.ones(2)}, out)


@pytest.mark.parametrize(
    "bad",
    [
        {"loss_scale": jnp.float32(jnp.nan)},
        {"loss_scale": jnp.float32(0.0)},
        {"loss_scale": jnp.float32(-1.0)},
        {"loss_scale": jnp.ones(3)},
        {"growth_tracker": np.float32(2.5)},
        {"loss_scale": np.complex64(1024.0)},
        {"growth_tracker": np.int64(2**40)},
    ],
)
def test_validate_state_never_repairs_garbage(bad):
    with pytest.raises(ValueError, match="must be") as info:
        jxs.validate_state(_state(**bad), repair=True)
    assert "repair=True" not in str(info.value)


def test_validate_state_accepts_every_holder_and_returns_valid_state_as_is():
    state = _state()
    assert jxs.validate_state(state) is state
    assert jxs.validate_state(state.loss_scale) is state.loss_scale
    chained = optax.chain(optax.clip(1.0), jxs.dynamic_scaling(optax.sgd(0.1)))
    cs = chained.init({"w": jnp.ones(2)})
    assert jxs.validate_state(cs) is not None
    static = jxs.StaticLossScale.create(8.0)
    assert jxs.validate_state(static) is static
    assert jxs.validate_state(jxs.NoOpLossScale()) == jxs.NoOpLossScale()
    # Nested: the error names the path.
    bad = (optax.EmptyState(), _state(growth_tracker=jnp.int32(99)))
    with pytest.raises(ValueError, match=r"`\[1\]\.loss_scale\.growth_tracker`"):
        jxs.validate_state(bad)


def test_validate_state_static_loss_scale():
    bad = jxs.StaticLossScale(loss_scale=jnp.float32(0.0))
    with pytest.raises(ValueError, match=r"`loss_scale` must be finite and > 0"):
        jxs.validate_state(bad)
    sub = jxs.StaticLossScale(loss_scale=jnp.float32(1e-40))
    with pytest.warns(UserWarning, match="repaired"):
        out = jxs.validate_state(sub, repair=True)
    assert float(out.loss_scale) == float(np.finfo(np.float32).tiny)


def test_validate_state_errors_on_misuse():
    with pytest.raises(ValueError, match="contains no jaxscale state"):
        jxs.validate_state({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="outside `jax.jit`"):
        jax.jit(jxs.validate_state)(_state())
    with pytest.raises(TypeError, match="`loss_scale` must be a jxs.LossScale"):
        jxs.validate_state(_state()._replace(loss_scale={"scale": 1.0}))


def test_every_reachable_state_is_valid():
    tx = make_tx()
    params, (xs, _) = problem()
    state = tx.init(params)
    step = jax.jit(tx.update)
    rng = np.random.default_rng(3)
    for t in range(40):
        g = jax.tree.map(jnp.ones_like, params)
        if rng.random() < 0.4:
            g["w1"] = g["w1"].at[0, 0].set(jnp.nan)
        state = step(g, state, params)[1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert jxs.validate_state(state) is state, t


DIAGNOSTIC_OPTIONS = {
    "plain": None,
    "overflow_hook": {"on_overflow": lambda event: None},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("saved", DIAGNOSTIC_OPTIONS)
@pytest.mark.parametrize("restored", DIAGNOSTIC_OPTIONS)
def test_diagnostic_options_never_change_what_restores(
    tmp_path, backend, saved, restored
):
    """Switching an overflow hook on or off between save and restore is safe:
    the per-leaf flags are always kept and ``monitor(on_overflow=...)`` adds no
    state. (0.1.0 added a flags subtree with ``track_nonfinite=True``, which
    broke both orbax and flax restores.) The floor warning's counter is state
    of its own: see the next test."""
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}

    def make(options):
        tx = jxs.dynamic_scaling(optax.sgd(0.1))
        hooks = DIAGNOSTIC_OPTIONS[options]
        return tx if hooks is None else jxs.diagnostics.monitor(tx, **hooks)

    tx = make(saved)
    state = tx.init(params)
    bad = {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.ones(2)}
    _, state = jax.jit(tx.update)(bad, state, params)
    jax.effects_barrier()
    out = BACKENDS[backend](tmp_path, state, make(restored).init(params))
    out = jxs.validate_state(out)
    assert_bit_identical(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, state))
    assert jxs.diagnostics.nonfinite_paths(out) == ["w"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_floor_warning_keeps_its_counter_in_its_own_state(tmp_path, backend):
    """``warn_at_floor_after`` adds a ``MonitorState``: its inner state is the
    plain optimizer's, so a plain checkpoint restores into it (and back) by
    wrapping or unwrapping, and a structure mismatch is loud, never silent."""
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    plain = jxs.dynamic_scaling(optax.sgd(0.1))
    watched = jxs.diagnostics.monitor(plain, warn_at_floor_after=5)
    state = watched.init(params)
    bad = {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.ones(2)}
    _, state = jax.jit(watched.update)(bad, state, params)
    for d in "abc":
        (tmp_path / d).mkdir()
    out = BACKENDS[backend](tmp_path / "a", state, watched.init(params))
    assert_bit_identical(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, state))
    inner = BACKENDS[backend](tmp_path / "b", state.inner_state, plain.init(params))
    assert jxs.diagnostics.nonfinite_paths(inner) == ["w"]
    with pytest.raises(Exception):  # noqa: B017 - orbax and flax raise differently
        BACKENDS[backend](tmp_path / "c", state, plain.init(params))


class V010State(NamedTuple):
    """``DynamicScalingState`` as jaxscale 0.1.0 and 0.2.0 stored it."""

    loss_scale: Any
    inner_state: Any
    steps: Any
    skipped_steps: Any
    consecutive_skips: Any
    last_step_finite: Any
    steps_at_floor: Any
    nonfinite_leaves: Any = None


@pytest.mark.parametrize("layout", ["0.1.0", "0.2.0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_old_checkpoint_loads_through_upgrade_checkpoint(tmp_path, backend, layout):
    """0.1.0 wrote ``nonfinite_leaves=None`` by default, and 0.1.0 and 0.2.0
    stored ``last_step_finite`` and ``steps_at_floor``; restoring that into
    today's ``tx.init(params)`` fails on the structure, and
    ``jxs.upgrade_checkpoint`` restores it (fresh flags for 0.1.0). The files
    those releases really wrote are tested in tests/test_upgrade.py."""
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), every_k=1)
    state = tx.init(params)
    for g in [jnp.inf, 1.0, 1.0]:
        grads = jax.tree.map(lambda p, g=g: p + g, params)
        _, state = jax.jit(tx.update)(grads, state)
    s = state.inner_state
    flags = s.nonfinite_leaves if layout == "0.2.0" else None
    old = state._replace(
        inner_state=V010State(*s[:5], jnp.bool_(True), jnp.int32(0), flags)
    )
    target = tx.init(params)
    (tmp_path / "direct").mkdir()
    with pytest.raises(Exception):  # noqa: B017 - orbax and flax raise differently
        BACKENDS[backend](tmp_path / "direct", old, target)
    tries = iter(range(10))

    def restore(like):  # a fresh directory per layout tried
        where = tmp_path / f"upgraded{next(tries)}"
        where.mkdir()
        return BACKENDS[backend](where, old, like)

    restored = jxs.upgrade_checkpoint(restore, target)
    restored = jxs.validate_state(restored)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    assert_bit_identical(
        jax.tree.map(np.asarray, tuple(restored.inner_state[:5])),
        jax.tree.map(np.asarray, tuple(old.inner_state[:5])),
    )
    assert jxs.diagnostics.nonfinite_paths(restored) == []
    assert int(jxs.diagnostics.summary(restored)["skipped_steps"]) == 1
    _, state = jax.jit(tx.update)(params, restored)  # trains on
    assert int(jxs.diagnostics.summary(state)["steps"]) == 4


def test_upgrade_checkpoint_errors():
    with pytest.raises(TypeError, match="`restore` must be a function"):
        jxs.upgrade_checkpoint("ckpt", {})
    with pytest.raises(ValueError, match="contains no jxs.DynamicScalingState"):
        jxs.upgrade_checkpoint(lambda like: like, {"w": jnp.ones(2)})


def test_validate_state_keeps_counters_above_2_24_exact():
    """0.1.0 rounded int32 counters through float32: 2**24 + 1 was rejected as
    out of range, and ``repair=True`` set it to 16777216."""
    big = jnp.int32(2**24 + 1)
    state = _state()._replace(steps=big, skipped_steps=big, consecutive_skips=big)
    assert jxs.validate_state(state) is state
    with pytest.warns(UserWarning, match="consecutive_skips"):
        fixed = jxs.validate_state(
            state._replace(consecutive_skips=jnp.int32(2**24 + 3)), repair=True
        )
    assert int(fixed.consecutive_skips) == 2**24 + 1  # clamped to skipped_steps
    assert int(fixed.steps) == 2**24 + 1


def test_validate_state_casts_integral_float_counters_exactly():
    """Counters that come back as float64 (a torch dict, a JSON or msgpack
    round trip) are cast exactly with ``repair=True``, also above 2**24."""
    big = np.float64(2**24 + 1)
    state = _state()._replace(steps=big, skipped_steps=big, consecutive_skips=big)
    with pytest.raises(
        ValueError,
        match=r"`steps` must be int32\[\], got float64\[\] 16777217\.0\. Pass "
        r"`repair=True`",
    ):
        jxs.validate_state(state)
    with pytest.warns(UserWarning, match=r"`steps` float64\[\] 16777217\.0 -> int32"):
        fixed = jxs.validate_state(state, repair=True)
    for field in ("steps", "skipped_steps", "consecutive_skips"):
        value = getattr(fixed, field)
        assert value.dtype == jnp.int32 and int(value) == 2**24 + 1, field
    assert jxs.validate_state(fixed) is fixed


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (np.float64(2.5), r"float64\[\] 2\.5"),
        (np.int64(2**31), r"int64\[\] 2147483648"),
    ],
)
def test_validate_state_never_repairs_a_counter_that_does_not_fit(value, shown):
    with pytest.raises(ValueError, match=rf"`steps` must be int32\[\], got {shown}\.$"):
        jxs.validate_state(_state()._replace(steps=value), repair=True)
