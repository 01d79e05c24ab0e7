"""The collectives of a compiled program, from its optimized HLO text.

The part of the one HLO reader (:mod:`jaxscale._hlo`, whose text helpers it
uses) that :func:`jaxscale.diagnostics.collective_report` reads: each array a
collective instruction moves, a combined all-reduce split into the arrays it
carries. It reads text only and imports nothing else of jaxscale.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import numpy as np

from jaxscale._hlo import computations, op_name, operands, shapes, split_type

__all__ = ["COLLECTIVE_KINDS", "CollectiveOp", "collectives", "module_devices", "roots"]

#: The collective opcodes; their async forms (``all-reduce-start`` with its
#: ``-done``) count once, under these names.
COLLECTIVE_KINDS = (
    "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute",
)  # fmt: skip
# Ops through which an entry parameter is still the same data.
_VIEWS = frozenset({"bitcast", "copy", "reshape", "transpose", "convert"})


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One array a collective instruction moves (one operand of a combined one)."""

    name: str  # the instruction (``all-reduce.3``; ``all-reduce.3[1]``: its operand 1)
    kind: str  # one of COLLECTIVE_KINDS
    dtype: str  # the HLO element type of its result: "f32", "pred"
    shape: tuple[int, ...]  # its result's shape on one device
    groups: tuple[tuple[int, ...], ...]  # device groups; a permute's (source, target)
    devices: int  # the module's devices (partitions x replicas)
    op_name: str  # the full op_name of its metadata
    computation: str  # the HLO computation holding it
    of_argument: bool  # its operand is (a view of) an argument of the entry
    instruction: str = ""  # the collective instruction (shared by its arrays)
    parts: int = 1  # the arrays that instruction moves


def module_devices(hlo: str) -> int:
    """``num_partitions`` x ``replica_count`` of the module's header (1 if absent)."""
    head = hlo.split("\n", 1)[0]
    n = re.search(r"\bnum_partitions=(\d+)", head)
    r = re.search(r"\breplica_count=(\d+)", head)
    return (int(n.group(1)) if n else 1) * (int(r.group(1)) if r else 1)


def _groups(attrs: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective's attributes, in any of XLA's forms:
    ``{{0,1},{2,3}}``, ``{}`` (every device), ``[2,4]<=[4,2]T(1,0)`` (iota) and
    ``mesh['a'=2,'b'=4] {'b'}``; a permute's ``source_target_pairs``; ``()`` if
    unreadable."""
    m = re.search(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m is None:
        m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m is not None:
        found = tuple(
            tuple(int(d) for d in g.split(",") if d)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        )
        return found or (tuple(range(devices)),)
    m = re.search(
        r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs
    )
    if m is not None:
        ids = np.arange(math.prod(int(d) for d in m.group(3).split(",")))
        ids = ids.reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        ids = ids.reshape(int(m.group(1)), int(m.group(2)))
        return tuple(tuple(int(d) for d in g) for g in ids)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m is not None:
        axes = [(a, int(n)) for a, n in re.findall(r"'?([\w.]+)'?=(\d+)", m.group(1))]
        inner = re.findall(r"'?([\w.]+)'?", m.group(2))
        names = [a for a, _ in axes]
        if all(a in names for a in inner):
            ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
            order = [i for i, a in enumerate(names) if a not in inner]
            order += [names.index(a) for a in inner]
            size = math.prod(dict(axes)[a] for a in inner)
            ids = ids.transpose(order).reshape(-1, size)
            return tuple(tuple(int(d) for d in g) for g in ids)
    return ()


def _is_parameter(defs: dict[str, tuple[str, str, list[str], str]], name: str) -> bool:
    """Whether ``name`` is a parameter of its computation, or a view of one."""
    op, _, args, _ = defs.get(name, ("", "", [], ""))
    while op in _VIEWS and args:
        op, _, args, _ = defs.get(args[0], ("", "", [], ""))
    return op == "parameter"


def roots(hlo: str) -> dict[str, str]:
    """``{computation: the name of its ROOT instruction}``."""
    out: dict[str, str] = {}
    current = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
        elif current is not None and line.lstrip().startswith("ROOT "):
            out[current] = line.split(" = ", 1)[0].split()[-1].lstrip("%")
    return out


_Defs = dict[str, tuple[str, str, list[str], str]]  # var: (op, type, args, attrs)
# Views through which a flattened part is still the array that was combined.
_RESHAPES = frozenset({"bitcast", "reshape", "copy"})
# Ops through which a part keeps the op_name of what made it.
_PASS = _VIEWS | {"get-tuple-element"}


def _definitions(lines: Iterable[str]) -> _Defs:
    defs: _Defs = {}
    for line in lines:
        var, rhs = line.split(" = ", 1)
        typ, rest = split_type(rhs)
        op, args, attrs = operands(rest)
        defs[var.split()[-1].lstrip("%")] = (op, typ, args, attrs)
    return defs


def _made_by(defs: _Defs, name: str) -> tuple[tuple[int, ...], str]:
    """The shape of the array ``name`` is a flattening of (through bitcasts,
    reshapes and copies of as many elements) and the ``op_name`` of what made it
    (through views and ``get-tuple-element``)."""
    op, typ, args, attrs = defs.get(name, ("", "", [], ""))
    typed = shapes(typ)
    dims = typed[0][1] if typed else ()
    size, reshaping, found = math.prod(dims), True, ""
    while True:
        found = found or op_name(attrs)
        if op not in _PASS or not args or (found and not reshaping):
            return dims, found
        reshaping = reshaping and op in _RESHAPES
        op, typ, args, attrs = defs.get(args[0], ("", "", [], ""))
        typed = shapes(typ)
        if reshaping and len(typed) == 1 and math.prod(typed[0][1]) == size:
            dims = typed[0][1]
        elif reshaping and op != "get-tuple-element":
            reshaping = False


def _flattened(
    defs: _Defs, name: str, comps: dict[str, list[str]], root: dict[str, str]
) -> list[tuple[str, tuple[tuple[int, ...], str]]] | None:
    """The arrays that XLA concatenated into the flat operand ``name`` of a
    combined all-reduce (XLA:GPU's combiner: a concatenation of flattened
    arrays, often inside a ``fusion``), as ``[(operand, (shape, op_name)),
    ...]``; ``None``
    if ``name`` is not such a concatenation. A concatenation with an
    ``op_name`` of its own is the program's, not the combiner's, and is kept
    whole."""
    op, typ, args, attrs = defs.get(name, ("", "", [], ""))
    while op in _RESHAPES and args and not op_name(attrs):
        op, typ, args, attrs = defs.get(args[0], ("", "", [], ""))
    if op_name(attrs) or len(shapes(typ)) != 1 or len(shapes(typ)[0][1]) != 1:
        return None
    if op == "concatenate":
        inner = args
    elif op == "fusion":
        m = re.search(r"\bcalls=%?([\w.\-]+)", attrs)
        called = m.group(1) if m else ""
        fused = _definitions(comps.get(called, []))
        cop, _, cargs, cattrs = fused.get(root.get(called, ""), ("", "", [], ""))
        while cop in _RESHAPES and cargs:
            cop, _, cargs, cattrs = fused.get(cargs[0], ("", "", [], ""))
        if cop != "concatenate" or op_name(cattrs):
            return None
        inner = []
        for a in cargs:
            aop, _, aargs, aattrs = fused.get(a, ("", "", [], ""))
            while aop in _RESHAPES and aargs:
                aop, _, aargs, aattrs = fused.get(aargs[0], ("", "", [], ""))
            if aop != "parameter" or not aargs or not aargs[0].isdigit():
                return None  # computed inside the fusion: not a plain combination
            if int(aargs[0]) >= len(args):
                return None
            inner.append(args[int(aargs[0])])
    else:
        return None
    if len(inner) < 2:
        return None
    return [(a, _made_by(defs, a)) for a in inner]


def collectives(hlo: str) -> list[CollectiveOp]:
    """Every collective of an optimized HLO module, one record per array moved.

    Every computation is read (a collective inside a loop body counts once, both
    branches of a conditional count). An async pair (``all-gather-start`` and
    its ``-done``) is one collective with the ``-done``'s result. A combined
    collective (a tuple of results) gives one record per operand, named
    ``name[i]``, with the ``op_name`` its ``get-tuple-element`` keeps of the
    collective it was combined from; an ``all-to-all`` of a tuple is one
    record, its parts stacked on a new first axis. An all-reduce of a flat
    concatenation that XLA made (XLA:GPU combines small all-reduces so: one
    ``f32[n]`` of several arrays, each flattened) gives one record per array
    concatenated, with its shape before flattening and the ``op_name`` of the
    operation that made it. The records of one instruction share
    ``instruction`` and count ``parts``.
    """
    comps, entry = computations(hlo)
    root = roots(hlo)
    devices = module_devices(hlo)
    out: list[CollectiveOp] = []
    for comp, lines in comps.items():
        defs: dict[str, tuple[str, str, list[str], str]] = {}  # var: op, type...
        picked: dict[tuple[str, int], str] = {}  # (tuple var, index): op_name
        found: list[tuple[str, str, str, list[str], str]] = []
        for line in lines:
            var, rhs = line.split(" = ", 1)
            var = var.split()[-1].lstrip("%")
            typ, rest = split_type(rhs)
            op, args, attrs = operands(rest)
            defs[var] = (op, typ, args, attrs)
            if op == "get-tuple-element" and args:
                m = re.search(r"\bindex=(\d+)", attrs)
                if m and op_name(attrs):
                    picked[(args[0], int(m.group(1)))] = op_name(attrs)
            base = op.removesuffix("-done")
            if op.endswith("-done") and base in COLLECTIVE_KINDS and args:
                _, _, start_args, start_attrs = defs.get(args[0], ("", "", [], ""))
                found.append((var, base, typ, start_args, start_attrs or attrs))
            elif op in COLLECTIVE_KINDS:
                found.append((var, op, typ, args, attrs))

        for var, kind, typ, args, attrs in found:
            parts = shapes(typ)
            groups = _groups(attrs, devices)
            if kind == "all-to-all" and len(parts) > 1:
                parts = [(parts[0][0], (len(parts), *parts[0][1]))]
            arrays = []  # (dtype, shape, op_name, operand)
            for i, (dtype, dims) in enumerate(parts):
                many = len(parts) > 1
                arg = args[i] if many and i < len(args) else (args[0] if args else "")
                name = picked.get((var, i)) if many else None
                if name is None and many:
                    name = op_name(defs.get(arg, ("", "", [], ""))[3])
                split = None
                if kind == "all-reduce" and arg:
                    split = _flattened(defs, arg, comps, root)
                if split:
                    arrays += [(dtype, d, n, a) for a, (d, n) in split]
                else:
                    arrays.append((dtype, dims, name or op_name(attrs), arg))
            for i, (dtype, dims, name, arg) in enumerate(arrays):
                out.append(
                    CollectiveOp(
                        name=f"{var}[{i}]" if len(arrays) > 1 else var,
                        kind=kind,
                        dtype=dtype,
                        shape=dims,
                        groups=groups,
                        devices=devices,
                        op_name=name,
                        computation=comp,
                        of_argument=comp == entry and _is_parameter(defs, arg),
                        instruction=var,
                        parts=len(arrays),
                    )
                )
    return out
