"""Written-out attention, found in a jaxpr: the chain autocast can run fused.

``softmax(mask(q @ k * scale)) @ v``, as a model writes it (``einsum`` ->
scale -> ``jnp.where(mask, s, min)`` -> ``jax.nn.softmax`` -> ``einsum``:
benchmarks/gpu.py's GPT, Flax's ``MultiHeadDotProductAttention``, the XLA form
of ``jax.nn.dot_product_attention``), is one :class:`Chain` of equations when

- the score product has one contracting dimension, one free dimension on each
  side and any batch dimensions;
- its result goes, each intermediate value used by the chain alone, through
  scalings by scalars, converts, at most one mask (a ``select_n`` or a jitted
  ``where`` keeping the scores and filling a scalar), and the softmax jax
  writes (``reduce_max``, ``stop_gradient``, ``sub``, ``exp``, ``reduce_sum``,
  ``div`` over the key axis);
- the probabilities, possibly converted, are contracted over the key axis with
  ``v`` by the second product, batch dimensions in the same order.

:func:`chains` finds them; the interpreter decides at the second product
whether to run the chain fused (:mod:`jaxscale._autocast.attention`) or
equation by equation. Anything else (a bias, dropout, an input-dependent mask,
another softmax) is no chain: it runs by the rules, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jaxscale._autocast.lookahead import SCALINGS
from jaxscale._jax_private import (
    bind,
    dot_dimension_numbers,
    jit_body,
    jit_name,
    reduction_axes,
)

__all__ = ["Chain", "Constants", "chains"]


@dataclasses.dataclass(frozen=True, eq=False)
class Chain:
    """One written-out attention (see the module docstring)."""

    scores: Any  # the q . k product
    out: Any  # the p . v product
    eqns: tuple[Any, ...]  # every equation of the chain, in program order
    scalings: tuple[Any, ...]  # the scaling equations (mul/div by a scalar)
    mask: Any  # the masking equation, or None
    probs_lhs: bool  # the probabilities are the out product's left operand

    @property
    def inputs(self) -> tuple[Any, ...]:
        """The variables the chain reads that it does not compute."""
        made = {v for e in self.eqns for v in e.outvars}
        seen: list[Any] = []
        for e in self.eqns:
            for v in e.invars:
                if not isinstance(v, jcore.Literal) and v not in made:
                    if v not in seen:
                        seen.append(v)
        return tuple(seen)


def _literal_scalar(v: Any) -> bool:
    return isinstance(v, jcore.Literal) or not getattr(v.aval, "shape", ())


def _is_where(eqn: Any) -> bool:
    """A jitted ``jnp.where(c, x, fill)``: its body a ``select_n`` keeping its
    second input where ``c`` holds, filling a scalar elsewhere."""
    if eqn.primitive.name != "jit" or jit_name(eqn) != "_where":
        return False
    body = jit_body(eqn)
    if body is None or len(eqn.invars) != 3:
        return False
    selects = [e for e in body.jaxpr.eqns if e.primitive.name == "select_n"]
    return (
        len(selects) == 1
        and body.jaxpr.outvars == selects[0].outvars
        and len(selects[0].invars) == 3
        and selects[0].invars[2] is body.jaxpr.invars[1]
        and _literal_scalar(eqn.invars[2])
    )


def chains(jaxpr: Any) -> dict[Any, Chain]:
    """``{out product equation: its Chain}`` for the attentions of ``jaxpr``."""
    uses: dict[Any, list[tuple[Any, int]]] = {}
    producer: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
        for i, v in enumerate(eqn.invars):
            if not isinstance(v, jcore.Literal):
                uses.setdefault(v, []).append((eqn, i))
    outs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}

    def only_use(var: Any) -> tuple[Any, int] | None:
        used = uses.get(var, [])
        return used[0] if len(used) == 1 and var not in outs else None

    found: dict[Any, Chain] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "dot_general":
            continue
        chain = _match(eqn, uses, only_use, outs)
        if chain is not None:
            found[chain.out] = chain
    return found


def _match(d1: Any, uses: Any, only_use: Any, outs: Any) -> Chain | None:
    dims = dot_dimension_numbers(d1.params)
    if dims is None:
        return None
    (lc, rc), (lb, rb) = dims
    lhs, rhs = (len(getattr(v.aval, "shape", ())) for v in d1.invars)
    if len(lc) != 1 or lhs != len(lb) + 2 or rhs != len(rb) + 2:
        return None
    rank = len(lb) + 2  # scores: batch..., T, S
    eqns, scalings, mask = [d1], [], None
    var = d1.outvars[0]
    while True:  # scalings, converts, one mask
        hit = only_use(var)
        if hit is None:
            break
        user, index = hit
        name = user.primitive.name
        if name in SCALINGS and (name == "mul" or index == 0):
            if not all(
                _literal_scalar(v) for i, v in enumerate(user.invars) if i != index
            ):
                return None
            scalings.append(user)
        elif name == "convert_element_type":
            pass
        elif mask is None and _is_where(user) and index == 1:
            mask = user
        elif (
            mask is None and name == "select_n" and index == 2 and len(user.invars) == 3
        ):
            if not _literal_scalar(user.invars[1]):
                return None
            mask = user
        else:
            break
        eqns.append(user)
        var = user.outvars[0]
    probs = _softmax(var, rank, uses, outs, eqns)
    if probs is None:
        return None
    while True:  # converts to the second product
        hit = only_use(probs)
        if hit is None:
            return None
        user, index = hit
        if user.primitive.name != "convert_element_type":
            break
        eqns.append(user)
        probs = user.outvars[0]
    if user.primitive.name != "dot_general":
        return None
    d2dims = dot_dimension_numbers(user.params)
    if d2dims is None:
        return None
    (c0, c1), (b0, b1) = d2dims
    pc, pb = (c0, b0) if index == 0 else (c1, b1)
    vc, vb = (c1, b1) if index == 0 else (c0, b0)
    v_rank = len(getattr(user.invars[1 - index].aval, "shape", ()))
    if (
        tuple(pc) != (rank - 1,)
        or tuple(pb) != tuple(range(rank - 2))
        or len(vc) != 1
        or len(vb) != rank - 2
        or v_rank != rank
    ):
        return None
    eqns.append(user)
    return Chain(d1, user, tuple(eqns), tuple(scalings), mask, index == 0)


def _softmax(var: Any, rank: int, uses: Any, outs: Any, eqns: list) -> Any:
    """The probabilities of jax's softmax of ``var`` over its last axis (the
    equations appended to ``eqns``), or None."""
    last = (rank - 1,)
    used = uses.get(var, [])
    if var in outs or len(used) != 2:
        return None
    kinds = {e.primitive.name: (e, i) for e, i in used}
    if set(kinds) != {"reduce_max", "sub"}:
        return None
    rmax, (sub, sub_i) = kinds["reduce_max"][0], kinds["sub"]
    if sub_i != 0 or reduction_axes(rmax) != last:
        return None
    steps = [rmax]
    cur = rmax.outvars[0]
    while cur is not sub.invars[1]:  # max with -inf, broadcast, stop_gradient
        nxt = uses.get(cur, [])
        if len(nxt) != 1 or cur in outs:
            return None
        e = nxt[0][0]
        if e.primitive.name not in (
            "max",
            "broadcast_in_dim",
            "stop_gradient",
            "reshape",
        ):
            return None
        steps.append(e)
        cur = e.outvars[0]
    exp_use = uses.get(sub.outvars[0], [])
    if len(exp_use) != 1 or exp_use[0][0].primitive.name != "exp":
        return None
    exp = exp_use[0][0]
    after = uses.get(exp.outvars[0], [])
    names = {e.primitive.name: (e, i) for e, i in after}
    if len(after) != 2 or set(names) != {"reduce_sum", "div"}:
        return None
    rsum, (div, div_i) = names["reduce_sum"][0], names["div"]
    if div_i != 0 or reduction_axes(rsum) != last:
        return None
    bcast = uses.get(rsum.outvars[0], [])
    if len(bcast) != 1 or bcast[0][0].primitive.name != "broadcast_in_dim":
        return None
    b = bcast[0][0]
    if uses.get(b.outvars[0], []) != [(div, 1)]:
        return None
    eqns.extend([*steps, sub, exp, rsum, b, div])
    return div.outvars[0]


class Constants:
    """The values of a jaxpr's variables that are known at trace time: literals,
    concrete constants, and what equations compute from them alone (a causal
    mask made of ``iota`` comparisons), evaluated on demand."""

    def __init__(self, jaxpr: Any, consts: dict[Any, Any]):
        self._producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self._known = {
            v: c for v, c in consts.items() if not isinstance(c, jax.core.Tracer)
        }

    def producer(self, var: Any) -> Any:
        """The equation that computes ``var`` in this jaxpr, or None."""
        return self._producer.get(var)

    def value(self, var: Any, depth: int = 0) -> Any:
        """``var``'s value (a NumPy array), or None if it is not known."""
        if isinstance(var, jcore.Literal):
            return np.asarray(var.val)
        if var in self._known:
            return self._known[var]
        eqn = self._producer.get(var)
        if eqn is None or depth > 32:
            return None
        args = [self.value(v, depth + 1) for v in eqn.invars]
        if any(a is None for a in args):
            return None
        try:
            with jax.ensure_compile_time_eval():
                outs = bind(eqn.primitive, eqn.params, args)
        except Exception:  # noqa: BLE001 - not evaluable here: not known
            return None
        for v, o in zip(eqn.outvars, outs, strict=True):
            if isinstance(o, jax.core.Tracer):
                return None
            self._known[v] = np.asarray(o)
        return self._known[var]
