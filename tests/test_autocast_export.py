"""Inference: a jitted autocast forward exported with ``jax.export``, serialised
and deserialised, gives the jitted program's outputs bit for bit, in the dtypes
the function gives them (the output contract: float32 logits)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxscale as jxs

with warnings.catch_warnings():  # equinox 0.13 on jax 0.7.1 reads a deprecated name
    warnings.simplefilter("ignore", DeprecationWarning)
    eqx = pytest.importorskip("equinox")

pytest.importorskip("flatbuffers")  # jax.export's serialisation

pytestmark = pytest.mark.core


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(nn.relu(nn.Dense(32)(x)))
        h = nn.MultiHeadDotProductAttention(num_heads=2)(h[:, None], mask=mask)[:, 0]
        return nn.Dense(10)(h)


def round_trip(fn, *args):
    exported = export.export(fn)(*args)
    back = export.deserialize(exported.serialize())
    return back.call(*args)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_an_exported_flax_forward_round_trips_bit_for_bit(dtype):
    net = _Net()
    x = jax.random.normal(jax.random.key(0), (4, 16))
    mask = jnp.ones((4, 2, 1, 1), bool)
    variables = net.init(jax.random.key(1), x, mask)
    forward = jax.jit(jxs.autocast(net.apply, dtype))
    out = round_trip(forward, variables, x, mask)
    ref = forward(variables, x, mask)
    assert out.dtype == ref.dtype == jnp.float32  # the output contract
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_allclose(out, net.apply(variables, x, mask), atol=0.1)


def test_an_equinox_model_is_exported_through_its_leaves():
    """``jax.export`` serialises arrays, not a module's Python parts: pass the
    array leaves and rebuild the model inside the exported function."""
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)

    def forward(leaves, x):
        model = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
        return jax.vmap(model)(x)

    forward16 = jax.jit(jxs.autocast(forward, jnp.float16))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    with pytest.raises(ValueError, match="unregistered type"):
        whole = jax.jit(jxs.autocast(lambda a, x: jax.vmap(eqx.combine(a, static))(x)))
        export.export(whole)(arrays, x).serialize()  # the module itself
    out = round_trip(forward16, leaves, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(forward16(leaves, x)))
    assert out.dtype == jnp.float32


def test_an_export_for_a_gpu_is_made_on_a_cpu():
    """Lowered for CUDA and the CPU at once (no GPU needed): the exported
    module lists both platforms and runs here."""
    w = jax.random.normal(jax.random.key(0), (8, 8))
    forward = jax.jit(jxs.autocast(lambda w, x: jnp.tanh(x @ w), jnp.bfloat16))
    exported = export.export(forward, platforms=("cpu", "cuda"))(w, w)
    assert exported.platforms == ("cpu", "cuda")
    back = export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(back.call(w, w)), forward(w, w))
