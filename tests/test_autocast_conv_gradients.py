"""Convolution kernels and normalisation parameters get float32 gradients under
autocast, as dense weights do (``gradient_dtype``): on 8 devices, data parallel,
no gradient of a conv net or of a ResNet's convolutions and BatchNorms crosses
devices in 16 bits, and ``gradient_dtype=float16`` gives the 16-bit reductions
back. The gradients agree with the 16-bit path within its rounding."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs

pytestmark = pytest.mark.core

F16, F32 = np.dtype("float16"), np.dtype("float32")
HALF = {"float16", "bfloat16"}


class ConvNet(nn.Module):
    """Three convolutions (one transposed), a BatchNorm in training mode."""

    transpose: bool = False
    norm: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.Conv(16, (3, 3), strides=2, use_bias=False)(x)
        if self.norm:
            x = nn.BatchNorm(use_running_average=False)(x)
        x = nn.relu(x)
        if self.transpose:
            x = nn.relu(nn.ConvTranspose(8, (3, 3), strides=(2, 2))(x))
        return nn.Dense(4)(jnp.mean(x, axis=(1, 2)))


def problem(transpose=False, norm=True):
    net = ConvNet(transpose, norm)
    x = jax.random.normal(jax.random.key(0), (32, 8, 8, 3))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 4)
    variables = jax.jit(net.init)(jax.random.key(2), x)

    def loss(params, stats, x, y):
        logits, upd = net.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        onehot = jax.nn.one_hot(y, 4)
        return optax.softmax_cross_entropy(logits.astype(F32), onehot).mean(), upd

    return loss, variables["params"], variables.get("batch_stats", {}), x, y


def data_parallel(loss, params, stats, x, y):
    """``grad`` of ``loss`` jitted on 8 devices (batch split on ``data``): the
    gradients and the half-precision arrays the compiled step reduces."""
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    args = (*jax.device_put((params, stats), rep), *jax.device_put((x, y), dat))
    grad = jax.jit(lambda p, s, x, y: jax.grad(loss, has_aux=True)(p, s, x, y)[0])
    compiled = grad.lower(*args).compile()  # compiled once: read, then run
    report = jxs.diagnostics.CollectiveReport.from_hlo(compiled)
    half = [
        (c.dtype, c.shape)
        for c in report.collectives
        if c.kind in ("all-reduce", "reduce-scatter") and c.dtype in HALF
    ]
    return compiled(*args), half


@pytest.mark.parametrize("transpose", [False, True])
def test_no_gradient_crosses_devices_in_16_bits_by_default(transpose):
    loss, params, stats, x, y = problem(transpose)
    g, half = data_parallel(jxs.autocast(loss), params, stats, x, y)
    assert half == []
    assert {np.dtype(a.dtype) for a in jax.tree.leaves(g)} == {F32}
    _, half16 = data_parallel(
        jxs.autocast(loss, gradient_dtype=jnp.float16), params, stats, x, y
    )
    shapes = {s for _, s in half16}
    # The opt-out: the kernels (as XLA lays them out) and the BatchNorm sums.
    assert any(len(s) == 4 for s in shapes)  # a convolution kernel
    assert (16,) in shapes  # a BatchNorm backward sum over 16 channels


@pytest.mark.parametrize("transpose", [False, True])
def test_gradients_agree_with_the_16_bit_path(transpose):
    loss, params, stats, x, y = problem(transpose)
    wide = jax.jit(jax.grad(jxs.autocast(loss), has_aux=True))(params, stats, x, y)
    narrow = jax.jit(
        jax.grad(jxs.autocast(loss, gradient_dtype=jnp.float16), has_aux=True)
    )(params, stats, x, y)
    exact = jax.jit(jax.grad(loss, has_aux=True))(params, stats, x, y)
    for a, b, e in zip(
        *map(jax.tree.leaves, (wide[0], narrow[0], exact[0])), strict=True
    ):
        scale = float(jnp.max(jnp.abs(e))) + 1e-3
        np.testing.assert_allclose(a, b, atol=3e-2 * scale, rtol=3e-2)
        # No further from the float32 gradient than the 16-bit path.
        assert (
            float(jnp.max(jnp.abs(a - e)))
            <= float(jnp.max(jnp.abs(b - e))) * 1.5 + 1e-6
        )


def test_a_norm_written_with_div_reduces_its_statistic_in_float32():
    """``(x - mean) / std * scale`` by hand: the statistic's and the scale's
    cotangents are summed over the batch in float32."""
    k = jax.random.split(jax.random.key(3), 2)
    p = {"w": jax.random.normal(k[0], (16, 32)) / 4, "scale": jnp.ones(32)}
    x = jax.random.normal(k[1], (64, 16))

    def loss(p, stats, x, y):
        h = x @ p["w"]
        mean = jnp.mean(h, axis=0, keepdims=True)
        std = jnp.sqrt(jnp.mean(jnp.square(h - mean), axis=0, keepdims=True) + 1e-5)
        out = (h - mean) / std * p["scale"][None, :]
        return jnp.mean(out.astype(F32) ** 3), stats

    y = jnp.zeros(64)
    g, half = data_parallel(jxs.autocast(loss), p, {}, x, y)
    assert half == []
    _, half16 = data_parallel(
        jxs.autocast(loss, gradient_dtype=jnp.float16), p, {}, x, y
    )
    assert half16
    exact = jax.grad(loss, has_aux=True)(p, {}, x, y)[0]
    for a, e in zip(jax.tree.leaves(g), jax.tree.leaves(exact), strict=True):
        np.testing.assert_allclose(a, e, atol=3e-2, rtol=5e-2)


def test_forward_mode_through_a_convolution():
    loss, params, stats, x, y = problem(norm=False)
    tangent = jax.tree.map(jnp.ones_like, params)
    f = jxs.autocast(loss)
    _, t = jax.jvp(lambda p: f(p, stats, x, y)[0], (params,), (tangent,))
    _, ref = jax.jvp(lambda p: loss(p, stats, x, y)[0], (params,), (tangent,))
    assert t.dtype == F32
    np.testing.assert_allclose(t, ref, rtol=5e-2, atol=5e-2)


def test_a_skipped_step_leaves_a_conv_net_bit_identical():
    """An overflow in the activation gradients still skips the step: params,
    BatchNorm statistics and optimizer state unchanged, bit for bit."""
    loss, params, stats, x, y = problem(transpose=True)
    scale = jxs.DynamicLossScale.create(init_scale=2.0**15)
    tx = jxs.dynamic_scaling(optax.sgd(1e-3, momentum=0.9), scale)
    state = tx.init(params)
    big = jxs.autocast(lambda p, s, x, y: jax.tree.map(lambda a: a, loss(p, s, x, y)))

    def scaled(p, s, x, y):
        value, upd = big(p, s, x, y)
        return value * 1e4, upd

    @jax.jit
    def step(p, s, state):
        (_, upd), g = jxs.value_and_grad(scaled, state, has_aux=True)(p, s, x, y)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), upd, state

    new_p, _, new_state = step(params, stats, state)
    assert float(jxs.loss_scale_of(new_state).loss_scale) < 2.0**15  # skipped
    for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
