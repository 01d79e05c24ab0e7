"""Fused attention under autocast, lowered for CUDA without a GPU: the
lowering of a step holds cuDNN's fused attention (forward and backward) for
``jax.nn.dot_product_attention`` and for written-out attention as benchmarks'
GPT, Flax and equinox write it; the CPU lowering of the same step holds none.

Needs jax to trace cuDNN's attention on this host (jax-cuda12-plugin and
nvidia-cudnn-cu12: ``.ci/gpu-budget``'s environment); skipped elsewhere.
"""

from __future__ import annotations

import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxscale as jxs
from jaxscale import _hlo

pytestmark = pytest.mark.integration
eqx = pytest.importorskip("equinox")  # its import warns on the floors: not ours

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
B, T, N, H = 2, 128, 4, 64


def _cudnn_traces() -> bool:
    spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float16)
    try:
        jax.eval_shape(
            lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"),
            spec,
        )
    except Exception:  # noqa: BLE001 - no cuDNN here, whatever jax raises
        return False
    return True


if not _cudnn_traces():
    pytest.skip(
        "jax cannot trace cuDNN attention here (.ci/gpu-budget installs "
        "jax-cuda12-plugin and nvidia-cudnn-cu12)",
        allow_module_level=True,
    )


def written(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(H))
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def through_jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def cudnn_calls(loss, *args, platform="cuda"):
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    text = grad.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    calls = _hlo.stablehlo_custom_calls(text)
    return sum(n for target, n in calls.items() if target.startswith("__cudnn$fmha"))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [written, through_jax_nn], ids=["written", "jax.nn"])
def test_attention_lowers_to_cudnn_for_cuda_only(fn, dtype):
    q = jnp.ones((B, T, N, H), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(jxs.autocast(fn, dtype)(q, k, v))

    assert cudnn_calls(loss, q, q, q) == 2  # forward and backward
    assert cudnn_calls(loss, q, q, q, platform="cpu") == 0
    off = jxs.autocast(fn, dtype, fuse_attention=False)
    assert cudnn_calls(lambda q, k, v: jnp.sum(off(q, k, v)), q, q, q) == 0


def test_flax_attention_with_a_causal_mask_lowers_to_cudnn():
    x = jnp.ones((B, T, 256))
    mha = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=256)
    variables = mha.init(jax.random.key(0), x)
    mask = nn.make_causal_mask(jnp.ones((B, T)))

    def loss(variables, x):
        return jnp.sum(jxs.autocast(mha.apply)(variables, x, mask=mask))

    assert cudnn_calls(loss, variables, x) == 2


def test_equinox_attention_with_a_causal_mask_lowers_to_cudnn():
    mha = eqx.nn.MultiheadAttention(N, 256, key=jax.random.key(0))
    x = jnp.ones((T, 256))
    causal = jnp.tril(jnp.ones((T, T), bool))

    def loss(mha, x):
        return jnp.sum(jxs.autocast(lambda m, x: m(x, x, x, mask=causal))(mha, x))

    params, static = eqx.partition(mha, eqx.is_array)

    def by_params(params, x):
        return loss(eqx.combine(params, static), x)

    assert cudnn_calls(by_params, params, x) == 2
