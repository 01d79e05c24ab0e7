"""The noise budget (issue 49 item 2): the sensor estimates each site's
minibatch gradient noise from two halves of a batch's rows, scores each
format's gradient error as a fraction of it, and the default budget admits a
format where that error is within a tenth of the noise: float8 where the noise
is large, 16 bits (or more) where it is tiny. The old budgets still work; a
noise budget without noise figures is refused, naming what to do."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale.precision as jxp

pytestmark = [pytest.mark.core]

F = jxp.Format
TOP, NEXT = "(top level)", "(top level)#1"
# Shapes at which the speed model prices float8 faster than 16 bits on an H200.
BIG = {TOP: (16384, 4096, 28672), NEXT: (16384, 28672, 4096)}


def normal(i, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(i), shape, jnp.float32)


def linear(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@pytest.mark.parametrize("rows", [32, 33])  # equal halves, and 16 against 17
def test_the_noise_estimate_matches_the_variance_across_batches(rows):
    """A linear model's per-batch gradients, over 150 batches: the variance of
    the batch gradient (summed over its elements) is what the sensor's noise
    estimates from each batch alone, within 20%."""
    w, w_true = normal(0, (12, 3)), normal(1, (12, 3))
    batches = []
    for i in range(150):
        x = normal(100 + i, (rows, 12))
        batches.append((x, x @ w_true + normal(1000 + i, (rows, 3), 0.5)))
    xs, ys = (jnp.stack(a) for a in zip(*batches, strict=True))
    grads = jax.jit(jax.vmap(jax.grad(linear), in_axes=(None, 0, 0)))(w, xs, ys)
    variance = float(jnp.sum(jnp.var(grads, axis=0, ddof=1)))
    sensor = jxp.Sensor(linear, jnp.bfloat16, formats={F.HALF})
    for x, y in batches:
        sensor.update(w, x, y)
    ref = sensor.stats()[TOP]["reference"]
    assert ref["halves"] == 1.0  # every batch split (the mean over batches)
    assert ref["noise"] == pytest.approx(variance, rel=0.2)


def mlp(p, x, y):
    h = jnp.tanh(x @ p["up"])
    return jnp.mean((h @ p["down"] - y) ** 2)


def mlp_params():
    return {"up": normal(1, (64, 256), 1 / 8), "down": normal(2, (256, 64), 1 / 16)}


def test_the_default_budget_takes_float8_where_the_noise_is_large():
    """16 rows with noisy targets: float8's gradient error is a small fraction
    of the noise, and at shapes where float8 is faster (an H200's figures) the
    default plan takes it at both sites. 1024 rows that are nearly alike: the
    noise is tiny, float8's error many times the budget, and the plan stays in
    16 bits. The 16-bit budget never takes float8."""
    p = mlp_params()
    noisy = jxp.Sensor(mlp, jnp.bfloat16)
    noisy.update(p, normal(3, (16, 64)), normal(4, (16, 64), 3.0))
    plan = noisy.plan(cost="H200")
    assert plan.budget_in == "noise" and plan.budget == 0.1
    big = plan.at(BIG)
    assert big.formats() == {TOP: F.FLOAT8, NEXT: F.FLOAT8}
    assert big.within_budget and big.spent == big.noise < 0.1
    assert big.sites[0].why.startswith("float8: 0.73x the 16-bit time, noise ")
    assert "16-bit (1.00x)" in big.sites[0].why and "no faster" in big.sites[0].why
    old = noisy.plan(cost="H200", budget="16-bit").at(BIG)
    assert F.FLOAT8 not in old.formats().values() and old.budget_in == "error"

    quiet = jxp.Sensor(mlp, jnp.bfloat16)
    alike = normal(5, (1, 64)) + normal(3, (1024, 64), 0.2)
    quiet.update(p, alike, jnp.full((1024, 64), 2.0, jnp.float32))
    measures = quiet.measures()
    assert all(m.noise[F.FLOAT8] > 0.1 > m.noise[F.HALF] for m in measures[1:])
    big = quiet.plan(cost="H200").at(BIG)
    assert big.formats() == {TOP: F.HALF, NEXT: F.HALF}
    why = big.sites[1].why
    assert "float8 (0.73x, noise " in why and "would take the plan over it" in why
    # A smaller fraction is a tighter budget.
    tight = quiet.plan(cost="H200", budget=jxp.NoiseBudget(1e-6)).at(BIG)
    assert set(tight.formats().values()) == {F.FLOAT32}


def test_a_noise_budget_by_hand_and_its_plan_saved():
    measures = [
        jxp.SiteMeasure(
            name,
            BIG[name],
            (2, 4),
            {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 3e-3},
            noise={F.FLOAT32: 0.0, F.HALF: 1e-5, F.FLOAT8: share},
        )
        for name, share in ((TOP, 0.04), (NEXT, 0.07))
    ]
    plan = jxp.solve(measures, cost="H200")  # the default: NoiseBudget(0.1)
    assert plan == jxp.solve(measures, cost="H200", budget=jxp.NoiseBudget())
    assert plan == jxp.solve(measures, cost="H200", budget="noise")
    # Room for one site in float8: the one whose share is smaller costs as much.
    assert plan.formats() == {TOP: F.FLOAT8, NEXT: F.HALF}
    assert plan.spent == pytest.approx(0.04 + 1e-5) and plan.error == 3e-3 + 1e-4
    lines = str(plan).splitlines()
    assert lines[2] == (
        "  noise 0.04, within the budget 0.1 (fractions of the minibatch gradient "
        "noise)"
    )
    assert lines[5].split()[-2:] == ["noise", "why"]
    assert jxp.Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["budget_in"] == "noise"
    with pytest.warns(jxp.PlanBudgetWarning, match=r"measured noise 0.11 > budget"):
        plan.replace(NEXT, F.FLOAT8)
    # A plan saved before noise figures (version 2) loads, budgeted in errors.
    doc = json.loads(jxp.solve(measures, cost="H200", budget="16-bit").to_json())
    del doc["budget_in"]
    for entry in doc["sites"]:
        del entry["noise"], entry["kind"]
    doc["version"] = 2
    old = jxp.Plan.from_json(json.dumps(doc))
    assert old.budget_in == "error" and old.noise is None
    with pytest.raises(
        ValueError,
        match=r"needs each site's gradient-noise figures .*2 of 2 sites have none "
        r"\(first '\(top level\)'\).*Measure again with a `jxp?.*Sensor`, or give "
        r"`budget='16-bit'` or a number",
    ):
        jxp.solve(old.measures, cost="H200")


@pytest.mark.parametrize(
    "fraction, error, match",
    [
        (-0.1, ValueError, r"`fraction` must be finite and > 0 .*got -0.1\."),
        (0.0, ValueError, r"`fraction` must be finite and > 0 .*got 0.0\."),
        (math.inf, ValueError, r"`fraction` must be finite and > 0 .*got inf\."),
        (math.nan, ValueError, r"`fraction` must be finite and > 0 .*got nan\."),
        ("0.1", TypeError, r"`fraction` must be a number .*got str '0.1'\."),
        (True, TypeError, r"`fraction` must be a number .*got bool True\."),
    ],
)
def test_a_bad_fraction_is_refused_naming_it(fraction, error, match):
    with pytest.raises(error, match=match):
        jxp.NoiseBudget(fraction)


def test_noise_figures_are_checked_against_the_errors():
    with pytest.raises(ValueError, match=r"`noise` must hold the formats of `errors`"):
        jxp.SiteMeasure("a", (8, 8, 8), (4, 4), {F.HALF: 1e-4}, noise={F.FLOAT8: 0.1})
    with pytest.raises(ValueError, match=r"inf exactly where `errors` is"):
        jxp.SiteMeasure("a", (8, 8, 8), (4, 4), {F.HALF: math.inf}, noise={F.HALF: 0.1})
    with pytest.raises(ValueError, match=r"`noise\[Format.HALF\]` must be a non-neg"):
        jxp.SiteMeasure("a", (8, 8, 8), (4, 4), {F.HALF: 1e-4}, noise={F.HALF: -1})


def test_one_row_has_no_noise_to_measure_and_the_noise_budget_says_so():
    p = mlp_params()
    sensor = jxp.Sensor(mlp, jnp.bfloat16, formats={F.HALF})
    sensor.update(p, normal(3, (1, 64)), normal(4, (1, 64)))
    assert all(m.noise is None for m in sensor.measures())
    assert "every site met a single row" in sensor.noise_problem()
    with pytest.raises(
        ValueError,
        match=r"`budget` 'noise' is relative to the minibatch gradient noise, but no "
        r"site could measure it.*single row\. Give calibration batches of more "
        r"rows.*or use `budget='16-bit'` or a number",
    ):
        sensor.plan(cost="H100")
    with pytest.raises(ValueError, match=r"Give calibration batches of more rows"):
        jxp.plan_precision(mlp, jnp.bfloat16, cost="H100")(
            p, normal(3, (1, 64)), normal(4, (1, 64))
        )
    plan = sensor.plan(cost="H100", budget="16-bit")  # the old budget works
    assert plan.budget_in == "error" and plan.within_budget


def test_more_steps_is_the_noise_scale_arithmetic():
    budget = jxp.NoiseBudget()
    assert budget.more_steps() == pytest.approx(1.05)  # B = B_noise
    assert budget.more_steps(1e9) == pytest.approx(1.1)  # B << B_noise: 1 + eps
    assert budget.more_steps(0.0) == 1.0  # B >> B_noise: noise does not matter
    assert np.isclose(jxp.NoiseBudget(0.2).more_steps(3.0), (1 + 1.2 * 3) / 4)
