"""A plan as it meets the step it runs in (issue 49 items 1 and 7, issue 48
item 7): it records the 16-bit dtype and loss scale it was measured at, warns
when an edit takes it over its budget, is re-solved at the shapes the step
traces, and stores each site once."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp

pytestmark = [pytest.mark.unit]

F = jxp.Format


def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])


def params(d=16, ffn=32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (d, ffn)) / 4,
        "w2": jax.random.normal(k2, (ffn, 4)) / 6,
    }


def batch(rows, d=16):
    return jax.random.normal(jax.random.key(3), (rows, d))


@pytest.fixture(scope="module")
def bf16_plan():
    # The 16-bit budget: a version-1 file of it (below) is what one was.
    return jxs.plan_precision(
        loss, jnp.bfloat16, cost="H100", loss_scale=8.0, budget="16-bit"
    )(params(), batch(8))


# ------------------------------------------------------------------ item 1


def test_a_plan_records_the_dtype_and_loss_scale_it_was_measured_at(bf16_plan):
    assert bf16_plan.dtype == np.dtype(jnp.bfloat16)
    assert bf16_plan.loss_scale == 8.0
    assert "measured in bfloat16 at loss scale 8" in str(bf16_plan).splitlines()[0]


def test_autocast_refuses_a_plan_of_another_16_bit_dtype(bf16_plan):
    p, x = params(), batch(8)
    with jax.numpy_dtype_promotion("strict"):
        out = jax.jit(jxs.autocast(loss, jnp.bfloat16, plan=bf16_plan))(p, x)
    assert out.dtype == jnp.float32
    with pytest.raises(
        ValueError,
        match=r"`plan` was measured in bfloat16, but autocast `dtype` is float16.*"
        r"plan.with_dtype\(jnp.float16\)",
    ):
        jxs.autocast(loss, jnp.float16, plan=bf16_plan)
    # The explicit override runs, in float16.
    f16 = bf16_plan.with_dtype(jnp.float16)
    assert f16.dtype == np.dtype(jnp.float16) and f16.loss_scale == 8.0
    with jax.numpy_dtype_promotion("strict"):
        jaxpr = jax.make_jaxpr(jxs.autocast(loss, jnp.float16, plan=f16))(p, x)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(
        e.invars[0].aval.dtype in (jnp.float16, jnp.float32) for e in dots
    )


def test_the_monitor_takes_the_plans_dtype_and_refuses_another(bf16_plan):
    assert jxp.Monitor(bf16_plan).dtype == np.dtype(jnp.bfloat16)
    assert jxp.Monitor(bf16_plan, jnp.bfloat16).dtype == np.dtype(jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"`dtype` is float16, but the plan was measured in bfloat16"
    ):
        jxp.Monitor(bf16_plan, jnp.float16)
    unknown = jxp.solve(bf16_plan.measures, cost="H100", budget="16-bit")
    assert unknown.dtype is None
    with pytest.raises(ValueError, match=r"`dtype` must be given.*records no dtype"):
        jxp.Monitor(unknown)
    assert jxp.Monitor(unknown, jnp.float16).dtype == np.dtype(jnp.float16)


def test_json_keeps_the_dtype_and_a_version_1_file_loads_it_unknown(bf16_plan):
    text = bf16_plan.to_json()
    doc = json.loads(text)
    assert doc["version"] == 4 and doc["dtype"] == "bfloat16"
    assert doc["loss_scale"] == 8.0
    back = jxp.Plan.from_json(text)
    assert back == bf16_plan and back.dtype == np.dtype(jnp.bfloat16)
    for key in ("dtype", "loss_scale", "allowed", "traced", "budget_in"):
        del doc[key]
    for entry in doc["sites"]:
        del entry["pinned"], entry["noise"], entry["kind"]
    doc["version"] = 1
    old = jxp.Plan.from_json(json.dumps(doc))
    assert old.dtype is None and old.loss_scale is None
    assert old.formats() == bf16_plan.formats()
    # Version 1 has no record of what the user chose: it runs as saved.
    assert old.pinned == set(old.formats())
    # Unknown: it runs in the dtype autocast is given, unchecked.
    jax.make_jaxpr(jxs.autocast(loss, jnp.float16, plan=old))(params(), batch(8))
    doc["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match=r"unknown \['dtype'\]"):
        jxp.Plan.from_json(json.dumps(doc))


# ------------------------------------------------------------------ item 3


def _measures():
    return [
        jxp.SiteMeasure(
            name,
            (16384, 4096, 6144),
            (2, 4),
            {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: e},
        )
        for name, e in (("qkv", 3e-3), ("mlp", 1e-3))
    ]


def test_an_edit_that_takes_the_plan_over_its_budget_warns():
    plan = jxp.solve(_measures(), cost="H100", budget=2e-4)
    assert plan.within_budget
    with pytest.warns(
        jxp.PlanBudgetWarning,
        match=r"Plan.replace takes the plan over its budget: measured error 0.0031 "
        r"> budget 2.0e-4; the edited sites, by error: 'qkv' \(0.003\)",
    ):
        over = plan.replace("qkv", F.FLOAT8)
    assert not over.within_budget
    # Edits that remove error, or stay within the budget, are quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        over.replace("qkv", F.FLOAT32)
        plan.replace("mlp", F.FLOAT32)
        jxp.Plan.from_formats(
            {"qkv": F.HALF, "mlp": F.HALF}, _measures(), cost="H100", budget=2e-4
        )
    with pytest.warns(
        jxp.PlanBudgetWarning,
        match=r"Plan.from_formats takes the plan over its budget: measured error "
        r"0.004 > budget 0.001; the edited sites, by error: 'qkv' \(0.003\), "
        r"'mlp' \(0.001\)",
    ):
        jxp.Plan.from_formats(
            {"qkv": F.FLOAT8, "mlp": F.FLOAT8}, _measures(), cost="H100", budget=1e-3
        )


# ------------------------------------------------------------------ item 2


def mlp(p, x):
    return jnp.mean(jax.nn.gelu(x @ p["w1"]) @ p["w2"])


def mlp_params(d, ffn):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (d, ffn)) / d**0.5,
        "w2": jax.random.normal(k2, (ffn, d)) / ffn**0.5,
    }


def dot_dtypes(jaxpr):
    """The operand dtypes of every dot_general the program runs: at the top
    level and in calls (``jaxpr``/``call_jaxpr``; not a custom rule's
    unused alternatives or another platform's branch)."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append((e.invars[0].aval.dtype.name, e.invars[1].aval.dtype.name))
        for key in ("jaxpr", "call_jaxpr"):
            inner = getattr(e.params.get(key), "jaxpr", e.params.get(key))
            if hasattr(inner, "eqns"):
                out += dot_dtypes(inner)
    return out


def test_plan_at_reprices_each_site_and_keeps_the_users_choices():
    m = jxp.SiteMeasure("mlp", (64, 768, 3072), (4, 4), {F.FLOAT32: 0.0, F.HALF: 1e-4})
    n = jxp.SiteMeasure("out", (64, 3072, 768), (4, 4), {F.FLOAT32: 0.0, F.HALF: 1e-4})
    plan = jxp.solve([m, n], cost="H100", budget=2e-4)
    assert set(plan.formats().values()) == {F.FLOAT32}  # 64 rows: launch-bound
    assert "the calibration batch's" in str(plan)
    big = {"mlp": (8192, 768, 3072), "out": (8192, 3072, 768)}
    at = plan.at(big)
    assert at.formats() == {"mlp": F.HALF, "out": F.HALF}
    assert at.traced and "a traced step's" in str(at)
    assert [s.shape for s in at.sites] == list(big.values())
    assert at.budget == plan.budget and at.within_budget
    assert plan.at(big) is at  # cached per shape set
    edited = plan.replace("out", F.FLOAT32, why="kept exact")
    at = edited.at(big)
    assert at.formats() == {"mlp": F.HALF, "out": F.FLOAT32}
    assert at.sites[1].why.startswith("float32: kept exact; ")
    with pytest.raises(ValueError, match=r"`shapes` must give \(m, k, n\) for each"):
        plan.at({"mlp": (1, 1, 1)})
    back = jxp.Plan.from_json(edited.to_json())
    assert back == edited and back.at(big).formats() == at.formats()


def test_autocast_runs_the_plan_at_the_traced_step_shapes():
    d, ffn = 64, 256
    p = mlp_params(d, ffn)
    plan = jxs.plan_precision(mlp, jnp.bfloat16, cost="H100")(p, batch(64, d))
    assert F.FLOAT32 in plan.formats().values()
    run = jxs.autocast(mlp, jnp.bfloat16, plan=plan)
    with jax.numpy_dtype_promotion("strict"):
        small = jax.make_jaxpr(jax.grad(run))(p, batch(64, d))
        big = jax.make_jaxpr(jax.grad(run))(
            p, jax.ShapeDtypeStruct((2**20, d), jnp.float32)
        )
    assert ("float32", "float32") in dot_dtypes(small.jaxpr)
    assert dot_dtypes(big.jaxpr) and all(
        t == ("bfloat16", "bfloat16") for t in dot_dtypes(big.jaxpr)
    )
    # The report runs the plan as autocast does: at the shapes it is given.
    report = jxs.diagnostics.autocast_report(mlp, jnp.bfloat16, plan=plan)
    rows = jax.ShapeDtypeStruct((2**20, d), jnp.float32)
    assert dict(report(p, rows).by_primitive["dot_general"]) == {"bfloat16": 2}
    # And it runs, under jit.
    with jax.numpy_dtype_promotion("strict"):
        g = jax.jit(jax.grad(run))(p, batch(64, d))
    assert g["w1"].dtype == jnp.float32


def test_the_default_call_at_gpt2_small_width_runs_8192_rows_in_16_bits():
    """The literal default call: 64 calibration rows of a d-768, ffn-3072 MLP
    choose float32 everywhere (launch-bound); the 8192-row step runs no float32
    site."""
    p = mlp_params(768, 3072)
    plan = jxs.plan_precision(mlp, jnp.bfloat16)(p, batch(64, 768))
    assert F.FLOAT32 in plan.formats().values()
    run = jxs.autocast(mlp, jnp.bfloat16, plan=plan)
    with jax.numpy_dtype_promotion("strict"):
        jaxpr = jax.make_jaxpr(jax.grad(run))(
            p, jax.ShapeDtypeStruct((8192, 768), jnp.float32)
        )
    dots = dot_dtypes(jaxpr.jaxpr)
    assert len(dots) >= 2 and all(t == ("bfloat16", "bfloat16") for t in dots)


# ------------------------------------------------- issue 48 item 7: stored once


def test_a_plan_stores_each_site_once_and_derives_its_sites(bf16_plan):
    import dataclasses

    names = [f.name for f in dataclasses.fields(jxp.Plan)]
    assert "measures" in names and "choices" in names and "sites" not in names
    for s, m, (fmt, why) in zip(
        bf16_plan.sites, bf16_plan.measures, bf16_plan.choices, strict=True
    ):
        assert (s.site, s.shape, s.format, s.why) == (m.site, m.shape, fmt, why)
        assert s.error == m.errors[fmt]
        assert s.seconds == m.seconds(fmt, bf16_plan.cost)
    with pytest.raises(ValueError, match=r"`choices` must give one \(format, why\)"):
        dataclasses.replace(bf16_plan, choices=bf16_plan.choices[:1])


def test_equal_plans_give_equal_rules(bf16_plan):
    again = jxp.Plan.from_json(bf16_plan.to_json())
    assert again is not bf16_plan
    assert bf16_plan.autocast_rule() == again.autocast_rule()
    assert hash(bf16_plan.autocast_rule()) == hash(again.autocast_rule())
