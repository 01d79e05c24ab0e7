"""Which written-out attentions autocast recognises to run fused
(``jaxscale._autocast.fusion.chains``), and which it leaves to the rules."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale._autocast.fusion import Constants, chains

pytestmark = pytest.mark.unit
eqx = pytest.importorskip("equinox")  # its import warns on the floors: not ours

B, T, N, H = 2, 16, 2, 8
X = jnp.ones((B, T, N, H))
CAUSAL = jnp.tril(jnp.ones((T, T), bool))


def found(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return closed, chains(closed.jaxpr)


def scaled(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def causal(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    s = jnp.where(CAUSAL, s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def value_first(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return jnp.einsum("bkhd,bhqk->bhdq", v, jax.nn.softmax(s, axis=-1))


@pytest.mark.parametrize("fn", [scaled, causal, value_first])
def test_written_out_attention_is_one_chain(fn):
    closed, got = found(fn, X, X, X)
    (chain,) = got.values()
    assert chain.scores.primitive.name == chain.out.primitive.name == "dot_general"
    assert set(closed.jaxpr.invars) <= set(chain.inputs)
    assert (chain.mask is not None) == (fn is causal)
    assert len(chain.scalings) == (fn is not value_first)


def test_flax_attention_is_a_chain():
    x = jnp.ones((B, T, 32))
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
    variables = mha.init(jax.random.key(0), x)
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    closed, got = found(lambda v, x: mha.apply(v, x, mask=mask), variables, x)
    (chain,) = got.values()
    assert chain.mask is not None


def test_equinox_attention_is_a_chain():
    mha = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    x = jnp.ones((T, 16))
    _, got = found(lambda x: mha(x, x, x, mask=CAUSAL), x)
    assert len(got) == 1


def linear(q, k, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.einsum("bqhd,bkhd->bhqk", q, k), v)


def scores_returned(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), s


def with_bias(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + jnp.ones((B, N, T, T))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def with_dropout(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    p = p * jax.random.bernoulli(jax.random.key(0), 0.9, p.shape).astype(p.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def softmax_over_queries(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-2)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize(
    "fn", [linear, scores_returned, with_bias, with_dropout, softmax_over_queries]
)
def test_what_is_not_attention_cudnn_runs_is_no_chain(fn):
    _, got = found(fn, X, X, X)
    assert got == {}


def test_constants_evaluates_a_causal_mask_made_in_the_function():
    closed, got = found(causal, X, X, X)
    (chain,) = got.values()
    consts = Constants(
        closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    )
    cond = consts.value(chain.mask.invars[0])
    np.testing.assert_array_equal(np.asarray(cond), np.asarray(CAUSAL))
    assert consts.value(closed.jaxpr.invars[0]) is None  # an input: not known


def test_a_causal_mask_is_read_as_causal_and_an_input_mask_is_not_known():
    """What the fused call would take: the causal pattern, read at (T, S) from
    a mask made in the function (``jnp.tril``) or closed over (Flax's
    ``make_causal_mask``); a mask passed in as an argument is not known."""
    from jaxscale._autocast.attention import _keep

    def keep_of(fn, *args):
        closed, got = found(fn, *args)
        (chain,) = got.values()
        consts = Constants(
            closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        )
        shape = tuple(chain.scores.outvars[0].aval.shape)
        return _keep(chain, consts, shape)

    tril = np.tril(np.ones((T, T), bool))
    np.testing.assert_array_equal(keep_of(causal, X, X, X), tril)
    x = jnp.ones((B, T, 32))
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
    variables = mha.init(jax.random.key(0), x)
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    np.testing.assert_array_equal(
        keep_of(lambda v, x: mha.apply(v, x, mask=mask), variables, x), tril
    )
    assert keep_of(lambda v, x, m: mha.apply(v, x, mask=m), variables, x, mask) is None
