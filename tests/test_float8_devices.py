"""Float8 across devices: one scale for every device (issue 32, item 3).

The suite runs with 8 CPU devices (``tests/conftest.py``). A float8 MLP whose
batch rows span very different ranges (each device's block its own amax) is
run on one device, under ``jit`` with sharded inputs (GSPMD: data parallel, and
with each weight split by rows as FSDP stores it) and inside ``shard_map``
(``jxs.autocast`` inside the body, and around a function that calls
``shard_map``). Every device must quantise with the scale of the whole tensor:
the loss and gradients match the one-device program's (to a tolerance:
differently compiled programs), and delayed scaling's state is the same on
every device. The compiled GSPMD step reduces each sharded tensor's amax with
one scalar all-reduce.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
import jaxscale.float8._numerics as numerics
from jaxscale import _hlo

pytestmark = [pytest.mark.core, pytest.mark.usefixtures("on_cpu")]

N, D, LAYERS = 8, 64, 3
CPUS = jax.devices("cpu")
CURRENT = jxs.float8.CurrentScaling(min_dim=0)
DELAYED = jxs.float8.DelayedScaling(history_len=4, min_dim=0)


def mesh_of():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,), devices=CPUS[:N])


def params():
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return {
        f"w{i}": jax.random.normal(k, (D, D), jnp.float32) * (i + 1)
        for i, k in enumerate(keys)
    }


def batch():
    # Rows from 0.1 to 10 in range: each device's block has its own amax.
    x = jax.random.normal(jax.random.key(1), (N * 8, D), jnp.float32)
    return x * jnp.linspace(0.1, 10.0, N * 8, dtype=jnp.float32)[:, None]


def mlp_loss(p, x):
    h = x
    for i in range(LAYERS):
        h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h.astype(jnp.float32) ** 2)


def f8(recipe=CURRENT):
    return jxs.autocast(mlp_loss, jnp.bfloat16, float8=recipe)


def put(tree, mesh, spec):
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)


def assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def reference():
    return jax.jit(jax.value_and_grad(f8()))(params(), batch())


# --------------------------------------------------------------------------- #
# Compiled HLO: scalar all-reduces, all-gathers and their bytes.
# --------------------------------------------------------------------------- #


def collectives(hlo: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """``(kind, [(element type, element count), ...])`` of each all-reduce and
    all-gather in ``hlo`` (a combined one lists several)."""
    out = []
    for i in _hlo.instructions(hlo):
        kind = i.opcode.removesuffix("-start")
        if kind in ("all-reduce", "all-gather"):
            shapes = [(t, math.prod(dims)) for t, dims in _hlo.shapes(i.type)]
            out.append((kind, shapes))
    return out


def scalar_all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduce ops holding a scalar, scalars they reduce)."""
    ops = [s for k, s in collectives(hlo) if k == "all-reduce"]
    scalars = [sum(1 for _, n in s if n == 1) for s in ops]
    return sum(1 for n in scalars if n), sum(scalars)


def added_scalars(step, args, bf16_step) -> tuple[int, int]:
    """The float8 step's scalar all-reduce ops, and the scalars it reduces
    beyond those of the same step under bfloat16 autocast (``bf16_step``)."""
    f8_ops, f8_scalars = scalar_all_reduces(step.lower(*args).compile().as_text())
    _, bf16_scalars = scalar_all_reduces(bf16_step.lower(*args).compile().as_text())
    return f8_ops, f8_scalars - bf16_scalars


# --------------------------------------------------------------------------- #
# 1. GSPMD: jit over a mesh. The amax of a sharded array is a global reduction.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_gspmd_float8_matches_one_device_with_one_all_reduce_per_amax(layout):
    mesh = mesh_of()
    wspec = P() if layout == "data_parallel" else P("data", None)
    p, x = put(params(), mesh, wspec), put(batch(), mesh, P("data"))
    step = jax.jit(jax.value_and_grad(f8()))
    assert_close(step(p, x), reference())
    bf16 = jax.jit(jax.value_and_grad(f8(None)))
    ops, scalars = added_scalars(step, (p, x), bf16)
    # An amax per sharded tensor: the activation of each layer (and under
    # FSDP its weight) in the forward, the gradient in the backward.
    assert scalars == LAYERS * (2 if layout == "data_parallel" else 3)
    assert ops <= scalars + 1  # and the loss's, combined or not


@pytest.mark.parametrize(
    "recipe",
    [CURRENT, jxs.float8.RowwiseScaling(min_dim=0)],
    ids=["current", "rowwise"],
)
def test_float8_data_parallel_on_an_explicit_mesh(recipe):
    """Sharding in types (``jax.make_mesh``'s default from jax 0.10): a weight
    gradient contracts the batch, sharded on both operands, and JAX refuses to
    choose the result's sharding (a ``ShardingTypeError``); a site gives each
    gradient its primal's. A differently compiled program: its gradients are
    as close to float32's as one device's float8 step is."""
    mesh = jax.make_mesh(
        (N,), ("data",), axis_types=(AxisType.Explicit,), devices=CPUS[:N]
    )
    keys = jax.random.split(jax.random.key(2), LAYERS)
    p = {f"w{i}": jax.random.normal(k, (D, D)) / D**0.5 for i, k in enumerate(keys)}
    x = jax.random.normal(jax.random.key(3), (N * 8, D))
    exact = jax.jit(jax.grad(mlp_loss))(p, x)
    one = jax.jit(jax.grad(f8(recipe)))(p, x)
    g = jax.jit(jax.grad(f8(recipe)))(put(p, mesh, P()), put(x, mesh, P("data")))

    def error(grads):
        return max(
            float(jnp.linalg.norm(grads[k] - exact[k]) / jnp.linalg.norm(exact[k]))
            for k in p
        )

    assert 0 < error(one) < 0.3  # float8_e5m2 gradients: about 10%
    assert error(g) < 1.5 * error(one) + 1e-3
    for k in p:
        assert g[k].sharding.is_fully_replicated, k


# --------------------------------------------------------------------------- #
# 2. shard_map: each block's amax is reduced over the manual axes (lax.pmax).
# --------------------------------------------------------------------------- #


def shard_map_step(check_vma, where, recipe=CURRENT):
    """A jitted data-parallel shard_map step: replicated params, rows of the
    batch per device; ``where``: autocast and the gradient inside the body, or
    around a loss that calls shard_map."""
    mesh = mesh_of()
    specs = dict(mesh=mesh, in_specs=(P(), P("data")), check_vma=check_vma)
    if where == "around":
        loss = jax.shard_map(
            lambda p, x: lax.pmean(mlp_loss(p, x), "data"), out_specs=P(), **specs
        )
        fp8 = jxs.autocast(loss, jnp.bfloat16, float8=recipe)
        return jax.jit(jax.value_and_grad(fp8)), mesh
    loss = f8(recipe)

    def body(p, x):
        if check_vma:  # the gradient of a replicated input is summed by JAX
            mean = lambda p, x: lax.pmean(loss(p, x), "data")  # noqa: E731
            return jax.value_and_grad(mean)(p, x)
        value, grads = jax.value_and_grad(loss)(p, x)
        return lax.pmean(value, "data"), lax.pmean(grads, "data")

    return jax.jit(jax.shard_map(body, out_specs=(P(), P()), **specs)), mesh


@pytest.mark.parametrize("where", ["inside", "around"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_float8_matches_one_device(check_vma, where):
    step, mesh = shard_map_step(check_vma, where)
    p, x = put(params(), mesh, P()), put(batch(), mesh, P("data"))
    assert_close(step(p, x), reference())
    bf16, _ = shard_map_step(check_vma, where, recipe=None)
    ops, scalars = added_scalars(step, (p, x), bf16)
    # x and w of each site in the forward (a replicated weight is varying by
    # type at the dot: JAX casts it), the gradient in the backward.
    assert scalars == 3 * LAYERS
    assert ops <= scalars + 2


def test_shard_map_with_per_device_amax_would_differ(monkeypatch):
    """The problem the reduction solves: each device's own amax gives each its
    own scale, and a result that is not the one-device program's."""
    monkeypatch.setattr(numerics, "reduction_axes", lambda x: ())
    step, mesh = shard_map_step(True, "inside")
    p, x = put(params(), mesh, P()), put(batch(), mesh, P("data"))
    with pytest.raises(AssertionError):
        assert_close(step(p, x), reference())


def per_device_state_step(check_vma):
    """A shard_map step with delayed scaling that returns every device's copy
    of the new state (stacked along the data axis)."""
    mesh = mesh_of()
    loss = f8(DELAYED)

    def body(p, x, state):
        # This device's share of the global mean loss (unchecked, a pmean's
        # transpose would sum the cotangents of every device).
        share = lambda p, x: lax.pmean(loss(p, x), "data")  # noqa: E731
        if not check_vma:
            share = lambda p, x: loss(p, x) / N  # noqa: E731
        value, grads, new = jxs.float8.value_and_grad(share, state)(p, x)
        return jax.tree.map(lambda a: a[None], new)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P("data"), P()),
        out_specs=P("data"),
        check_vma=check_vma,
    )
    return jax.jit(fn), mesh


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_delayed_state_is_the_same_on_every_device(check_vma):
    state = jxs.float8.init(f8(DELAYED), params(), batch())
    _, _, want = jax.jit(jxs.float8.value_and_grad(f8(DELAYED), state))(
        params(), batch()
    )
    step, mesh = per_device_state_step(check_vma)
    p, x = put(params(), mesh, P()), put(batch(), mesh, P("data"))
    copies = step(p, x, put(state, mesh, P()))
    for got, ref in zip(jax.tree.leaves(copies), jax.tree.leaves(want), strict=True):
        got = np.asarray(got)
        for device in range(1, N):
            np.testing.assert_array_equal(got[device], got[0])
        np.testing.assert_allclose(got[0], np.asarray(ref), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- #
# The amax key: one integer max-reduction; a NaN wins over inf, exact values.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("blocks", "want"),
    [
        ([[1.0, -3.0], [2.0, 0.5]], 3.0),
        ([[1.0, np.nan], [2.0, 0.5]], np.nan),
        ([[1.0, np.nan], [-np.inf, 0.5]], np.nan),
        ([[1.0, 7.0], [-np.inf, 0.5]], np.inf),
        ([[0.0, 0.0], [0.0, -0.0]], 0.0),
        ([[np.finfo(np.float32).max, 1.0], [2.0, 0.5]], np.finfo(np.float32).max),
    ],
)
def test_amax_over_blocks_is_exact_and_keeps_inf_and_nan(blocks, want):
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=CPUS[:2])
    x = jnp.asarray(blocks, jnp.float32)
    fn = jax.shard_map(
        lambda b: numerics.amax(b), mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    got = float(jax.jit(fn)(x))
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert got == want  # exact: float32's largest value too
    assert np.isnan(want) == np.isnan(float(numerics.amax(x)))
