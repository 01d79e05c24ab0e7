"""One overflow decision for every device: jit over a mesh, shard_map, pmap, vmap.

The suite runs with 8 CPU devices (``tests/conftest.py``). An ``inf`` is put in
one block of one gradient leaf (one device's share); every device must skip the
step, and the parameters, the optimizer state and the loss scale must be the
same on every device afterwards. Under ``jit`` the compiled program must reach
that decision with one small all-reduce, never by gathering gradients.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import set_mesh
from helpers import relaxed
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
from jaxscale import _hlo
from jaxscale._hlo_collectives import COLLECTIVE_KINDS

pytestmark = pytest.mark.core

N = 8
BAD_DEVICE = 5  # the one device whose block of the gradient overflows
INIT = 2.0**16


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


def assert_same_on_every_device(tree):
    """Every device holding a block of a leaf holds the same bits for it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        groups = defaultdict(list)
        for shard in leaf.addressable_shards:
            groups[str(shard.index)].append(bits(shard.data))
        for copies in groups.values():
            for other in copies[1:]:
                np.testing.assert_array_equal(
                    copies[0], other, err_msg=jax.tree_util.keystr(path)
                )


def assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


# CPU devices by name: a GPU host has one device of its default backend, and the
# CPU backend's 8 (tests/conftest.py) beside it.
CPUS = jax.devices("cpu")


def mesh_of(axis_type, shape=(N,), names=("data",)):
    devices = CPUS[: int(np.prod(shape))]
    return jax.make_mesh(
        shape, names, axis_types=(axis_type,) * len(shape), devices=devices
    )


# --------------------------------------------------------------------------- #
# Compiled HLO: which collectives, of what size.
# --------------------------------------------------------------------------- #


def collectives(hlo: str) -> list[tuple[str, bool, list[int]]]:
    """``(kind, on_entry, element counts)`` of every collective in ``hlo``.

    ``on_entry`` is true for those in the ENTRY computation, which runs on every
    step (the bodies of conditionals run only when their branch is taken).
    """
    out, entry = [], _hlo.computations(hlo)[1]
    for i in _hlo.instructions(hlo):
        kind = i.opcode.removesuffix("-start")
        if kind in COLLECTIVE_KINDS:
            sizes = [math.prod(dims) for _, dims in _hlo.shapes(i.type)]
            out.append((kind, i.computation == entry, sizes))
    return out


# --------------------------------------------------------------------------- #
# jit over a mesh: XLA reduces the finite check over every device.
# --------------------------------------------------------------------------- #


def fsdp_params():
    return {
        "w": jnp.linspace(-1.0, 1.0, 64 * 32, dtype=jnp.float32).reshape(64, 32),
        "v": jnp.linspace(0.5, 2.0, 16 * 64, dtype=jnp.float32).reshape(16, 64),
        "b": jnp.zeros((32,), jnp.float32),
    }


def fsdp_specs():
    # Split on the leading, a minor and the only dimension.
    return {"w": P("data", None), "v": P(None, "data"), "b": P("data")}


def fsdp_grads(value):
    """Host gradients of the scaled loss, every entry ``value``."""
    return jax.tree.map(lambda p: np.full(p.shape, value, np.float32), fsdp_params())


def put(tree, mesh, specs):
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_fully_sharded_inf_in_one_block_skips_on_every_device(axis_type):
    mesh = mesh_of(axis_type)
    specs = fsdp_specs()
    params = put(fsdp_params(), mesh, specs)
    tx = jxs.dynamic_scaling(relaxed(optax.adam(1e-2)))
    state = tx.init(params)
    # The scale and counters start replicated over the params' mesh.
    for leaf in jax.tree.leaves(state.loss_scale) + [state.steps]:
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.mesh.shape == mesh.shape

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, put(fsdp_grads(INIT), mesh, specs))
    bad = fsdp_grads(INIT)
    bad["v"][3, 8 * BAD_DEVICE + 2] = np.inf  # in BAD_DEVICE's block of "v" only
    bad = put(bad, mesh, specs)
    holders = [
        s.device for s in bad["v"].addressable_shards if not np.isfinite(s.data).all()
    ]
    assert len(holders) == 1

    new_params, new_state = step(params, state, bad)
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    for tree in (new_params, new_state):
        assert_same_on_every_device(tree)
    for s in new_state.loss_scale.loss_scale.addressable_shards:
        assert float(s.data) == INIT / 2
    for s in new_state.skipped_steps.addressable_shards:
        assert int(s.data) == 1
    assert new_state.loss_scale.loss_scale.sharding.is_fully_replicated
    assert new_params["v"].sharding.spec == specs["v"]


def fully_sharded_collectives(axis_type, tx):
    """``collectives`` of a jitted FSDP step of ``tx`` (parameters, gradients
    and state sharded over 8 CPU devices) and its number of leaves."""
    mesh = mesh_of(axis_type)
    specs = fsdp_specs()
    params = put(fsdp_params(), mesh, specs)
    grads = put(fsdp_grads(1.0), mesh, specs)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    hlo = jax.jit(step).lower(params, state, grads).compile().as_text()
    return collectives(hlo), len(jax.tree.leaves(params))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_fully_sharded_step_reduces_flags_and_gathers_nothing(axis_type):
    """The decision costs scalar all-reduces only. How many XLA combines them
    into is its own choice (one on jax 0.10.2 and 0.12, three on 0.7.x):
    tests/test_compiled_step.py pins that on the default jax."""
    inner = optax.sgd(0.1, momentum=0.9)
    bare, _ = fully_sharded_collectives(axis_type, inner)
    assert bare == []  # the bare step needs none
    found, n_leaves = fully_sharded_collectives(axis_type, jxs.dynamic_scaling(inner))
    kinds = {kind for kind, _, _ in found}
    assert kinds == {"all-reduce"}, found  # no all-gather, all-to-all, ...
    for _, _, sizes in found:
        # One scalar per gradient leaf at most: never a block of a gradient.
        assert all(size == 1 for size in sizes), found
    assert sum(len(sizes) for _, _, sizes in found) <= n_leaves, found
    # The path every step takes reduces the flags (not only a branch).
    assert any(on_entry for _, on_entry, _ in found), found


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_layers_of_one_role_share_a_check_and_gather_nothing(axis_type):
    """Six layers, each a kernel and a bias sharded alike per role: the check
    reduces each role's leaves together (jaxscale/_finite.py), which must
    cost no gather, and still names the one leaf whose block overflowed."""
    mesh = mesh_of(axis_type)
    params = {
        f"layer_{i}": {
            "kernel": jnp.full((N * 4, 16), 0.1 * (i + 1), jnp.float32),
            "bias": jnp.zeros((16 * N,), jnp.float32),
        }
        for i in range(6)
    }
    specs = jax.tree.map(lambda x: P("data", *([None] * (x.ndim - 1))), params)
    params = put(params, mesh, specs)
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = put(
        jax.tree.map(lambda p: np.ones(p.shape, np.float32), params), mesh, specs
    )
    hlo = jax.jit(step).lower(params, state, grads).compile().as_text()
    found = collectives(hlo)
    assert {kind for kind, _, _ in found} == {"all-reduce"}, found
    for _, _, sizes in found:  # flags, never a block of a gradient
        assert all(size <= 12 for size in sizes), found

    params, state = jax.jit(step)(params, state, grads)
    bad = jax.tree.map(lambda p: np.ones(p.shape, np.float32), params)
    bad["layer_4"]["kernel"][4 * BAD_DEVICE + 1, 3] = np.inf
    new_params, new_state = jax.jit(step)(params, state, put(bad, mesh, specs))
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert_same_on_every_device((new_params, new_state))
    assert jxs.diagnostics.nonfinite_paths(new_state) == ["layer_4/kernel"]


def dp_loss(params, x):
    h = x @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16)[None]
    return jnp.mean(h.astype(jnp.float32) ** 2)


def dp_setup(axis_type):
    mesh = mesh_of(axis_type)
    params = jax.device_put(
        {
            "w": jnp.linspace(-0.1, 0.1, 16 * 32, dtype=jnp.float32).reshape(16, 32),
            "b": jnp.zeros((32,), jnp.float32),
        },
        NamedSharding(mesh, P()),
    )
    x = np.linspace(-1.0, 1.0, 64 * 16, dtype=np.float16).reshape(64, 16)
    return mesh, params, x


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_data_parallel_overflow_in_one_shard_of_the_batch_skips_everywhere(axis_type):
    mesh, params, x = dp_setup(axis_type)
    batch = NamedSharding(mesh, P("data"))
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
        loss, grads = jxs.value_and_grad(dp_loss, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, jax.device_put(x, batch))
    assert int(state.skipped_steps) == 0
    bad = x.copy()
    bad[8 * BAD_DEVICE + 1, 4] = np.inf  # one example of one device's shard
    new_params, new_state = step(params, state, jax.device_put(bad, batch))
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert_same_on_every_device((new_params, new_state))
    assert int(new_state.skipped_steps) == 1
    assert float(new_state.loss_scale.loss_scale) == INIT / 2


def test_data_parallel_scaling_adds_no_collective():
    """Data parallel: the gradients are all-reduced for the mean anyway, so the
    finite check runs on replicated gradients and needs no collective at all."""
    mesh, params, x = dp_setup(AxisType.Auto)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    inner = optax.sgd(0.1, momentum=0.9)
    tx = jxs.dynamic_scaling(inner)

    def bare(params, state, x):
        _, grads = jax.value_and_grad(dp_loss)(params, x)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def scaled(params, state, x):
        _, grads = jxs.value_and_grad(dp_loss, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def shapes(fn, state):
        hlo = jax.jit(fn).lower(params, state, x).compile().as_text()
        return sorted((kind, sorted(sizes)) for kind, _, sizes in collectives(hlo))

    bare_collectives = shapes(bare, inner.init(params))
    assert any(max(sizes) > 1 for _, sizes in bare_collectives)  # the grad mean
    assert shapes(scaled, tx.init(params)) == bare_collectives


def test_init_under_jit_in_a_mesh_context_is_replicated():
    mesh = mesh_of(AxisType.Auto)
    params = put(fsdp_params(), mesh, fsdp_specs())
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    with set_mesh(mesh):
        state = jax.jit(tx.init)(params)
    assert state.loss_scale.loss_scale.sharding.is_fully_replicated
    assert len(state.loss_scale.loss_scale.sharding.device_set) == N


def test_init_on_one_device_is_unchanged():
    state = jxs.dynamic_scaling(optax.sgd(0.1)).init({"w": jnp.ones(3)})
    assert len(state.loss_scale.loss_scale.sharding.device_set) == 1


# --------------------------------------------------------------------------- #
# shard_map and pmap: ``axis_name`` reduces the decision over the named axis.
# --------------------------------------------------------------------------- #


def data_parallel(tx, axis_name):
    """``tx`` after the data-parallel mean of the scaled gradients over the
    axis (in their own dtype, as torch's DDP all-reduces them): the one
    ``lax.pmean`` the multi-device guide shows (0.1.0's ``mean_grads=True``)."""

    def update(grads, state, params=None):
        return tx.update(lax.pmean(grads, axis_name), state, params)

    return optax.GradientTransformation(tx.init, update)


def replica_grads(value=INIT, bad=BAD_DEVICE, size=3):
    """``f32[N, size]``: row ``i`` is replica ``i``'s gradient; row ``bad`` has
    an inf (none if ``bad`` is None). Rows differ so a mean is visible."""
    g = (
        np.full((N, size), value, np.float32)
        * (1 + np.arange(N, dtype=np.float32))[:, None]
    )
    if bad is not None:
        g[bad, 1] = np.inf
    return jnp.asarray(g)


def shard_map_step(tx, mesh, axis="data", check_vma=True, per_replica=False):
    """A jitted shard_map step: replicated params and state, one gradient row
    per replica. ``per_replica``: return every replica's params and state,
    stacked, instead of asserting they are replicated."""

    def step(params, state, grads):
        updates, state = tx.update(grads[0], state, params)
        out = optax.apply_updates(params, updates), state
        return jax.tree.map(lambda x: x[None], out) if per_replica else out

    out_spec = P(axis) if per_replica else P()
    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P(axis)),
            out_specs=(out_spec, out_spec),
            check_vma=check_vma,
        )
    )


def test_shard_map_data_parallel_mean_grads_all_replicas_skip():
    """Replicated params, a different gradient on every replica (as under
    ``check_vma=False`` or when gradients come in per replica): a ``lax.pmean``
    averages them, ``axis_name`` makes the skip decision common."""
    mesh = mesh_of(AxisType.Auto)
    tx = data_parallel(
        jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9), axis_name="data"), "data"
    )
    params = jnp.zeros(3)
    state = tx.init(params)
    step = shard_map_step(tx, mesh)
    new_params, _ = step(params, state, replica_grads(bad=None))
    mean = np.mean(np.asarray(replica_grads(value=1.0, bad=None)), axis=0)
    np.testing.assert_allclose(new_params, -0.1 * mean, rtol=1e-6)
    assert_same_on_every_device(new_params)
    new_params, new_state = step(params, state, replica_grads())
    assert_bit_identical(new_params, params)
    assert_same_on_every_device((new_params, new_state))
    assert int(new_state.skipped_steps) == 1
    assert float(new_state.loss_scale.loss_scale) == INIT / 2


def test_shard_map_with_sharded_params_and_axis_name_all_replicas_skip():
    """Fully sharded inside shard_map: each device updates its own block."""
    mesh = mesh_of(AxisType.Auto)
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9), axis_name="data")
    params = jnp.zeros((N, 4))
    state = tx.init(params)
    state_specs = jax.tree.map(lambda _: P(), state)._replace(
        inner_state=jax.tree.map(lambda _: P("data"), state.inner_state)
    )

    @jax.jit
    @jax.shard_map(
        mesh=mesh,
        in_specs=(P("data"), state_specs, P("data")),
        out_specs=(P("data"), state_specs),
    )
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = np.full((N, 4), INIT, np.float32)
    params, state = step(params, state, jnp.asarray(grads))
    grads[BAD_DEVICE, 2] = np.nan
    new_params, new_state = step(params, state, jnp.asarray(grads))
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert int(new_state.skipped_steps) == 1
    assert float(new_state.loss_scale.loss_scale) == INIT / 2


def test_shard_map_over_two_axes_with_a_tuple_axis_name():
    mesh = mesh_of(AxisType.Auto, shape=(2, 4), names=("x", "y"))
    tx = data_parallel(
        jxs.dynamic_scaling(optax.sgd(0.1), axis_name=("x", "y")), ("x", "y")
    )
    params = jnp.zeros(3)
    step = shard_map_step(tx, mesh, axis=("x", "y"))
    new_params, new_state = step(params, tx.init(params), replica_grads())
    assert_bit_identical(new_params, params)
    assert int(new_state.skipped_steps) == 1


def test_shard_map_without_axis_name_replicas_disagree():
    """Why ``axis_name`` exists: each replica decides alone on its own block."""
    mesh = mesh_of(AxisType.Auto)
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    params = jnp.zeros(3)
    state = tx.init(params)
    # JAX's replication check catches a state that differs between replicas...
    with pytest.raises(ValueError, match="out_specs"):
        shard_map_step(tx, mesh)(params, state, replica_grads())
    # ...and without it (or with a per-replica out_spec) they silently diverge.
    per_replica = shard_map_step(tx, mesh, check_vma=False, per_replica=True)
    _, states = per_replica(params, state, replica_grads())
    skipped = np.asarray(states.skipped_steps)
    scales = np.asarray(states.loss_scale.loss_scale)
    assert skipped.tolist() == [int(i == BAD_DEVICE) for i in range(N)]
    assert scales.tolist() == [INIT / 2 if i == BAD_DEVICE else INIT for i in range(N)]


def replicate(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *jnp.shape(x))), tree)


@pytest.mark.parametrize("mean_grads", [False, True])
def test_pmap_with_axis_name_all_replicas_skip(mean_grads):
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9), axis_name="i")
    if mean_grads:
        tx = data_parallel(tx, "i")
    params = jnp.zeros(3)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.pmap(step, axis_name="i", devices=CPUS[:N])
    params, state = replicate(params), replicate(tx.init(params))
    params, state = step(params, state, replica_grads(bad=None))
    if mean_grads:  # every replica applied the same mean
        np.testing.assert_array_equal(params, np.broadcast_to(params[0], params.shape))
    new_params, new_state = step(params, state, replica_grads())
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert np.asarray(new_state.skipped_steps).tolist() == [1] * N
    assert np.asarray(new_state.loss_scale.loss_scale).tolist() == [INIT / 2] * N


def test_pmap_without_axis_name_replicas_disagree():
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    params = jnp.zeros(3)
    step = jax.pmap(
        lambda p, s, g: tx.update(g, s, p)[1], axis_name="i", devices=CPUS[:N]
    )
    state = step(replicate(params), replicate(tx.init(params)), replica_grads())
    assert np.asarray(state.skipped_steps).tolist() == [
        int(i == BAD_DEVICE) for i in range(N)
    ]


# --------------------------------------------------------------------------- #
# The options' validation and the unbound-axis error.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"axis_name": 3}, TypeError, r"`axis_name` must be a str or tuple of str"),
        ({"axis_name": ["a"]}, TypeError, r"`axis_name` must be a str or tuple"),
        ({"axis_name": ("a", 1)}, TypeError, r"got \('a', 1\)\."),
        ({"axis_name": ()}, ValueError, r"`axis_name` must name at least one"),
    ],
)
def test_axis_options_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        jxs.dynamic_scaling(optax.sgd(0.1), **kwargs)


def test_axis_name_outside_a_mapped_axis_explains():
    tx = jxs.dynamic_scaling(optax.sgd(0.1), axis_name="data")
    params = jnp.zeros(3)
    with pytest.raises(NameError, match=r"`axis_name` 'data' is not bound here"):
        tx.update(jnp.ones(3), tx.init(params), params)


# --------------------------------------------------------------------------- #
# vmap.
# --------------------------------------------------------------------------- #


def test_vmap_over_states_gives_independent_scales_and_static_config():
    """An ensemble: one state per member, each decides alone."""
    ls = jxs.DynamicLossScale.create(init_scale=INIT, growth_interval=3)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    params = jnp.zeros((4, 3))
    states = jax.vmap(tx.init)(params)
    # Static configuration stays static (flax#4114): same tree structure as one
    # member's state, Python numbers in the treedef, only array leaves batched.
    assert jax.tree.structure(states) == jax.tree.structure(tx.init(params[0]))
    assert states.loss_scale.growth_interval == 3
    assert isinstance(states.loss_scale.growth_factor, float)
    assert states.loss_scale.loss_scale.shape == (4,)
    grads = jnp.full((4, 3), INIT).at[2, 0].set(jnp.inf)
    step = jax.jit(jax.vmap(tx.update))
    _, states = step(grads, states, params)
    assert np.asarray(states.loss_scale.loss_scale).tolist() == [
        INIT,
        INIT,
        INIT / 2,
        INIT,
    ]
    assert np.asarray(states.skipped_steps).tolist() == [0, 0, 1, 0]
    assert states.loss_scale.loss_scale.dtype == jnp.float32
    assert states.loss_scale.growth_interval == 3


def test_vmap_per_example_grads_then_one_update_keeps_a_scalar_scale():
    """flax#4114: vmapping the gradient function must not batch the scale."""
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)

    def loss_fn(params, x):
        return jnp.sum(params["w"] * x) ** 2

    @jax.jit
    def step(params, state, xs):
        per_example = jax.vmap(jxs.value_and_grad(loss_fn, state), in_axes=(None, 0))
        _, grads = per_example(params, xs)  # leaves f32[B, ...]
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    xs = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)
    params, state = step(params, state, xs)
    params, state = step(params, state, xs.at[1, 1].set(jnp.inf))
    assert state.loss_scale.loss_scale.shape == ()
    assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
    assert int(state.skipped_steps) == 1
    assert step._cache_size() == 1  # no retrace: the state's types never changed


def tx_without_axis():
    return jxs.dynamic_scaling(optax.sgd(0.1))


def test_vmap_update_with_axis_name_takes_one_decision():
    tx = data_parallel(jxs.dynamic_scaling(optax.sgd(0.1), axis_name="batch"), "batch")
    params = jnp.zeros(3)
    state = tx.init(params)
    update = jax.vmap(
        tx.update, in_axes=(0, None, None), out_axes=None, axis_name="batch"
    )
    grads = replica_grads(bad=None)
    updates, new_state = update(grads, state, params)
    ref_updates, ref_state = tx_without_axis().update(
        jnp.mean(grads, axis=0), state, params
    )
    np.testing.assert_allclose(updates, ref_updates, rtol=1e-6)
    assert new_state.loss_scale.loss_scale.shape == ()
    updates, new_state = update(replica_grads(), state, params)
    assert int(new_state.skipped_steps) == 1
    assert np.all(np.signbit(updates)) and not np.any(updates)


def test_vmap_update_with_a_shared_state_needs_axis_name():
    """Without ``axis_name`` each example decides alone: the state comes out
    batched, so asking for one shared state (``out_axes=None``) fails."""
    tx = tx_without_axis()
    params = jnp.zeros(3)
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=None)
    with pytest.raises(ValueError, match="out_axes"):
        update(replica_grads(), tx.init(params), params)


def test_axis_name_flags_every_replica():
    tx = jxs.dynamic_scaling(optax.sgd(0.1), axis_name="i")
    params = {"a": jnp.zeros(3), "b": jnp.zeros(3)}
    grads = {"a": replica_grads(), "b": replica_grads(bad=None)}
    update = jax.vmap(
        lambda g, s, p: tx.update(g, s, p)[1],
        in_axes=(0, None, None),
        out_axes=None,
        axis_name="i",
    )
    state = update(grads, tx.init(params), params)
    assert jxs.diagnostics.nonfinite_paths(state) == ["a"]


def test_pmean_in_own_dtype_overflow_is_a_skip():
    """The data-parallel mean sums float16 gradients in float16, as DDP
    all-reduces scaled gradients: a sum that overflows is an overflow like any
    other."""
    tx = data_parallel(
        jxs.dynamic_scaling(
            relaxed(optax.sgd(0.1)), jxs.StaticLossScale.create(1.0), axis_name="i"
        ),
        "i",
    )
    params = jnp.zeros(2, jnp.float16)
    grads = jnp.full((N, 2), 40000.0, jnp.float16)  # finite; the sum is not
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=None, axis_name="i")
    _, state = update(grads, tx.init(params), params)
    assert int(state.skipped_steps) == 1


def test_on_overflow_reports_the_leaves_bad_on_any_replica():
    events = []
    tx = jxs.diagnostics.monitor(
        jxs.dynamic_scaling(optax.sgd(0.1), axis_name="i"), on_overflow=events.append
    )
    params = {"a": jnp.zeros(3), "b": jnp.zeros(3)}
    grads = {"a": replica_grads(), "b": replica_grads(bad=None)}
    update = jax.vmap(
        lambda g, s, p: tx.update(g, s, p)[1],
        in_axes=(0, None, None),
        out_axes=None,
        axis_name="i",
    )
    update(grads, tx.init(params), params)
    jax.effects_barrier()
    assert events, "the skipped step fires the hook"
    assert {e.paths for e in events} == {("a",)}  # or-ed over the replicas
    assert {e.next_loss_scale for e in events} == {INIT / 2}


@pytest.mark.parametrize("wrap", ["dynamic_scaling", "accumulate"])
def test_shard_map_check_vma_stateful_inner_with_varying_grads(wrap):
    """A stateful inner optimizer fed gradients that vary over the axis, under
    ``check_vma=True``: the skip branch types the unchanged inner state as the
    apply branch does (varying), so tracing succeeds and both steps run. (In
    0.1.0 this raised a TypeError blaming dtypes, shapes or integer leaves.)"""
    mesh = mesh_of(AxisType.Auto)
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9), axis_name="data")
    if wrap == "accumulate":
        tx = jxs.accumulate(tx, every_k=1)
    params = jnp.zeros(3)
    state = tx.init(params)
    per_replica = shard_map_step(tx, mesh, check_vma=True, per_replica=True)
    new_params, new_state = per_replica(params, state, replica_grads(bad=None))
    assert bool(jnp.all(jxs.loss_scale_of(new_state).loss_scale == INIT))
    mine = np.asarray(replica_grads(value=1.0, bad=None))
    np.testing.assert_allclose(new_params, -0.1 * mine, rtol=1e-6)
    one = jax.tree.map(lambda x: x[0], new_state)
    skipped_params, skipped = per_replica(new_params[0], one, replica_grads())
    summary = jxs.diagnostics.summary(skipped)
    assert bool(jnp.all(summary["skipped_steps"] == 1)), "every replica skips"
    assert_bit_identical(skipped_params, jnp.broadcast_to(new_params[0], (N, 3)))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_the_guide_shard_map_snippet_runs_as_written(axis_type):
    """docs/multidevice.md's shard_map step, executed with a small problem.

    0.1.0's snippet missed the batch's device_put: on an ``Explicit`` mesh (what
    ``jax.make_mesh`` builds by default on jax 0.10) shard_map then raised
    ``in_specs ... does not match``; an ``Auto`` mesh accepts either.
    """
    import pathlib

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "multidevice.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    (snippet,) = [b for b in blocks if "@jax.shard_map" in b]
    mesh = mesh_of(axis_type)
    params = {"w": jnp.zeros((3, 1))}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4 * N, 3)), jnp.float32)

    def loss_fn(p, batch):
        return jnp.mean((batch @ p["w"].astype(jnp.float16)).astype(jnp.float32) ** 2)

    scope = {
        "jax": jax,
        "jnp": jnp,
        "lax": lax,
        "optax": optax,
        "jxs": jxs,
        "P": P,
        "NamedSharding": NamedSharding,
        "mesh": mesh,
        "loss_fn": lambda p, b: loss_fn(p, b.astype(jnp.float16)),
        "params": params,
        "batch": x,
    }
    exec(snippet, scope)  # noqa: S102 - our own documentation
    tx, step = scope["tx"], scope["train_step"]
    with jax.numpy_dtype_promotion("standard"):  # optax.adam promotes itself
        new_params, state, loss = step(params, tx.init(params), scope["batch"])
    assert bool(jxs.all_finite(new_params)) and np.isfinite(float(loss))
    assert int(state.steps) == 1 and bool(state.last_step_finite)
