"""Values computed from parameters alone, and 0/1 masks made in the function (issue 40).

Gemma's and Griffin's RMSNorm multiply by ``1 + scale``; SSMs scale by
``softplus(raw)`` or ``exp(log_scale)``: computed from float32 parameters (and
constants) alone, such a value broadcast against a float16 activation is cast to
float16 at the use, as the parameter itself is, so the norm's output and the
residual stream stay float16. A boolean converted to a float inside the function
(``mask.astype(h.dtype)``: float32 when traced) and multiplied into a float16
activation is cast to float16, exactly. Tested on plain jax, flax linen (under
``nn.jit``) and equinox, under ``jit``, with gradients.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns

import jaxscale as jxs
from jaxscale.diagnostics import autocast_report

with warnings.catch_warnings():  # equinox 0.13 on jax 0.7.1 reads a deprecated name
    warnings.simplefilter("ignore", DeprecationWarning)
    import equinox as eqx

pytestmark = [pytest.mark.core]


@pytest.fixture(autouse=True)
def _broadcasting():
    """The models here broadcast a ``(D,)`` scale as Gemma's code does."""
    with jax.numpy_rank_promotion("allow"):
        yield


F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
B, T, D = 2, 8, 16
SCALES = {
    "one plus": lambda s: 1 + s,
    "softplus": jax.nn.softplus,
    "exp": jnp.exp,
    "times a constant": lambda s: s * 0.5,
    "one plus, reshaped": lambda s: (1.0 + s).reshape(1, 1, -1),
}


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


def rms(x, scale):
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * scale


def block_params():
    w1, w2 = _normal(0, (D, D)) / 4, _normal(1, (D, D)) / 4
    return {"w1": w1, "w2": w2, "s": _normal(2, (D,)) / 10}


def block(scale_of):
    """Two residual blocks, each normed by ``scale_of(p["s"])``."""

    def loss(p, x):
        h = x @ p["w1"]  # float16 under autocast
        for _ in range(2):
            h = h + jnp.tanh(rms(h, scale_of(p["s"])) @ p["w2"])
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    return loss


def out_dtypes(fn, *args, name="mul"):
    return [
        np.dtype(e.outvars[0].aval.dtype)
        for e in all_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == name and e.outvars[0].aval.shape == (B, T, D)
    ]


@pytest.mark.parametrize("form", SCALES)
def test_a_scale_computed_from_a_parameter_keeps_the_stream_16_bit(form):
    p, x = block_params(), _normal(3, (B, T, D))
    loss = jxs.autocast(block(SCALES[form]))
    report = autocast_report(block(SCALES[form]))(p, x)
    assert not report.islands, report
    # The residual additions run in float16: nothing activation-sized widens.
    assert set(out_dtypes(loss, p, x, name="add")) == {F16}
    value, grads = jax.jit(jax.value_and_grad(loss))(p, x)
    ref_value, ref = jax.value_and_grad(block(SCALES[form]))(p, x)
    np.testing.assert_allclose(value, ref_value, rtol=2e-2)
    for k in p:
        assert grads[k].dtype == F32
        np.testing.assert_allclose(grads[k], ref[k], rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize(
    ("gradient_dtype", "wire"), [(None, "float32"), (F16, "float16")]
)
def test_a_derived_scales_gradient_crosses_devices_in_the_chosen_dtype(
    gradient_dtype, wire
):
    """``1 + s`` is cast at its use as ``s`` would be, and its gradient is summed
    as a parameter's: data parallel over the suite's 8 CPU devices, the
    all-reduce of ``s``'s gradient is float32 by default (``gradient_dtype``)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    p = jax.device_put(block_params(), replicated)
    x = jax.device_put(_normal(3, (8, T, D)), rows)
    loss = jxs.autocast(block(lambda s: 1 + s), gradient_dtype=gradient_dtype)
    report = jxs.diagnostics.collective_report(jax.jit(jax.grad(loss)))(p, x)
    scale = [c.dtype for c in report.select("all-reduce") if c.shape == (D,)]
    assert scale and set(scale) == {wire}, report  # one per use, or combined


def test_the_scale_form_matches_the_plain_form_bit_for_bit():
    """``normed * (1 + s)`` under autocast is ``normed * w`` with ``w = 1 + s``
    computed in float32 and passed in: the same float16 program."""
    p, x = block_params(), _normal(3, (B, T, D))
    derived = jax.jit(jxs.autocast(block(lambda s: 1 + s)))(p, x)
    plain = {**p, "s": 1 + p["s"]}
    direct = jax.jit(jxs.autocast(block(lambda s: s)))(plain, x)
    np.testing.assert_array_equal(derived, direct)


def test_a_value_mixing_a_parameter_with_an_activation_still_widens():
    """The rule's limit: ``1 + s * exp(h)`` (``exp`` runs in float32) depends
    on an activation; it is not a parameter, and the product widens as the
    promotion rule says."""
    p, x = block_params(), _normal(3, (B, T, D))

    def loss(p, x):
        h = x @ p["w1"]
        g = 1 + p["s"] * jnp.exp(h)  # float32, activation-sized
        return jnp.sum((h * g).astype(jnp.float32))

    assert out_dtypes(jxs.autocast(loss), p, x) == [F32, F32]
    assert autocast_report(loss)(p, x).islands


# --------------------------------------------------------------------------- #
# 0/1 masks converted inside the function.
# --------------------------------------------------------------------------- #

MASKS = {
    "astype of a comparison": lambda pos, h: (pos > 2).astype(h.dtype)[..., None],
    "where of 1.0 and 0.0": lambda pos, h: jnp.where(pos > 2, 1.0, 0.0)[..., None],
    "product of two masks": lambda pos, h: (
        (pos > 2).astype(h.dtype) * (pos < 6).astype(h.dtype)
    )[..., None],
}


def masked(mask_of):
    def loss(w, x, pos):
        h = x @ w
        y = h * mask_of(pos, h)
        return jnp.sum(jnp.tanh(y @ w).astype(jnp.float32)), y

    return loss


@pytest.mark.parametrize("form", MASKS)
def test_a_mask_made_in_the_function_keeps_the_activation_16_bit(form):
    w, x = _normal(0, (D, D)) / 4, _normal(1, (B, T, D))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    loss = jxs.autocast(masked(MASKS[form]), cast_outputs=False)
    (value, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(w, x, pos)
    assert y.dtype == F16
    # Exact: the float16 product is the float16 activation, or zero.
    h = (x.astype(F16) @ w.astype(F16)).astype(F16)
    keep = np.asarray(pos > 2)[..., None]
    if form == "product of two masks":
        keep = keep & np.asarray(pos < 6)[..., None]
    np.testing.assert_array_equal(y, np.where(keep, h, 0).astype(F16))
    ref_value, _ = masked(MASKS[form])(w, x, pos)
    np.testing.assert_allclose(value, ref_value, rtol=2e-2)
    assert g.dtype == F32
    report = autocast_report(masked(MASKS[form]))(w, x, pos)
    assert not report.islands, report
    assert any("0/1 mask" in site.note for site in report.norms), report


@pytest.mark.parametrize(
    "mask_of",
    [
        lambda pos, h: (pos + 1).astype(h.dtype)[..., None],  # any integer
        lambda pos, h: jnp.where(pos > 2, 1.0, 0.5)[..., None],  # not 0/1
    ],
    ids=["an int32 cast", "where of 1.0 and 0.5"],
)
def test_values_the_rule_cannot_vouch_for_still_widen(mask_of):
    w, x = _normal(0, (D, D)) / 4, _normal(1, (B, T, D))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    loss = jxs.autocast(masked(mask_of), cast_outputs=False)
    _, y = loss(w, x, pos)
    assert y.dtype == F32


def test_a_mask_added_rather_than_multiplied_still_widens():
    w, x = _normal(0, (D, D)) / 4, _normal(1, (B, T, D))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(w, x, pos):
        h = x @ w
        return h + (pos > 2).astype(h.dtype)[..., None]

    assert jxs.autocast(loss, cast_outputs=False)(w, x, pos).dtype == F32


# --------------------------------------------------------------------------- #
# Library models: flax linen under nn.jit, equinox.
# --------------------------------------------------------------------------- #


class GemmaNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class GemmaBlock(nn.Module):
    @nn.compact
    def __call__(self, x, segment_pos):
        h = nn.Dense(D, use_bias=False)(GemmaNorm()(x))
        mask = (segment_pos != 0).astype(h.dtype)[..., None]  # Griffin's Conv1D
        return x + nn.Dense(D, use_bias=False)(jax.nn.gelu(h) * mask)


class GemmaLike(nn.Module):
    @nn.compact
    def __call__(self, tokens, segment_pos):
        x = nn.Embed(32, D)(tokens)
        for _ in range(2):
            x = nn.jit(GemmaBlock)()(x, segment_pos)
        return nn.Dense(32)(GemmaNorm()(x))


def test_a_flax_gemma_like_model_under_nn_jit_stays_16_bit():
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, 32)
    pos = jnp.broadcast_to(jnp.arange(T) % 4, (B, T))
    model = GemmaLike()
    params = model.init(jax.random.key(1), tokens, pos)

    def loss(params, tokens, pos):
        logits = model.apply(params, tokens, pos)
        return jnp.mean(jnp.square(logits.astype(jnp.float32)))

    report = autocast_report(loss)(params, tokens, pos)
    assert not report.islands, report
    value, grads = jax.jit(jax.value_and_grad(jxs.autocast(loss)))(params, tokens, pos)
    ref_value, ref = jax.value_and_grad(loss)(params, tokens, pos)
    np.testing.assert_allclose(value, ref_value, rtol=3e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-3)


class SSMBlock(eqx.Module):
    proj: eqx.nn.Linear
    raw_decay: jax.Array
    log_scale: jax.Array

    def __init__(self, key):
        self.proj = eqx.nn.Linear(D, D, key=key)
        self.raw_decay = jnp.full((D,), 0.5)
        self.log_scale = jnp.zeros((D,))

    def __call__(self, x):
        h = jax.vmap(self.proj)(x)
        return h * jax.nn.softplus(self.raw_decay) + h * jnp.exp(self.log_scale)


def test_an_equinox_ssm_style_block_stays_16_bit():
    model = SSMBlock(jax.random.key(0))
    x = _normal(1, (T, D))

    @eqx.filter_jit
    def loss(model, x):
        return jnp.mean(jnp.square(model(model(x)).astype(jnp.float32)))

    assert not autocast_report(loss)(model, x).islands
    half = jxs.autocast(loss)
    muls = [
        np.dtype(e.outvars[0].aval.dtype)
        for e in all_eqns(jax.make_jaxpr(half)(model, x))
        if e.primitive.name in ("mul", "add") and e.outvars[0].aval.shape == (T, D)
    ]
    assert muls and set(muls) == {F16}
    grads = eqx.filter_grad(half)(model, x)
    ref = eqx.filter_grad(loss)(model, x)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-3)
