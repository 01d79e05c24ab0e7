"""Which values a jaxpr widens to float32 anyway: a look-ahead over its uses.

Attention scores ``q @ k.T`` go through a scale, a mask and a bias into a
softmax, which autocast runs in float32 (torch's list). Computed in float16,
a score above 65504 is ``inf`` before the softmax sees it; torch's fused
attention and ``jax.nn.dot_product_attention`` (``preferred_element_type=
float32``) keep scores in float32. A matmul whose every use leads, through
such cheap elementwise steps and views, to float32 work can take float16
operands and produce float32. On XLA:CPU that costs nothing (the float32 copy
existed anyway); XLA:GPU fuses the cast into the consumer, so there the
float32 product is twice the bytes of the float16 one (docs/measurements.md,
the H200 run of 2026-11-27). :func:`widened` finds those values.

A value *widens* when every floating use of it is

- an operation of the ``"float32"`` rule (``exp``, ``log``, ``logistic``...),
- a step that passes values on (:data:`PASSES`: additions, selection,
  ``max``, views; :data:`SCALINGS`: a product with a scalar) whose outputs all
  widen,
- a call (``jit``, a custom derivative's function, ``checkpoint``) in whose
  body the value widens, or
- an output of the jaxpr that widens in the caller (``outer``);

and at least one use is not a comparison (whose boolean output reads no
precision). Anything else (a matmul, a sum, a scan, an output the caller does
not widen) keeps it in the autocast dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jcore

from jaxscale._autocast.rules import AutocastRule
from jaxscale._jax_private import call_like_body

__all__ = ["PASSES", "SCALINGS", "folds", "widened"]

# Steps a widening value may pass through: their outputs are as wide as their
# operands, cost the same in float32 inside one fusion, and their derivatives
# keep no copy of the value (a softmax's maximum is under ``stop_gradient``).
PASSES = frozenset(
    {"add", "broadcast_in_dim", "concatenate", "convert_element_type", "copy"}
    | {"dynamic_slice", "expand_dims", "max", "min", "name", "neg", "pad"}
    | {"pvary", "reduce_max", "reduce_min", "reshape", "reshard", "rev"}
    | {"select_n", "sharding_constraint", "slice", "squeeze", "stop_gradient"}
    | {"sub", "transpose"}
)
# Steps that pass it on when the other operand is a literal or a scalar (a
# score's scale): a product with an array would keep the value for the
# array's derivative.
SCALINGS = frozenset({"div", "mul"})


def _scaling(eqn: Any, var_index: int) -> bool:
    others = [v for i, v in enumerate(eqn.invars) if i != var_index]
    return all(
        isinstance(v, jcore.Literal) or not getattr(v.aval, "shape", ()) for v in others
    )


_NO, _NONE, _WIDE = 0, 1, 2  # no; no floating use; widens


def _floating(var: Any) -> bool:
    aval = getattr(var, "aval", None)
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _combine(a: int, b: int) -> int:
    return min(a, b) if _NO in (a, b) else max(a, b)


def _verdicts(
    jaxpr: Any, is_float32: Callable[[str], bool], outer: Sequence[bool]
) -> dict[Any, int]:
    state: dict[Any, int] = {}

    def use(var: Any, verdict: int) -> None:
        if not isinstance(var, jcore.Literal) and _floating(var):
            state[var] = _combine(state.get(var, _NONE), verdict)

    for var, wide in zip(jaxpr.outvars, outer, strict=True):
        use(var, _WIDE if wide else _NO)
    for eqn in reversed(jaxpr.eqns):
        outs = [state.get(v, _NONE) for v in eqn.outvars if _floating(v)]
        name = eqn.primitive.name
        if not outs:  # a comparison, an integer result: reads no precision
            continue
        if is_float32(name):
            verdicts = [_WIDE] * len(eqn.invars)
        elif name in PASSES or name in SCALINGS:
            whole = _NONE
            for v in outs:
                whole = _combine(whole, v)
            verdicts = [
                whole if name in PASSES or _scaling(eqn, i) else _NO
                for i in range(len(eqn.invars))
            ]
        else:
            body = call_like_body(eqn)
            if body is None or len(body.jaxpr.invars) != len(eqn.invars):
                verdicts = [_NO] * len(eqn.invars)
            else:
                wide_outs = [state.get(v, _NONE) == _WIDE for v in eqn.outvars]
                inner = _verdicts(body.jaxpr, is_float32, wide_outs)
                verdicts = [inner.get(v, _NONE) for v in body.jaxpr.invars]
        for var, verdict in zip(eqn.invars, verdicts, strict=True):
            use(var, verdict)
    return state


def widened(
    jaxpr: Any, table: Mapping[str, AutocastRule], outer: Sequence[bool]
) -> frozenset[Any]:
    """The variables of ``jaxpr`` that widen (see the module docstring), given
    which of its outputs widen in the caller (``outer``)."""

    def is_float32(name: str) -> bool:
        return table.get(name) == AutocastRule.FLOAT32

    state = _verdicts(jaxpr, is_float32, outer)
    return frozenset(v for v, verdict in state.items() if verdict == _WIDE)


def folds(jaxpr: Any) -> dict[Any, Any]:
    """``{dot_general equation: the scaling that follows it}``: a product whose
    only use is a multiplication by a scalar, or a division by one (attention
    scores ``q @ k.T * scale``). Under float16 autocast such a product, when it
    widens, accumulates and takes its scale in float32 and is rounded once,
    after the scale (:class:`jaxscale._autocast.classes.Lower`)."""
    uses: dict[Any, list[tuple[Any, int]]] = {}
    for eqn in jaxpr.eqns:
        for i, v in enumerate(eqn.invars):
            if not isinstance(v, jcore.Literal):
                uses.setdefault(v, []).append((eqn, i))
    outs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    found: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "dot_general" or len(eqn.outvars) != 1:
            continue
        var = eqn.outvars[0]
        used = uses.get(var, [])
        if var in outs or len(used) != 1:
            continue
        user, index = used[0]
        name = user.primitive.name
        if name not in SCALINGS or (name == "div" and index != 0):
            continue
        if _scaling(user, index):
            found[eqn] = user
    return found
