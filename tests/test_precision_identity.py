"""An all-16-bit plan is the plain autocast program (issue 49 item 7).

``jxs.autocast(loss, dtype, plan=plan)`` with every site of ``plan`` in
``Format.HALF`` must trace the same program as ``jxs.autocast(loss, dtype)``,
so that its gradients agree bit for bit, scaled (loss scale 2**16) or not,
whatever the backend compiles. Reported on a Keras 3 GPT-2 (scaled gradients
an ulp apart): Keras computes a layer norm's variance with ``jnp.var``, a
``jit`` inside the model; autocast without a plan re-traces such a call, the
plan inlined it, and JAX summed the input's cotangents in another order. The
models here are GPT-2s with what Keras' has (token and position embeddings,
layer norms, causal attention with a softmax, GELU, biases after products, a
tied output embedding read by a gather and by ``x @ E.T``), written in plain
JAX as Keras' JAX backend writes it, in Flax linen, Flax NNX and Equinox.

The programs are compared as jaxprs (the same text: the same program on any
backend) and by their gradients under one ``jax.jit`` each (the same bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale._autocast import attention
from jaxscale.precision._apply import _ShapeRule

pytestmark = [pytest.mark.integration, pytest.mark.libraries]

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

F = jxp.Format
V, T, D, H, B = 64, 16, 32, 4, 4
DH = D // H


@pytest.fixture(autouse=True)
def _cpu(on_cpu):
    """Every test on the first CPU device, a GPU host's too; the models
    broadcast as the libraries do (ranks promoted; dtypes stay strict)."""
    with jax.numpy_rank_promotion("allow"):
        yield


def _normal(key, shape, scale=0.05):
    return jax.random.normal(key, shape) * scale


# --------------------------------------------------------------- plain JAX
# As Keras 3's JAX backend writes a GPT-2: jnp.take, EinsumDense's einsums
# (heads as their own dimensions: the output projection contracts two), an
# additive causal mask, jnp.var in the layer norm, one-hot cross-entropy.


def _keras_params(key):
    ks = iter(jax.random.split(key, 16))
    p = {"tok": _normal(next(ks), (V, D)), "pos": _normal(next(ks), (T, D))}
    for n in ("ln1", "ln2", "lnf"):
        p[n] = {"g": jnp.ones(D), "b": jnp.zeros(D)}
    for n in "qkv":
        p[n] = {"w": _normal(next(ks), (D, H, DH)), "b": _normal(next(ks), (H, DH))}
    p["o"] = {"w": _normal(next(ks), (H, DH, D)), "b": _normal(next(ks), (D,))}
    p["fc"] = {"w": _normal(next(ks), (D, 4 * D)), "b": _normal(next(ks), (4 * D,))}
    p["pr"] = {"w": _normal(next(ks), (4 * D, D)), "b": _normal(next(ks), (D,))}
    return p


def _keras_norm(x, p):
    mean = jnp.mean(x, -1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * p["g"]
    return x * inv + (p["b"] - mean * inv)


def _keras_loss(p, tokens, targets):
    x = jnp.take(p["tok"], tokens, axis=0)
    x = jnp.add(x, jnp.broadcast_to(p["pos"][:T], (B, T, D)))
    h = _keras_norm(x, p["ln1"])
    q, k, v = (
        jnp.add(jnp.einsum("abc,cde->abde", h, p[n]["w"]), p[n]["b"]) for n in "qkv"
    )
    q = jnp.multiply(q, jnp.asarray(1 / np.sqrt(DH), q.dtype))
    s = jnp.einsum("aecd,abcd->acbe", k, q)
    mask = jnp.tril(jnp.ones((T, T), "int32"))[None, None]
    s = s + (1.0 - mask.astype(s.dtype)) * jnp.asarray(-1e9, s.dtype)
    o = jnp.einsum("acbe,aecd->abcd", jax.nn.softmax(s, axis=-1), v)
    x = jnp.add(x, jnp.add(jnp.einsum("abcd,cde->abe", o, p["o"]["w"]), p["o"]["b"]))
    h = _keras_norm(x, p["ln2"])
    f = jax.nn.gelu(jnp.add(jnp.matmul(h, p["fc"]["w"]), p["fc"]["b"]))
    x = jnp.add(x, jnp.add(jnp.matmul(f, p["pr"]["w"]), p["pr"]["b"]))
    logits = jnp.matmul(_keras_norm(x, p["lnf"]), jnp.transpose(p["tok"]))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.mean(-jnp.sum(jax.nn.one_hot(targets, V) * log_probs, axis=-1))


def keras_like():
    return _keras_loss, _keras_params(jax.random.key(0))


# ------------------------------------------------------------- Flax linen


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=H)(
            h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2]))
        )
        h = nn.Dense(4 * D)(nn.LayerNorm()(x))
        return x + nn.Dense(D)(nn.gelu(h))


class _LinenGPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(V, D)
        pos = self.param("pos", nn.initializers.normal(0.02), (T, D))
        x = _LinenBlock()(embed(tokens) + pos)
        return embed.attend(nn.LayerNorm()(x))  # tied: x @ E.T


def _xent(logits, targets):
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], -1))


def linen():
    model = _LinenGPT()
    params = model.init(jax.random.key(0), jnp.zeros((B, T), jnp.int32))

    def loss(p, tokens, targets):
        return _xent(model.apply(p, tokens), targets)

    return loss, params


# --------------------------------------------------------------- Flax NNX


class _NnxGPT(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Param(_normal(rngs.params(), (T, D)))
        self.ln1, self.ln2, self.lnf = (nnx.LayerNorm(D, rngs=rngs) for _ in "123")
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.fc = nnx.Linear(D, 4 * D, rngs=rngs)
        self.pr = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        mask = nnx.make_causal_mask(jnp.ones(tokens.shape))
        x = x + self.attn(self.ln1(x), mask=mask)
        x = x + self.pr(jax.nn.gelu(self.fc(self.ln2(x))))
        return self.embed.attend(self.lnf(x))


def nnx_gpt():
    graph, params = nnx.split(_NnxGPT(nnx.Rngs(0)))

    def loss(p, tokens, targets):
        return _xent(nnx.merge(graph, p)(tokens), targets)

    return loss, params


# ---------------------------------------------------------------- Equinox


class _EqxGPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    lnf: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    fc: eqx.nn.Linear
    pr: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(V, D, key=ks[0])
        self.pos = _normal(ks[1], (T, D))
        self.ln1, self.ln2, self.lnf = (eqx.nn.LayerNorm(D) for _ in "123")
        self.attn = eqx.nn.MultiheadAttention(H, D, use_output_bias=True, key=ks[2])
        self.fc = eqx.nn.Linear(D, 4 * D, key=ks[3])
        self.pr = eqx.nn.Linear(4 * D, D, key=ks[4])

    def __call__(self, tokens):  # one sequence
        x = jax.vmap(self.embed)(tokens) + self.pos
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))
        h = jax.vmap(self.fc)(jax.vmap(self.ln2)(x))
        x = x + jax.vmap(self.pr)(jax.nn.gelu(h))
        return jax.vmap(self.lnf)(x) @ self.embed.weight.T


def equinox():
    params, static = eqx.partition(_EqxGPT(jax.random.key(0)), eqx.is_array)

    def loss(p, tokens, targets):
        return _xent(jax.vmap(eqx.combine(p, static))(tokens), targets)

    return loss, params


MODELS = {"keras_like": keras_like, "linen": linen, "nnx": nnx_gpt, "eqx": equinox}


# ------------------------------------------------------------------ tests


def data():
    k1, k2 = jax.random.split(jax.random.key(1))
    return (
        jax.random.randint(k1, (B, T), 0, V),
        jax.random.randint(k2, (B, T), 0, V),
    )


def half_plan(loss, dtype, *args):
    """A plan with every site of ``loss`` in 16 bits (``Plan.from_formats``)."""
    shapes = _ShapeRule()
    jax.eval_shape(jxs.autocast(loss, dtype, plan=shapes), *args)
    measures = [
        jxp.SiteMeasure(site, mkn, (4, 4), {F.HALF: 0.0}, kind=shapes.kinds_met[site])
        for site, mkn in shapes.shapes.items()
    ]
    assert len(measures) >= 5  # four per block, the tied output embedding
    return jxp.Plan.from_formats(
        dict.fromkeys(shapes.shapes, F.HALF), measures, cost="H100"
    )


def scaled_grad(fn, scale):
    """The gradient of the loss scaled as ``jxs.value_and_grad`` scales it."""
    ls = jxs.StaticLossScale.create(scale)
    return jax.grad(lambda p, *a: ls.scale(fn(p, *a)))


@pytest.mark.parametrize("scale", [1.0, 2.0**16], ids=["unscaled", "scale2^16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_an_all_16_bit_plan_is_the_plain_autocast_program(model, scale):
    dtype = jnp.float16
    loss, params = MODELS[model]()
    tokens, targets = data()
    plan = half_plan(loss, dtype, params, tokens, targets)
    assert set(plan.formats().values()) == {F.HALF}
    plain = scaled_grad(jxs.autocast(loss, dtype), scale)
    planned = scaled_grad(jxs.autocast(loss, dtype, plan=plan), scale)
    # The same program: the same jaxpr, whatever backend compiles it.
    assert str(jax.make_jaxpr(planned)(params, tokens, targets)) == str(
        jax.make_jaxpr(plain)(params, tokens, targets)
    )
    want = jax.jit(plain)(params, tokens, targets)
    got = jax.jit(planned)(params, tokens, targets)
    for path, w, g in zip(
        jax.tree_util.tree_leaves_with_path(want),
        jax.tree.leaves(want),
        jax.tree.leaves(got),
        strict=True,
    ):
        assert g.dtype == w.dtype == jnp.float32
        assert np.array_equal(np.asarray(g), np.asarray(w)), jax.tree_util.keystr(
            path[0]
        )
    assert any(np.any(np.asarray(w) != 0) for w in jax.tree.leaves(want))


def test_a_plan_runs_a_written_out_attention_fused_as_autocast_does(monkeypatch):
    """Autocast runs a written-out attention as cuDNN's fused kernel where it
    is lowered for CUDA (``attention.run_chain``); a plan whose sites in the
    attention (its batched score and value products) are 16-bit lets it, as
    autocast without a plan does."""
    calls = []
    run_chain = attention.run_chain

    def spy(it, chain, *rest):
        calls.append(chain)
        return run_chain(it, chain, *rest)

    monkeypatch.setattr(attention, "run_chain", spy)
    loss, params = linen()
    tokens, targets = data()
    plan = half_plan(loss, jnp.float16, params, tokens, targets)
    jax.make_jaxpr(jxs.autocast(loss, jnp.float16))(params, tokens, targets)
    plain = len(calls)
    assert plain == 1
    jax.make_jaxpr(jxs.autocast(loss, jnp.float16, plan=plan))(params, tokens, targets)
    assert len(calls) == 2 * plain
