"""Values under :func:`jaxscale.autocast`: dtypes, casts, and what the
interpreter knows about where a value came from (:class:`Info`): its source's rank
and size (torch's scalar rule, the bias and normalisation rules), whether it is a
parameter or a statistic, and its values when they are known at trace time (a
constant, checked against the narrow dtype's range: :func:`const_fit`,
:func:`saturate`). :func:`provenance` derives an equation's outputs' ``Info``
(the rule classes of :mod:`jaxscale._autocast.interp` refine it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jaxscale._jax_private import (
    rebind,
)

__all__ = [
    "Const",
    "Info",
    "REDUCTIONS",
    "SELECTIONS",
    "bias_kind",
    "cast",
    "const_fit",
    "const_info",
    "const_misfit",
    "const_values",
    "dtype_of",
    "floating",
    "fresh_info",
    "input_info",
    "is_castable",
    "provenance",
    "saturate",
    "size_of",
    "widest",
]

_F16, _BF16, _F32 = (
    np.dtype(jax.numpy.dtype(d)) for d in ("float16", "bfloat16", "float32")
)
_CASTABLE = frozenset({_F16, _BF16, _F32})
# Constants larger than this are not read back at trace time (their values are
# not checked against the narrow dtype's range).
_MAX_CONST = 1 << 16


class Const(NamedTuple):
    """A value known when tracing: ``root`` (a literal or a constant of the
    jaxpr) viewed through ``chain``, equations that keep its values (broadcasts,
    reshapes, transposes, slices, float casts), so it can be replayed from a
    changed root."""

    root: Any  # a NumPy or a concrete JAX array
    chain: tuple[Any, ...]


class Info(NamedTuple):
    """What the interpreter knows about where a value came from."""

    src_rank: int  # rank of the array it was broadcast or reshaped from
    param: bool  # an input or constant of the function, or a view of one
    lowered: bool  # the output of a "lower" op, possibly reshaped
    src_size: int = 0  # elements of the array it was broadcast from
    stat: bool = False  # a reduction's result, or computed from reductions only
    const: Const | None = None  # its values, when they are known at trace time
    # An input (or a view of one) whose gradient leaves a matmul in float32
    # (``autocast``'s ``gradient_dtype``): see ``jaxscale._autocast.gradients``.
    wide: bool = False
    # Its values are 0 or 1: a boolean converted to a float (a mask), viewed,
    # selected or multiplied by another such: exact in every float dtype.
    unit: bool = False
    # The primitive that computed it, views and casts skipped ("" for an input
    # or a constant): what the report's island notes name.
    origin: str = ""


def size_of(x: Any) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64))


def fresh_info(x: Any) -> Info:
    """A value computed by the function: no provenance."""
    return Info(len(np.shape(x)), False, False, size_of(x))


def input_info(x: Any, wide: bool = False) -> Info:
    return Info(len(np.shape(x)), True, False, size_of(x), wide=wide)


def const_info(x: Any, param: bool = True) -> Info:
    """A literal (``param=False``) or a constant of a jaxpr: its values are
    known."""
    root = None
    if isinstance(x, np.ndarray | np.generic):
        root = x
    elif isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        root = x if size_of(x) <= _MAX_CONST else None  # read back when needed
    const = Const(root, ()) if root is not None and floating(root.dtype) else None
    return Info(len(np.shape(x)), param, False, size_of(x), False, const)


def const_values(const: Const, dtype: np.dtype) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(const.root).astype(dtype)


def const_fit(const: Const, src: np.dtype, dst: np.dtype) -> str | None:
    """Why ``const`` (in ``src``) does not survive a cast to ``dst``: ``"inf"``
    (a finite value beyond ``dst``'s range), ``"zero"`` (a non-zero scalar that
    rounds to 0), or ``None`` if it survives. Infinities and NaNs survive."""
    v = const_values(const, src)
    with np.errstate(all="ignore"):
        n = v.astype(dst)
    if np.any(np.isfinite(v) & ~np.isfinite(n)):
        return "inf"
    if v.size == 1 and np.any((v != 0) & (n == 0)):
        return "zero"
    return None


def saturate(const: Const, src: np.dtype, dst: np.dtype) -> Any:
    """``const`` cast to ``dst`` with finite values clipped to ``dst``'s finite
    range (infinities and NaNs kept), replayed through its chain."""
    v = const_values(const, src)
    fi = jax.numpy.finfo(dst)
    lo, hi = float(fi.min), float(fi.max)
    with np.errstate(all="ignore"):
        out: Any = np.where(np.isfinite(v), np.clip(v, lo, hi), v).astype(dst)
    for eqn in const.chain:
        if eqn.primitive.name != "convert_element_type":
            out = rebind(eqn, [out])[0]
    return out


def const_misfit(v: Any, info: Info, target: np.dtype) -> tuple[str, str] | None:
    """Why the constant ``v`` does not survive a cast to ``target`` (see
    :func:`const_fit`) and a description, or None (not a constant, not
    narrowed, or it fits)."""
    src = dtype_of(v)
    if info.const is None or not is_castable(src):
        return None
    if not is_castable(target) or src.itemsize <= target.itemsize:
        return None
    why = const_fit(info.const, src, target)
    if why is None:
        return None
    value = const_values(info.const, src).ravel()[0] if size_of(v) else 0
    what = "overflows to inf" if why == "inf" else "rounds to 0"
    return why, f"{float(value):.6g} {what} in {np.dtype(target).name}"


def bias_kind(
    dtype: np.dtype, name: str, vals: list[Any], infos: list[Info]
) -> str | None:
    """``"bias"``: ``low + bias`` or ``low - bias`` (either order), ``low`` in
    ``dtype`` from a "lower" op, ``bias`` a castable wider parameter of rank
    <= 1, broadcast or reshaped: the bias is cast to ``dtype`` (torch's
    ``linear``). ``"norm"``: an activation in ``dtype`` combined with a wider
    value broadcast from fewer elements that is a parameter (or computed from
    parameters and constants alone: Gemma's ``1 + scale``), a statistic
    (reductions of activations, as a norm's mean and variance) or a constant
    that fits ``dtype``: the wider value is cast to ``dtype`` (saturating) and
    the operation runs in ``dtype``, so the activation stays in ``dtype`` as
    with torch's ``batch_norm`` and Flax's ``dtype=float16``. ``"mask"``: an
    activation in ``dtype`` times a wider 0/1 mask (a boolean converted to a
    float in the function: ``mask.astype(h.dtype)`` read float32 when traced):
    the mask is cast to ``dtype``, exactly, and the product runs in ``dtype``."""
    if len(vals) != 2:
        return None
    for k in (0, 1):
        low, wide, lo_i, w_i = vals[k], vals[1 - k], infos[k], infos[1 - k]
        if dtype_of(low) != dtype or not is_castable(dtype_of(wide)):
            continue
        if dtype_of(wide).itemsize <= dtype.itemsize:
            continue
        if name == "mul" and w_i.unit:
            return "mask"
        if const_misfit(wide, w_i, dtype) is not None:
            return None
        if name in ("add", "sub") and lo_i.lowered and w_i.param and w_i.src_rank <= 1:
            return "bias"
        size = size_of(low)
        if (
            lo_i.src_size >= size > 1
            and 1 < w_i.src_size < size
            and (w_i.param or w_i.stat or w_i.const is not None)
        ):
            return "norm"
    return None


def dtype_of(x: Any) -> Any:
    return x.dtype


def is_castable(dtype: Any) -> bool:
    return dtype in _CASTABLE


def floating(dtype: Any) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.floating)


def widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The smallest floating dtype that holds all of ``dtypes``: float16 and
    bfloat16 give float32, as in JAX's and torch's promotion."""
    out = dtypes[0]
    for d in dtypes[1:]:
        if d == out:
            continue
        if d.itemsize == out.itemsize:
            out = np.dtype({1: np.float16, 2: np.float32}.get(d.itemsize, np.float64))
        elif d.itemsize > out.itemsize:
            out = d
    return out


def cast(x: Any, dtype: np.dtype) -> Any:
    """``x`` in ``dtype``; NumPy constants (literals) stay NumPy constants."""
    if dtype_of(x) == dtype:
        return x
    if isinstance(x, np.ndarray | np.generic):
        return np.asarray(x, dtype)
    return lax.convert_element_type(x, dtype)


# Provenance: which primitives pass a value's origin through.
_SAME_SOURCE = frozenset(
    {"broadcast_in_dim", "convert_element_type", "copy", "device_put", "name", "pvary"}
    | {"reshape", "reshard", "sharding_constraint", "squeeze", "stop_gradient"}
    | {"transpose"}
)
_SAME_PARAM = _SAME_SOURCE | {"dynamic_slice", "gather", "rev", "slice"}
# Equations that keep a constant's values (a view, a subset, or a float cast):
# a constant seen through them can be checked and replayed.
_SAME_VALUES = (_SAME_PARAM - {"device_put", "dynamic_slice", "gather"}) | {
    "rev",
    "slice",
}
# Primitives whose output elements are copies of operand elements: a constant
# that overflows the narrow dtype is a sentinel ("very negative") there, and
# saturates to the dtype's finite extreme instead of widening the operation.
SELECTIONS = frozenset(
    {"clamp", "concatenate", "dynamic_update_slice", "max", "min", "pad"}
    | {"select_n", "scatter"}
)
REDUCTIONS = frozenset({"reduce_max", "reduce_min", "reduce_prod", "reduce_sum"})
# What a statistic may go through and stay one: the arithmetic of a mean, a
# variance and its inverse square root, views and casts. Not logarithms or
# exponentials: ``x - logsumexp(x)`` (log-softmax) is not a normalisation.
# Collectives a statistic passes through and stays one: a BatchNorm synchronised
# across devices (flax and equinox ``axis_name=``) reduces its per-device means
# with ``pmean`` (``psum``, then a division), often stacked into one operand.
_COLLECTIVES = frozenset(
    {"all_gather", "all_gather_invariant", "all_to_all", "pbroadcast", "pmax"}
    | {"pmin", "ppermute", "psum", "psum_invariant", "pvary", "reduce_scatter"}
    | {"unreduced_psum", "unreduced_pmax", "unreduced_pmin"}
)
_STAT_OPS = (
    _SAME_SOURCE
    | _COLLECTIVES
    | {
        "concatenate",
        "dynamic_slice",
        "slice",
        "split",
        "stack",
        "unstack",
        "abs",
        "add",
        "div",
        "integer_pow",
        "max",
        "min",
        "mul",
        "neg",
        "rsqrt",
        "sqrt",
        "square",
        "sub",
    }
)

# Elementwise arithmetic that keeps a value computed from parameters and
# constants alone a parameter (Gemma's ``1 + scale``, ``softplus(raw)``,
# ``exp(log_scale)``, ``w * 0.5``): broadcast against an activation, it follows
# the parameter rules (``bias_kind``).
_PARAM_OPS = frozenset(
    {"abs", "add", "atan2", "cbrt", "clamp", "cos", "div", "erf", "exp", "exp2"}
    | {"expm1", "integer_pow", "log", "log1p", "logistic", "max", "min", "mul"}
    | {"neg", "pow", "rsqrt", "select_n", "sign", "sin", "sqrt", "square", "sub"}
    | {"tan", "tanh"}
)

_SAME_LOWERED = frozenset(
    {"copy", "name", "pvary", "reshape", "reshard", "sharding_constraint", "squeeze"}
    | {"transpose"}
)


def _nonunit(shape: Sequence[int]) -> list[int]:
    return [d for d in shape if d != 1]


def provenance(
    eqn: Any, infos: list[Info], outs: list[Any], elementwise: bool = True
) -> list[Info]:
    """The ``Info`` of an equation's outputs, from its operands'. With
    ``elementwise=False`` (a contraction: a matmul, a convolution) broadcast
    operands do not bound the outputs' number of distinct sources."""
    name = eqn.primitive.name
    floats = [
        i for i, v in zip(infos, eqn.invars, strict=True) if floating(v.aval.dtype)
    ]
    stat = False
    if name in REDUCTIONS:
        stat = True
    elif name in _STAT_OPS and any(i.stat for i in floats):
        stat = all(i.stat or i.param or i.src_size == 1 for i in floats)
    derived = (
        name in _PARAM_OPS
        and any(i.param for i in floats)
        and all(i.param or i.const is not None for i in floats)
    )
    unit = _unit(eqn, infos)
    # Elementwise on broadcast operands (a statistic times a scale): the
    # result holds no more distinct sources than its operands together.
    elementwise = elementwise and name not in REDUCTIONS
    in_size = sum(i.src_size for i in infos) if elementwise else None
    result = []
    for out in outs:
        shape = np.shape(out)
        src, param, lowered, wide = len(shape), False, False, False
        src_size, const = size_of(out), None
        if in_size is not None and all(
            len(getattr(v.aval, "shape", ())) in (0, len(shape)) for v in eqn.invars
        ):
            src_size = min(src_size, in_size)
        if infos and name in _SAME_SOURCE:
            first = infos[0]
            same_rank = name != "reshape" or _nonunit(
                eqn.invars[0].aval.shape
            ) == _nonunit(shape)
            src = first.src_rank if same_rank else src
            src_size = first.src_size
        origin = infos[0].origin if infos and name in _SAME_PARAM else name
        if infos and name in _SAME_PARAM:
            param, wide = infos[0].param, infos[0].wide
        elif derived:
            param, wide = True, any(i.wide for i in floats)
        if infos and name in _SAME_LOWERED:
            lowered = infos[0].lowered
        if infos and name in _SAME_VALUES and infos[0].const is not None:
            if floating(dtype_of(out)):
                c = infos[0].const
                const = Const(c.root, (*c.chain, eqn))
        result.append(
            Info(
                min(src, len(shape)),
                param,
                lowered,
                min(src_size, size_of(out)),
                stat and floating(dtype_of(out)),
                const,
                wide,
                unit and floating(dtype_of(out)),
                origin,
            )
        )
    return result


def _unit(eqn: Any, infos: list[Info]) -> bool:
    """Whether the equation's output holds only 0 and 1 (see ``Info.unit``)."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        return eqn.invars[0].aval.dtype == np.bool_ or infos[0].unit
    if name in _SAME_PARAM:
        return bool(infos) and infos[0].unit
    if name == "mul":
        return all(i.unit for i in infos)
    if name == "select_n":  # the predicate, then the cases
        return all(i.unit or _zero_or_one(i.const) for i in infos[1:])
    return False


def _zero_or_one(const: Const | None) -> bool:
    if const is None or const.root is None:
        return False
    values = np.asarray(const.root)
    return values.size <= _MAX_CONST and bool(np.all((values == 0) | (values == 1)))
