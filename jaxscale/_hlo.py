"""Kernels, bytes and collectives of a compiled program, from its optimized HLO text.

The one reader of XLA's optimized HLO text in the package: the accounting that
``benchmarks/step_account.py``, ``benchmarks/gpu.py`` and
``benchmarks/float8_passes.py`` share (each kernel on the executed path, with
the bytes it reads and writes, XLA's own convention, and the difference of two
programs), and the collectives that
:func:`jaxscale.diagnostics.collective_report` reports. It reads text only: it
imports nothing of jaxscale and works for any backend's compile, a deviceless
GPU compile included.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable
from types import MappingProxyType

import numpy as np

__all__ = [
    "DTYPE_BYTES",
    "COLLECTIVE_KINDS",
    "Account",
    "CollectiveOp",
    "Kernel",
    "categories",
    "collectives",
    "computations",
    "difference",
    "kernels",
    "label",
    "module_devices",
    "nbytes",
    "op_name",
    "operands",
    "roots",
    "shapes",
    "split_type",
]

#: Bytes per element of each HLO element type.
DTYPE_BYTES = MappingProxyType({
    "f64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "s8": 1, "u8": 1,
    "pred": 1, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "s16": 2, "u16": 2,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e3m4": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
})  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
# Instructions that run no kernel of their own.
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
})  # fmt: skip
# Instructions whose callees run in their place.
_CALLS = frozenset({"call", "conditional", "while", "async-start", "async-done"})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One device instruction of an optimized HLO module."""

    name: str
    kind: str  # "fusion:kLoop", "custom-call:__cublas$gemm", "copy", "sort", ...
    reads: int  # bytes of its operands
    writes: int  # bytes of its result (a custom call's workspace left out)
    signature: tuple  # kind, result shapes, non-scalar operand shapes (sorted)
    label: str  # the op_name of its metadata, shortened

    @property
    def bytes(self) -> int:
        return self.reads + self.writes


def shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array type in ``text``: ``[("f32", (4, 8)), ...]``."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(text)
    ]


def nbytes(typed: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    """The bytes of ``(dtype, dims)`` pairs, as :func:`shapes` returns them."""
    total = 0
    for dtype, dims in typed:
        n = 1
        for d in dims:
            n *= d
        total += n * DTYPE_BYTES[dtype]
    return total


def split_type(rhs: str) -> tuple[str, str]:
    """``(result type, the rest)`` of an instruction's right-hand side."""
    if rhs.startswith("("):  # a tuple type: up to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].lstrip()
    head, _, rest = rhs.partition(" ")
    return head, rest


def operands(rest: str) -> tuple[str, list[str], str]:
    """``(opcode, operand names, attributes)`` of ``opcode(operands), attrs``."""
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return "", [], rest
    depth, start = 0, m.end() - 1
    for i in range(start, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        if depth == 0:
            inner, attrs = rest[start + 1 : i], rest[i + 1 :]
            break
    else:
        inner, attrs = rest[start + 1 :], ""
    names = []
    for tok in re.split(r",\s*(?![^{]*\})", inner):
        tok = re.sub(r"/\*.*?\*/", "", tok).strip()
        if tok:
            names.append(tok.split()[-1].lstrip("%"))
    return m.group(1), names, attrs


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """``({computation: its instruction lines}, the entry's name)``."""
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            if line.startswith(("HloModule", "FileNames", "FunctionNames")):
                continue
            name = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
            comps[name], current = [], name
            if line.startswith("ENTRY"):
                entry = name
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None and " = " in line:
            comps[current].append(line.strip().removeprefix("ROOT "))
    return comps, entry


def op_name(attrs: str) -> str:
    """The full ``op_name`` of an instruction's metadata (``""`` if none)."""
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


def label(attrs: str) -> str:
    """The ``op_name``, its outer ``jit(...)`` dropped, its last 60 characters."""
    name = op_name(attrs).split(";")[0]
    return re.sub(r"^jit\([^)]*\)/", "", name)[-60:]


def kernels(hlo: str) -> list[Kernel]:
    """The kernels of an optimized HLO module on the path a finite step runs.

    From the entry computation, following ``call`` (XLA:GPU's command buffers),
    ``while`` bodies (once) and, of a ``conditional``, its second branch only
    (``true_computation``, or branch 1: the finite branch of a ``lax.cond``
    around a skip); nested fusion computations are not kernels of their own.
    """
    comps, entry = computations(hlo)
    out: list[Kernel] = []

    def walk(comp: str, seen: tuple[str, ...]) -> None:
        types: dict[str, str] = {}
        for line in comps.get(comp, []):
            var, rhs = line.split(" = ", 1)
            var = var.split()[-1].lstrip("%")
            typ, rest = split_type(rhs)
            types[var] = typ
            op, args, attrs = operands(rest)
            if op in _FREE or not op:
                continue
            if op in _CALLS:
                targets = re.findall(
                    r"\b(?:to_apply|calls|body|true_computation)=%?([\w.\-]+)", attrs
                )
                branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
                if branches:
                    names = [
                        b.strip().lstrip("%") for b in branches.group(1).split(",")
                    ]
                    targets.append(names[1] if len(names) > 1 else names[0])
                for t in targets:
                    if t in comps and t not in seen:
                        walk(t, (*seen, t))
                continue
            result = shapes(typ)
            kind = op
            if op == "fusion":
                m = re.search(r"kind=(\w+)", attrs)
                kind = f"fusion:{m.group(1) if m else '?'}"
            elif op == "custom-call":
                m = re.search(r'custom_call_target="([^"]*)"', attrs)
                kind = f"custom-call:{m.group(1) if m else '?'}"
                if typ.startswith("(") and len(result) > 1:
                    result = result[:1]  # the result; not the workspace
            operand_shapes = [s for a in args for s in shapes(types.get(a, ""))]
            big = sorted(s for s in operand_shapes if nbytes([s]) > 16)
            out.append(
                Kernel(
                    name=var,
                    kind=kind,
                    reads=nbytes(operand_shapes),
                    writes=nbytes(result),
                    signature=(kind.split(":")[0], tuple(result), tuple(big)),
                    label=label(attrs),
                )
            )

    if entry:
        walk(entry, (entry,))
    return out


def difference(
    bare: list[Kernel], ours: list[Kernel]
) -> tuple[list[Kernel], list[Kernel]]:
    """``(added, removed)``: the kernels of ``ours`` that no kernel of ``bare``
    matches by signature, and those of ``bare`` that none of ``ours`` matches."""
    left = collections.Counter(k.signature for k in bare)
    right = collections.Counter(k.signature for k in ours)
    extra, missing = right - left, left - right
    added, removed = [], []
    for k in ours:
        if extra[k.signature] > 0:
            extra[k.signature] -= 1
            added.append(k)
    for k in bare:
        if missing[k.signature] > 0:
            missing[k.signature] -= 1
            removed.append(k)
    by_size = lambda k: -k.bytes  # noqa: E731
    return sorted(added, key=by_size), sorted(removed, key=by_size)


@dataclasses.dataclass
class Account:
    """The per-kernel comparison of a bare and a ``dynamic_scaling`` step."""

    model: str
    n_params: int
    leaves: int
    bare: list[Kernel]
    ours: list[Kernel]

    @property
    def extra_kernels(self) -> int:
        return len(self.ours) - len(self.bare)

    @property
    def extra_bytes(self) -> int:
        return sum(k.bytes for k in self.ours) - sum(k.bytes for k in self.bare)

    @property
    def bytes_per_param(self) -> float:
        return self.extra_bytes / self.n_params

    def lines(self, top: int = 12) -> list[str]:
        """The account as text lines, each starting ``account:``: the totals,
        the kinds of kernel whose count or bytes changed, and the kernels
        added and removed (matched by signature), largest first."""
        added, removed = difference(self.bare, self.ours)
        mb = lambda n: f"{n / 1e6:.3f} MB"  # noqa: E731
        per = lambda n: f"{n / self.n_params:.2f} B/param"  # noqa: E731
        out = [
            f"account: {self.model} | {self.n_params:,} params in {self.leaves} "
            f"leaves | kernels {len(self.bare)} -> {len(self.ours)} "
            f"({self.extra_kernels:+d}) | bytes {mb(sum(k.bytes for k in self.bare))}"
            f" -> {mb(sum(k.bytes for k in self.ours))} "
            f"({self.extra_bytes / 1e6:+.3f} MB, {self.bytes_per_param:+.2f} B/param)"
        ]
        for (kind, label), (n0, b0, n1, b1) in categories(self.bare, self.ours)[:top]:
            out.append(
                f"account: {self.model} | by kind: {kind} {label or '-'} | "
                f"{n0} -> {n1} kernels | {per(b0)} -> {per(b1)}"
            )
        for sign, group in (("+", added), ("-", removed)):
            for k in group[:top]:
                out.append(
                    f"account: {self.model} | {sign} {k.kind} {k.name} | reads "
                    f"{k.reads:,} B, writes {k.writes:,} B ({per(k.bytes)}) | "
                    f"{k.label}"
                )
            if len(group) > top:
                rest = sum(k.bytes for k in group[top:])
                out.append(
                    f"account: {self.model} | {sign} {len(group) - top} more, "
                    f"{rest:,} B ({per(rest)})"
                )
        return out


def categories(
    bare: list[Kernel], ours: list[Kernel]
) -> list[tuple[tuple[str, str], tuple[int, int, int, int]]]:
    """The kinds of kernel (kind and the last op of its metadata name) whose
    count or bytes differ: ``((kind, op), (n bare, bytes bare, n ours, bytes
    ours))``, the largest change in bytes first. XLA names a fusion after
    one of its ops, so a kernel may change kind without changing its work:
    the totals are what count."""
    table: dict[tuple[str, str], list[int]] = collections.defaultdict(
        lambda: [0, 0, 0, 0]
    )
    for col, ks in ((0, bare), (2, ours)):
        for k in ks:
            entry = table[(k.kind, k.label.rsplit("/", 1)[-1])]
            entry[col] += 1
            entry[col + 1] += k.bytes
    changed = [(key, tuple(v)) for key, v in table.items() if v[:2] != v[2:]]
    return sorted(changed, key=lambda kv: (-abs(kv[1][3] - kv[1][1]), kv[0]))


# --------------------------------------------------------------------------- #
# Collectives
# --------------------------------------------------------------------------- #

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
