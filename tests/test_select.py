"""One per-site selector (issue 48, item 4): ``(site, shape) -> Format | None``.

A float8 recipe's ``sites``, ``min_dim`` and cost model are selectors; a recipe
takes one of the user's (``select=``): a torchao-style filter, or a precision
plan's ``Plan.select``. Plain JAX under ``jax.jit`` with strict promotion."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns

import jaxscale as jxs
import jaxscale.precision
from jaxscale._cost import device_cost
from jaxscale.float8._choice import SpeedModel, selectors
from jaxscale.float8._select import MinDim, Patterns

pytestmark = [pytest.mark.unit]

F = jaxscale.precision.Format
H200 = "NVIDIA H200"


def _mlp(params, x):
    with jax.named_scope("up"):
        h = jax.nn.relu(x @ params["up"])
    with jax.named_scope("head"):
        return jnp.mean(h @ params["head"])


def _args():
    sds = jax.ShapeDtypeStruct
    params = {"up": sds((64, 128), jnp.float32), "head": sds((128, 32), jnp.float32)}
    return params, sds((256, 64), jnp.float32)


def _float8_dots(fun, *args):
    return [
        e
        for e in all_eqns(jax.make_jaxpr(fun)(*args))
        if e.primitive.name == "dot_general"
        and any(np.dtype(v.aval.dtype).itemsize == 1 for v in e.invars)
    ]


def _step(recipe):
    return jax.jit(jax.grad(jxs.autocast(_mlp, jnp.bfloat16, float8=recipe)))


def _notes(recipe):
    report = jxs.diagnostics.autocast_report(_mlp, jnp.bfloat16, float8=recipe)(
        *_args()
    )
    return {s.source: s.note for s in report.float8}


def _plan(formats):
    measures = [
        jxs.precision.SiteMeasure(
            name, shape, (4, 4), {F.HALF: 1e-4, F.FLOAT8: 1e-3, F.FLOAT32: 1e-6}
        )
        for name, shape in (("up", (256, 64, 128)), ("head", (256, 128, 32)))
    ]
    return jxs.precision.Plan.from_formats(formats, measures, cost="H100")


def test_the_recipes_choices_are_selectors_of_one_type():
    # Each is (site, shape) -> Format | None.
    patterns = Patterns((("head", False), ("mlp", True)))
    assert patterns("GPT/head", (8, 8, 8)) is F.HALF
    assert patterns("GPT/mlp_up", (8, 8, 8)) is F.FLOAT8
    assert patterns("GPT/qkv", (8, 8, 8)) is None
    assert MinDim(64)("x", (64, 64, 64)) is F.FLOAT8
    assert MinDim(64)("x", (64, 63, 64)) is F.HALF
    model = SpeedModel((2, 2), lambda: device_cost(H200))
    assert model("x", (8192, 8192, 8192)) is F.FLOAT8
    assert model("x", (8192, 256, 256)) is F.HALF
    # float8=True reads as the speed model's selector.
    recipe = jxs.float8.CurrentScaling()
    (only,) = selectors(recipe, (2, 2), lambda: device_cost(H200), "bfloat16")
    assert isinstance(only, SpeedModel)
    rowwise = jxs.float8.RowwiseScaling(min_dim=0)
    assert selectors(rowwise, (2, 2), None, "")[-1]("x", (1, 1, 1)) is (
        F.FLOAT8_ROWWISE
    )


def test_a_torchao_style_filter_selects_sites_under_jit():
    seen = []

    def module_filter_fn(site, shape):
        seen.append((site, shape))
        return site != "head"

    recipe = jxs.float8.CurrentScaling(device_kind=H200, select=module_filter_fn)
    with jax.numpy_dtype_promotion("strict"):
        assert len(_float8_dots(_step(recipe), *_args())) == 3  # up only
    assert ("up", (256, 64, 128)) in seen and ("head", (256, 128, 32)) in seen
    notes = _notes(recipe)
    said = f"`select` ({module_filter_fn.__qualname__}) says so"
    assert notes["up"].endswith(f"; float8: {said}")
    assert notes["head"] == f"float8 declined: 16 bits: {said}"
    # The cost model alone puts neither small product in float8.
    alone = _step(jxs.float8.CurrentScaling(device_kind=H200))
    with pytest.warns(jxs.AutocastWarning, match="nothing runs in float8"):
        assert not _float8_dots(alone, *_args())


def test_patterns_come_first_and_none_asks_the_next_selector():
    def select(site, shape):
        return True if site == "head" else None

    recipe = jxs.float8.CurrentScaling(
        min_dim=100, sites={"^up$": True}, select=lambda s, m: F.HALF
    )
    notes = _notes(recipe)
    assert notes["up"].endswith("float8: pattern '^up$' says so")
    assert notes["head"].startswith("float8 declined: 16 bits: `select` (")
    recipe = jxs.float8.CurrentScaling(min_dim=100, select=select)
    notes = _notes(recipe)
    assert notes["head"].endswith("says so")  # head's K is 128 >= 100
    assert notes["up"] == (
        "float8 declined: 16 bits: below min_dim 100 (M=256, K=64, N=128)"
    )


def test_a_plan_is_a_selector_and_runs_as_plan_runs_it():
    plan = _plan({"up": F.FLOAT8, "head": F.HALF})
    assert plan.select("up", (256, 64, 128)) is F.FLOAT8
    assert plan.select("head") is F.HALF
    assert plan.select("GPT/other", (1, 2, 3)) is None
    recipe = jxs.float8.CurrentScaling(select=plan.select)
    by_plan = jax.jit(jax.grad(jxs.autocast(_mlp, jnp.bfloat16, plan=plan)))
    # The same products: float8 for up (three), 16 bits for head, in order.
    assert _dot_dtypes(_step(recipe)) == _dot_dtypes(by_plan)
    assert len(_float8_dots(_step(recipe), *_args())) == 3
    params, x = _ones()
    got, want = _step(recipe)(params, x), by_plan(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    notes = _notes(recipe)
    assert "`select` (Plan.select) says so" in notes["up"]
    # The same plan, the same recipe (frozen, hashable).
    same = jxs.float8.CurrentScaling(select=plan.select)
    assert same == recipe and hash(same) == hash(recipe)


def test_plan_select_names_numbered_sites_by_their_name_stack():
    m = [
        jxs.precision.SiteMeasure(n, s, (2, 2), {F.HALF: 1e-4, F.FLOAT8: 1e-3})
        for n, s in (
            ("(top level)", (8, 8, 8)),
            ("blk", (8, 16, 8)),
            ("blk#1", (8, 16, 8)),
            ("mlp", (8, 8, 8)),
            ("mlp#1", (8, 8, 32)),
        )
    ]
    formats = {"(top level)": F.FLOAT8, "blk": F.HALF, "blk#1": F.HALF}
    plan = jxs.precision.Plan.from_formats(
        {**formats, "mlp": F.FLOAT8, "mlp#1": F.HALF}, m, cost="H100"
    )
    assert plan.select("", (8, 8, 8)) is F.FLOAT8  # the top level
    assert plan.select("blk", (8, 16, 8)) is F.HALF  # both agree
    assert plan.select("mlp#1") is F.HALF  # a site's own name
    assert plan.select("mlp", (8, 8, 32)) is F.HALF  # the shape decides
    with pytest.raises(
        ValueError, match=r"`site` 'mlp' .*\(mlp: float8, mlp#1: 16-bit\)"
    ):
        plan.select("mlp", (4, 4, 4))


def test_select_is_validated():
    with pytest.raises(TypeError, match=r"`select` must be None or a callable.*int 3"):
        jxs.float8.CurrentScaling(select=3)
    bad = jxs.float8.CurrentScaling(select=lambda s, m: "yes", min_dim=0)
    with pytest.raises(TypeError, match=r"`select` \(.*<lambda>\) must return .*'yes'"):
        _step(bad)(*_zeros())
    wide = jxs.float8.CurrentScaling(select=lambda s, m: F.FLOAT32)
    with pytest.raises(ValueError, match=r"returned Format.FLOAT32 .*plan=plan"):
        _step(wide)(*_zeros())
    other = jxs.float8.RowwiseScaling(select=lambda s, m: F.FLOAT8)
    with pytest.raises(ValueError, match=r"Use jxs.float8.CurrentScaling"):
        _step(other)(*_zeros())


def _zeros():
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _args())


def _ones():
    key = jax.random.key(0)
    return jax.tree.map(lambda s: jax.random.normal(key, s.shape, s.dtype), _args())


def _dot_dtypes(fun):
    return [
        tuple(np.dtype(v.aval.dtype).name for v in e.invars)
        for e in all_eqns(jax.make_jaxpr(fun)(*_args()))
        if e.primitive.name == "dot_general"
    ]


def test_the_guides_selector_snippet_runs_as_written():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "float8.md").read_text()
    section = text.split("## Which matmuls run in float8", 1)[1].split("\n## ", 1)[0]
    (code,) = [
        b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "select" in b
    ]
    namespace = {"jax": jax, "jnp": jnp, "jxs": jxs}
    with jax.numpy_dtype_promotion("strict"):
        exec(compile(code, "float8.md", "exec"), namespace)
    assert namespace["float8_sites"] == 1


def test_a_selector_that_declines_every_site_does_not_warn():
    # The user said so, as with `sites={"": False}`: no "nothing runs in float8"
    # (the suite turns warnings into errors).
    recipe = jxs.float8.CurrentScaling(min_dim=0, select=lambda site, shape: False)
    assert _float8_dots(_step(recipe), *_args()) == []
