"""Several devices, one decision: named-axis reductions and replicated placement.

Under ``jit`` with sharded arrays XLA already reduces the finite check over every
device (the check is a reduction over whole, global arrays). Inside ``shard_map``,
``pmap`` or a ``vmap`` with an ``axis_name``, code sees only its own block, so
:func:`jaxscale.dynamic_scaling` built with ``axis_name=...`` reduces the finite
flag and the per-leaf flags over that axis with the helpers here. (Averaging the
gradients over the axis, for data parallelism, is the caller's ``lax.pmean`` or
:func:`jaxscale.reduce_mean`, whose all-gather :func:`gather_invariant` types.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale._jax_private import manual_axes, mark_varying, varying_axes
from jaxscale._scope import FINITE_SCOPE

__all__ = [
    "FINITE_SCOPE",
    "AxisName",
    "differing_processes",
    "from_every_process",
    "any_replica",
    "check_axis_name",
    "explain_unbound",
    "gather_invariant",
    "match_varying",
    "place_replicated",
]


#: What ``axis_name`` accepts: one mapped axis, or several (reduced over all).
AxisName = str | tuple[str, ...]


def check_axis_name(axis_name: Any) -> None:
    """Validates the ``axis_name`` keyword (eagerly)."""
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"`axis_name` must be a str or tuple of str, got {axis_name!r}."
        )
    if not names:
        raise ValueError(
            "`axis_name` must name at least one mapped axis (a str or a "
            "non-empty tuple of str), got ()."
        )


def explain_unbound(
    axis_name: AxisName,
    err: NameError,
    what: str = "`update` of a `jxs.dynamic_scaling(..., axis_name=...)`",
) -> NameError:
    """The ``NameError`` to raise for an ``axis_name`` no mapped axis binds:
    where to call ``what`` instead, and JAX's own words."""
    return NameError(
        f"`axis_name` {axis_name!r} is not bound here: call {what} inside "
        "`jax.shard_map`, "
        "`jax.pmap` or `jax.vmap` over that axis (under plain `jit` with sharded "
        f"arrays, leave `axis_name=None`). JAX said: {err}"
    )


def any_replica(flags: Any, axis_name: AxisName) -> Any:
    """Boolean flags (any pytree of them) or-ed over the ``axis_name`` axis."""
    try:
        return jax.tree.map(
            lambda f: lax.pmax(f.astype(jnp.int32), axis_name) > 0,
            flags,
        )
    except NameError as err:
        raise explain_unbound(axis_name, err) from None


def gather_invariant(x: jax.Array, axis_name: str) -> jax.Array:
    """``lax.all_gather(x, axis_name, tiled=True)``, typed invariant over the
    axis (every device holds the same value) where ``shard_map`` checks varying
    types: ``to="invarying"`` from jax 0.10, ``lax.all_gather_invariant``
    before; the plain all-gather elsewhere (``pmap``, ``vmap``,
    ``check_vma=False``)."""
    axes, checked = manual_axes()
    if not checked or axis_name not in axes:
        return lax.all_gather(x, axis_name, tiled=True)
    if hasattr(lax, "all_gather_invariant"):  # jax < 0.10
        return lax.all_gather_invariant(x, axis_name, tiled=True)
    return lax.all_gather(x, axis_name, tiled=True, to="invarying")


def match_varying(x: jax.Array, like: Any) -> jax.Array:
    """``x`` marked as varying over the same ``shard_map`` axes as ``like`` (an
    array or a ``jax.ShapeDtypeStruct``), so both branches of a ``lax.cond``
    have the same type; ``x`` itself outside ``shard_map``."""
    missing = tuple(a for a in varying_axes(like) if a not in varying_axes(x))
    if not missing:
        return x
    return mark_varying(x, missing)


def _replicated_sharding(params: Any) -> NamedSharding | None:
    """Fully replicated sharding over the mesh of the first parameter placed on
    a multi-device ``NamedSharding`` (``None`` if there is none, or under a
    trace, where ``jit`` decides placement)."""
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.core.Tracer):
            return None
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return NamedSharding(s.mesh, PartitionSpec())
    return None


def place_replicated(state: Any, params: Any, *, skip: str) -> Any:
    """Puts every array leaf of a state NamedTuple, except its field ``skip``,
    replicated on the mesh of ``params``.

    When ``params`` live on a multi-device (possibly multi-process) mesh, the
    loss scale and counters are placed with ``NamedSharding(mesh, P())`` from
    host values (``jax.make_array_from_callback``, which also works where the
    mesh spans several processes), so every device holds the same copy from the
    start. Otherwise ``state`` is returned unchanged.
    """
    sharding = _replicated_sharding(params)
    if sharding is None:
        return state

    def place(x):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return state._replace(
        **{
            f: jax.tree.map(place, getattr(state, f))
            for f in state._fields
            if f != skip
        }
    )


# --------------------------------------------------------------------------- #
# Several jax.distributed processes: host-side agreement.
# --------------------------------------------------------------------------- #


def from_every_process(x: np.ndarray) -> np.ndarray:
    """``x`` (a host array, the same shape on each process) from every
    ``jax.distributed`` process, stacked in process order: ``[p, *x.shape]``."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def differing_processes(value: Any) -> list[int]:
    """The processes whose ``repr(value)`` differs from process 0's (by its
    sha256): ``[]`` when every process holds the same, or with one process."""
    if jax.process_count() == 1:
        return []
    import hashlib

    key = np.frombuffer(hashlib.sha256(repr(value).encode()).digest(), np.uint32)
    keys = from_every_process(key)
    return sorted(int(i) for i in np.nonzero((keys != keys[0]).any(1))[0])
