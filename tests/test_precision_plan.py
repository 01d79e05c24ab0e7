"""The precision plan and its exact solver (issue 41, item 3): ``jaxscale.precision``.

The solver is checked against brute force on random small instances, and against a
plain Pareto dynamic programme (no bounds) on larger ones; the plan's text, JSON,
edits and errors are checked as a user meets them.
"""

import itertools
import json
import math
import random
import re

import pytest

import jaxscale.precision as jxp
from jaxscale._cost import device_cost
from jaxscale._speed import site_seconds
from jaxscale.precision._measure import in_order

pytestmark = [pytest.mark.unit]

F = jxp.Format
PRECISION = (F.FLOAT32, F.HALF_WIDE, F.HALF, F.FLOAT8_ROWWISE, F.FLOAT8)
H100, _ = device_cost("H100")

# Shapes where float8 pays and where it does not (on the H100's figures).
BIG = (16384, 4096, 28672)  # float8 0.82x the 16-bit time
MID = (16384, 4096, 6144)  # float8 0.93x
SMALL = (8192, 768, 3072)  # float8 1.83x: never chosen over 16 bits


def site(name, shape=BIG, errors=None, nbytes=(2, 4), notes=None):
    errors = errors or {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 1e-3}
    return jxp.SiteMeasure(name, shape, nbytes, errors, notes or {})


def added(errors):
    """Error scores added one at a time in site order, as a plan adds them
    (``sum`` compensates on Python 3.12)."""
    total = 0.0
    for e in errors:
        total += e
    return total


def ps(fmt, m, cost=H100):
    return round(site_seconds(fmt, *m.shape, *m.operand_bytes, cost) * 1e12)


def candidates(m, allowed=frozenset(PRECISION)):
    return [
        f
        for f in PRECISION
        if f in allowed and f in m.errors and math.isfinite(m.errors[f])
    ]


def brute_force(measures, budget, allowed=frozenset(PRECISION)):
    """The best plan by enumeration: least time (picoseconds), then least error
    (added in site order), then the more precise format site by site."""
    options = [
        [(f, ps(f, m), m.errors[f]) for f in candidates(m, allowed)] for m in measures
    ]
    best = None
    for combo in itertools.product(*options):
        error = added(e for _, _, e in combo)
        if error > budget:
            continue
        key = (
            sum(t for _, t, _ in combo),
            error,
            [PRECISION.index(f) for f, _, _ in combo],
        )
        if best is None or key < best[0]:
            best = (key, [f for f, _, _ in combo])
    return None if best is None else best[1]


def greedy(measures, budget):
    """Every site at its fastest format, then the least time per error saved
    back to more precise formats until the budget holds: not exact."""
    pick = {m.site: min(candidates(m), key=lambda f: ps(f, m)) for m in measures}
    while added(m.errors[pick[m.site]] for m in measures) > budget:
        moves = [
            (
                (ps(f, m) - ps(pick[m.site], m))
                / (m.errors[pick[m.site]] - m.errors[f]),
                m.site,
                f,
            )
            for m in measures
            for f in candidates(m)
            if m.errors[f] < m.errors[pick[m.site]]
        ]
        _, name, f = min(moves)
        pick[name] = f
    return [pick[m.site] for m in measures]


def random_instance(rng, n, shapes=(BIG, MID, SMALL)):
    levels = [0.0, 1e-4, 2e-4, 5e-4, 1e-3, 3e-3, math.inf]
    measures = []
    for i in range(n):
        errors = {}
        for f in PRECISION:
            if rng.random() < 0.85:
                errors[f] = (
                    rng.choice(levels) if rng.random() < 0.5 else rng.random() * 3e-3
                )
        errors = errors or {F.HALF: 1e-4}
        nbytes = (rng.choice([2, 4]), rng.choice([2, 4]))
        measures.append(jxp.SiteMeasure(f"s{i}", rng.choice(shapes), nbytes, errors))
    return measures


def realistic(n, seed):
    """A model's sites: shapes of a few kinds, errors growing from float32 to
    float8 by site-dependent factors."""
    rng = random.Random(seed)
    measures = []
    for i in range(n):
        shape = (
            rng.choice([4096, 8192, 16384, 32768]),
            rng.choice([1024, 2048, 4096, 8192, 14336]),
            rng.choice([1024, 4096, 8192, 16384, 28672]),
        )
        u = math.exp(rng.gauss(0, 1))
        scale = {
            F.HALF_WIDE: 5e-5,
            F.HALF: 1e-4,
            F.FLOAT8_ROWWISE: 8e-4,
            F.FLOAT8: 2e-3,
        }
        errors = {F.FLOAT32: 0.0}
        errors.update(
            {f: s * u * math.exp(rng.gauss(0, 0.4)) for f, s in scale.items()}
        )
        measures.append(
            jxp.SiteMeasure(f"GPT/block_{i // 4}/dense_{i % 4}", shape, (2, 4), errors)
        )
    return measures


# --------------------------------------------------------------------------- #
# The optimum
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("batch", range(4))
def test_solve_is_the_brute_force_optimum(batch):
    found_infeasible = 0
    differs_from_greedy = 0
    for seed in range(batch * 40, batch * 40 + 40):
        rng = random.Random(seed)
        measures = random_instance(rng, 6)
        if any(not candidates(m) for m in measures):
            with pytest.raises(ValueError, match="fails in every allowed format"):
                jxp.solve(measures, cost=H100, budget=math.inf)
            continue
        least = added(min(m.errors[f] for f in candidates(m)) for m in measures)
        budget = rng.choice([least * 0.5, least, least + rng.random() * 6e-3, math.inf])
        expected = brute_force(measures, budget)
        if expected is None:
            found_infeasible += 1
            with pytest.raises(ValueError, match="no plan meets `budget`"):
                jxp.solve(measures, cost=H100, budget=budget)
            continue
        plan = jxp.solve(measures, cost=H100, budget=budget)
        assert list(plan.formats().values()) == expected, seed
        assert plan.within_budget and plan.budget == budget
        differs_from_greedy += greedy(measures, budget) != expected
    assert differs_from_greedy, "the instances do not tell exact from greedy"


def test_solve_matches_an_unbounded_pareto_programme_on_larger_instances():
    """25 sites: too many to enumerate; a plain Pareto programme (no bounds, no
    restarts) is the reference for the solver's bounds."""
    for seed in range(6):
        measures = realistic(25, seed)
        budget = [added(m.errors[F.HALF] for m in measures), 0.01, 0.03][seed % 3]
        front = [(0, 0.0, ())]  # time, error, formats: every non-dominated prefix
        for m in measures:
            grown = [
                (t + ps(f, m), e + m.errors[f], (*fs, f))
                for t, e, fs in front
                for f in candidates(m)
                if e + m.errors[f] <= budget
            ]
            grown.sort(key=lambda p: (p[0], [PRECISION.index(f) for f in p[2]]))
            front, least = [], math.inf
            for p in grown:
                if p[1] < least:
                    front.append(p)
                    least = p[1]
        best = min(
            front, key=lambda p: (p[0], p[1], [PRECISION.index(f) for f in p[2]])
        )
        plan = jxp.solve(measures, cost=H100, budget=budget)
        assert list(plan.formats().values()) == list(best[2]), seed


def test_300_sites_solve_within_budget_and_beat_the_greedy_plan():
    """A real model's site count; how long it takes is measured apart
    (docs/precision.md), not asserted here."""
    measures = realistic(300, 1)
    half = added(m.errors[F.HALF] for m in measures)
    for budget in ("16-bit", half / 2, half * 2, math.inf):
        plan = jxp.solve(measures, cost=H100, budget=budget)
        assert plan.within_budget
        limit = half if budget == "16-bit" else budget
        fast = greedy(measures, limit)
        assert plan.seconds <= sum(
            site_seconds(f, *m.shape, *m.operand_bytes, H100)
            for f, m in zip(fast, measures, strict=True)
        )


# --------------------------------------------------------------------------- #
# Ties, inf, budgets, allowed
# --------------------------------------------------------------------------- #


def test_ties_go_to_the_higher_precision_site_by_site():
    """Two identical sites, room for one in float8: the first stays in 16 bits."""
    a, b = site("a"), site("b")
    plan = jxp.solve([a, b], cost=H100, budget=1e-3 + 1e-4)
    assert plan.formats() == {"a": F.HALF, "b": F.FLOAT8}
    same = [site(n, errors={F.HALF: 1e-4, F.FLOAT8_ROWWISE: 1e-4}) for n in "xy"]
    plan = jxp.solve(same, cost=H100, budget=math.inf)
    assert set(plan.formats().values()) == {F.HALF}  # faster and as accurate


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_ties_in_time_go_to_the_smaller_error_first(order):
    """Same shapes, so the same time whichever one runs in float8: the one whose
    float8 error is smaller does, wherever it stands."""
    low = site("low", errors={F.HALF: 1e-4, F.FLOAT8: 2e-4})
    high = site("high", errors={F.HALF: 1e-4, F.FLOAT8: 9e-4})
    measures = [[low, high][i] for i in order]
    plan = jxp.solve(measures, cost=H100, budget=1.05e-3)  # room for one
    assert plan.formats() == {"low": F.FLOAT8, "high": F.HALF}


def test_a_format_whose_range_fails_is_never_chosen():
    m = site(
        "down",
        errors={F.FLOAT32: 0.0, F.HALF: math.inf, F.FLOAT8: math.inf},
        notes={F.HALF: "max |x| 9.1e4 overflows float16"},
    )
    plan = jxp.solve([m], cost=H100, budget=math.inf)
    assert plan.formats() == {"down": F.FLOAT32}
    assert plan.sites[0].why.endswith(" and float8 (0.82x) fail here")
    assert "max |x| 9.1e4 overflows float16" in plan.sites[0].why


def test_a_site_that_fails_in_every_format_is_named():
    ok = site("ok")
    bad = site(
        "GPT/head",
        errors={F.HALF: math.inf, F.FLOAT8: math.inf},
        notes={F.HALF: "logits overflow float16"},
    )
    with pytest.raises(
        ValueError,
        match=r"site 'GPT/head' fails in every allowed format.*logits overflow",
    ):
        jxp.solve([ok, bad], cost=H100, budget=math.inf)
    with pytest.raises(
        ValueError, match=r"site 'ok' has no error measured in an allowed format"
    ):
        jxp.solve([ok], cost=H100, budget=1.0, allowed={F.HALF_WIDE})


def test_an_infeasible_budget_says_the_smallest_error_reachable():
    measures = [site("a", errors={F.HALF: 1e-4, F.FLOAT8: 1e-3}), site("b")]
    with pytest.raises(
        ValueError,
        match=r"no plan meets `budget` 5.0e-5: the smallest total error the allowed "
        r"formats reach is 1.0e-4.*Raise `budget`",
    ):
        jxp.solve(measures, cost=H100, budget=5e-5)
    plan = jxp.solve(measures, cost=H100, budget=1e-4)  # exactly reachable
    assert plan.formats() == {"a": F.HALF, "b": F.FLOAT32}


@pytest.mark.parametrize("name", ["16-bit", "bfloat16"])
def test_the_16_bit_budget_is_the_sum_of_the_16_bit_errors(name):
    measures = [
        site("qkv", MID, {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 3e-3}),
        site("up", BIG, {F.FLOAT32: 0.0, F.HALF: 2e-4, F.FLOAT8: 1e-4}),
        site("down", BIG, {F.FLOAT32: 0.0, F.HALF: 3e-4, F.FLOAT8: 3e-4}),
    ]
    plan = jxp.solve(measures, cost=H100, budget=name)
    assert plan.budget == 1e-4 + 2e-4 + 3e-4
    assert plan.formats() == {"qkv": F.HALF, "up": F.FLOAT8, "down": F.FLOAT8}
    assert plan.error <= plan.budget
    assert plan == jxp.solve(measures, cost=H100, budget=1e-4 + 2e-4 + 3e-4)


def test_the_16_bit_budget_needs_every_site_measured_in_16_bits():
    with pytest.raises(ValueError, match=r"site 'b' has no 16-bit error"):
        jxp.solve(
            [site("a"), site("b", errors={F.FLOAT32: 0.0})], cost=H100, budget="16-bit"
        )
    inf = site("c", errors={F.HALF: math.inf})
    with pytest.raises(ValueError, match=r"site 'c' fails in 16 bits"):
        jxp.solve([inf], cost=H100, budget="16-bit")
    # Where 16 bits fails, the budget counts the nearest more precise format.
    wide = site("d", errors={F.FLOAT32: 0.0, F.HALF_WIDE: 2e-4, F.HALF: math.inf})
    plan = jxp.solve([wide, site("a")], cost=H100, budget="16-bit")
    assert plan.budget == in_order([2e-4, site("a").errors[F.HALF]])
    assert plan.formats()["d"] in (F.HALF_WIDE, F.FLOAT32)
    with pytest.raises(
        ValueError,
        match=r"`budget` must be a NoiseBudget, a number or one of "
        r"\['noise', '16-bit', 'bfloat16'\].*got 'fp8'",
    ):
        jxp.solve([site("a")], cost=H100, budget="fp8")


def test_allowed_restricts_the_formats():
    measures = realistic(6, 3)
    half = added(m.errors[F.HALF] for m in measures)
    for allowed in (
        {F.FLOAT32},
        {F.HALF, F.HALF_WIDE},
        {F.FLOAT8, F.FLOAT8_ROWWISE, F.FLOAT32},
    ):
        for budget in (math.inf, half):
            plan = jxp.solve(measures, cost=H100, budget=budget, allowed=allowed)
            assert set(plan.formats().values()) <= allowed
            assert list(plan.formats().values()) == brute_force(
                measures, budget, allowed
            )
    everything = jxp.solve(measures, cost=H100, budget=math.inf)
    assert F.FLOAT8 in everything.formats().values()
    plan = jxp.solve(measures, cost=H100, budget=math.inf, allowed=[F.HALF, F.FLOAT32])
    assert set(plan.formats().values()) == {F.HALF}


def test_a_kind_without_figures_takes_the_h100s_and_says_so():
    plan = jxp.solve([site("a")], cost="cpu", budget="16-bit")
    assert plan.device == "cpu, as NVIDIA H100 SXM"
    assert plan.cost == H100
    h200 = jxp.solve([site("a")], cost="NVIDIA H200", budget="16-bit")
    assert h200.device == "NVIDIA H200" and h200.seconds < plan.seconds


# --------------------------------------------------------------------------- #
# The plan: text, JSON, edits, hashing
# --------------------------------------------------------------------------- #


def three_sites():
    return [
        site("GPT/block_0/qkv", MID, {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 3e-3}),
        site("GPT/block_0/mlp_up", BIG, {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 1e-4}),
        site(
            "GPT/block_0/mlp_down",
            (16384, 14336, 4096),
            {F.FLOAT32: 0.0, F.HALF: 2e-4, F.FLOAT8: math.inf},
            notes={F.FLOAT8: "amax beyond e4m3 after scaling"},
        ),
    ]


def test_the_plan_prints_a_table():
    plan = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == (
        "precision plan: 3 sites on NVIDIA H100 SXM, measured in an unknown dtype"
    )
    assert re.fullmatch(
        r"  predicted 29.2 ms: 0.90x the 16-bit time \(32.7 ms\)", lines[1]
    )
    assert lines[2] == "  error 4.0e-4, within the budget 4.0e-4"
    assert lines[3] == (
        "  formats for the shapes below: the calibration batch's (a step of other "
        "shapes is re-solved at its own)"
    )
    assert lines[5].split() == [
        "site",
        "m",
        "x",
        "k",
        "x",
        "n",
        "format",
        "time",
        "error",
        "why",
    ]
    up = next(line for line in lines if "mlp_up" in line)
    assert "16384 x 4096 x 28672" in up and "float8" in up and "15.5 ms" in up
    # Each other format's reason: over the budget, its range fails, no faster.
    assert up.endswith(
        "float8: 0.82x the 16-bit time, error 1.0e-4 within the budget; "
        "16-bit (1.00x) and float32 (1.93x) no faster"
    )
    qkv = next(line for line in lines if "qkv" in line)
    assert qkv.endswith(
        "; float8 (0.93x, error 0.003) here would take the plan over it"
        "; float32 (2.03x) no faster"
    )
    down = next(line for line in lines if "mlp_down" in line)
    assert down.endswith(
        "float8 (0.85x, amax beyond e4m3 after scaling) fails here"
        "; float32 (2.09x) no faster"
    )
    with pytest.warns(jxp.PlanBudgetWarning):
        over = plan.replace("GPT/block_0/qkv", F.FLOAT8)
    assert "  error 0.0033, OVER the budget 4.0e-4" in str(over).splitlines()


def test_replace_is_the_users_edit():
    plan = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    with pytest.warns(jxp.PlanBudgetWarning):
        edited = plan.replace("GPT/block_0/qkv", F.FLOAT8)
    assert plan.formats()["GPT/block_0/qkv"] is F.HALF  # unchanged
    assert edited.formats() == {**plan.formats(), "GPT/block_0/qkv": F.FLOAT8}
    s = edited.sites[0]
    assert s.why == "float8: chosen by the user; 0.93x the 16-bit time, error 0.003"
    assert s.error == 3e-3
    assert s.seconds == site_seconds(F.FLOAT8, *MID, 2, 4, H100)
    assert edited.seconds < plan.seconds and edited.half_seconds == plan.half_seconds
    assert edited.error == 3e-3 + 1e-4 + 2e-4
    assert not edited.within_budget and edited.budget == plan.budget
    back = edited.replace("GPT/block_0/qkv", F.HALF)
    assert back.formats() == plan.formats() and back.seconds == plan.seconds
    assert back != plan  # the why says the user chose it
    assert back.sites[0].why.startswith("16-bit: chosen by the user")


def test_replace_refuses_what_it_cannot_price():
    plan = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    with pytest.raises(
        ValueError,
        match=r"`site` must be a site of the plan, got 'GPT/qkv'; its sites are "
        r"\['GPT/block_0/qkv'",
    ):
        plan.replace("GPT/qkv", F.HALF)
    with pytest.raises(
        ValueError,
        match=r"`fmt` must be a format measured at site 'GPT/block_0/qkv'.*got "
        r"Format.HALF_WIDE.*Measure it first",
    ):
        plan.replace("GPT/block_0/qkv", F.HALF_WIDE)
    with pytest.raises(
        ValueError,
        match=r"fails at site 'GPT/block_0/mlp_down': its error is inf "
        r"\(amax beyond e4m3",
    ):
        plan.replace("GPT/block_0/mlp_down", F.FLOAT8)
    with pytest.raises(TypeError, match=r"`fmt` must be a Format .*got str 'float8'"):
        plan.replace("GPT/block_0/qkv", "float8")


def test_json_round_trips_exactly():
    plan = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    with pytest.warns(jxp.PlanBudgetWarning):
        edited = plan.replace("GPT/block_0/qkv", F.FLOAT8)
    for p in (
        plan,
        edited,
        jxp.solve(realistic(20, 4), cost="NVIDIA H200", budget=math.inf),
    ):
        text = p.to_json()
        json.loads(text)  # standard JSON: no Infinity
        assert "Infinity" not in text
        back = jxp.Plan.from_json(text)
        assert back == p and hash(back) == hash(p)
        assert back.to_json() == text and str(back) == str(p)
    doc = json.loads(plan.to_json())
    assert doc["kind"] == "jaxscale.precision.Plan" and doc["version"] == 4
    assert doc["sites"][2]["errors"]["float8"] == "inf"


def _edited(plan, edit):
    doc = json.loads(plan.to_json())
    edit(doc)
    return json.dumps(doc)


def test_bad_json_raises_clearly():
    plan = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    with pytest.raises(ValueError, match=r"`text` must be a plan's JSON text"):
        jxp.Plan.from_json("{not json")
    with pytest.raises(
        ValueError,
        match=r"must be the JSON of a jaxscale.precision.Plan .*got kind 'list'",
    ):
        jxp.Plan.from_json("[]")
    with pytest.raises(
        ValueError,
        match=r"reads plans of versions 1 to 4, got version 5: load it with the "
        r"jaxscale that wrote it",
    ):
        jxp.Plan.from_json(_edited(plan, lambda d: d.update(version=5, extra=1)))
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['comment'\]"):
        jxp.Plan.from_json(_edited(plan, lambda d: d.update(comment="mine")))
    with pytest.raises(
        ValueError, match=r"a site must have the fields .*missing \['why'\]"
    ):
        jxp.Plan.from_json(_edited(plan, lambda d: d["sites"][0].pop("why")))
    with pytest.raises(
        ValueError, match=r"not a valid plan: 'fp8' is not a valid Format"
    ):
        jxp.Plan.from_json(_edited(plan, lambda d: d["sites"][0].update(format="fp8")))
    with pytest.raises(
        ValueError, match=r"not a valid plan: .*must be a non-negative number"
    ):
        jxp.Plan.from_json(
            _edited(plan, lambda d: d["sites"][0]["errors"].update({"16-bit": -1}))
        )
    with pytest.raises(
        ValueError, match=r"planned in Format.HALF_WIDE, which it has no error for"
    ):
        jxp.Plan.from_json(
            _edited(
                plan, lambda d: d["sites"][0].update(format="16-bit, float32 result")
            )
        )
    with pytest.raises(
        ValueError, match=r"a time or figure must be a number, got '3.35'"
    ):
        jxp.Plan.from_json(_edited(plan, lambda d: d["cost"].update(hbm_tbs="3.35")))
    with pytest.raises(
        ValueError, match=r"a time or figure must be a number, got None"
    ):
        jxp.Plan.from_json(_edited(plan, lambda d: d["sites"][1].update(seconds=None)))
    with pytest.raises(ValueError, match=r"`sites` must name at least one site"):
        jxp.Plan.from_json(_edited(plan, lambda d: d.update(sites=[])))
    with pytest.raises(
        ValueError, match=r"`sites` must name at least one site, each once"
    ):
        jxp.Plan.from_json(_edited(plan, lambda d: d["sites"].append(d["sites"][0])))


def test_plans_and_measures_are_hashable_values():
    plan = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    again = jxp.solve(three_sites(), cost="H100", budget="16-bit")
    assert plan == again and hash(plan) == hash(again)
    assert {plan: 1}[again] == 1
    a = jxp.SiteMeasure("a", BIG, (2, 4), {F.HALF: 1e-4, F.FLOAT8: 1e-3})
    b = jxp.SiteMeasure("a", BIG, (2, 4), {F.FLOAT8: 1e-3, F.HALF: 1e-4})
    assert a == b and hash(a) == hash(b)
    assert list(b.errors) == [F.HALF, F.FLOAT8]  # most precise first
    with pytest.raises(TypeError):
        a.errors[F.HALF] = 0.0  # read-only
    with pytest.raises(AttributeError):
        plan.budget = 1.0  # frozen


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(site=""), ValueError, r"`site` must be a non-empty string .*got ''"),
        (dict(site=3), TypeError, r"`site` must be a non-empty string .*got 3"),
        (
            dict(shape=(1, 2)),
            TypeError,
            r"SiteMeasure 'a': `shape` must be three positive integers .*got \(1, 2\)",
        ),
        (
            dict(shape=(1, 0, 2)),
            ValueError,
            r"`shape` must be three positive integers .*got \(1, 0, 2\)",
        ),
        (
            dict(shape=(1.0, 2, 2)),
            TypeError,
            r"`shape` must be three positive integers",
        ),
        (
            dict(operand_bytes=(3, 4)),
            ValueError,
            r"`operand_bytes` must be two byte counts .*one of 1, 2, 4, 8 "
            r".*got \(3, 4\)",
        ),
        (
            dict(errors={}),
            ValueError,
            r"`errors` must hold at least one format's error score",
        ),
        (
            dict(errors=[1e-4]),
            TypeError,
            r"`errors` must map a Format to a value, got list",
        ),
        (
            dict(errors={"16-bit": 1e-4}),
            TypeError,
            r"the keys of `errors` must be Formats \(Format.FLOAT32, .*got '16-bit'",
        ),
        (
            dict(errors={F.HALF: -1e-4}),
            ValueError,
            r"`errors\[Format.HALF\]` must be a non-negative number \(math.inf "
            r"where the format's range fails\), got -0.0001",
        ),
        (
            dict(errors={F.HALF: math.nan}),
            ValueError,
            r"`errors\[Format.HALF\]` must be a non-negative number",
        ),
        (
            dict(errors={F.HALF: True}),
            TypeError,
            r"`errors\[Format.HALF\]` must be a non-negative number, got bool",
        ),
        (
            dict(errors={F.HALF: "small"}),
            TypeError,
            r"must be a non-negative number, got str 'small'",
        ),
        (
            dict(notes={F.FLOAT8: "x"}),
            ValueError,
            r"`notes` must be about measured formats, got notes for Format.FLOAT8",
        ),
        (
            dict(notes={F.HALF: 3}),
            TypeError,
            r"`notes\[Format.HALF\]` must be a string",
        ),
    ],
)
def test_bad_site_measures_raise_naming_the_argument(kwargs, error, match):
    args = dict(
        site="a", shape=BIG, operand_bytes=(2, 4), errors={F.HALF: 1e-4}, notes={}
    )
    with pytest.raises(error, match=match):
        jxp.SiteMeasure(**{**args, **kwargs})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(measures="abc"),
            TypeError,
            r"`measures` must be a sequence of SiteMeasure, got str",
        ),
        (
            dict(measures=[]),
            ValueError,
            r"`measures` must hold at least one SiteMeasure",
        ),
        (
            dict(measures=[site("a"), {"site": "b"}]),
            TypeError,
            r"`measures\[1\]` must be a SiteMeasure, got dict",
        ),
        (
            dict(measures=[site("a"), site("a")]),
            ValueError,
            r"names the site 'a' twice.*'a#1'",
        ),
        (
            dict(cost=3.35),
            TypeError,
            r"`cost` must be a DeviceCost or a device kind .*got float 3.35",
        ),
        (
            dict(budget=-1.0),
            ValueError,
            r"`budget` must be a non-negative number \(math.inf: no limit\), got -1.0",
        ),
        (dict(budget=math.nan), ValueError, r"`budget` must be a non-negative number"),
        (
            dict(budget=True),
            TypeError,
            r"`budget` must be a NoiseBudget, a number or one of "
            r"\['noise', '16-bit', 'bfloat16'\], got bool",
        ),
        (
            dict(budget=None),
            TypeError,
            r"`budget` must be a NoiseBudget, a number .*got NoneType",
        ),
        (
            dict(allowed=F.HALF),
            TypeError,
            r"`allowed` must be None \(every format\) or a set of Formats",
        ),
        (
            dict(allowed={"float8"}),
            TypeError,
            r"`allowed` must be a set of Formats .*got 'float8'",
        ),
        (dict(allowed=set()), ValueError, r"`allowed` must hold at least one format"),
    ],
)
def test_bad_solve_arguments_raise_naming_the_argument(kwargs, error, match):
    args = dict(measures=[site("a")], cost=H100, budget=1.0)
    args.update(kwargs)
    measures = args.pop("measures")
    with pytest.raises(error, match=match):
        jxp.solve(measures, **args)


def test_a_site_run_several_times_a_step_costs_as_many_runs():
    one = site("a")
    four = jxp.SiteMeasure("a", BIG, (2, 4), one.errors, runs=4)
    for f in one.errors:
        assert four.seconds(f, H100) == 4 * one.seconds(f, H100)
    plan = jxp.solve([four, site("b")], cost=H100, budget="16-bit")
    assert "(x4)" in str(plan)
    assert jxp.Plan.from_json(plan.to_json()) == plan
    # A plan saved before `runs` existed reads as one run per site.
    doc = json.loads(plan.to_json())
    for entry in doc["sites"]:
        entry.pop("runs")
    old = jxp.Plan.from_json(json.dumps(doc))
    assert [m.runs for m in old.measures] == [1, 1]
    for bad, error in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="`runs` must be a positive int"):
            jxp.SiteMeasure("a", BIG, (2, 4), one.errors, runs=bad)
