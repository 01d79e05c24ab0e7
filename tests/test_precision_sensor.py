"""The sensor and applying a plan (issue 41): what each format does at each
matmul site, measured on a batch, and ``jxs.autocast(f, dtype, plan=plan)``.

The sensor's first-order estimate of the loss change is checked against running
that one site in the format and every other site in float32; sites are named
alike by the sensor and by autocast (plain functions, Flax modules, scans,
remat, equinox); range failures make a format's score ``inf`` with a note; a plan
made for another function is refused.
"""

from __future__ import annotations

import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale.precision._apply import PlanRule

with warnings.catch_warnings():  # equinox 0.13 on jax 0.7.1 reads a deprecated name
    warnings.simplefilter("ignore", DeprecationWarning)
    import equinox as eqx

pytestmark = [pytest.mark.core]

F = jxp.Format
TOP = "(top level)"


def normal(i, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(i), shape, jnp.float32)


def chain(p, x):
    """Three sites, nothing between them: a site's error reaches the loss
    linearly, so the first-order estimate is exact up to rounding."""
    y = ((x @ p["w1"]) @ p["w2"]) @ p["w3"]
    return jnp.sum(y)


def chain_params():
    return {
        "w1": normal(1, (16, 32)),
        "w2": normal(2, (32, 24)),
        "w3": normal(3, (24, 8)),
        "c": normal(4, (8,)),
    }


def mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    h = jnp.tanh(h @ p["w2"])
    return jnp.mean((h @ p["w3"]) ** 2)


def mlp_params():
    return {
        "w1": normal(1, (16, 32)),
        "w2": normal(2, (32, 32)),
        "w3": normal(3, (32, 4)),
    }


@pytest.fixture(scope="module")
def mlp_sensor():
    """One bfloat16 sensor of ``mlp`` on one batch, which the tests below only
    read (one compile for all of them): ``plan_precision(mlp, jnp.bfloat16,
    ...)(p, x)`` is its ``plan(...)``."""
    return jxp.Sensor(mlp, jnp.bfloat16).update(mlp_params(), normal(9, (8, 16)))


def only(names, site, fmt):
    """A plan with ``site`` in ``fmt`` and every other site in float32."""
    return PlanRule({n: (fmt if n == site else F.FLOAT32) for n in names})


def rounding(fn):
    """``fn`` jitted without XLA's excess precision: a 16-bit result is
    rounded to 16 bits, as the sensor measures it, even where the next site
    widens it (XLA may otherwise fold the widening into the product)."""

    def run(*args):
        lowered = jax.jit(fn).lower(*args)
        return lowered.compile({"xla_allow_excess_precision": False})(*args)

    return run


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_first_order_estimate_matches_lowering_the_site_alone(dtype):
    # The float32 sites run at "highest": a GPU's default float32 matmul is
    # TF32-like (operands rounded to 10 bits, float16's width), so a float32 plan
    # there is no reference and its float16 site changes nothing (issue 47).
    # Under "highest" XLA:GPU also computes the float8 sites in float32, so there
    # their rows compare float32 with float32; XLA:CPU checks them for real.
    with jax.default_matmul_precision("highest"):
        p, x = chain_params(), normal(9, (8, 16))
        stats = jxp.Sensor(chain, dtype).update(p, x).stats()
        names = list(stats)
        assert names == [TOP, f"{TOP}#1", f"{TOP}#2"]
        base = rounding(
            jxs.autocast(chain, dtype, plan=PlanRule(dict.fromkeys(names, F.FLOAT32)))
        )(p, x)
        assert float(base) == pytest.approx(float(jax.jit(chain)(p, x)), rel=1e-6)
        for name in names:
            for fmt in (F.HALF, F.HALF_WIDE, F.FLOAT8, F.FLOAT8_ROWWISE):
                run = rounding(jxs.autocast(chain, dtype, plan=only(names, name, fmt)))
                actual = float(run(p, x)) - float(base)
                estimate = stats[name][fmt]["linear"]
                close = pytest.approx(estimate, rel=2e-2, abs=2e-3)
                assert actual == close, (name, fmt)
                assert stats[name][fmt]["fisher"] > 0
            assert stats[name][F.FLOAT32]["linear"] == 0.0  # default is HIGHEST here


def test_float8_errors_exceed_16_bit_ones_and_float32_is_exact(mlp_sensor):
    p, x = mlp_params(), normal(9, (8, 16))
    measures = mlp_sensor.measures()
    # float32 is exact at "highest" (a GPU's default float32 matmul is TF32-like).
    # Only float32's row is read there: under "highest" XLA:GPU computes the
    # float8 products in float32 (their errors fell 70-fold on an H200).
    with jax.default_matmul_precision("highest"):
        exact = jxp.Sensor(mlp, jnp.bfloat16).update(p, x).measures()
    assert [m.errors[F.FLOAT32] for m in exact] == [0.0] * len(exact)
    for m in measures:
        eight = min(m.errors[F.FLOAT8], m.errors[F.FLOAT8_ROWWISE])
        assert eight > 10 * m.errors[F.HALF]
        assert m.errors[F.HALF] > 0
        # No output rounding; the same 16-bit backward (up to its rounding).
        assert m.errors[F.HALF_WIDE] <= m.errors[F.HALF] * 1.1
    # The scores are shares: the model in 16 bits scores 2 (forward and backward).
    assert math.fsum(m.errors[F.HALF] for m in measures) == pytest.approx(2.0)
    assert [m.shape for m in measures] == [(8, 16, 32), (8, 32, 32), (8, 32, 4)]
    # Parameters arrive in float32 (4 bytes), activations in 16 bits (2).
    # (The function's float32 input x arrives in 4 bytes, as a parameter does.)
    assert [m.operand_bytes for m in measures] == [(4, 4), (2, 4), (2, 4)]


def test_the_sensor_measures_only_the_formats_asked_and_16_bits():
    p, x = mlp_params(), normal(9, (8, 16))
    (m, *_) = jxp.Sensor(mlp, jnp.bfloat16, formats={F.FLOAT8}).update(p, x).measures()
    assert list(m.errors) == [F.HALF, F.FLOAT8]
    allowed = (f for f in (F.FLOAT32, F.FLOAT8))  # read once, used twice
    plan = jxs.plan_precision(mlp, jnp.bfloat16, cost="H100", allowed=allowed)(p, x)
    assert list(plan.measures[0].errors) == [F.FLOAT32, F.HALF, F.FLOAT8]
    assert set(plan.formats().values()) <= {F.FLOAT32, F.FLOAT8}
    with pytest.raises(TypeError, match="`formats` must be a collection"):
        jxp.Sensor(mlp, formats=F.FLOAT8)
    with pytest.raises(TypeError, match="`formats` must hold"):
        jxp.Sensor(mlp, formats=["float8"])


def test_batches_are_averaged():
    p = mlp_params()
    x0, x1 = normal(10, (8, 16)), normal(11, (8, 16))
    both = jxp.Sensor(mlp, jnp.bfloat16).update(p, x0)
    first = both.stats()[TOP][F.FLOAT8]["fisher"]
    both.update(p, x1)
    second = jxp.Sensor(mlp, jnp.bfloat16).update(p, x1).stats()[TOP][F.FLOAT8]
    assert both.batches == 2
    mean = (first + second["fisher"]) / 2
    assert both.stats()[TOP][F.FLOAT8]["fisher"] == pytest.approx(mean, rel=1e-6)


def test_plan_precision_plans_each_call_from_its_own_batch():
    """``plan_precision(...)`` returns a planner that measures one calibration
    batch per call, as its docstring says: a second call's plan is the plan of
    that batch alone, not of the two batches averaged (review finding 5)."""
    p = mlp_params()
    x0, x1 = normal(10, (8, 16)), normal(11, (8, 16), scale=30.0)
    planner = jxp.plan_precision(mlp, jnp.bfloat16, cost="H100")
    planner(p, x0)
    again = planner(p, x1)
    alone = jxp.plan_precision(mlp, jnp.bfloat16, cost="H100")(p, x1)
    assert again == alone
    averaged = jxp.Sensor(mlp, jnp.bfloat16).update(p, x0).update(p, x1)
    assert again.measures != averaged.plan(cost="H100").measures


def test_a_scanned_site_is_one_site_summed_over_its_iterations(on_cpu):
    # The bookkeeping, on a CPU device: XLA:CPU rounds the scanned and the
    # unrolled programs' products alike. XLA:GPU does not: on an H200 their
    # float8 sums differed by 0.15% ("linear") to 0.65% ("dw"), and "highest"
    # there computes float8 in float32 (issue 47).
    ws = normal(1, (4, 16, 16), 0.3)

    def scanned(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h**2)

    def unrolled(ws, x):
        h = x
        for i in range(4):
            h = jnp.tanh(h @ ws[i])
        return jnp.sum(h**2)

    x = normal(9, (8, 16))
    sensor = jxp.Sensor(scanned, jnp.bfloat16).update(ws, x)
    unrolled_sensor = jxp.Sensor(unrolled, jnp.bfloat16).update(ws, x)
    s, u = sensor.stats(), unrolled_sensor.stats()
    assert list(s) == [TOP]
    assert list(u) == [TOP, f"{TOP}#1", f"{TOP}#2", f"{TOP}#3"]
    for fmt in (F.HALF, F.FLOAT8):
        for field in ("linear", "fisher", "dw"):
            total = sum(u[n][fmt][field] for n in u)
            assert s[TOP][fmt][field] == pytest.approx(total, rel=1e-3, abs=1e-9)
    # The plan of the scanned function has one entry, run 4 times a step.
    (m,) = sensor.measures()
    assert m.runs == 4 and m.shape == (8, 16, 16)
    assert [u.runs for u in unrolled_sensor.measures()] == [1] * 4
    plan = sensor.plan(cost="H100")
    assert list(plan.formats()) == [TOP] and "(x4)" in str(plan)
    g = jax.jit(jax.grad(jxs.autocast(scanned, jnp.bfloat16, plan=plan)))(ws, x)
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        y = nn.Dense(32, name="up")(nn.LayerNorm()(h))
        return h + nn.Dense(32, name="down")(nn.gelu(y)), None


class Model(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="embed")(x)
        block = nn.remat(Block) if self.remat else Block
        scan = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        h, _ = scan(name="blocks")(h, None)
        return nn.Dense(4, name="head")(h)


@pytest.mark.parametrize("remat", [False, True])
def test_flax_sites_are_named_by_module_path(remat):
    m, x = Model(remat), normal(1, (16, 8))
    p = m.init(jax.random.key(0), x)

    def loss(p, x):
        return jnp.mean(m.apply(p, x) ** 2)

    sensor = jxp.Sensor(loss, jnp.float16, loss_scale=2.0**10).update(p, x)
    names = [s.site for s in sensor.measures()]
    assert names[0].endswith("embed") and names[-1].endswith("head")
    assert [n.rsplit("/", 1)[-1] for n in names[1:3]] == ["up", "down"]
    plan = sensor.plan(cost="H200")
    run = jax.jit(jax.value_and_grad(jxs.autocast(loss, jnp.float16, plan=plan)))
    value, g = run(p, x)
    assert float(value) == pytest.approx(float(loss(p, x)), rel=2e-2)
    assert jax.tree.leaves(jax.tree.map(lambda a: a.dtype == jnp.float32, g)) == [
        True
    ] * len(jax.tree.leaves(g))


def test_equinox_mlp_and_jax_attention():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        net = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))

    def loss(net, x):
        q = jax.vmap(net)(x)[:, None, None, :]  # (B, T=1, N=1, H=4)
        out = jax.nn.dot_product_attention(q, q, q)
        return jnp.mean(out**2)

    x = normal(2, (6, 8))
    params, static = eqx.partition(net, eqx.is_array)

    def split(params, x):
        return loss(eqx.combine(params, static), x)

    plan = jxs.plan_precision(split, jnp.bfloat16, cost="H100")(params, x)
    # the MLP's three layers and attention's two batched products
    assert [m.kind for m in plan.measures] == ["dense"] * 3 + ["batched"] * 2
    run = jax.jit(jxs.autocast(split, jnp.bfloat16, plan=plan))
    assert float(run(params, x)) == pytest.approx(float(split(params, x)), rel=5e-2)


def overflowing(p, x):
    """The first site's output reaches ~1e5: float16 overflows there only."""
    big = x @ p["big"]
    h = big / jnp.max(jnp.abs(big), axis=-1, keepdims=True)
    return jnp.mean((h @ p["small"]) ** 2)


def overflow_params():
    return {"big": normal(1, (64, 32), 10000.0), "small": normal(2, (32, 8))}


def test_a_float16_overflow_is_inf_with_a_note_and_the_plan_avoids_it():
    p, x = overflow_params(), normal(9, (16, 64))
    sensor = jxp.Sensor(overflowing, jnp.float16).update(p, x)
    big, small = sensor.measures()
    assert big.errors[F.HALF] == math.inf
    assert "outputs overflow float16" in big.notes[F.HALF]
    assert math.isfinite(big.errors[F.HALF_WIDE])
    assert all(math.isfinite(e) for e in small.errors.values())
    plan = sensor.plan(cost="H100")
    assert plan.formats()[big.site] in (F.HALF_WIDE, F.FLOAT32)
    assert plan.within_budget
    plain = jax.jit(jxs.autocast(overflowing, jnp.float16))(p, x)
    planned = jax.jit(jxs.autocast(overflowing, jnp.float16, plan=plan))(p, x)
    assert not bool(jnp.isfinite(plain))
    assert float(planned) == pytest.approx(float(overflowing(p, x)), rel=1e-2)


def test_scaled_gradients_that_overflow_or_flush_are_reported():
    p, x = mlp_params(), normal(9, (8, 16))

    def loud(p, x):
        return 1e3 * mlp(p, x)

    # Overflowing only at the loss scale: noted (dynamic scaling lowers the
    # scale), not failed.
    over = jxp.Sensor(loud, jnp.float16, loss_scale=2.0**24).update(p, x).measures()
    notes = [m.notes.get(F.HALF, "") for m in over]
    assert any("overflows float16 at loss scale 1.7e7" in n for n in notes), notes
    assert all(math.isfinite(m.errors[F.HALF]) for m in over)

    # Beyond float16 unscaled: no loss scale helps, so float16 fails there.
    def louder(p, x):
        return 1e12 * mlp(p, x)

    beyond = jxp.Sensor(louder, jnp.float16).update(p, x).measures()
    head = beyond[-1]
    assert head.errors[F.HALF] == math.inf
    assert "of the gradient beyond float16, unscaled" in head.notes[F.HALF]
    assert head.errors[F.FLOAT32] == 0.0

    def quiet(p, x):
        return 1e-9 * mlp(p, x)

    under = jxp.Sensor(quiet, jnp.float16).update(p, x).measures()
    assert any("flushes to zero in float16" in m.notes.get(F.HALF, "") for m in under)


def one_site(p, x):
    return jnp.sum((x @ p["w"]) * p["c"][None])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_each_format_runs_as_its_own_rule_would(dtype):
    p = {"w": normal(1, (32, 16)), "c": normal(2, (16,))}
    x = normal(3, (8, 32))

    def run(**kw):
        return jax.jit(jax.value_and_grad(jxs.autocast(one_site, dtype, **kw)))(p, x)

    def planned(fmt):
        return run(plan=PlanRule({TOP: fmt}))

    same = [
        (F.HALF, {}),
        (F.FLOAT8, {"float8": jxs.float8.CurrentScaling(min_dim=0)}),
        (F.FLOAT8_ROWWISE, {"float8": jxs.float8.RowwiseScaling(min_dim=0)}),
    ]
    for fmt, kw in same:
        a, b = planned(fmt), run(**kw)
        assert jax.tree.all(jax.tree.map(lambda u, v: bool(jnp.all(u == v)), a, b)), fmt
    value32, _ = planned(F.FLOAT32)
    assert float(value32) == pytest.approx(float(one_site(p, x)), rel=1e-6)
    wide, _ = planned(F.HALF_WIDE)
    hand = jnp.sum(
        jax.lax.dot(
            x.astype(dtype), p["w"].astype(dtype), preferred_element_type=jnp.float32
        )
        * p["c"][None]
    )
    assert float(wide) == pytest.approx(float(hand), rel=1e-5)


def test_a_plan_round_trips_through_json_and_applies_the_same(mlp_sensor):
    p, x = mlp_params(), normal(9, (8, 16))
    plan = mlp_sensor.plan(cost="H100", budget=math.inf)
    again = jxp.Plan.from_json(plan.to_json())
    a = jax.jit(jxs.autocast(mlp, jnp.bfloat16, plan=plan))(p, x)
    b = jax.jit(jxs.autocast(mlp, jnp.bfloat16, plan=again))(p, x)
    assert bool(a == b)
    assert hash(plan.autocast_rule()) == hash(again.autocast_rule())


def test_a_plan_for_another_function_is_refused(mlp_sensor):
    p, x = mlp_params(), normal(9, (8, 16))
    plan = mlp_sensor.plan(cost="H100")

    def deeper(p, x):
        return mlp(p, x) + jnp.mean(x @ p["w1"])

    with pytest.raises(ValueError, match=r"site '\(top level\)#3'.*does not name"):
        jxs.autocast(deeper, jnp.bfloat16, plan=plan)(p, x)

    def shallower(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    with pytest.raises(ValueError, match=r"never met: \(top level\)#2"):
        jxs.autocast(shallower, jnp.bfloat16, plan=plan)(p, x)


def test_wrong_arguments_are_refused_with_what_to_do(mlp_sensor):
    p, x = mlp_params(), normal(9, (8, 16))
    plan = mlp_sensor.plan(cost="H100")
    with pytest.raises(ValueError, match="pass one of them"):
        jxs.autocast(mlp, jnp.bfloat16, plan=plan, float8=True)
    with pytest.raises(ValueError, match="16-bit autocast `dtype`"):
        jxs.autocast(mlp, jnp.float32, plan=plan)
    with pytest.raises(TypeError, match="`plan` must be a `jxs.precision.Plan`"):
        jxs.autocast(mlp, jnp.bfloat16, plan={"(top level)": F.HALF})
    with pytest.raises(ValueError, match="`dtype` must be bfloat16 or float16"):
        jxp.Sensor(mlp, jnp.float32)
    with pytest.raises(ValueError, match="`loss_scale` must be finite and positive"):
        jxp.Sensor(mlp, jnp.float16, loss_scale=0.0)
    with pytest.raises(TypeError, match="`loss_scale` must be a number"):
        jxp.Sensor(mlp, jnp.float16, loss_scale="2**15")
    with pytest.raises(TypeError, match="`fun` must be callable"):
        jxp.Sensor(None)
    with pytest.raises(ValueError, match="call `update` first"):
        jxp.Sensor(mlp).measures()
    with pytest.raises(ValueError, match="has no site"):
        jxp.Sensor(lambda x: jnp.sum(jnp.tanh(x))).update(x)
    with pytest.raises(TypeError, match="scalar floating loss"):
        jxp.Sensor(lambda p, x: x @ p["w1"]).update(p, x)
    with pytest.raises(TypeError, match="`formats` must map site names"):
        PlanRule([("a", F.HALF)])
    with pytest.raises(TypeError, match="a site name .* and a Format"):
        PlanRule({"a": "float8"})


def test_a_plan_with_float8_sites_accumulates_and_shards():
    """A plan's float8 sites under gradient accumulation (a weight quantised
    once per window) and under ``jit`` over 8 devices (data parallel)."""
    p, x = mlp_params(), normal(9, (16, 16))
    plan = jxs.plan_precision(mlp, jnp.bfloat16, cost="H100", budget=math.inf)(p, x)
    for s in plan.sites:
        plan = plan.replace(s.site, F.FLOAT8_ROWWISE if "#1" in s.site else F.FLOAT8)
    run = jxs.autocast(mlp, jnp.bfloat16, plan=plan)
    step = jax.jit(jax.value_and_grad(run))
    value, grads = step(p, x)
    scale = jxs.NoOpLossScale()
    acc = jxs.accumulate_value_and_grad(run, scale, num_microbatches=2, batch_argnums=1)
    v2, g2 = jax.jit(acc)(p, x)
    assert float(v2) == pytest.approx(float(value), rel=5e-2)
    for k in grads:
        assert bool(jnp.all(jnp.isfinite(g2[k])))
        assert float(jnp.linalg.norm(g2[k] - grads[k])) <= 0.2 * float(
            jnp.linalg.norm(grads[k])
        )
    # Sharded over the 8 CPU devices against the same step on one CPU device: on a
    # GPU host the step above ran on the GPU, whose float8 products round
    # otherwise (XLA:CPU widens them), so it is no reference for XLA:CPU's.
    devices = jax.devices("cpu")[:8]
    with jax.default_device(devices[0]):
        value, grads = step(p, x)
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    xs = jax.device_put(x, spec)
    v3, g3 = step(p, xs)
    assert float(v3) == pytest.approx(float(value), rel=1e-2)
    for k in grads:
        np.testing.assert_allclose(g3[k], grads[k], rtol=0.05, atol=1e-3)
