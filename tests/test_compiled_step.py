"""The compiled step: what XLA makes of the branch-free skip.

The skip decision is one scalar that every selected leaf reads. Computed as
``~any(flags)`` over ``n`` per-leaf flags, XLA would fuse the ``n``-operand
``or`` into each of the ``n`` selects (``n**2`` operands, a compile time
quadratic in the number of leaves); jaxscale reduces the flags through an
op that XLA does not fuse into its consumers, so each select reads one
operand. Pinned on XLA:CPU with the current jax (integration tier).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxscale as jxs

pytestmark = pytest.mark.integration

_FUSION = re.compile(r"^\s*%?[\w.\-]+ = \S+ fusion\((.*?)\), kind=", re.M)


def fusion_operands(n_leaves: int) -> list[int]:
    """The operand count of every fusion of the compiled step."""
    step, args = step_for(n_leaves)
    text = jax.jit(step).lower(*args).compile().as_text()
    return [len(m.group(1).split(",")) for m in _FUSION.finditer(text)]


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
