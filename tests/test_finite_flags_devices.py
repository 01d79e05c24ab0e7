"""The finite flags of a jitted step across devices: how many collectives carry
them, and that a non-finite value in one device's block skips the step on all.

Counted with ``benchmarks/finite_flags.py``'s steps (flax linen, flax NNX and
equinox models under ``jxs.dynamic_scaling(optax.adamw)``) on the suite's 8 CPU
devices (``tests/conftest.py``). XLA's partitioner reduces each group of leaves'
flags over the devices that shard them, and XLA's all-reduce combiner merges
the reductions over the same devices into one instruction: none for data
parallelism (the gradients arrive replicated), one for FSDP or tensor
parallelism, one per set of mesh axes that shards some gradient for FSDP and
tensor parallelism together (docs/multidevice.md).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs

ROOT = Path(__file__).resolve().parents[1]
CPUS = jax.devices("cpu")
BAD_DEVICE = 5


def counts(library, layout):
    """``(instructions, arrays)`` carrying finite flags in the compiled step."""
    pytest.importorskip("flax")
    if library == "equinox":
        pytest.importorskip("equinox")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import finite_flags

    mesh = finite_flags._mesh(None, layout)
    flags, _ = finite_flags.finite_flag_collectives(library, layout, mesh)
    return len({c.instruction or c.name for c in flags}), len(flags)


@pytest.mark.integration
@pytest.mark.pinned
@pytest.mark.parametrize("library", ["linen", "nnx", "equinox"])
@pytest.mark.parametrize(
    ("layout", "expected"),
    [("data parallel", 0), ("fsdp", 1), ("tensor parallel", 1)],
)
def test_one_finite_flag_collective_per_step(library, layout, expected):
    # jax 0.10.2's XLA:CPU: the flags of several groups of leaves travel as
    # the arrays of one combined all-reduce (one instruction).
    instructions, arrays = counts(library, layout)
    assert instructions == expected, (instructions, arrays)
    if expected:
        assert arrays > 1  # several groups' flags, combined


@pytest.mark.integration
@pytest.mark.pinned
def test_fsdp_with_tensor_parallelism_reduces_once_per_device_group():
    # On a 2 x 4 mesh, gradients sharded over ``data`` only, ``model`` only and
    # both have their flags reduced over different device groups, which XLA
    # does not combine: three all-reduces.
    assert counts("linen", "fsdp+tp")[0] == 3


# --------------------------------------------------------------------------- #
# Behaviour: a non-finite value in one device's block skips everywhere.
# --------------------------------------------------------------------------- #


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind in "fV" else x


def assert_same_on_every_device(tree):
    for leaf in jax.tree.leaves(tree):
        groups = defaultdict(list)
        for shard in leaf.addressable_shards:
            groups[str(shard.index)].append(bits(shard.data))
        for copies in groups.values():
            for other in copies[1:]:
                np.testing.assert_array_equal(copies[0], other)


def assert_bit_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


FLOAT8 = [jnp.float8_e5m2, jnp.float8_e4m3fn]


@pytest.mark.core
@pytest.mark.parametrize(
    "dtype",
    [jnp.float32, jnp.float16, jnp.bfloat16, *FLOAT8],
    ids=lambda d: jnp.dtype(d).name,
)
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=str)
@pytest.mark.parametrize("layout", ["fsdp", "tensor parallel"])
def test_a_non_finite_value_in_one_block_skips_on_every_device(dtype, value, layout):
    if dtype == jnp.float8_e4m3fn and np.isinf(value):
        pytest.skip("float8_e4m3fn has no inf (an overflow is NaN)")
    if layout == "fsdp":
        mesh = jax.make_mesh((8,), ("data",), (AxisType.Auto,), devices=CPUS[:8])
        specs = {"w": P("data", None), "v": P(None, "data"), "b": P("data")}
    else:
        mesh = jax.make_mesh(
            (2, 4), ("data", "model"), (AxisType.Auto,) * 2, devices=CPUS[:8]
        )
        specs = {"w": P(None, "model"), "v": P("model", None), "b": P()}
    host = {
        "w": np.linspace(-1, 1, 32 * 16).reshape(32, 16),
        "v": np.linspace(1, 2, 16 * 32).reshape(16, 32),
        "b": np.linspace(0, 1, 16),
    }

    def put(tree):
        return jax.tree.map(
            lambda x, s: jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, s)),
            tree,
            specs,
        )

    params = put(host)
    tx = jxs.dynamic_scaling(
        optax.sgd(0.1, momentum=0.9), jxs.DynamicLossScale.create(init_scale=1.0)
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ones = jax.tree.map(lambda x: np.full(x.shape, 0.25), host)
    params, state = step(params, state, put(ones))
    assert int(state.skipped_steps) == 0
    bad = jax.tree.map(np.copy, ones)
    # one element of the block that one device holds
    target = bad["v"]
    row = (BAD_DEVICE % 4) * 4 + 1 if layout != "fsdp" else 3
    col = BAD_DEVICE * 4 + 2 if layout == "fsdp" else 7
    target[row, col] = value
    bad = put(bad)
    holders = {
        s.device
        for s in bad["v"].addressable_shards
        if not np.isfinite(np.asarray(s.data, np.float32)).all()
    }
    assert 0 < len(holders) < 8
    new_params, new_state = step(params, state, bad)
    assert_bit_identical(new_params, params)
    assert_bit_identical(new_state.inner_state, state.inner_state)
    assert_same_on_every_device((new_params, new_state))
    assert int(new_state.skipped_steps) == 1
    assert jxs.diagnostics.nonfinite_paths(new_state) == ["v"]
