"""Why an activation is float32: the words of the autocast report's islands.

An island starts where an operation widens a low-precision activation; its note
says what the widening operand is, in terms a user can act on (a parameter, a
table computed in float32, a full-size float32 activation, a loop carry), and a
loop or a branch that widens its result says so (:data:`CARRIED`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
from jax.extend import core as jcore

from jaxscale._autocast.values import Info, dtype_of
from jaxscale._jax_private import construct_of, scan_parts, while_parts
from jaxscale.diagnostics._report_text import typed

__all__ = ["CARRIED", "carried_note", "carry_vars", "widened_note", "widening_operand"]

CARRIED = MappingProxyType(
    {
        "scan": "{} loop carry kept in float32",
        "while": "{} loop carry kept in float32",
        "cond": "{} branch result widened to another branch's float32",
    }
)


def carry_vars(eqn: Any, jaxpr: Any) -> frozenset[Any]:
    """The inputs of ``jaxpr`` that are the carry of the loop ``eqn`` (the
    higher-order equation evaluating it, or ``None``)."""
    construct = construct_of(eqn.primitive) if eqn is not None else None
    if construct == "scan":
        parts = scan_parts(eqn)
        if parts is not None and parts.body.jaxpr is jaxpr:
            nc = parts.num_consts
            return frozenset(jaxpr.invars[nc : nc + parts.num_carry])
    if construct == "while":
        loop = while_parts(eqn)
        if loop is not None and loop.body.jaxpr is jaxpr:
            return frozenset(jaxpr.invars[loop.body_nconsts :])
    return frozenset()


def widening_operand(atom: Any, info: Info, size: int, carries: frozenset[Any]) -> str:
    """What a float32 operand that widens a low-precision activation is, in the
    terms a user can act on."""
    if not isinstance(atom, jcore.Literal) and atom in carries:
        return "a loop carry kept at its traced float32"
    broadcast = info.src_size < size
    if info.param:
        return (
            "a float32 parameter, broadcast (a bias, a scale, a position table)"
            if broadcast
            else "a float32 parameter or input"
        )
    made = f" made by `{info.origin}`" if info.origin else ""
    if broadcast:
        return (
            f"a float32 value{made} broadcast to its shape, computed from more "
            "than parameters and constants (from positions, as a RoPE table, or "
            "from an activation); passed in as an argument it would be cast"
        )
    return f"a full-size float32 activation{made} (a residual stream kept in float32)"


def widened_note(
    dtype: np.dtype,
    rec: Any,
    vals: Sequence[Any],
    infos: Sequence[Info],
    wide: Sequence[bool],
    carries: frozenset[Any],
) -> str:
    """The note of an operation (``rec``, a ``Record``) that widens an
    activation in ``dtype``: each float32 operand (``wide``) and what it is."""
    size = int(np.prod(np.shape(rec.outs[0])))
    parts = [
        f"{typed(dtype_of(v), np.shape(v))}, "
        f"{widening_operand(atom, info, size, carries)}"
        for v, info, atom, w in zip(vals, infos, rec.eqn.invars, wide, strict=True)
        if w
    ]
    by = f" by {'; '.join(parts)}" if parts else ""
    return f"{np.dtype(dtype).name} widened{by}"


def carried_note(name: str, dtype: np.dtype) -> str:
    """The note of a loop or branch ``name`` whose result is float32 where its
    body gave ``dtype``."""
    return CARRIED.get(name, "{} result in float32").format(np.dtype(dtype).name)
