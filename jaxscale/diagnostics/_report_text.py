"""How a :class:`~jaxscale.diagnostics.AutocastReport` prints: tables.

(:class:`~jaxscale.diagnostics.CollectiveReport` prints with the same
:func:`columns`, :func:`typed` and :func:`human_bytes`.)

The functions here read the report's and its sites' attributes; they import no
other module of the package (:mod:`jaxscale.diagnostics._autocast_report` and
:mod:`jaxscale.diagnostics._census` import them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = ["columns", "human_bytes", "render", "typed"]

_ROWS = 10  # rows per list in the printed report
_SHORT = MappingProxyType(
    {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
)


def typed(dtype: Any, shape: Sequence[int]) -> str:
    """``f16[2,8]``, as JAX prints avals."""
    name = np.dtype(dtype).name
    return f"{_SHORT.get(name, name)}[{','.join(map(str, shape))}]"


def columns(rows: list[list[str]], right: Sequence[int] = ()) -> list[str]:
    """Rows as aligned lines: text left-aligned, the ``right`` columns (numbers)
    right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def _dtype_order(report: Any) -> list[str]:
    seen = {d for row in report.by_primitive.values() for d in row}
    first = [d for d in dict.fromkeys((report.dtype, "float32")) if d in seen]
    return first + sorted(seen - set(first))


def _grid(
    title: str, groups: Mapping[str, Mapping[str, int]], dts: list[str]
) -> list[str]:
    rows = [[title, *dts]]
    for name, row in groups.items():
        rows.append([name, *(str(row[d]) if d in row else "-" for d in dts)])
    return columns(rows, right=range(1, len(dts) + 1))


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 MiB``..."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _locations(sites: Sequence[Any]) -> str:
    """``file:line`` of the sites, one file once: ``a.py:3,7 b.py:2``."""
    files: dict[str, list[str]] = {}
    for s in sites:
        file, _, line = s.location.rpartition(":")
        if file:
            lines = files.setdefault(file, [])
            if line not in lines:
                lines.append(line)
    return " ".join(f"{f}:{','.join(lines)}" for f, lines in files.items())


def _elsewhere(location: str, source: str) -> str:
    """The location, where it says more than the source."""
    return "" if location == source else location


def _grouped(sites: Sequence[Any]) -> list[list[str]]:
    """Sites with the same source and note as one row: its primitives in order,
    the largest output, the note, the locations."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for s in sites:
        groups.setdefault((s.source, s.note), []).append(s)
    rows = []
    for (source, note), group in groups.items():
        prims = ", ".join(dict.fromkeys(s.primitive for s in group))
        big = max(group, key=lambda s: int(np.prod(s.shape, dtype=np.int64)))
        where = _locations(group)
        rows.append(
            [
                source,
                prims,
                typed(big.dtype, big.shape),
                note,
                _elsewhere(where, source),
            ]
        )
    return rows


def _section(
    lines: list[str],
    title: str,
    head: list[str],
    rows: list,
    what: str,
    right: Sequence[int] = (),
) -> None:
    lines += ["", title]
    if not rows:
        lines.append("  none")
        return
    lines += columns([head, *rows[:_ROWS]], right)
    if len(rows) > _ROWS:
        lines.append(f"  ... {len(rows) - _ROWS} more rows: see report.{what}")


def _decision(note: str) -> str:
    """A float8 choice's note, decision first: ``float8: predicted 0.85 of
    bfloat16 on NVIDIA H200 (site 3)``, ``16 bits: pattern 'head' says so``."""
    if note.startswith("float8 declined: "):
        return note[len("float8 declined: ") :]
    head, _, why = note.partition("; ")
    return f"{why} ({head.split(':')[0][len('float8 ') :]})" if why else note


def render(r: Any) -> str:
    """The report ``r`` (an :class:`~jaxscale.diagnostics.AutocastReport`) as tables."""
    dts = _dtype_order(r)
    per = [sum(row.get(d, 0) for row in r.by_primitive.values()) for d in dts]
    summary = ", ".join(f"{n} {d}" for n, d in zip(per, dts, strict=True))
    lines = [f"autocast report: {r.dtype}, {r.operations} operations ({summary})"]
    lines += ["", "by primitive (the dtype each operation ran in):"]
    lines += _grid("primitive", r.by_primitive, dts)
    lines += ["", "by source:"]
    lines += _grid("source", r.by_source, dts)
    total = sum(r.bytes_by_dtype.values()) or 1
    lines += ["", "activation bytes (floating outputs of all operations):"]
    rows = [
        [d, human_bytes(n), f"{100 * n / total:.0f}%"]
        for d, n in r.bytes_by_dtype.items()
    ]
    lines += columns(rows or [["none", "0 B", ""]], right=(1, 2))
    _section(
        lines,
        f"float32 islands (outputs of >= {r.min_size} elements):",
        ["source", "ops", "largest", "why", "location"],
        _grouped(r.islands),
        "islands",
    )
    _section(
        lines,
        "constants:",
        ["source", "op", "output", "decision", "location"],
        [
            [
                s.source,
                s.primitive,
                typed(s.dtype, s.shape),
                s.note,
                _elsewhere(s.location, s.source),
            ]
            for s in r.constants
        ],
        "constants",
    )
    _section(
        lines,
        f"norm rule (float32 statistic or parameter cast to {r.dtype}):",
        ["source", "ops", "largest", "location"],
        [row[:3] + row[4:] for row in _grouped(r.norms)],
        "norms",
    )
    if r.float8:
        _section(
            lines,
            "float8 choice (matmuls without batch dimensions):",
            ["source", "output", "decision", "location"],
            [
                [
                    s.source,
                    typed(s.dtype, s.shape),
                    _decision(s.note),
                    _elsewhere(s.location, s.source),
                ]
                for s in r.float8
            ],
            "float8",
        )
    if r.deviation is not None:
        _section(
            lines,
            "deviation from float32, worst first (local: the operation alone):",
            ["source", "op", "output", "local", "rel", "abs", "nonfin", "location"],
            [
                [
                    s.source,
                    s.primitive,
                    typed(s.dtype, s.shape),
                    "-" if s.local_error is None else f"{s.local_error:.1e}",
                    f"{s.rel_error:.1e}",
                    f"{s.abs_error:.3g}",
                    str(s.nonfinite),
                    _elsewhere(s.location, s.source),
                ]
                for s in r.deviation
            ],
            "deviation",
            right=(3, 4, 5, 6),
        )
    return "\n".join(lines)
