"""FSDP weights gathered in float8 inside ``shard_map`` (issue 39, item 4).

A 3-layer float8 MLP on 8 CPU devices, each weight split by rows over
``data`` as FSDP stores it and the batch split too, gathers its weights inside
the ``shard_map`` body: with ``lax.all_gather`` (the float32 weight crosses,
and the site quantises it) and with ``jxs.float8.all_gather`` (each block is
quantised with the scale of the whole weight and its float8 bits cross). The
loss and the gradients are those of the gather-then-quantise program and of
the one-device program; the compiled step gathers ``uint8``, a quarter of the
float32 bytes, and reduce-scatters the float32 gradient. Recipes whose site
would quantise the gathered values again with another scale are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs

pytestmark = [pytest.mark.core, pytest.mark.usefixtures("on_cpu")]

N, D, LAYERS = 8, 64, 3
CPUS = jax.devices("cpu")
CURRENT = jxs.float8.CurrentScaling(min_dim=0)


def mesh_of():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,), devices=CPUS[:N])


def params():
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return {
        f"w{i}": jax.random.normal(k, (D, D), jnp.float32) * (i + 1)
        for i, k in enumerate(keys)
    }


def batch():
    x = jax.random.normal(jax.random.key(1), (N * 8, D), jnp.float32)
    return x * jnp.linspace(0.1, 10.0, N * 8, dtype=jnp.float32)[:, None]


def plain(w):
    return lax.all_gather(w, "data", tiled=True)


def float8(w):
    return jxs.float8.all_gather(w, "data")


def mlp_loss(p, x, gather=lambda w: w):
    h = x
    for i in range(LAYERS):
        h = jnp.tanh(h @ gather(p[f"w{i}"]))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def fsdp_step(gather, check_vma=True, where="inside", recipe=CURRENT):
    """A jitted FSDP shard_map step: weights and batch split by rows, each
    weight gathered by ``gather`` before its matmul; the gradients come back
    split by rows. ``where``: autocast and the gradient inside the body, or
    around a loss that calls shard_map."""
    mesh = mesh_of()
    specs = dict(mesh=mesh, in_specs=(P("data"), P("data")), check_vma=check_vma)

    def local(p, x):
        return mlp_loss(p, x, gather)

    if where == "around":
        loss = jax.shard_map(
            lambda p, x: lax.pmean(local(p, x), "data"), out_specs=P(), **specs
        )
        return jax.jit(
            jax.value_and_grad(jxs.autocast(loss, jnp.bfloat16, float8=recipe))
        )
    loss = jxs.autocast(local, jnp.bfloat16, float8=recipe)

    def body(p, x):
        if check_vma:
            return jax.value_and_grad(lambda p, x: lax.pmean(loss(p, x), "data"))(p, x)
        value, grads = jax.value_and_grad(lambda p, x: loss(p, x) / N)(p, x)
        return lax.psum(value, "data"), grads

    return jax.jit(jax.shard_map(body, out_specs=(P(), P("data")), **specs))


def sharded(mesh):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    return jax.tree.map(put, params()), put(batch())


def assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["inside", "around"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_float8_gather_matches_gather_then_quantise(check_vma, where):
    args = sharded(mesh_of())
    got = fsdp_step(float8, check_vma, where)(*args)
    assert_close(got, fsdp_step(plain, check_vma, where)(*args))
    one_device = jxs.autocast(mlp_loss, jnp.bfloat16, float8=CURRENT)
    assert_close(got, jax.jit(jax.value_and_grad(one_device))(params(), batch()))


@pytest.mark.parametrize("where", ["inside", "around"])
def test_float8_gather_moves_float8_bits_and_scatters_float32(where):
    args = sharded(mesh_of())
    f8 = jxs.diagnostics.collective_report(fsdp_step(float8, where=where))(*args)
    f32 = jxs.diagnostics.collective_report(fsdp_step(plain, where=where))(*args)
    gathers = f8.select("all-gather")
    assert len(gathers) == LAYERS
    assert {(c.dtype, c.shape) for c in gathers} == {("uint8", (D, D))}
    assert f8.bytes("all-gather") * 2 <= f32.bytes("all-gather")  # a quarter
    assert f32.dtypes("all-gather") == ("float32",)
    # The backward: the float32 gradient of each gathered weight, scattered.
    scatters = f8.select("reduce-scatter")
    assert len(scatters) == LAYERS
    assert {(c.dtype, c.shape) for c in scatters} == {("float32", (D // N, D))}
    # One amax more per layer than the f32 gather's step: the blocks' (the
    # site then reduces the gathered weight's, as it reduced it before).
    amaxes = len(f8.select("all-reduce", "amax"))
    assert amaxes == len(f32.select("all-reduce", "amax")) + LAYERS


@pytest.mark.parametrize("axis", [0, 1])
def test_float8_gather_is_the_whole_tensor_quantised_with_one_scale(axis):
    w = params()["w2"]
    spec = P("data") if axis == 0 else P(None, "data")
    fn = jax.shard_map(
        lambda b: jxs.float8.all_gather(b, "data", axis=axis),
        mesh=mesh_of(),
        in_specs=spec,
        out_specs=P(),
        check_vma=False,
    )
    got = jax.jit(fn)(w)
    scale = jxs.float8.scale_from_amax(jnp.max(jnp.abs(w)), jnp.float8_e4m3fn)
    want = jxs.float8.dequantize(
        jxs.float8.quantize(w, scale, jnp.float8_e4m3fn), scale
    )
    # Every value a float8 value times the one scale...
    q = got / scale
    on_grid = q.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(q), np.asarray(on_grid), rtol=1e-6)
    # ... the one next to w (x / scale is compiled differently across jax
    # versions, a reciprocal or a division: a value may round to the other
    # neighbour).
    step = float(scale) * 2.0**-9  # float8_e4m3fn's subnormal step
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=2.0**-3, atol=step
    )


def test_float8_gather_of_a_block_with_inf_is_nan():
    w = params()["w0"].at[3, 5].set(jnp.inf)
    fn = jax.shard_map(
        float8, mesh=mesh_of(), in_specs=P("data"), out_specs=P(), check_vma=False
    )
    assert bool(jnp.all(jnp.isnan(jax.jit(fn)(w))))


@pytest.mark.parametrize(
    ("recipe", "error", "match"),
    [
        (jxs.float8.DelayedScaling(min_dim=0), ValueError, "delayed scaling"),
        (jxs.float8.RowwiseScaling(min_dim=0), ValueError, "RowwiseScaling"),
        ("current", TypeError, "`recipe` must be a float8 recipe"),
    ],
)
def test_float8_gather_refuses_recipes_that_quantise_again(recipe, error, match):
    with pytest.raises(error, match=match):
        jxs.float8.all_gather(jnp.ones((8, 8)), "data", recipe=recipe)


def test_float8_gather_refuses_delayed_scaling_in_scope():
    """Under ``jxs.float8.value_and_grad`` with a delayed recipe the site would
    quantise the gathered values again with its own (delayed) scale."""
    delayed = jxs.float8.DelayedScaling(history_len=4, min_dim=0)
    mesh = mesh_of()
    fn = jxs.autocast(lambda p, x: mlp_loss(p, x, float8), jnp.bfloat16, float8=delayed)

    def body(p, x):
        state = jxs.float8.init(fn, p, x)
        return jxs.float8.value_and_grad(fn, state)(p, x)[0]

    smap = jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(), check_vma=False
    )
    with pytest.raises(ValueError, match="delayed scaling"):
        jax.eval_shape(smap, params(), batch())


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "match"),
    [
        (jnp.ones((8, 8), jnp.int32), {}, TypeError, "must be a floating array"),
        (jnp.ones((8, 8)), {"axis": 2}, ValueError, r"`axis` must be a dimension"),
    ],
)
def test_float8_gather_bad_input(x, kwargs, error, match):
    with pytest.raises(error, match=match):
        jxs.float8.all_gather(x, "data", **kwargs)


def test_float8_gather_over_an_unknown_axis_is_loud():
    fn = jax.shard_map(
        lambda b: jxs.float8.all_gather(b, "model"),
        mesh=mesh_of(),
        in_specs=P("data"),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(NameError, match="model"):
        jax.eval_shape(fn, params()["w0"])
