"""Probes: a statistic per site carried out of the backward pass.

A *probe* is a zero input of the differentiated function, read by a
``custom_vjp`` at one site, whose backward returns the statistics it measured
as the probe's cotangent: ``jax.grad`` with respect to the probes is the
report, with no side effect and no host callback.

A probe is a :class:`typing.NamedTuple` of ``float32`` arrays, one per
statistic, its *kind*: JAX carries the tuple through ``custom_vjp`` as it
carries any pytree, so the users read fields by name, never by position. A
kind declares, in a class attribute ``COMBINE`` (``{field: "sum" | "max"}``),
how each field combines when one site runs several times: summed (counts, sums
of squares) or by its maximum (largest magnitudes, shares). :func:`spread` is
the one rule that applies it: the autocast interpreter feeds a site in a
``scan`` body one probe per iteration, and the transpose of :func:`spread`
combines the iterations' statistics field by field. A probe read by the
user's own code in a loop (:func:`jaxscale.diagnostics.cotangent_probe`) is
combined by JAX's own rule for a value read many times, the sum: its kind
declares every field ``"sum"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["COMBINE", "combine_of", "spread", "stack", "unstack", "zeros"]

COMBINE = ("sum", "max")  # how a probe's statistics combine over iterations


def combine_of(kind: type) -> dict[str, str]:
    """The declared combine of each field of probe kind ``kind``, checked."""
    rule = getattr(kind, "COMBINE", None)
    fields = getattr(kind, "_fields", None)
    if fields is None or not isinstance(rule, Mapping) or set(rule) != set(fields):
        raise TypeError(
            f"a probe kind must be a NamedTuple with a `COMBINE` entry per field, "
            f"got {kind!r}."
        )
    bad = {f: c for f, c in rule.items() if c not in COMBINE}
    if bad:
        raise ValueError(f"`COMBINE` values must be one of {COMBINE}, got {bad}.")
    return {f: rule[f] for f in fields}


def zeros(kind: type, lead: tuple[int, ...] = (), **shapes: tuple[int, ...]) -> Any:
    """A probe of kind ``kind`` at zero: every field ``f32[*lead, *shape]``,
    ``shape`` from ``shapes`` by field name (``()`` where not given)."""
    combine_of(kind)
    return kind(
        *(jnp.zeros((*lead, *shapes.get(f, ())), jnp.float32) for f in kind._fields)
    )


def stack(probes: Sequence[Any]) -> Any:
    """Probes of one kind as one, each field stacked along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *probes)


def unstack(block: Any) -> list[Any]:
    """:func:`stack`'s inverse: the probes along ``block``'s leading axis."""
    n = jax.tree.leaves(block)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], block) for i in range(n)]


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _spread(x: jax.Array, length: int, combine: str) -> jax.Array:
    return jnp.broadcast_to(x, (length, *jnp.shape(x)))


def _spread_fwd(x, length, combine):
    return _spread(x, length, combine), None


def _spread_bwd(length, combine, _, ct):
    reduce = jnp.sum if combine == "sum" else jnp.max
    return (reduce(ct, axis=0),)


_spread.defvjp(_spread_fwd, _spread_bwd)


def spread(probe: Any, length: int) -> Any:
    """``probe`` stacked ``length`` times along a new leading axis (one probe
    per iteration of a loop); its transpose combines the iterations'
    cotangents field by field, as the kind's ``COMBINE`` declares: ``"sum"``
    (a gradient's own rule) or ``"max"``."""
    rule = combine_of(type(probe))
    return type(probe)(
        *(
            _spread(x, length, rule[f])
            for f, x in zip(probe._fields, probe, strict=True)
        )
    )
