"""The finite check of :func:`dynamic_scaling`: one reduction per group of
like gradient leaves, not one per leaf.

Below the transformation (``_transform``), beside the loss scales: it knows
how a leaf is unscaled (by the factors of ``reciprocal_parts``), nothing of
the optimizer or of the skip.

Why groups: XLA compiles a reduction over each array into kernels of its own
(on a GPU one or two per leaf: a large reduction is split in two), and fuses
no two reductions over different arrays. A 148-leaf GPT-2 step paid about 200
check kernels, most of them reading a few kilobytes (a bias, a layer norm):
launches, not bytes. A reduction over all but the first axis of
``jnp.stack(masks)`` compiles, on a GPU, to one reduction that computes each
leaf's mask from the leaf where it lies (XLA fuses the masks and the stack
into the reduction's input: no copy), so the check costs a kernel or two per
*group*, and a model's groups do not multiply with its depth.

Which leaves share a group: those of one shape and dtype whose key paths are
equal up to their numbers (``Block_3/mlp/kernel`` and ``Block_7/mlp/kernel``;
``w0001`` and ``w0002``). Stacking arrays that lie on the devices differently
would make XLA's SPMD partitioner move one of them first (still right, no
longer free); the sharding schemes in use (FSDP, tensor parallelism by logical
axis names) lay out the same parameter of every layer alike, but not two
parameters of different roles (a column- and a row-parallel matrix of one
shape), so roles never share a group. A group holds at most :data:`MAX_GROUP`
leaves.

What was tried and left (docs/measurements.md): a variadic ``lax.reduce``
over a group reads each leaf once on a CPU too, but XLA's SPMD partitioner
gathers its operands and supports no custom combiner; stacking the values
instead of the masks copies them on a CPU (8 bytes per float32 element before
the check reads them); a reduction of all leaves concatenated into one flat
array is split back into one per leaf by XLA's simplifier, and the
concatenation gathers sharded leaves.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._tree import compute_dtype, is_inexact_leaf, path_name, real_parts

__all__ = ["MAX_GROUP", "leaf_flags"]

#: Leaves per stacked reduction, at most (XLA:GPU passes a fusion's operands
#: as kernel parameters; 64 stays well inside every limit).
MAX_GROUP = 64

_NUMBER = re.compile(r"\d+")


def _nonfinite(x: jax.Array, hl: jax.Array) -> jax.Array:
    """``bool[...]``: where ``x`` is not finite once unscaled, in its own dtype.

    ``x * (hi * lo)`` in the compute dtype, rounded to ``x``'s own dtype as
    :func:`unscale_leaf` rounds it, so exact for every scale. ``x * (hi *
    lo)`` rather than ``unscale_leaf``'s ``x * hi * lo``: another expression,
    so XLA does not share (and materialise) it with the optimizer's unscaling
    but fuses it into the check. It overflows exactly where ``unscale_leaf``
    does: ``lo`` is 1, or ``2**-64`` for scales above ``2**126``, where nothing
    finite can overflow (and a flushed ``hi * lo`` still leaves ``inf`` and
    ``NaN`` non-finite: ``inf * 0`` is ``NaN``).
    """
    c = compute_dtype(x.dtype)
    return ~jnp.isfinite((x.astype(c) * hl.astype(c)).astype(x.dtype))


def _role(path: Any) -> str:
    """A leaf's key path with its numbers replaced: the same for the same
    parameter of every layer."""
    return _NUMBER.sub("#", path_name(path))


def _any_nonfinite(parts: list[jax.Array], hl: jax.Array) -> jax.Array:
    """``bool[k]``: whether each part (all of one shape and dtype) holds an
    element that is not finite once unscaled, from one reduction over the
    stacked masks.

    The masks, not the values, are stacked: on a GPU, XLA fuses the masks and
    the stack into the reduction, which reads each part once where it lies; on
    a CPU, which fuses neither into a reduction, each mask is materialised at
    one byte per element and the stack copies those bytes (8 bytes per float32
    element in all, where stacking the values would copy 8 bytes first)."""
    masks = [_nonfinite(p, hl) for p in parts]
    x = masks[0][None] if len(masks) == 1 else jnp.stack(masks)
    return jnp.any(x, axis=tuple(range(1, x.ndim)))


def leaf_flags(grads: Any, hi: jax.Array, lo: jax.Array) -> jax.Array | None:
    """``bool[n]``: whether each leaf of ``grads``, unscaled by ``hi * lo``,
    holds an ``inf`` or a ``NaN`` (``False`` for integer leaves), in
    flattening order; ``None`` for a tree without leaves.

    Exact in each leaf's own dtype for every scale (:func:`_nonfinite`); a
    complex leaf is flagged where its real or its imaginary part is. The
    leaves are checked in groups (module docstring): one reduction per group,
    whose outputs are its leaves' flags.
    """
    with_paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    if not with_paths:
        return None
    hl = hi * lo
    groups: dict[tuple[Any, ...], list[tuple[int, jax.Array]]] = {}
    for i, (path, leaf) in enumerate(with_paths):
        if is_inexact_leaf(leaf):
            for part in real_parts(leaf):
                key = (_role(path), part.shape, part.dtype)
                groups.setdefault(key, []).append((i, part))
    found: list[list[int]] = [[] for _ in with_paths]
    chunks, offset = [], 0
    for members in groups.values():
        for start in range(0, len(members), MAX_GROUP):
            chunk = members[start : start + MAX_GROUP]
            for j, (i, _) in enumerate(chunk):
                found[i].append(offset + j)
            offset += len(chunk)
            chunks.append(_any_nonfinite([p for _, p in chunk], hl))
    chunks.append(jnp.zeros((1,), jnp.bool_))  # integer leaves: never flagged
    bad = jnp.concatenate(chunks)
    none = bad.shape[0] - 1
    first = [f[0] if f else none for f in found]
    second = [f[-1] if f else none for f in found]
    if first == list(range(len(found))) and first == second:
        return bad[: len(found)]  # the usual: one part per leaf, in order
    return bad[np.array(first)] | bad[np.array(second)]
