"""``jxs.diagnostics.collective_report``: every collective of a compiled step.

What crosses devices is decided by XLA's partitioner, not by the jaxpr: a
gradient's all-reduce appears only in the compiled program, and its dtype is the
one the partitioner chose. This module compiles the function (or takes a
compiled program, or its optimized HLO text, :meth:`CollectiveReport.from_hlo`),
reads its collectives with :mod:`jaxscale._hlo_collectives`, and says of each what it
moves
(dtype, shape, bytes per device, an estimate of the bytes each device sends),
over which devices, and what it carries, read from the instruction's metadata:
a gradient, jaxscale's finite flags, a float8 amax, a gathered argument...
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxscale._autocast.interp import REGION_PREFIX
from jaxscale._hlo_collectives import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    collectives,
    module_devices,
)
from jaxscale._scope import (
    AMAX_SCOPE,
    BLOCK_SCALES_SCOPE,
    FINITE_SCOPE,
    FLOAT8_GATHER_SCOPE,
    REDUCE_MEAN_SCOPE,
)
from jaxscale.diagnostics._report_text import columns, human_bytes, typed

__all__ = ["CARRIES", "Collective", "CollectiveReport", "collective_report"]

#: What a collective can carry (:attr:`Collective.carries`).
CARRIES = (
    "gradient", "finite flags", "amax", "argument gather", "activation gather",
    "backward", "unknown", "forward", "float8 gather", "reduce_mean",
    "reduce_mean scales",
)  # fmt: skip
_ROWS = 20  # rows in the printed report
_HLO_TYPES = (("pred", "bool"), ("bf16", "bfloat16"), ("f8", "float8_"))
# Name-stack wrappers of JAX's transformations, unwrapped to what they name.
_WRAPPERS = ("transpose", "jvp", "vmap", "checkpoint", "remat", "jit", "pjit")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One array that a collective of the compiled program moves.

    Attributes:
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
        ``"all-to-all"`` or ``"collective-permute"`` (an async pair, such as
        ``all-reduce-start`` and its ``-done``, counts once under its name).
      dtype: the dtype it moves, as NumPy names it (``"float32"``, ``"bool"``).
      shape: the shape of its result on one device: for ``reduce-scatter`` the
        shard, for ``all-gather`` the gathered array. It is the array XLA moves,
        which may be a transpose of yours (a gradient of ``f32[32,8]`` may cross
        as ``f32[8,32]``). XLA combines collectives
        into one of several arrays: each array is a :class:`Collective` of its
        own (its :attr:`name` ends ``[i]``), whether the instruction has a
        tuple of operands (XLA:CPU) or one flat array concatenated of the
        arrays flattened (XLA:GPU: a part has its shape before flattening);
        an ``all-to-all`` of several parts is one, its parts stacked on a new
        first axis.
      group_size: ``n``, the devices in each group that it reduces, gathers or
        exchanges over (a ``collective-permute``: the devices in its pairs).
      bytes: the bytes of its result on one device.
      wire_bytes: an estimate of the bytes each device sends: a ring all-reduce
        ``2(n-1)/n`` times ``bytes``, a reduce-scatter ``(n-1)/n`` of the whole
        (unscattered) array, an all-gather and an all-to-all ``(n-1)/n`` of
        ``bytes``, a collective-permute ``bytes``.
      carries: what it carries, from the ``op_name`` of its metadata (one of
        :data:`CARRIES`): ``"finite flags"`` (the check of
        :func:`jaxscale.dynamic_scaling`), ``"amax"`` (a float8 scale's
        reduction over devices), ``"float8 gather"`` (the float8 bits that
        :func:`jaxscale.float8.all_gather` gathers), ``"reduce_mean"`` and
        ``"reduce_mean scales"`` (the values and the float32 block scales
        that :func:`jaxscale.reduce_mean` and :func:`jaxscale.reduce_gradients`
        send), ``"argument gather"`` (an all-gather of an argument of the
        step, such as a sharded weight), ``"gradient"`` (a reduction in the
        backward pass: a parameter's gradient, a BatchNorm's backward sums,
        a cotangent of model parallelism), ``"backward"`` (another collective
        of the backward pass), ``"forward"`` (a reduction in the forward pass
        of a differentiated function: a loss, a metric, batch statistics),
        ``"activation gather"`` (another all-gather) or ``"unknown"`` (no
        metadata tells: a ``psum`` outside any derivative, say).
      source: the name stack of the operation it came from, JAX's
        transformations unwrapped and the primitive left out (a Flax module
        path, ``jax.named_scope`` names): for a gradient, the module whose
        parameter it is; ``""`` if there is none.
      op_name: the ``op_name`` of its metadata, in full.
      name: the HLO instruction.
      groups: the device groups (a ``collective-permute``: its ``(source,
        target)`` pairs); ``()`` where XLA's text was not readable.
      computation: the HLO computation holding it (a loop body's collectives
        run once per iteration).
      instruction: the collective instruction that moves it (the same for
        every array that XLA combined into one).
      parts: the arrays that instruction moves (1: not combined).
      operation: the primitive that made it, the last part of ``op_name``
        (for a gradient, ``"dot_general"`` or ``"conv_general_dilated"``: a
        kernel's; ``"reduce_sum"``: a bias's, a norm's); ``""`` if none.

    Examples:
      >>> import jaxscale as jxs
      >>> hlo = '''HloModule m, num_partitions=8
      ... ENTRY %main (p: f16[4,2]) -> f16[32,2] {
      ...   %p = f16[4,2]{1,0} parameter(0)
      ... %g = f16[32,2] all-gather(%p), metadata={op_name="jit(f)/MLP/Dense_0/dot"}
      ... }'''
      >>> c = jxs.diagnostics.CollectiveReport.from_hlo(hlo).collectives[0]
      >>> c.kind, c.dtype, c.shape, c.group_size, c.bytes, c.wire_bytes
      ('all-gather', 'float16', (32, 2), 8, 128, 112)
      >>> c.carries, c.source
      ('argument gather', 'MLP/Dense_0')
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    bytes: int
    wire_bytes: int
    carries: str
    source: str
    op_name: str
    name: str
    groups: tuple[tuple[int, ...], ...]
    computation: str
    instruction: str = ""
    parts: int = 1
    operation: str = ""


def _numpy_name(hlo_dtype: str) -> str:
    for short, name in _HLO_TYPES:
        if hlo_dtype.startswith(short):
            rest = hlo_dtype[len(short) :]
            return name + (rest if short == "f8" else "")
    prefix = {"s": "int", "u": "uint", "f": "float", "c": "complex"}
    return prefix.get(hlo_dtype[0], hlo_dtype[0]) + hlo_dtype[1:]


def _segments(op_name: str) -> list[str]:
    """``a/b(c/d)/e`` as ``["a", "b(c/d)", "e"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(op_name):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "/" and depth == 0:
            parts.append(op_name[start:i])
            start = i + 1
    return [*parts, op_name[start:]]


def _source(op_name: str) -> str:
    """The name stack without the outer ``jit``, transformations' wrappers,
    ``shard_map``, autocast's own scopes, ``lax.cond``'s branches and the
    primitive:
    ``jit(f)/transpose(jvp(MLP))/Dense_0/dot`` gives ``MLP/Dense_0``. A
    backward operation's stack ends with its forward one in full
    (``transpose(jvp(Net))/bn0/jvp(Net)/bn0/reduce_sum``): that is kept."""
    out: list[str] = []
    restarts = []  # where a transformation's wrapper starts a stack again
    for i, seg in enumerate(_segments(op_name)[:-1]):
        if seg == "shard_map" or (i == 0 and re.match(r"p?jit\(", seg)):
            continue
        m = re.fullmatch(r"(\w+)\((.*)\)", seg)
        if m and m.group(1) in _WRAPPERS:
            restarts.append(len(out))
        while m and m.group(1) in _WRAPPERS:
            seg = m.group(2)
            m = re.fullmatch(r"(\w+)\((.*)\)", seg)
        for part in _segments(seg):
            if re.fullmatch(r"branch_\d+_fun", part):  # lax.cond's, in its "cond"
                out = out[:-1] if out and out[-1] == "cond" else out
            elif part and not part.startswith(REGION_PREFIX):
                out.append(part)
    for at in reversed(restarts):
        if 0 < at < len(out) and out[at] == out[0]:
            return "/".join(out[at:])
    return "/".join(out)


def _carries(op: CollectiveOp) -> str:
    name, reduces = op.op_name, op.kind in ("all-reduce", "reduce-scatter")
    if FINITE_SCOPE in name:
        return "finite flags"
    if AMAX_SCOPE in name:
        return "amax"
    if REDUCE_MEAN_SCOPE in name:
        return "reduce_mean scales" if BLOCK_SCALES_SCOPE in name else "reduce_mean"
    if op.kind == "all-gather" and FLOAT8_GATHER_SCOPE in name:
        return "float8 gather"
    if op.kind == "all-gather" and op.of_argument:
        return "argument gather"
    if "transpose(" in name:
        return "gradient" if reduces else "backward"
    if op.kind == "all-gather":
        return "activation gather"
    return "forward" if reduces and "jvp(" in name else "unknown"


def _collective(op: CollectiveOp) -> Collective:
    if op.kind == "collective-permute":
        n = len({d for pair in op.groups for d in pair}) or op.devices
    else:
        n = len(op.groups[0]) if op.groups else op.devices
    size = int(np.prod(op.shape, dtype=np.int64))
    nbytes = size * np.dtype(_numpy_name(op.dtype)).itemsize
    wire = {
        "all-reduce": 2 * (n - 1) * nbytes / n,
        "reduce-scatter": (n - 1) * nbytes,
        "collective-permute": nbytes,
    }.get(op.kind, (n - 1) * nbytes / n)
    return Collective(
        kind=op.kind,
        dtype=_numpy_name(op.dtype),
        shape=op.shape,
        group_size=n,
        bytes=int(nbytes),
        wire_bytes=round(wire),
        carries=_carries(op),
        source=_source(op.op_name),
        op_name=op.op_name,
        name=op.name,
        groups=op.groups,
        computation=op.computation,
        instruction=op.instruction or op.name,
        parts=op.parts,
        operation=_segments(op.op_name)[-1] if op.op_name else "",
    )


def _check_choice(name: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value is not None and value not in allowed:
        raise ValueError(
            f"`{name}` must be one of {', '.join(map(repr, allowed))} or None, "
            f"got {value!r}."
        )


@dataclasses.dataclass(frozen=True, repr=False)
class CollectiveReport:
    """The collectives of a compiled program, one :class:`Collective` per array.

    ``print(report)`` shows them as a table; :meth:`select`, :meth:`dtypes`,
    :meth:`bytes` and :meth:`check` answer a test's questions.

    Attributes:
      collectives: every array moved, in the order of the program's text.
      devices: the devices the program runs on (partitions x replicas).

    Examples:
      >>> import jaxscale as jxs
      >>> hlo = '''HloModule m, num_partitions=4
      ... ENTRY %main (p: f32[8,2]) -> f32[8,2] {
      ...   %p = f32[8,2]{1,0} parameter(0)
      ...   ROOT %ar = f32[8,2]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add
      ... }'''
      >>> report = jxs.diagnostics.CollectiveReport.from_hlo(hlo)
      >>> report.dtypes(), report.bytes(), report.bytes(wire=True)
      (('float32',), 64, 96)
      >>> print(report)
      collective report: 1 collective on 4 devices, 64 B per device (sent: 96 B)
      <BLANKLINE>
        kind        carries  array     n  bytes  sent  source
        all-reduce  unknown  f32[8,2]  4   64 B  96 B
    """

    collectives: tuple[Collective, ...]
    devices: int

    @classmethod
    def from_hlo(cls, hlo: Any) -> CollectiveReport:
        """The report of a compiled program: a ``jax.stages.Compiled`` (what
        ``jax.jit(f).lower(*args).compile()`` returns, for any backend: a
        deviceless GPU compile too) or its optimized HLO text
        (``compiled.as_text()``).

        Raises:
          TypeError: if ``hlo`` is neither (a ``Lowered`` must be compiled
            first: its text has no partitioner's collectives yet).
          ValueError: if the text is not an HLO module's.
        """
        if isinstance(hlo, jax.stages.Compiled):
            hlo = hlo.as_text()
        if not isinstance(hlo, str):
            raise TypeError(
                "`hlo` must be a `jax.stages.Compiled` or its optimized HLO text "
                f"(`compiled.as_text()`), got {type(hlo).__name__}"
                + (": call `.compile()` first." if hasattr(hlo, "compile") else ".")
            )
        if not hlo.lstrip().startswith("HloModule"):
            raise ValueError(
                "`hlo` must be optimized HLO text, starting `HloModule` (as "
                "`jax.jit(f).lower(*args).compile().as_text()` returns), got "
                f"{hlo.lstrip()[:40]!r}..."
            )
        ops = collectives(hlo)
        return cls(tuple(_collective(op) for op in ops), module_devices(hlo))

    def select(
        self, kind: str | None = None, carries: str | None = None, dtype: Any = None
    ) -> tuple[Collective, ...]:
        """The collectives of this ``kind``, carrying this, of this ``dtype``
        (each ``None``: any).

        Raises:
          ValueError: for an unknown ``kind`` or ``carries``.
        """
        _check_choice("kind", kind, COLLECTIVE_KINDS)
        _check_choice("carries", carries, CARRIES)
        name = None if dtype is None else np.dtype(dtype).name
        return tuple(
            c
            for c in self.collectives
            if kind in (None, c.kind)
            and carries in (None, c.carries)
            and name in (None, c.dtype)
        )

    def dtypes(
        self, kind: str | None = None, carries: str | None = None
    ) -> tuple[str, ...]:
        """The dtypes moved (sorted NumPy names) by the selected collectives."""
        return tuple(sorted({c.dtype for c in self.select(kind, carries)}))

    def bytes(
        self,
        kind: str | None = None,
        carries: str | None = None,
        dtype: Any = None,
        *,
        wire: bool = False,
    ) -> int:
        """The bytes per device of the selected collectives' results (with
        ``wire=True``: the estimate of what each device sends)."""
        field = "wire_bytes" if wire else "bytes"
        return sum(getattr(c, field) for c in self.select(kind, carries, dtype))

    def check(
        self,
        *,
        allow_dtypes: Iterable[Any] | None = None,
        max_bytes: int | None = None,
        kind: str | None = None,
        carries: str | None = None,
    ) -> CollectiveReport:
        """Asserts that every selected collective moves an allowed dtype and at
        most ``max_bytes`` per device; returns the report.

        Raises:
          AssertionError: listing the collectives that break a rule.
          ValueError: for an unknown ``kind`` or ``carries``.
        """
        allowed = None
        if allow_dtypes is not None:
            allowed = {np.dtype(d).name for d in allow_dtypes}
        bad = [
            c
            for c in self.select(kind, carries)
            if (allowed is not None and c.dtype not in allowed)
            or (max_bytes is not None and c.bytes > max_bytes)
        ]
        if bad:
            rules = []
            if allowed is not None:
                rules.append(f"dtypes {sorted(allowed)}")
            if max_bytes is not None:
                rules.append(f"at most {max_bytes} bytes")
            raise AssertionError(
                f"{len(bad)} collective(s) break the rule ({', '.join(rules)}):\n"
                + "\n".join(_table(bad))
            )
        return self

    def to_dicts(self) -> list[dict[str, Any]]:
        """Every collective as a dict of its fields (for ``json.dumps``)."""
        return [dataclasses.asdict(c) for c in self.collectives]

    def to_json(self) -> str:
        """The report as JSON: ``{"devices": ..., "collectives": [...]}``."""
        return json.dumps({"devices": self.devices, "collectives": self.to_dicts()})

    def __repr__(self) -> str:
        kinds = {}
        for c in self.collectives:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"
        return f"CollectiveReport({self.devices} devices: {parts})"

    def __str__(self) -> str:
        n = len(self.collectives)
        k = len({(c.computation, c.instruction) for c in self.collectives})
        combined = f" in {k} instruction{'s' * (k != 1)}" if k < n else ""
        lines = [
            f"collective report: {n} collective{'s' * (n != 1)}{combined} on "
            f"{self.devices} devices, {human_bytes(self.bytes())} per device (sent: "
            f"{human_bytes(self.bytes(wire=True))})",
            "",
        ]
        if not self.collectives:
            return "\n".join([*lines, "  none"])
        lines += _table(self.collectives[:_ROWS])
        if n > _ROWS:
            lines.append(f"  ... {n - _ROWS} more rows: see report.collectives")
        return "\n".join(lines)


def _table(rows: Iterable[Collective]) -> list[str]:
    head = ["kind", "carries", "array", "n", "bytes", "sent", "source"]
    body = [
        [
            c.kind,
            c.carries,
            typed(c.dtype, c.shape),
            str(c.group_size),
            human_bytes(c.bytes),
            human_bytes(c.wire_bytes),
            c.source,
        ]
        for c in rows
    ]
    return columns([head, *body], right=(3, 4, 5))


def collective_report(fun: Callable[..., Any]) -> Callable[..., CollectiveReport]:
    """The collectives of ``fun``'s compiled program: what crosses devices.

    ``jxs.diagnostics.collective_report(step)(*args)`` compiles ``step`` for
    ``args`` as ``jax.jit(step).lower(*args).compile()`` does (``step`` may be
    jitted already, with its shardings and static arguments) and returns a
    :class:`CollectiveReport`: every all-reduce, reduce-scatter, all-gather,
    all-to-all and collective-permute of the optimized program, those that XLA's
    partitioner inserted for sharded arrays as well as a ``shard_map``'s
    ``psum``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and
    ``ppermute``, with its dtype, shape, bytes per device and what it carries
    (a gradient, jaxscale's finite flags...). Nothing is run: arguments may be
    ``jax.ShapeDtypeStruct`` with shardings, placed on a deviceless topology (a
    GPU compile without a GPU). A program already compiled, or its text, is
    read by :meth:`CollectiveReport.from_hlo`.

    The dtype is the one on the wire: XLA:CPU widens float8 and bfloat16
    collectives to float16 or float32 where XLA:GPU keeps them, so read a GPU's
    collectives from a GPU compile.

    Args:
      fun: the step: a function, or a ``jax.jit`` of one.

    Returns:
      A function with ``fun``'s signature returning a :class:`CollectiveReport`.

    Raises:
      TypeError: if ``fun`` is not callable (a compiled program or its text
        goes to :meth:`CollectiveReport.from_hlo`).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices("cpu")[:2], ("data",))
      >>> step = jax.shard_map(
      ...     lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"),
      ...     out_specs=P(),
      ... )
      >>> report = jxs.diagnostics.collective_report(step)(jnp.ones((4, 3)))
      >>> c = report.collectives[0]
      >>> c.kind, c.dtype, c.shape, c.group_size, c.bytes, c.wire_bytes
      ('all-reduce', 'float32', (2, 3), 2, 24, 24)
      >>> report.check(allow_dtypes=["float32"], max_bytes=1024)
      CollectiveReport(2 devices: 1 all-reduce)
    """
    if isinstance(fun, str | jax.stages.Compiled):
        raise TypeError(
            "`fun` must be a function; read a compiled program or its HLO text "
            "with `jxs.diagnostics.CollectiveReport.from_hlo(compiled)`."
        )
    if not callable(fun):
        raise TypeError(
            f"`fun` must be callable, got {type(fun).__name__}: "
            "`jxs.diagnostics.collective_report(step)(*args)` reports the "
            "collectives of `jax.jit(step).lower(*args).compile()`."
        )
    jitted = fun if hasattr(fun, "lower") else jax.jit(fun)

    def report(*args: Any, **kwargs: Any) -> CollectiveReport:
        return CollectiveReport.from_hlo(jitted.lower(*args, **kwargs).compile())

    return report
