"""Probes: a statistic per site carried out of the backward pass.

A *probe* is a zero input of the differentiated function, read by a
``custom_vjp`` at one site, whose backward returns the statistics it measured
as the probe's cotangent: ``jax.grad`` with respect to the probes is the
report, with no side effect and no host callback. The autocast interpreter
feeds a site in a ``scan`` body one probe per iteration; :func:`spread` is the
one rule for how the iterations' statistics combine: summed (counts, sums of
squares) or by their maximum (largest magnitudes, shares), by the probe's
declared ``combine``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["COMBINE", "spread"]

COMBINE = ("sum", "max")  # how a probe's statistics combine over iterations


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def spread(tree: Any, length: int, combine: str) -> Any:
    """``tree`` stacked ``length`` times along a new leading axis (one probe
    per iteration of a loop); its transpose combines the iterations' cotangents
    by ``combine``: ``"sum"`` (a gradient's own rule) or ``"max"``."""
    if combine not in COMBINE:
        raise ValueError(f"`combine` must be one of {COMBINE}, got {combine!r}.")
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (length, *jnp.shape(x))), tree)


def _spread_fwd(tree, length, combine):
    return spread(tree, length, combine), None


def _spread_bwd(length, combine, _, ct):
    reduce = jnp.sum if combine == "sum" else jnp.max
    return (jax.tree.map(lambda c: reduce(c, axis=0), ct),)


spread.defvjp(_spread_fwd, _spread_bwd)
