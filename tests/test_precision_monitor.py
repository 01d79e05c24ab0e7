"""The precision monitor (issue 41): per-site measurements inside the jitted
step, with no host transfer; counters in a state; a host-side re-plan that
raises a troubled site and lowers it back after a calm window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale.precision._monitor import FIELDS

pytestmark = [pytest.mark.core]

F = jxp.Format
TOP = "(top level)"


def loss(p, x):
    h = x @ p["w1"]
    return jnp.mean((jnp.tanh(h) @ p["w2"]) ** 2)


def params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (16, 32)) / 4,
        "w2": jax.random.normal(k2, (32, 4)) / 6,
    }


def x_of(scale):
    return scale * jax.random.normal(jax.random.key(3), (8, 16))


def half_plan(p):
    # The 16-bit budget: float8 at a site then takes the plan over it (the
    # noise budget of 8 rows would admit it).
    plan = jxs.plan_precision(loss, jnp.float16, cost="H100", budget="16-bit")(
        p, x_of(1.0)
    )
    for s in plan.sites:
        plan = plan.replace(s.site, F.HALF)
    return plan


def step_fn(mon):
    @jax.jit
    def step(p, state, x):
        (value, grads), seen = mon.value_and_grad(loss)(p, x)
        return value, grads, mon.update(state, seen), seen

    return step


def test_measurements_come_back_with_the_gradients_without_a_host_transfer():
    p = params()
    mon = jxp.Monitor(half_plan(p), jnp.float16)
    step = step_fn(mon)
    state, x = mon.init(), x_of(1.0)
    _, _, state, _ = step(p, state, x)  # compiled first
    with jax.transfer_guard("disallow"):
        value, grads, state, seen = step(p, state, x)
    assert seen.shape == (2, len(FIELDS))
    h = x @ p["w1"]
    col = dict(zip(FIELDS, np.asarray(seen).T, strict=True))
    # The operands as the site takes them: float16 here.
    np.testing.assert_allclose(col["x_amax"][0], jnp.max(jnp.abs(x)), rtol=1e-3)
    np.testing.assert_allclose(col["y_amax"][0], jnp.max(jnp.abs(h)), rtol=2e-3)
    assert col["overflow"].tolist() == [0, 0]
    assert int(state.steps) == 2 and state.troubled.tolist() == [0, 0]
    assert state.quiet.tolist() == [2, 2]
    ref = jax.grad(jxs.autocast(loss, jnp.float16, plan=mon.plan))(p, x)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), grads, ref))


def test_a_site_near_float16s_limit_is_raised_and_lowered_back_when_calm():
    p = params()
    mon = jxp.Monitor(half_plan(p), jnp.float16, patience=2, window=3)
    step = step_fn(mon)
    state = mon.init()
    for _ in range(2):  # inputs ~2e4: beyond 65504 / 4 as float16 operands
        *_, state, _ = step(p, state, x_of(2e4))
    assert state.troubled.tolist()[0] == 2
    mon2, state2, changes = mon.replan(state)
    assert changes and changes[0].startswith(f"{TOP}: 16-bit -> 16-bit, float32")
    new = mon2.plan.formats()
    assert new[TOP] is F.HALF_WIDE or new[TOP] is F.FLOAT32
    assert "raised by the monitor" in mon2.plan.sites[0].why
    assert int(state2.troubled[0]) == 0
    assert mon2.base == mon.base  # what a raised site returns to
    # Still large: raised again (16-bit operands are float16 too), never lowered.
    step2 = step_fn(mon2)
    for _ in range(3):
        *_, state2, _ = step2(p, state2, x_of(2e4))
    mon3, state3, changes = mon2.replan(state2)
    assert mon3.plan.formats()[TOP] is F.FLOAT32
    # Calm again: lowered one format at a time, back to the plan's own.
    step3 = step_fn(mon3)
    for _ in range(3):
        *_, state3, _ = step3(p, state3, x_of(1.0))
    mon4, state4, changes = mon3.replan(state3)
    assert [c.split(" (")[0] for c in changes] == [
        f"{TOP}: float32 -> 16-bit, float32 result"
    ]
    step4 = step_fn(mon4)
    for _ in range(3):
        *_, state4, _ = step4(p, state4, x_of(1.0))
    mon5, _, _ = mon4.replan(state4)
    assert mon5.plan.formats() == mon.plan.formats()
    assert mon5.replan(mon5.init())[2] == ()


def test_float8_flushes_are_trouble():
    p = params()
    with pytest.warns(jxp.PlanBudgetWarning):
        plan = half_plan(p).replace(TOP, F.FLOAT8)
    mon = jxp.Monitor(plan, jnp.float16, patience=1)
    x = x_of(1.0).at[0, 0].set(1e6)  # one outlier: the rest flush per tensor
    _, _, state, seen = step_fn(mon)(p, mon.init(), x)
    assert float(seen[0, FIELDS.index("float8_flush")]) > 0.5
    _, _, changes = mon.replan(state)
    assert changes[0].startswith(f"{TOP}: float8 -> float8 rowwise")


def test_a_scanned_site_reports_its_worst_iteration():
    ws = jnp.stack([jnp.eye(16), 1e4 * jnp.eye(16), jnp.eye(16)])

    def scanned(ws, x):
        body = lambda h, w: ((h @ w) / jnp.max(jnp.abs(w)), None)  # noqa: E731
        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h)

    x = x_of(1.0)
    plan = jxs.plan_precision(scanned, jnp.float16, cost="H100", budget=1e9)(ws, x)
    plan = plan.replace(TOP, F.HALF)
    mon = jxp.Monitor(plan, jnp.float16)
    (_, _), seen = jax.jit(mon.value_and_grad(scanned))(ws, x)
    assert seen.shape == (1, len(FIELDS))
    assert float(seen[0, FIELDS.index("w_amax")]) == 1e4  # the max, not a sum
    assert bool(mon.troubled(seen)[0][0])


def test_with_a_loss_scale_the_measurements_are_unscaled():
    p, x = params(), x_of(1.0)
    mon = jxp.Monitor(half_plan(p), jnp.float16)
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    opt = tx.init(p)
    (v1, g1), seen1 = jax.jit(mon.value_and_grad(loss, opt))(p, x)
    (v0, g0), seen0 = jax.jit(mon.value_and_grad(loss))(p, x)
    assert float(v1) == float(v0)
    amax = [FIELDS.index(f) for f in ("x_amax", "w_amax", "y_amax")]
    np.testing.assert_array_equal(seen1[:, amax], seen0[:, amax])
    scale = float(jxs.loss_scale_of(opt).loss_scale)
    np.testing.assert_allclose(g1["w1"] / scale, g0["w1"], rtol=1e-2, atol=1e-9)


def test_wrong_arguments_are_refused():
    p = params()
    plan = half_plan(p)
    with pytest.raises(TypeError, match="`plan` must be a `jxs.precision.Plan`"):
        jxp.Monitor({TOP: F.HALF}, jnp.float16)
    with pytest.raises(ValueError, match="`patience` must be an int >= 1"):
        jxp.Monitor(plan, jnp.float16, patience=0)
    with pytest.raises(ValueError, match="`headroom` must be a number >= 1"):
        jxp.Monitor(plan, jnp.float16, headroom=0.5)
    with pytest.raises(ValueError, match=r"`max_flush` must be in \[0, 1\)"):
        jxp.Monitor(plan, jnp.float16, max_flush=1.0)
    other = jxp.Monitor(plan.replace(TOP, F.FLOAT32), jnp.float16)
    state = jxp.Monitor(plan, jnp.float16).init()
    with pytest.raises(ValueError, match="another plan of these sites"):
        other.replan(state)  # same sites, another plan
    with pytest.raises(ValueError, match="`state` is for other sites"):
        mon = jxs.plan_precision(lambda w, x: jnp.sum(x @ w), jnp.float16)(
            jnp.ones((16, 4)), x_of(1.0)
        )
        jxp.Monitor(mon, jnp.float16).replan(state)


def test_a_state_from_before_a_replan_is_refused():
    """The plan's identity travels in the state (static): the new monitor
    refuses the old state, and a step traced from the old monitor refuses the
    new state, instead of counting one plan's steps for another."""
    p = params()
    mon = jxp.Monitor(half_plan(p), jnp.float16, patience=1)
    step = step_fn(mon)
    *_, state, _ = step(p, mon.init(), x_of(2e4))
    mon2, state2, changes = mon.replan(state)
    assert changes and state2.formats != state.formats
    with pytest.raises(ValueError, match="another plan of these sites"):
        mon2.replan(state)
    with pytest.raises(ValueError, match="another plan of these sites"):
        step(p, state2, x_of(1.0))  # the old monitor's step, the new state
    *_, state3, _ = step_fn(mon2)(p, state2, x_of(1.0))
    assert int(state3.steps) == 2
