"""``jxs.autocast_report``: what :func:`jaxscale.autocast` did to a function.

The function is run under autocast with an observing interpreter (a subclass of
:class:`~jaxscale._autocast_interp.Interpreter` whose ``observer`` receives a
:class:`~jaxscale._autocast_interp.Record` per first-order equation), under
``jax.eval_shape``: nothing is computed, so it works on models of any size. The
interpreter also keeps track of the higher-order equations it is inside (to give
every equation of the user's function one key, however often a loop body or a
custom-derivative function is traced) and of which float32 values descend from a
low-precision activation (the float32 islands).

With ``compare=True`` the function is also run eagerly twice on the same jaxpr:
at float32 (every value kept) and under autocast, and each operation's output is
compared with the float32 one, in total and for the operation alone (run at
autocast's dtypes on the float32 run's inputs).
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxscale._autocast import _check_dtype, _run
from jaxscale._autocast_hop import HANDLERS
from jaxscale._autocast_interp import (
    REGION_PREFIX,
    Info,
    Interpreter,
    Record,
    bind,
    cast,
    dtype_of,
    is_castable,
)
from jaxscale._autocast_rules import HIGHER_ORDER, AutocastRule, resolve_rules
from jaxscale._cotangents import _as_pure

__all__ = ["AutocastReport", "AutocastSite", "autocast_report"]

_F32 = np.dtype("float32")
# The default island threshold: outputs at least this fraction of the largest
# output of a "lower" operation (a matmul's or convolution's activation).
_ISLAND_FRACTION = 16
_ROWS = 10  # rows per list in the printed report


@dataclasses.dataclass(frozen=True)
class AutocastSite:
    """One operation of the function as :func:`autocast_report` saw it.

    Attributes:
      primitive: the JAX primitive (``"mul"``, ``"dot_general"``...), as
        :func:`jax.make_jaxpr` prints it.
      source: the Flax module path of the operation (``"CNN/BatchNorm_0"``, from
        JAX's name stack: linen modules and ``jax.named_scope`` put it there), or
        its ``location`` where there is none.
      location: ``file:line`` of the innermost frame outside JAX that created the
        operation (a Flax file, shown relative to ``site-packages``, or yours);
        ``""`` if unknown.
      shape: the shape of its (first) output.
      dtype: the dtype its (first) output has under autocast.
      note: what autocast decided there, in words.
      abs_error: ``compare=True`` only: the largest ``|autocast - float32|``
        over the output's elements that are finite in both runs.
      rel_error: ``abs_error / max|float32|``: the error relative to the
        output's scale (0 where both are 0).
      local_error: the same relative error for this operation alone: run at
        autocast's dtypes on the float32 run's inputs, so it measures what the
        operation itself loses, not what it inherits; ``inf`` if it alone turns
        finite values into ``inf`` or ``NaN``.
      nonfinite: the number of output elements that are ``inf`` or ``NaN``
        under autocast and finite in the float32 run.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> report = jxs.autocast_report(lambda x: jnp.log(jnp.tanh(x @ x) + 1e-8))(
      ...     jnp.ones((4, 4)))
      >>> site = report.constants[0]
      >>> site.primitive, site.shape, site.dtype
      ('add', (4, 4), 'float32')
      >>> site.note
      'constant 1e-08 rounds to 0 in float16: runs in float32'
    """

    primitive: str
    source: str
    location: str
    shape: tuple[int, ...]
    dtype: str
    note: str = ""
    abs_error: float | None = None
    rel_error: float | None = None
    local_error: float | None = None
    nonfinite: int | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class AutocastReport:
    """What :func:`jaxscale.autocast` does to a function, operation by operation.

    ``print(report)`` shows it as tables; the fields hold the same numbers.
    Every count is per equation of the function (a loop body's operations once,
    not once per iteration); dtypes are named as NumPy names them
    (``"float16"``, ``"float32"``, ``"int32"``, ``"bool"``).

    Attributes:
      dtype: the autocast dtype (``"float16"`` or ``"bfloat16"``; ``"float32"``
        when autocast is off).
      operations: the number of operations (first-order equations, in the
        function and in the bodies of its ``jit``, ``scan``, ``cond``...).
      by_primitive: primitive name to {dtype it ran in: count}. The dtype an
        operation ran in is that of its floating operands after autocast's casts
        (a norm-rule operation, computed in float32 and rounded, ran in
        float32), or its output's for casts and operations without floating
        operands.
      by_source: the same counts per source (:attr:`AutocastSite.source`), in
        the order the sources first appear in the function.
      bytes_by_dtype: the bytes of every operation's floating outputs, summed
        per dtype: what the program writes if nothing is fused. Compare the
        dtypes with each other, not with a memory profile.
      min_size: the smallest output (in elements) that counts as an activation
        for :attr:`islands`.
      islands: the float32 islands: every operation whose float32 output has at
        least ``min_size`` elements and descends from an activation in
        ``dtype`` through operations that autocast runs at their operands'
        dtypes (``promote``, ``bias`` and ``keep`` rules), not through a
        ``float32``-rule one (``exp``, ``log``, sums...: float32 by design, as in
        torch). An island starts where such an operation widens an activation
        in ``dtype`` (its note says which operand was float32) and continues
        through what is computed from it in float32, up to the next matmul.
        These are the float32 activations autocast did not intend: a BatchNorm
        computed in float32 between float16 convolutions, a residual stream
        kept in float32, a loss's difference with float32 targets.
      constants: the operations where a constant of the function would not
        survive narrowing (see :func:`autocast`): saturated to the finite range
        in a selection, or run in float32 elsewhere, as the note says.
      norms: the operations the norm rule computed in float32 and rounded to
        ``dtype`` (a norm's statistics or parameters combined with an
        activation in ``dtype``).
      deviation: with ``compare=True``, every operation with floating outputs
        and concrete values, worst first (by ``local_error``, then
        ``nonfinite``, then ``rel_error``); ``None`` otherwise.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def f(w, x):
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> report = jxs.autocast_report(f)(jnp.ones((3, 2)), jnp.ones((4, 3)))
      >>> dict(report.by_primitive["dot_general"]), report.operations
      ({'float16': 1}, 3)
      >>> dict(report.bytes_by_dtype)  # f16[4,2] twice (dot, tanh), f32[] once
      {'float16': 32, 'float32': 4}
    """

    dtype: str
    operations: int
    by_primitive: Mapping[str, Mapping[str, int]]
    by_source: Mapping[str, Mapping[str, int]]
    bytes_by_dtype: Mapping[str, int]
    min_size: int
    islands: tuple[AutocastSite, ...]
    constants: tuple[AutocastSite, ...]
    norms: tuple[AutocastSite, ...]
    deviation: tuple[AutocastSite, ...] | None = None

    def __repr__(self) -> str:
        parts = [
            f"{self.operations} operations",
            f"{len(self.islands)} in float32 islands",
            f"{len(self.constants)} constants",
            f"{len(self.norms)} norm-rule",
        ]
        if self.deviation is not None:
            parts.append(f"{len(self.deviation)} compared")
        return f"AutocastReport({self.dtype}: {', '.join(parts)})"

    def __str__(self) -> str:
        return _render(self)


# --------------------------------------------------------------------------- #
# Where an equation comes from
# --------------------------------------------------------------------------- #


def _user_frame(eqn: Any) -> Any:
    from jax._src import source_info_util as siu

    try:
        return siu.user_frame(eqn.source_info.traceback)
    except (AttributeError, TypeError):  # older jax: takes the SourceInfo
        return siu.user_frame(eqn.source_info)


def _short(path: str) -> str:
    for marker in ("site-packages", "dist-packages"):
        head, sep, tail = path.rpartition(marker + os.sep)
        if sep:
            return tail
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith("..") else rel


def _source(eqns: Sequence[Any]) -> tuple[str, str]:
    """``(source, location)`` of the last of ``eqns`` (the equations around it
    first): the name stacks joined, and the innermost user frame."""
    location = ""
    for e in reversed(eqns):
        frame = _user_frame(e)
        if frame is not None:
            location = f"{_short(frame.file_name)}:{frame.start_line}"
            break
    return _names(eqns) or location or "?", location


def _names(eqns: Sequence[Any]) -> str:
    """The name stacks of ``eqns`` joined, without autocast's own regions, as
    JAX prints them (``jvp(CNN)/Conv_0`` in a gradient); ``""`` if no scope."""
    from jax._src import source_info_util as siu

    stack = []
    for e in eqns:
        stack += getattr(e.source_info.name_stack, "stack", ())
    kept = tuple(
        s for s in stack if not str(getattr(s, "name", "")).startswith(REGION_PREFIX)
    )
    if not any(isinstance(s, siu.Scope) for s in kept):
        return ""
    return str(siu.NameStack(stack=kept))


# --------------------------------------------------------------------------- #
# The observing interpreters
# --------------------------------------------------------------------------- #


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


class _Frame:
    """A higher-order equation being evaluated, with the island flags of its
    operands, and those of its sub-computations' outputs as they are evaluated."""

    def __init__(self, eqn: Any, flags: list[bool]):
        self.eqn = eqn
        self.flags = flags
        self.sub_outs: list[tuple[list[Any], list[Any]]] = []  # (outvars, outs)


class _Walker(Interpreter):
    """An interpreter that knows which higher-order equations it is inside, so
    each equation of the function has one key however often it is traced."""

    def __init__(self, dtype: np.dtype, table: Mapping[str, Any], handlers: Any):
        super().__init__(dtype, table, handlers)
        self.observer = self._observe
        self._frames: list[_Frame] = []
        self._calls: list[tuple[Any, list[Any], list[Info]]] = []

    def path(self, eqn: Any) -> tuple[Any, ...]:
        return tuple(f.eqn for f in self._frames if f.eqn is not eqn)

    def eval_eqn(
        self, eqn: Any, vals: list[Any], infos: list[Info]
    ) -> tuple[list[Any], list[Info]]:
        hop = eqn.primitive.name in HIGHER_ORDER
        if hop:
            self._frames.append(_Frame(eqn, self.flags(eqn.invars)))
        self._calls.append((eqn, vals, infos))
        try:
            outs, out_infos = super().eval_eqn(eqn, vals, infos)
            frame = self._frames[-1] if hop else None
        finally:
            self._calls.pop()
            if hop:
                self._frames.pop()
        self.finished(eqn, frame, vals, outs)
        return outs, out_infos

    def eval_jaxpr(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        infos: Sequence[Info] | None = None,
    ) -> tuple[list[Any], list[Info]]:
        frame = self._frames[-1] if self._frames else None
        self.entered(jaxpr, frame, args)
        outs, out_infos = super().eval_jaxpr(jaxpr, consts, args, infos)
        if frame is not None:
            frame.sub_outs.append((list(jaxpr.outvars), list(outs)))
        return outs, out_infos

    def _observe(self, rec: Record) -> None:
        eqn, vals, infos = self._calls[-1]
        self.observed(rec, vals, infos, self.path(rec.eqn))

    # Hooks.
    def flags(self, atoms: Sequence[Any]) -> list[bool]:
        return [False] * len(atoms)

    def entered(self, jaxpr: Any, frame: _Frame | None, args: Sequence[Any]) -> None:
        pass

    def observed(
        self, rec: Record, vals: list[Any], infos: list[Info], path: tuple
    ) -> None:
        pass

    def finished(
        self, eqn: Any, frame: _Frame | None, vals: list[Any], outs: list[Any]
    ) -> None:
        pass


def _key(path: Sequence[Any], eqn: Any) -> tuple[int, ...]:
    return (*map(id, path), id(eqn))


def _ran_in(name: str, operands: Sequence[Any], outs: Sequence[Any]) -> str:
    floats = [dtype_of(v) for v in operands if _floating(dtype_of(v))]
    if floats and name != "convert_element_type":
        return max(floats, key=lambda d: np.dtype(d).itemsize).name
    return np.dtype(dtype_of(outs[0])).name if outs else "none"


_CARRIED = {
    "scan": "{} loop carry kept in float32",
    "while": "{} loop carry kept in float32",
    "cond": "{} branch result widened to another branch's float32",
}


def _aligned(frame: _Frame, jaxpr: Any) -> list[bool]:
    """The island flags of ``jaxpr``'s inputs, from the operands of the
    higher-order equation evaluating it."""
    eqn, flags, p = frame.eqn, frame.flags, frame.eqn.params
    n, m = len(jaxpr.invars), len(flags)
    if eqn.primitive.name == "while" and "cond_nconsts" in p:
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        if jaxpr is getattr(p["cond_jaxpr"], "jaxpr", None):
            return flags[:cn] + flags[cn + bn :]
        return flags[cn:]
    if n == m:
        return flags
    if n == m - 1:  # cond: the branch index first
        return flags[1:]
    nc = p.get("num_consts", 0)
    if n == m - nc:  # a custom_vjp forward: the primals
        return flags[nc:]
    if n == 2 * (m - nc):  # a JVP rule: primals, then tangents
        return flags[nc:] * 2
    return [False] * n


class _Census(_Walker):
    """Records each equation once, with its source and island flag."""

    def __init__(self, dtype: np.dtype, table: Mapping[str, Any], handlers: Any):
        super().__init__(dtype, table, handlers)
        self.entries: dict[tuple[int, ...], dict[str, Any]] = {}
        # Higher-order equations whose float32 outputs came from low values.
        self.widened: dict[tuple[int, ...], dict[str, Any]] = {}
        self._flags: dict[int, tuple[Any, bool]] = {}

    def _wide(self, x: Any) -> bool:
        d = dtype_of(x)
        return is_castable(d) and np.dtype(d).itemsize > self.dtype.itemsize

    def flags(self, atoms: Sequence[Any]) -> list[bool]:
        out = []
        for a in atoms:
            hit = None if isinstance(a, jcore.Literal) else self._flags.get(id(a))
            out.append(hit is not None and hit[0] is a and hit[1])
        return out

    def _set(self, atoms: Sequence[Any], flags: Sequence[bool]) -> None:
        for a, f in zip(atoms, flags, strict=True):
            if not isinstance(a, jcore.Literal):
                self._flags[id(a)] = (a, bool(f))

    def entered(self, jaxpr: Any, frame: _Frame | None, args: Sequence[Any]) -> None:
        flags = _aligned(frame, jaxpr) if frame else [False] * len(jaxpr.invars)
        self._set(
            jaxpr.invars,
            [f and self._wide(a) for f, a in zip(flags, args, strict=True)],
        )

    def finished(
        self, eqn: Any, frame: _Frame | None, vals: list[Any], outs: list[Any]
    ) -> None:
        key = _key(self.path(eqn), eqn)
        if frame is not None and key not in self.entries:  # handled: no record
            self._carried(eqn, key, frame, outs)
        elif key not in self.entries:  # a weak-type-only convert: a no-op
            self._set(eqn.outvars, self.flags(eqn.invars))
            rec = Record(eqn, AutocastRule.KEEP, (), tuple(vals), tuple(outs), ())
            self.observed(rec, vals, [], self.path(eqn))

    def _carried(self, eqn: Any, key: tuple, frame: _Frame, outs: list[Any]) -> None:
        """The island flags of a higher-order equation's outputs, from its
        sub-computations' (a scan's body, a cond's branches...). An output in
        float32 that a sub-computation gave in ``dtype`` (a loop carry kept at its
        traced float32, a branch widened to match another) starts an island."""
        k = len(eqn.outvars)
        subs = [(v[:k], o[:k]) for v, o in frame.sub_outs if len(v) in (k, 2 * k)]
        flags, widened = [], []
        for i, out in enumerate(outs):
            island = any(self.flags([v[i]])[0] for v, _ in subs)
            low = any(dtype_of(o[i]) == self.dtype for _, o in subs)
            flags.append(self._wide(out) and (island or low))
            if self._wide(out) and low and not island:
                widened.append(out)
        self._set(eqn.outvars, flags)
        if widened and key not in self.widened:
            big = max(widened, key=lambda o: int(np.prod(np.shape(o))))
            self.widened[key] = {
                "eqns": (*self.path(eqn), eqn),
                "name": eqn.primitive.name,
                "outs": [(tuple(np.shape(big)), np.dtype(dtype_of(big)))],
                "island": _CARRIED.get(
                    eqn.primitive.name, "{} result in float32"
                ).format(self.dtype.name),
                "seq": len(self.entries) + len(self.widened),
            }

    def observed(
        self, rec: Record, vals: list[Any], infos: list[Info], path: tuple
    ) -> None:
        eqn, name = rec.eqn, rec.eqn.primitive.name
        from_low = any(
            _floating(dtype_of(v)) and np.dtype(dtype_of(v)) == self.dtype for v in vals
        )
        from_island = any(self.flags(eqn.invars))
        eligible = rec.rule not in (AutocastRule.FLOAT32, AutocastRule.TRACED)
        carried = eligible and (from_low or from_island) and self.dtype != _F32
        self._set(eqn.outvars, [carried and self._wide(o) for o in rec.outs])
        key = _key(path, eqn)
        if key in self.entries:
            return
        island = ""
        if carried and rec.outs and self._wide(rec.outs[0]):
            if from_low:
                wide = [_typed(dtype_of(v), np.shape(v)) for v in vals if self._wide(v)]
                by = f" by {', '.join(wide)}" if wide else ""
                island = f"{self.dtype.name} widened{by} ({rec.rule.value})"
            else:
                island = "from an island"
        self.entries[key] = {
            "eqns": (*path, eqn),
            "name": name,
            "rule": rec.rule,
            "ran_in": _ran_in(name, rec.operands, rec.outs),
            "outs": [(tuple(np.shape(o)), np.dtype(dtype_of(o))) for o in rec.outs],
            "notes": rec.notes,
            "island": island,
            "seq": len(self.entries) + len(self.widened),
        }


class _Reference(_Walker):
    """The float32 run: keeps every value, by the variable it is bound to."""

    def __init__(self, table: Mapping[str, Any], handlers: Any):
        super().__init__(_F32, table, handlers)
        self.values: dict[tuple[Any, ...], Any] = {}

    def _keep(self, path: tuple, atoms: Sequence[Any], vals: Sequence[Any]) -> None:
        ids = tuple(map(id, path))
        for a, v in zip(atoms, vals, strict=True):
            if not isinstance(a, jcore.Literal) and not isinstance(v, jax.core.Tracer):
                self.values[(ids, id(a))] = (a, v)

    def value(self, ids: tuple, atom: Any) -> Any:
        """The float32 run's value of ``atom`` (a variable), or ``None``."""
        hit = self.values.get((ids, id(atom)))
        return hit[1] if hit is not None and hit[0] is atom else None

    def entered(self, jaxpr: Any, frame: _Frame | None, args: Sequence[Any]) -> None:
        self._keep(tuple(f.eqn for f in self._frames), jaxpr.invars, args)

    def finished(
        self, eqn: Any, frame: _Frame | None, vals: list[Any], outs: list[Any]
    ) -> None:
        self._keep(self.path(eqn), eqn.outvars, outs)


class _Compare(_Walker):
    """The autocast run, compared with a float32 run of the same jaxpr made just
    before it (the first ``eval_closed`` is the function's own jaxpr)."""

    def __init__(self, dtype: np.dtype, table: Mapping[str, Any], handlers: Any):
        super().__init__(dtype, table, handlers)
        self.reference = _Reference(table, handlers)
        self.sites: dict[tuple[int, ...], AutocastSite] = {}
        self._started = False
        # Both beyond the low dtype's range: a saturated constant, not an error.
        self._big = float(jnp.finfo(dtype).max)

    def eval_closed(
        self, closed: Any, args: Sequence[Any], infos: Sequence[Info] | None = None
    ) -> tuple[list[Any], list[Info]]:
        if not self._started:
            self._started = True
            self.reference.eval_closed(closed, args, infos)
        return super().eval_closed(closed, args, infos)

    def observed(
        self, rec: Record, vals: list[Any], infos: list[Info], path: tuple
    ) -> None:
        key = _key(path, rec.eqn)
        if key in self.sites or rec.eqn.primitive.name in HIGHER_ORDER:
            return
        tracer = jax.core.Tracer
        if any(isinstance(v, tracer) for v in (*vals, *rec.operands, *rec.outs)):
            return  # inside a loop or a branch: no values
        ids = tuple(map(id, path))
        ref = [self.reference.value(ids, v) for v in rec.eqn.outvars]
        pairs = [
            (o, r)
            for o, r in zip(rec.outs, ref, strict=True)
            if r is not None and _floating(dtype_of(o))
        ]
        if not pairs:
            return
        abs_error, rel_error, nonfinite = _errors(pairs, self._big)
        source, location = _source((*path, rec.eqn))
        out = rec.outs[0]
        self.sites[key] = AutocastSite(
            primitive=rec.eqn.primitive.name,
            source=source,
            location=location,
            shape=tuple(np.shape(out)),
            dtype=np.dtype(dtype_of(out)).name,
            note=f"{rec.rule.value}, ran in {_ran_in('', rec.operands, rec.outs)}",
            abs_error=abs_error,
            rel_error=rel_error,
            local_error=self._local(rec, vals, infos, ids),
            nonfinite=nonfinite,
        )

    def _local(
        self, rec: Record, vals: list[Any], infos: list[Info], ids: tuple
    ) -> float | None:
        """The relative error of the operation alone. Its inputs are the float32
        run's, rounded to the dtypes they arrive in under autocast (so what an
        earlier operation lost is not counted again); it runs once as autocast
        runs it (its casts, its dtype, its output's rounding) and once at the
        dtypes it was traced with, and the two are compared. A constant is taken
        as autocast gives it (saturation is not an error)."""
        eqn = rec.eqn
        low, exact = [], []
        for atom, v, used, info, t in zip(
            eqn.invars, vals, rec.operands, infos, rec.traced, strict=True
        ):
            r = None
            if not isinstance(atom, jcore.Literal) and info.const is None:
                r = self.reference.value(ids, atom)
            if r is None or not _floating(dtype_of(v)):
                low.append(used)
                exact.append(_cast_float(v, t))
            else:
                r = cast(r, np.dtype(dtype_of(v)))
                low.append(cast(r, np.dtype(dtype_of(used))))
                exact.append(_cast_float(r, t))
        try:
            params = self.adjust_params(rec.rule, eqn, low, list(rec.traced))
            outs = bind(eqn.primitive, params, low)
            refs = bind(eqn.primitive, eqn.params, exact)
        except Exception:  # a diagnostic: no local figure rather than no report
            return None
        pairs = [
            (_cast_float(o, dtype_of(a)), r)
            for o, r, a in zip(outs, refs, rec.outs, strict=True)
            if _floating(dtype_of(a))
        ]
        _, rel, nonfinite = _errors(pairs, self._big)
        return float("inf") if nonfinite else rel


def _cast_float(x: Any, dtype: Any) -> Any:
    if _floating(dtype_of(x)) and _floating(dtype):
        return cast(x, np.dtype(dtype))
    return x


def _errors(pairs: Sequence[tuple[Any, Any]], big: float) -> tuple[float, float, int]:
    """``(max |a - r|, that / max |r|, new non-finite count)`` over pairs of
    (autocast, float32) arrays, on the elements finite in both and not both
    beyond ``big`` with one sign (a constant saturated to the low range)."""
    diff, scale, bad = 0.0, 0.0, 0
    for a, r in pairs:
        a = np.asarray(a).astype(np.float64)
        r = np.asarray(r).astype(np.float64)
        ok = np.isfinite(a) & np.isfinite(r)
        bad += int(np.sum(~np.isfinite(a) & np.isfinite(r)))
        ok &= ~((np.abs(a) >= big) & (np.abs(r) >= big) & (np.sign(a) == np.sign(r)))
        if np.any(ok):
            diff = max(diff, float(np.max(np.abs(a[ok] - r[ok]))))
            scale = max(scale, float(np.max(np.abs(r[ok]))))
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return diff, rel, bad


def _inline(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Any:
    """A call-like higher-order equation (``jit``, ``checkpoint``, custom
    derivatives) evaluated in place, so its values stay concrete; its forward
    is the same as the handler's."""
    p = eqn.params
    sub = p.get("call_jaxpr", p.get("jaxpr"))
    if isinstance(sub, jcore.ClosedJaxpr) and len(sub.jaxpr.invars) == len(vals):
        return it.eval_closed(sub, vals, infos)
    if isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(vals):
        return it.eval_jaxpr(sub, (), vals, infos)
    return HANDLERS[eqn.primitive.name](it, eqn, vals, infos)


_INLINE = {
    **HANDLERS,
    **{
        name: _inline
        for name in ("checkpoint", "closed_call", "core_call", "custom_jvp_call")
        + ("custom_vjp_call", "jit", "pjit", "remat2")
        if name in HANDLERS
    },
}


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


def _counts(pairs: Sequence[tuple[str, str]]) -> Mapping[str, Mapping[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for group, dtype in pairs:
        row = out.setdefault(group, {})
        row[dtype] = row.get(dtype, 0) + 1
    return types.MappingProxyType(
        {k: types.MappingProxyType(v) for k, v in out.items()}
    )


def _site(entry: dict[str, Any], note: str) -> AutocastSite:
    source, location = _source(entry["eqns"])
    shape, dtype = entry["outs"][0] if entry["outs"] else ((), np.dtype("float32"))
    return AutocastSite(
        entry["name"], source, location, shape, np.dtype(dtype).name, note
    )


def _build(
    census: _Census, min_size: int | None, deviation: Sequence[AutocastSite] | None
) -> AutocastReport:
    entries = list(census.entries.values())
    lowered = [
        int(np.prod(shape, dtype=np.int64))
        for e in entries
        if e["rule"] is AutocastRule.LOWER
        for shape, _ in e["outs"][:1]
    ]
    if min_size is None:
        min_size = max(max(lowered, default=0) // _ISLAND_FRACTION, 1)
    sources = {id(e): _source(e["eqns"])[0] for e in entries}
    nbytes: dict[str, int] = {}
    for e in entries:
        for shape, dtype in e["outs"]:
            if _floating(dtype):
                size = int(np.prod(shape, dtype=np.int64))
                nbytes[dtype.name] = nbytes.get(dtype.name, 0) + size * dtype.itemsize
    islands = tuple(
        _site(e, e["island"])
        for e in sorted([*entries, *census.widened.values()], key=lambda e: e["seq"])
        if e["island"] and int(np.prod(e["outs"][0][0], dtype=np.int64)) >= min_size
    )
    constants, norms = [], []
    for e in entries:
        for note in e["notes"]:
            (constants if note.startswith("constant") else norms).append(_site(e, note))
    if deviation is not None:
        deviation = tuple(
            sorted(
                deviation,
                key=lambda s: (
                    -(s.local_error if s.local_error is not None else 0.0),
                    -(s.nonfinite or 0),
                    -(s.rel_error or 0.0),
                ),
            )
        )
    return AutocastReport(
        dtype=census.dtype.name,
        operations=len(entries),
        by_primitive=_counts(sorted((e["name"], e["ran_in"]) for e in entries)),
        by_source=_counts([(sources[id(e)], e["ran_in"]) for e in entries]),
        bytes_by_dtype=types.MappingProxyType(dict(sorted(nbytes.items()))),
        min_size=min_size,
        islands=islands,
        constants=tuple(constants),
        norms=tuple(norms),
        deviation=deviation,
    )


def _abstract_pure(
    fun: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable[..., Any], list[Any]]:
    """:func:`_as_pure`, with ``jax.ShapeDtypeStruct`` leaves as arrays too (for
    ``jax.eval_shape``): stand-ins of no size mark them, then they replace them."""
    shapes: dict[int, Any] = {}

    def stand_in(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        dummy = np.zeros((0,), np.float32)
        shapes[id(dummy)] = (dummy, x)
        return dummy

    is_sds = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    args, kwargs = jax.tree.map(stand_in, (args, kwargs), is_leaf=is_sds)
    pure, arrays = _as_pure(fun, args, kwargs)
    return pure, [shapes[id(a)][1] if id(a) in shapes else a for a in arrays]


def autocast_report(
    fun: Callable[..., Any],
    dtype: Any = jnp.float16,
    *,
    rules: Mapping[Any, Any] | None = None,
    compare: bool = False,
    min_size: int | None = None,
) -> Callable[..., AutocastReport]:
    """What :func:`autocast` does to ``fun``: each operation's dtype, and where.

    ``jxs.autocast_report(fun, dtype, rules=...)`` takes the arguments of
    ``jxs.autocast`` and returns a function with ``fun``'s signature that
    returns an :class:`AutocastReport` instead of ``fun``'s outputs: how many
    operations ran in which dtype, per primitive and per source (the Flax module
    path where there is one, else ``file:line``), the bytes of the activations
    per dtype, the float32 *islands* (float32 activations descended from
    low-precision ones, such as a BatchNorm computed in float32 between float16
    convolutions), the constants autocast had to treat specially (a mask's
    ``finfo(float32).min`` saturated in float16, an ``eps`` that would round to
    0 run in float32) and the operations of the norm rule. ``print(report)``
    shows it as tables.

    The report runs ``fun`` under ``jax.eval_shape``: nothing is computed, so
    it is as cheap for a large model as tracing it, and array arguments may be
    given as ``jax.ShapeDtypeStruct``. Every count is per equation of ``fun``
    (an operation in a ``lax.scan`` body counts once, one in a ``jit`` function
    called twice counts twice). With ``compare=True`` it
    also runs the function eagerly (operation by operation, not under ``jit``),
    once in float32 and once under autocast, on the same jaxpr and the given
    arguments, and lists every operation's deviation from float32, worst first:
    the first step of debugging a loss that mixed precision broke. The
    comparison keeps every intermediate value of both runs: use a small batch.
    Operations inside ``lax.scan``, ``while_loop`` and ``cond`` bodies have no
    concrete values and are left out of it (their results are compared where
    they are used); ``jit``, ``checkpoint`` and custom-derivative functions are
    evaluated in place, as autocast evaluates them.

    Flax NNX modules passed as arguments are run on a copy (their BatchNorm
    statistics and RNG counts are not updated). Call the report function
    outside ``jax.jit``: it returns a Python object. ``docs/autocast_report.md``
    shows the report of a BatchNorm CNN and of Flax's attention with a mask.

    Args:
      fun: the function, as passed to :func:`autocast`.
      dtype: the autocast dtype, as for :func:`autocast` (float16 by default,
        bfloat16; float32 reports autocast switched off).
      rules: overrides of the table, as for :func:`autocast`.
      compare: whether to run the comparison with float32 (eagerly).
      min_size: the smallest float32 output, in elements, that counts as an
        activation for the islands. Default: the largest output of a matmul or
        convolution (``lower`` rule) divided by 16, at least 1, so that the
        statistics of a norm and other per-channel values do not count.

    Returns:
      A function with ``fun``'s signature returning an :class:`AutocastReport`.

    Raises:
      TypeError: if ``fun`` is not callable, ``compare`` is not a bool,
        ``min_size`` is not an int, or ``rules`` is not a mapping; from the
        report function, with ``compare=True``, if an argument is a tracer or a
        ``jax.ShapeDtypeStruct``.
      ValueError: if ``dtype`` is not one :func:`autocast` accepts, a rule is
        unknown, or ``min_size`` is below 1.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def mlp(params, x):
      ...     h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
      ...     return jax.nn.log_softmax(h @ params["w2"])
      >>> params = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 3))}
      >>> report = jxs.autocast_report(mlp)(params, jnp.ones((2, 4)))
      >>> dict(report.by_primitive["dot_general"]), dict(report.by_primitive["exp"])
      ({'float16': 2}, {'float32': 1})
      >>> report.islands  # every activation stays float16
      ()

      A float32 target makes the loss's difference a float32 island:

      >>> def loss(params, x, y):
      ...     return jnp.mean(jnp.abs(x @ params["w1"] - y))
      >>> y = jnp.full((2, 8), 0.1)
      >>> report = jxs.autocast_report(loss)(params, jnp.ones((2, 4)), y)
      >>> for site in report.islands:
      ...     print(site.primitive, site.shape, site.note)
      sub (2, 8) float16 widened by f32[2,8] (bias)
      abs (2, 8) from an island

      ``compare=True`` finds the operation that loses most against float32
      (here a matmul whose result, 80000, overflows float16's 65504):

      >>> w, x = jnp.full((4, 4), 200.0), jnp.full((2, 4), 100.0)
      >>> f = lambda w, x: jnp.mean(jnp.log(x @ w))
      >>> worst = jxs.autocast_report(f, compare=True)(w, x).deviation[0]
      >>> worst.primitive, worst.nonfinite, worst.local_error
      ('dot_general', 8, inf)
      >>> print(jxs.autocast_report(f, compare=True)(w, x))  # doctest: +ELLIPSIS
      autocast report: float16, 5 operations (1 float16, 4 float32)
      ...
    """
    if not callable(fun):
        raise TypeError(
            f"`fun` must be callable, got {type(fun).__name__}: "
            "`jxs.autocast_report(fun, dtype)(*args)` reports what "
            "`jxs.autocast(fun, dtype)(*args)` does."
        )
    dt = _check_dtype(dtype)
    table = resolve_rules(rules)
    if not isinstance(compare, bool | np.bool_):
        raise TypeError(f"`compare` must be a Python bool, got {compare!r}.")
    if min_size is not None:
        if isinstance(min_size, bool) or not isinstance(min_size, int | np.integer):
            raise TypeError(f"`min_size` must be an int or None, got {min_size!r}.")
        if min_size < 1:
            raise ValueError(f"`min_size` must be >= 1, got {min_size}.")

    def report(*args: Any, **kwargs: Any) -> AutocastReport:
        leaves = jax.tree.leaves((args, kwargs))
        if compare and any(
            isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct) for x in leaves
        ):
            raise TypeError(
                "`autocast_report(..., compare=True)` compares concrete values: "
                "pass arrays (not `jax.ShapeDtypeStruct`), and call its function "
                "outside `jax.jit` and other transformations."
            )
        census = _Census(dt, table, HANDLERS)
        pure, arrays = _abstract_pure(
            lambda *a, **kw: _run(fun, census, a, kw), args, kwargs
        )
        jax.eval_shape(pure, arrays)
        deviation = None
        if compare:
            it = _Compare(dt, table, _INLINE)
            pure, arrays = _as_pure(lambda *a, **kw: _run(fun, it, a, kw), args, kwargs)
            pure(arrays)
            deviation = list(it.sites.values())
        return _build(census, min_size, deviation)

    return report


# --------------------------------------------------------------------------- #
# Printing
# --------------------------------------------------------------------------- #


def _columns(rows: list[list[str]], right: Sequence[int] = ()) -> list[str]:
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


def _dtype_order(report: AutocastReport) -> list[str]:
    seen = {d for row in report.by_primitive.values() for d in row}
    first = [d for d in dict.fromkeys((report.dtype, "float32")) if d in seen]
    return first + sorted(seen - set(first))


def _grid(
    title: str, groups: Mapping[str, Mapping[str, int]], dts: list[str]
) -> list[str]:
    rows = [[title, *dts]]
    for name, row in groups.items():
        rows.append([name, *(str(row[d]) if d in row else "-" for d in dts)])
    return _columns(rows, right=range(1, len(dts) + 1))


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def _typed(dtype: Any, shape: Sequence[int]) -> str:
    """``f16[2,8]``, as JAX prints avals."""
    name = np.dtype(dtype).name
    return f"{_SHORT.get(name, name)}[{','.join(map(str, shape))}]"


def _locations(sites: Sequence[AutocastSite]) -> str:
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


def _grouped(sites: Sequence[AutocastSite]) -> list[list[str]]:
    """Sites with the same source and note as one row: its primitives in order,
    the largest output, the note, the locations."""
    groups: dict[tuple[str, str], list[AutocastSite]] = {}
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
                _typed(big.dtype, big.shape),
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
    lines += _columns([head, *rows[:_ROWS]], right)
    if len(rows) > _ROWS:
        lines.append(f"  ... {len(rows) - _ROWS} more rows: see report.{what}")


def _render(r: AutocastReport) -> str:
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
        [d, _bytes(n), f"{100 * n / total:.0f}%"] for d, n in r.bytes_by_dtype.items()
    ]
    lines += _columns(rows or [["none", "0 B", ""]], right=(1, 2))
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
                _typed(s.dtype, s.shape),
                s.note,
                _elsewhere(s.location, s.source),
            ]
            for s in r.constants
        ],
        "constants",
    )
    _section(
        lines,
        f"norm rule (computed in float32, rounded to {r.dtype}):",
        ["source", "ops", "largest", "location"],
        [row[:3] + row[4:] for row in _grouped(r.norms)],
        "norms",
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
                    _typed(s.dtype, s.shape),
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
