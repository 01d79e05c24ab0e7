"""Kernels and bytes of a compiled program, read from its optimized HLO text.

The accounting that ``benchmarks/step_account.py`` (a step with and without
``dynamic_scaling``), ``benchmarks/gpu.py`` (the same account of its steps on a
GPU) and ``benchmarks/float8_passes.py`` share: each kernel on the executed path
(fusions, GEMMs, copies, sorts; the callees of calls, conditionals and loops in
their place) with the bytes it reads (its operands) and writes (its result),
XLA's own convention; the difference of two programs; and, with ``--target``,
the deviceless XLA:GPU compilation that makes such a program without a GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

_DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2,
                "s8": 1, "u8": 1, "pred": 1, "s64": 8, "u64": 8, "c64": 8,
                "c128": 16, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
# Instructions that run no kernel of their own.
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
}  # fmt: skip
# Instructions whose callees run in their place.
_CALLS = {"call", "conditional", "while", "async-start", "async-done"}


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


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(text)
    ]


def _nbytes(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    total = 0
    for dtype, dims in shapes:
        n = 1
        for d in dims:
            n *= d
        total += n * _DTYPE_BYTES[dtype]
    return total


def _split_type(rhs: str) -> tuple[str, str]:
    """``(result type, the rest)`` of an instruction's right-hand side."""
    if rhs.startswith("("):  # a tuple type: up to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].lstrip()
    head, _, rest = rhs.partition(" ")
    return head, rest


def _operands(rest: str) -> tuple[str, list[str], str]:
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


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
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


def _label(attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attrs)
    if not m:
        return ""
    name = m.group(1).split(";")[0]
    return re.sub(r"^jit\([^)]*\)/", "", name)[-60:]


def kernels(hlo: str) -> list[Kernel]:
    """The kernels of an optimized HLO module on the path a finite step runs.

    From the entry computation, following ``call`` (XLA:GPU's command buffers),
    ``while`` bodies (once) and, of a ``conditional``, its second branch only
    (``true_computation``, or branch 1: the finite branch of a ``lax.cond``
    around a skip); nested fusion computations are not kernels of their own.
    """
    comps, entry = _computations(hlo)
    out: list[Kernel] = []

    def walk(comp: str, seen: tuple[str, ...]) -> None:
        types: dict[str, str] = {}
        for line in comps.get(comp, []):
            var, rhs = line.split(" = ", 1)
            var = var.split()[-1].lstrip("%")
            typ, rest = _split_type(rhs)
            types[var] = typ
            op, args, attrs = _operands(rest)
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
            result = _shapes(typ)
            kind = op
            if op == "fusion":
                m = re.search(r"kind=(\w+)", attrs)
                kind = f"fusion:{m.group(1) if m else '?'}"
            elif op == "custom-call":
                m = re.search(r'custom_call_target="([^"]*)"', attrs)
                kind = f"custom-call:{m.group(1) if m else '?'}"
                if typ.startswith("(") and len(result) > 1:
                    result = result[:1]  # the result; not the workspace
            operand_shapes = [s for a in args for s in _shapes(types.get(a, ""))]
            big = sorted(s for s in operand_shapes if _nbytes([s]) > 16)
            out.append(
                Kernel(
                    name=var,
                    kind=kind,
                    reads=_nbytes(operand_shapes),
                    writes=_nbytes(result),
                    signature=(kind.split(":")[0], tuple(result), tuple(big)),
                    label=_label(attrs),
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


def row(acc: Account) -> str:
    """One Markdown row of the summary table."""
    return (
        f"| {acc.model} | {acc.n_params:,} | {acc.leaves} | {len(acc.bare)} -> "
        f"{len(acc.ours)} ({acc.extra_kernels:+d}) | {acc.bytes_per_param:+.2f} |"
    )


TABLE_HEADER = (
    "| model | params | leaves | kernels, bare -> dynamic_scaling | "
    "extra bytes per parameter |\n|---|---|---|---|---|"
)


# --------------------------------------------------------------------------- #
# The steps, compiled on the default backend or for a GPU without one.
# --------------------------------------------------------------------------- #

# Deviceless targets: XLA:GPU's device description of each GPU (the fields
# its fusion and cost model passes read), for ``--target``.
_GPU_TARGETS = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, 3352320000000, 52428800, 84929347584),
    "h200": ("NVIDIA H200", 132, 4800000000000, 62914560, 150754820096),
}


def _target_config(target: str) -> str:
    name, cores, bandwidth, l2, memory = _GPU_TARGETS[target]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  threads_per_core_limit: 2048 core_count: {cores} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: {l2} clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""


def abstract_for(target: str | None) -> Callable[[Any], Any]:
    """A function that turns a pytree of arrays into what ``lower`` compiles
    for ``target``: the arrays themselves on the default backend, or
    ``ShapeDtypeStruct``s placed on a deviceless GPU's topology."""
    import jax

    if target is None:
        return lambda tree: tree
    # A machine without CUDA: the plugin's version check would fail before the
    # deviceless compiler is reached (it needs no CUDA library).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=_target_config(target), topology="1x1x1"
    )
    mesh = topologies.make_mesh(topo=topo, mesh_shape=(1,), axis_names=("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
    )
