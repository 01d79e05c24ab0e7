"""The compiled step: what XLA makes of the branch-free skip.

The skip decision is one scalar that every selected leaf reads. Computed as
``~any(flags)`` over ``n`` per-leaf flags, XLA would fuse the ``n``-operand
``or`` into each of the ``n`` selects (``n**2`` operands, a compile time
quadratic in the number of leaves); jaxscale reduces the flags through an
op that XLA does not fuse into its consumers, so each select reads one
operand. Counts of one XLA: `pinned` (the default environment's jax only).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import relaxed

import jaxscale as jxs
from jaxscale import _hlo

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

# Compiled for one CPU device by name, on a GPU host too: these are XLA:CPU's
# figures (XLA:GPU's: benchmarks/step_account.py --target h100|h200).
CPU = jax.devices("cpu")[0]


def fusion_operands(n_leaves: int) -> list[int]:
    """The operand count of every fusion of the compiled step."""
    step, args = step_for(n_leaves)
    args = jax.device_put(args, CPU)
    text = jax.jit(step).lower(*args).compile().as_text()
    return [len(i.operands) for i in _hlo.instructions(text) if i.opcode == "fusion"]


def step_for(n_leaves: int):
    params = {f"w{i}": jnp.full((16, 16), 0.01 * (i + 1)) for i in range(n_leaves)}
    tx = jxs.dynamic_scaling(optax.sgd(0.1))

    def loss_fn(params, x):
        return sum(jnp.sum((x @ w) ** 2) for w in params.values())

    def step(params, opt_state, x):
        _, grads = jxs.value_and_grad(loss_fn, opt_state)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params), jnp.ones((4, 16)))


def test_no_fusion_reads_every_leafs_flag():
    small, large = fusion_operands(4), fusion_operands(64)
    # The per-leaf flags are stacked into one array (a fusion of up to 64
    # operands, once); every other fusion reads the decision as one operand,
    # so its operand count does not grow with the leaves.
    wide = [n for n in large if n > max(small)]
    assert len(wide) <= 2 and max(large) <= 64 + 2, (max(small), sorted(large)[-5:])


# --------------------------------------------------------------------------- #
# Kernels and bytes, by benchmarks/step_account.py's accounting of the
# optimized HLO of XLA:CPU. The assertions are on our own counts, with margins,
# not on XLA's fusion names.
# --------------------------------------------------------------------------- #

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_SPEC = importlib.util.spec_from_file_location(
    "step_account", BENCHMARKS / "step_account.py"
)
step_account = sys.modules.setdefault(
    "step_account", importlib.util.module_from_spec(_SPEC)
)
_SPEC.loader.exec_module(step_account)

SIDE = 128  # every parameter a SIDE x SIDE matrix: its gradient dwarfs activations


def layered_step(n_layers: int, scaled: bool, inner=None):
    """A jitted step over ``n_layers`` layers of one role (a kernel and a
    bias each), bare or with ``dynamic_scaling``; ``(kernels, n_params)``."""
    params = {
        f"layer_{i}": {
            "kernel": jnp.full((SIDE, SIDE), 0.01 * (i + 1)),
            "bias": jnp.zeros((SIDE,)),
        }
        for i in range(n_layers)
    }
    inner = inner or optax.sgd(0.1, momentum=0.9)
    tx = jxs.dynamic_scaling(inner) if scaled else inner
    grad = jxs.value_and_grad if scaled else None

    def loss_fn(params, x):
        h = x
        for layer in params.values():
            h = jnp.tanh(h @ layer["kernel"] + layer["bias"][None])
        return jnp.sum(h**2)

    def step(params, opt_state, x):
        if scaled:
            _, grads = grad(loss_fn, opt_state)(params, x)
        else:
            grads = jax.grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    args = (params, tx.init(params), jnp.ones((4, SIDE)))
    args = jax.device_put(args, CPU)
    text = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return step_account.kernels(text), n_params


def gradient_reductions(kernels) -> int:
    """Kernels that read at least a byte per element of one gradient leaf and
    write at most a sixteenth of what they read: the reductions over
    gradients (an optimizer pass writes as much as it reads; a reduction
    over activations reads far less than a SIDE x SIDE leaf)."""
    return sum(k.reads >= SIDE * SIDE and 16 * k.writes <= k.reads for k in kernels)


def test_check_reductions_do_not_grow_with_the_layers():
    # One layer: the check reduces its two leaves. Twenty-four layers of the
    # same two roles: still about two reductions (per role, all layers at
    # once), where one per leaf would be forty-eight.
    added = {}
    for n in (1, 24):
        bare, _ = layered_step(n, scaled=False)
        ours, _ = layered_step(n, scaled=True)
        added[n] = gradient_reductions(ours) - gradient_reductions(bare)
    assert 1 <= added[1] <= 3, added
    assert added[24] <= added[1] + 2, added


def test_bytes_added_per_parameter():
    # The check reads each gradient once (4 bytes a float32 parameter); a CPU
    # also writes and reads a one-byte mask and stacks it (8 bytes in all).
    # The optimizer's own passes (unscale and skip included) move no more
    # bytes than the bare step's: no separate select pass over its state.
    bare, n_params = layered_step(12, scaled=False, inner=relaxed(optax.adam(1e-3)))
    ours, _ = layered_step(12, scaled=True, inner=relaxed(optax.adam(1e-3)))
    extra = sum(k.bytes for k in ours) - sum(k.bytes for k in bare)
    assert extra / n_params <= 9.0, extra / n_params

    def state_passes(kernels):
        # Kernels that write a float32 array at least a leaf's size: the
        # optimizer's passes over g, m, v and p (and the backward's matmuls).
        return sum(
            k.bytes
            for k in kernels
            if any(d == "f32" and np.prod(s) >= SIDE * SIDE for d, s in k.signature[1])
        )

    assert state_passes(ours) <= 1.02 * state_passes(bare), state_passes(
        ours
    ) / state_passes(bare)


# --------------------------------------------------------------------------- #
# Across devices: XLA's all-reduce combiner (tests/test_multidevice.py checks,
# on every jax, that the decision reduces scalar flags and gathers nothing).
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_fully_sharded_step_combines_its_flags_into_one_all_reduce(axis_type):
    # jax 0.10.2 and 0.12 combine the flags into one all-reduce on the path
    # every step takes; jax 0.7.0 and 0.7.1 left three (one per leaf).
    from test_multidevice import fully_sharded_collectives

    axis_type = getattr(jax.sharding.AxisType, axis_type)
    found, _ = fully_sharded_collectives(
        axis_type, jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9))
    )
    assert sum(on_entry for _, on_entry, _ in found) == 1, found
