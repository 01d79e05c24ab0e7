"""Kernels and bytes of a compiled program, from its optimized HLO text.

The one reader of XLA's HLO text in the package, the benchmarks and the tests
(with :mod:`jaxscale._hlo_collectives`, which reads the collectives with this
module's helpers): every instruction of a module (:func:`instructions`, with
what it calls and its attributes), the kernels on the executed path with the
bytes each reads and writes, XLA's own convention, and the difference of two
programs (the accounting of ``benchmarks/step_account.py``, ``gpu.py``,
``overhead.py`` and ``float8_passes.py``), and the ``dot_general`` and
``convert`` operations of a lowered (StableHLO) program (:func:`stablehlo_dots`,
:func:`stablehlo_converts`: the float8 GEMM check's input). No other module
keeps a regular expression over HLO text or a table of bytes per dtype
(``tests/test_hlo.py`` checks it). It reads text only: it imports nothing of
jaxscale and works for any backend's compile, a deviceless GPU compile included.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable
from types import MappingProxyType

__all__ = [
    "DTYPE_BYTES",
    "Account",
    "Dot",
    "Instruction",
    "Kernel",
    "attribute",
    "backend_kind",
    "called",
    "categories",
    "computations",
    "difference",
    "instructions",
    "kernels",
    "label",
    "nbytes",
    "op_name",
    "operands",
    "shapes",
    "split_type",
    "stablehlo_converts",
    "stablehlo_dots",
    "stablehlo_ops",
    "strip_layouts",
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

    @property
    def opcode(self) -> str:
        """The HLO opcode: ``kind`` without its fusion kind or call target."""
        return self.kind.split(":", 1)[0]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of an HLO module, as :func:`instructions` reads it."""

    computation: str  # the computation holding it (fused computations too)
    name: str  # "fusion.3", without its "%"
    opcode: str  # "fusion", "convert", "all-reduce-start", ...
    type: str  # its result type as written, layouts included: "f32[4,8]{1,0}"
    operands: tuple[str, ...]  # the names of its operands
    attrs: str  # the text after its operands: "kind=kLoop, calls=%f, ..."


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


def instructions(hlo: str) -> list[Instruction]:
    """Every instruction of an HLO module, in the order of its text (the
    instructions of fused and called computations included)."""
    out = []
    for comp, lines in computations(hlo)[0].items():
        for line in lines:
            var, rhs = line.split(" = ", 1)
            typ, rest = split_type(rhs)
            op, args, attrs = operands(rest)
            name = var.split()[-1].lstrip("%")
            out.append(Instruction(comp, name, op, typ, tuple(args), attrs))
    return out


def attribute(attrs: str, key: str) -> str:
    """The value of ``key=`` in an instruction's attributes, unquoted (``""``
    if absent): a fusion's ``kind`` (``"kLoop"``), a custom call's
    ``custom_call_target``, a fusion's ``calls``, a ``get-tuple-element``'s
    ``index``."""
    m = re.search(rf'\b{re.escape(key)}=(?:"([^"]*)"|%?([^\s,{{}}]+))', attrs)
    return (m.group(1) if m.group(1) is not None else m.group(2)) if m else ""


def backend_kind(attrs: str) -> str:
    """The ``"kind"`` of an instruction's ``backend_config`` (``""`` if none):
    an XLA:GPU Triton fusion's ``"__triton_gemm"``."""
    m = re.search(r'"kind":"([^"]*)"', attrs)
    return m.group(1) if m else ""


def called(attrs: str) -> list[str]:
    """Every computation an instruction's attributes name: ``to_apply``,
    ``calls``, ``body``, ``condition``, ``true_computation``,
    ``false_computation``, ``branch_computations`` and
    ``called_computations``."""
    out = re.findall(
        r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)"
        r"=%?([\w.\-]+)",
        attrs,
    )
    for group in re.findall(
        r"\b(?:branch_computations|called_computations)=\{([^}]*)\}", attrs
    ):
        out += [n.strip().lstrip("%") for n in group.split(",")]
    return out


def strip_layouts(typ: str) -> str:
    """A type without its layouts: ``"f32[4,8]"`` for ``"f32[4,8]{1,0}"``."""
    return re.sub(r"\{[^}]*\}", "", typ)


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
# The lowered program: StableHLO text
# --------------------------------------------------------------------------- #

_DOT = re.compile(
    r"stablehlo\.dot_general\s+(?P<args>.*?):\s*\((?P<types>.*?)\)\s*->\s*"
    r"(?P<out>tensor<[^>]*>)"
)
_TENSOR = re.compile(r"tensor<([^>]*)>")
_CONVERT = re.compile(r"stablehlo\.convert .*-> tensor<(?:[\d?]+x)*(\w+)>")


@dataclasses.dataclass(frozen=True)
class Dot:
    """One ``stablehlo.dot_general`` of a lowered program. A type is
    ``(element type, dims)``, StableHLO's spelling: ``("f8E4M3FN", (32, 64))``
    (a dynamic dimension is -1); dimension numbers are ``(lhs, rhs)`` tuples,
    ``None`` where the dot has none; ``attrs`` is the text between the operands
    and the types (dimension numbers, precision, a dot ``algorithm``)."""

    operands: tuple[tuple[str, tuple[int, ...]], ...]
    result: tuple[str, tuple[int, ...]]
    batching: tuple[tuple[int, ...], tuple[int, ...]] | None
    contracting: tuple[tuple[int, ...], tuple[int, ...]] | None
    attrs: str = ""


def _tensor(body: str) -> tuple[str, tuple[int, ...]]:
    *dims, dtype = body.split("x")
    return dtype, tuple(int(d) if d.isdigit() else -1 for d in dims)


def _dimension_numbers(args: str, kind: str):
    m = re.search(rf"{kind}\s*=\s*\[([^\]]*)\]\s*x\s*\[([^\]]*)\]", args)
    if m is None:
        return None
    ints = lambda s: tuple(int(d) for d in s.split(",") if d.strip())  # noqa: E731
    return ints(m.group(1)), ints(m.group(2))


def stablehlo_dots(lowered: str) -> list[Dot]:
    """The ``stablehlo.dot_general`` operations of a lowered program's text
    (``jax.jit(f).lower(*args).as_text()``), in order."""
    out = []
    for line in lowered.splitlines():
        m = _DOT.search(line)
        if m is None:
            continue
        out.append(
            Dot(
                operands=tuple(_tensor(t) for t in _TENSOR.findall(m.group("types"))),
                result=_tensor(_TENSOR.match(m.group("out")).group(1)),
                batching=_dimension_numbers(m.group("args"), "batching_dims"),
                contracting=_dimension_numbers(m.group("args"), "contracting_dims"),
                attrs=m.group("args"),
            )
        )
    return out


def stablehlo_ops(lowered: str) -> list[str]:
    """The ``stablehlo`` operations of a lowered program's text, in order:
    ``["constant", "dot_general", "case", ...]``."""
    return re.findall(r"(?<![#!])\bstablehlo\.(\w+)", lowered)  # not attributes


def stablehlo_custom_calls(lowered: str) -> collections.Counter:
    """The ``stablehlo.custom_call`` operations of a lowered program's text, by
    call target (``"__cudnn$fmhaSoftmax"``: cuDNN's fused attention)."""
    return collections.Counter(
        re.findall(r"stablehlo\.custom_call @([\w$.]+)", lowered)
    )


def stablehlo_converts(lowered: str) -> collections.Counter:
    """The ``stablehlo.convert`` operations of a lowered program's text, by
    result element type (StableHLO's spelling: ``"bf16"``, ``"f32"``)."""
    return collections.Counter(_CONVERT.findall(lowered))
