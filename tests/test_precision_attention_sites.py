"""Attention's batched products are sites (issue 49, item 3): the score
product ``q . k^T`` and the value product ``p . v``, named by name stack like
the dense sites. A float16 plan keeps 16-bit scores where the sensor's
measured amax (after the scale) times the headroom stays within 65504, and a
float32 result where it does not; bfloat16 keeps 16-bit scores. An older
plan, naming only dense sites, runs them as autocast does without a plan."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp

pytestmark = pytest.mark.integration

nn = pytest.importorskip("flax.linen")

F = jxp.Format
B, T, H, DH = 2, 8, 2, 8
D = H * DH


def _params(key):
    ks = jax.random.split(key, 4)
    return {
        n: jax.random.normal(k, (D, D)) / 4 for n, k in zip("qkvo", ks, strict=True)
    }


def _heads(x):
    return x.reshape(B, T, H, DH)


def written(p, x, blow=1.0):
    """``einsum -> scale -> mask -> softmax -> einsum``, as GPTs write it."""
    q, k, v = (_heads(x @ p[n]) for n in "qkv")
    s = jnp.einsum("bthd,bshd->bhts", q * blow, k * blow) * (DH**-0.5)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    return jnp.mean((o.reshape(B * T, D) @ p["o"]) ** 2)


def dpa(p, x, blow=1.0):
    """``jax.nn.dot_product_attention`` in its XLA form."""
    q, k, v = (_heads(x @ p[n]) for n in "qkv")
    o = jax.nn.dot_product_attention(q * blow, k * blow, v, implementation="xla")
    return jnp.mean((o.reshape(B * T, D) @ p["o"]) ** 2)


class _Flax(nn.Module):
    blow: float = 1.0

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones((B, T)))
        h = nn.Dense(D, name="embed")(x) * self.blow
        return nn.MultiHeadDotProductAttention(num_heads=H, name="attn")(h, mask=mask)


_FLAX = _Flax()
_FLAX_PARAMS = _FLAX.init(jax.random.key(2), jnp.ones((B, T, D)))


def flax_mha(p, x, blow=1.0):
    out = _Flax(blow=blow).apply(p, x.reshape(B, T, D))
    return jnp.mean(out**2)


MODELS = {"written": written, "dpa": dpa, "flax": flax_mha}
BLOW = 300.0  # |q . k| ~ 1e5 and more: the scaled scores overflow float16


def _args(model):
    x = jax.random.normal(jax.random.key(1), (B * T, D))
    p = _FLAX_PARAMS if model == "flax" else _params(jax.random.key(0))
    return p, x


def _plan(model, dtype, blow=1.0):
    loss = functools.partial(MODELS[model], blow=blow)
    p, x = _args(model)
    with jax.numpy_rank_promotion("allow"):
        return jxs.plan_precision(loss, dtype, cost="H100", budget="16-bit")(p, x)


@pytest.fixture(scope="module")
def plans():
    """Per model, the float16 plans of the healthy and the blown-up model."""
    return {m: (_plan(m, jnp.float16), _plan(m, jnp.float16, BLOW)) for m in MODELS}


def _batched(plan):
    return {
        m.site: s.format
        for m, s in zip(plan.measures, plan.sites, strict=True)
        if m.kind == "batched"
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_a_healthy_model_keeps_16_bit_scores(plans, model):
    healthy, _ = plans[model]
    batched = _batched(healthy)
    assert len(batched) == 2, healthy  # the score and the value product
    assert set(batched.values()) == {F.HALF}
    for s, m in zip(healthy.sites, healthy.measures, strict=True):
        if m.kind == "batched":
            assert "measured amax" in s.why and "65504 / headroom 4" in s.why
            assert set(m.errors) <= {F.FLOAT32, F.HALF_WIDE, F.HALF}
    if model == "flax":
        assert all(site.startswith("_Flax/attn/") for site in batched)


@pytest.mark.parametrize("model", list(MODELS))
def test_an_overflowing_model_keeps_float32_scores_and_stays_finite(plans, model):
    healthy, blown = plans[model]
    score, value = list(_batched(blown).items())
    assert score[1] is F.HALF_WIDE and value[1] is F.HALF
    why = blown.sites[[s.site for s in blown.sites].index(score[0])].why
    assert "> 16376 (float16's 65504 / headroom 4)" in why
    loss = functools.partial(MODELS[model], blow=BLOW)
    p, x = _args(model)

    def run(plan):
        step = jax.jit(jax.value_and_grad(jxs.autocast(loss, jnp.float16, plan=plan)))
        with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("allow"):
            return step(p, x)

    value, grads = run(blown)
    assert np.isfinite(value)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    # The healthy plan's 16-bit scores, on the same blown-up model, overflow.
    value16, grads16 = run(healthy)
    assert not (
        np.isfinite(value16)
        and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads16))
    )


def test_the_float32_score_runs_as_a_float32_product():
    blown = _plan("written", jnp.float16, BLOW)
    loss = functools.partial(written, blow=BLOW)
    p, x = _args("written")
    jaxpr = str(jax.make_jaxpr(jxs.autocast(loss, jnp.float16, plan=blown))(p, x))
    assert "preferred_element_type=float32" in jaxpr


def test_bfloat16_keeps_16_bit_scores():
    plan = _plan("written", jnp.bfloat16, BLOW)
    batched = _batched(plan)
    assert set(batched.values()) == {F.HALF}
    assert all(
        "bfloat16 has float32's range" in s.why
        for s, m in zip(plan.sites, plan.measures, strict=True)
        if m.kind == "batched"
    )


def test_a_version_3_plan_runs_an_attention_model(plans):
    healthy, _ = plans["written"]
    doc = json.loads(healthy.to_json())
    doc["version"] = 3
    doc["sites"] = [e for e in doc["sites"] if e["kind"] == "dense"]
    for e in doc["sites"]:
        del e["kind"]
    old = jxp.Plan.from_json(json.dumps(doc))
    assert {m.kind for m in old.measures} == {"dense"}
    p, x = _args("written")
    with jax.numpy_dtype_promotion("strict"):
        value = jax.jit(jxs.autocast(written, jnp.float16, plan=old))(p, x)
        plain = jax.jit(jxs.autocast(written, jnp.float16))(p, x)
    assert np.isfinite(value) and abs(float(value) - float(plain)) < 1e-2 * abs(
        float(plain)
    )
    # from_formats naming only the dense sites runs too.
    dense = [m for m in healthy.measures if m.kind == "dense"]
    by_hand = jxp.Plan.from_formats({m.site: F.HALF for m in dense}, dense, cost="H100")
    jax.make_jaxpr(jxs.autocast(written, jnp.float16, plan=by_hand))(p, x)


def test_a_float8_score_site_is_refused_naming_the_site(plans):
    healthy, _ = plans["written"]
    site = next(m.site for m in healthy.measures if m.kind == "batched")
    with pytest.raises(
        ValueError,
        match=rf"a batched site runs in \(Format.FLOAT32, Format.HALF_WIDE, "
        rf"Format.HALF\) at site '{site}', got Format.FLOAT8",
    ):
        healthy.replace(site, F.FLOAT8)
    with pytest.raises(ValueError, match=r"a batched site runs in .* only"):
        jxp.SiteMeasure(site, (4, 4, 4), (2, 2), {F.FLOAT8: 0.0}, kind="batched")


def test_the_monitor_raises_a_score_site_near_the_limit(plans):
    """The monitor watches a batched site as a dense one: a 16-bit score whose
    largest output nears 65504 is raised to a float32 result."""
    healthy, _ = plans["written"]
    mon = jxp.Monitor(healthy, patience=1)
    loss = functools.partial(written, blow=BLOW)
    p, x = _args("written")
    (value, grads), seen = jax.jit(mon.value_and_grad(loss))(p, x)
    state = mon.update(mon.init(), seen)
    _, _, changes = mon.replan(state)
    score = next(m.site for m in healthy.measures if m.kind == "batched")
    assert any(
        c.startswith(f"{score}: 16-bit -> 16-bit, float32 result") for c in changes
    )
