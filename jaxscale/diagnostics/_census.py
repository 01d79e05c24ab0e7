"""The observing interpreters of :func:`jaxscale.diagnostics.autocast_report`.

:class:`Census` runs the function under autocast (under ``jax.eval_shape``) and
records each equation of the function once (a subclass of
:class:`~jaxscale._autocast.interp.Interpreter` whose ``observer`` receives a
:class:`~jaxscale._autocast.interp.Record` per first-order equation): its source,
the dtype it ran in, its outputs, autocast's notes and whether it is in a float32
island. The interpreters keep track of the higher-order equations they are
inside, to give every equation of the user's function one key however often a
loop body or a custom-derivative function is traced, and of which float32 values
descend from a low-precision activation (the float32 islands).

:class:`Compare` runs it eagerly under autocast after a float32 run of the same
jaxpr (:class:`_Reference`, every value kept) and measures each operation's
deviation from float32, in total and for the operation alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxscale._autocast.classes import FOLD_NOTE, WIDE_NOTE
from jaxscale._autocast.gradients import DOT_ALGORITHMS
from jaxscale._autocast.hop import HANDLERS
from jaxscale._autocast.interp import (
    REGION_PREFIX,
    Interpreter,
    Record,
)
from jaxscale._autocast.rules import AutocastRule
from jaxscale._autocast.values import Info, cast, dtype_of, floating, is_castable
from jaxscale._jax_private import (
    branch_platforms,
    call_like_body,
    construct_of,
    custom_jvp_parts,
    custom_vjp_parts,
    dot_precision,
    name_stack_text,
    rebind,
    user_frame,
    while_parts,
)
from jaxscale.diagnostics._islands import carried_note, carry_vars, widened_note

__all__ = ["INLINE_HANDLERS", "Census", "Compare", "source_of"]

_F32 = np.dtype("float32")


# --------------------------------------------------------------------------- #
# Where an equation comes from
# --------------------------------------------------------------------------- #


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


def source_of(eqns: Sequence[Any]) -> tuple[str, str]:
    """``(source, location)`` of the last of ``eqns`` (the equations around it
    first): the name stacks joined, and the innermost user frame."""
    location = ""
    for e in reversed(eqns):
        frame = user_frame(e)
        if frame is not None:
            location = f"{_short(frame.file_name)}:{frame.start_line}"
            break
    return _names(eqns) or location or "?", location


def _names(eqns: Sequence[Any]) -> str:
    """The name stacks of ``eqns`` joined, without autocast's own regions, as
    JAX prints them (``jvp(CNN)/Conv_0`` in a gradient); ``""`` if no scope."""
    stack = []
    for e in eqns:
        stack += getattr(e.source_info.name_stack, "stack", ())
    kept = tuple(
        s for s in stack if not str(getattr(s, "name", "")).startswith(REGION_PREFIX)
    )
    return name_stack_text(kept)


# --------------------------------------------------------------------------- #
# The observing interpreters
# --------------------------------------------------------------------------- #


class _Frame:
    """A higher-order equation being evaluated, with the island flags of its
    operands, and those of its sub-computations' outputs as they are evaluated."""

    def __init__(self, eqn: Any, flags: list[bool]):
        self.eqn = eqn
        self.flags = flags
        self.sub_outs: list[tuple[list[Any], list[Any]]] = []  # (outvars, outs)


class _Walker(Interpreter):
    """An interpreter that knows which higher-order equations it is inside, so
    each equation of the function has one key however often it is traced.

    The branches of a ``lax.platform_dependent`` cond are alternatives for one
    computation (lowering keeps one): only the first (the first platform
    named) is observed. A widened weight-gradient product is such a cond, its
    first branch the CUDA one (:mod:`jaxscale._autocast.gradients`)."""

    def __init__(self, dtype: np.dtype, table: Mapping[str, Any], handlers: Any, **kw):
        super().__init__(dtype, table, handlers, **kw)  # classes=, extension=
        self.observer = self._observe
        self._frames: list[_Frame] = []
        self._calls: list[tuple[Any, list[Any], list[Info]]] = []
        self._carries: list[frozenset[Any]] = []  # per jaxpr: its loop carries
        self._muted = 0  # inside a platform-dependent cond's later branch

    def path(self, eqn: Any) -> tuple[Any, ...]:
        return tuple(f.eqn for f in self._frames if f.eqn is not eqn)

    def eval_eqn(
        self, eqn: Any, vals: list[Any], infos: list[Info]
    ) -> tuple[list[Any], list[Info]]:
        hop = self.recurses_into(eqn)
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
        if not self._muted:
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
        self._carries.append(
            carry_vars(frame.eqn if frame is not None else None, jaxpr)
        )
        muted = frame is not None and bool(frame.sub_outs) and _alternatives(frame)
        self._muted += muted
        try:
            outs, out_infos = super().eval_jaxpr(jaxpr, consts, args, infos)
        finally:
            self._carries.pop()
            self._muted -= muted
        if frame is not None:
            frame.sub_outs.append((list(jaxpr.outvars), list(outs)))
        return outs, out_infos

    def _observe(self, rec: Record) -> None:
        eqn, vals, infos = self._calls[-1]
        if not self._muted:
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


def _alternatives(frame: _Frame) -> bool:
    """Whether ``frame``'s sub-computations are alternatives (the branches of
    a ``lax.platform_dependent`` cond)."""
    eqn = frame.eqn
    return construct_of(eqn.primitive) == "cond" and bool(branch_platforms(eqn))


def _key(path: Sequence[Any], eqn: Any) -> tuple[int, ...]:
    return (*map(id, path), id(eqn))


def _ran_in(
    name: str,
    operands: Sequence[Any],
    outs: Sequence[Any],
    notes: Sequence[str] = (),
    params: Mapping[str, Any] | None = None,
) -> str:
    if any(n.startswith("float8 site") for n in notes):
        return "float8"
    precision = dot_precision(params) if params is not None else None
    for dtype, algorithm in DOT_ALGORITHMS.items():
        if precision == algorithm:  # its operands rounded to 16 bits (F16_F16_F32)
            return dtype.name
    floats = [dtype_of(v) for v in operands if floating(dtype_of(v))]
    if floats and name != "convert_element_type":
        return max(floats, key=lambda d: np.dtype(d).itemsize).name
    return np.dtype(dtype_of(outs[0])).name if outs else "none"


def _aligned(frame: _Frame, jaxpr: Any) -> list[bool]:
    """The island flags of ``jaxpr``'s inputs, from the operands of the
    higher-order equation evaluating it."""
    eqn, flags = frame.eqn, frame.flags
    n, m = len(jaxpr.invars), len(flags)
    loop = while_parts(eqn) if construct_of(eqn.primitive) == "while" else None
    if loop is not None:
        cn, bn = loop.cond_nconsts, loop.body_nconsts
        if jaxpr is loop.cond.jaxpr:
            return flags[:cn] + flags[cn + bn :]
        return flags[cn:]
    if n == m:
        return flags
    if n == m - 1:  # cond: the branch index first
        return flags[1:]
    nc = _num_consts(eqn)
    if n == m - nc:  # a custom_vjp forward: the primals
        return flags[nc:]
    if n == 2 * (m - nc):  # a JVP rule: primals, then tangents
        return flags[nc:] * 2
    return [False] * n


def _num_consts(eqn: Any) -> int:
    """The consts leading a custom-derivative call's operands (else 0)."""
    construct = construct_of(eqn.primitive)
    parts = (
        custom_jvp_parts(eqn)
        if construct == "custom_jvp"
        else custom_vjp_parts(eqn)
        if construct == "custom_vjp"
        else None
    )
    return parts.num_consts if parts is not None else 0


class Census(_Walker):
    """Records each equation once, with its source and island flag; enters the
    higher-order equations of a region another autocast owns (a gradient's
    ``jit``, custom derivatives), whose equations it records as traced."""

    enters_owned = True

    def __init__(self, dtype: np.dtype, table: Mapping[str, Any], handlers: Any, **kw):
        super().__init__(dtype, table, handlers, **kw)
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
                "island": carried_note(eqn.primitive.name, self.dtype),
                "seq": len(self.entries) + len(self.widened),
            }

    def observed(
        self, rec: Record, vals: list[Any], infos: list[Info], path: tuple
    ) -> None:
        eqn, name = rec.eqn, rec.eqn.primitive.name
        from_low = any(
            floating(dtype_of(v)) and np.dtype(dtype_of(v)) == self.dtype for v in vals
        )
        from_island = any(self.flags(eqn.invars))
        eligible = rec.rule not in (AutocastRule.FLOAT32, AutocastRule.TRACED)
        eligible = eligible and not {WIDE_NOTE, FOLD_NOTE} & set(
            rec.notes
        )  # float32 by design
        carried = eligible and (from_low or from_island) and self.dtype != _F32
        self._set(eqn.outvars, [carried and self._wide(o) for o in rec.outs])
        key = _key(path, eqn)
        if key in self.entries:
            return
        island = ""
        if carried and rec.outs and self._wide(rec.outs[0]):
            carries = self._carries[-1] if self._carries else frozenset()
            wide = [self._wide(v) for v in vals]
            island = (
                widened_note(self.dtype, rec, vals, infos, wide, carries)
                if from_low
                else "from an island"
            )
        self.entries[key] = {
            "eqns": (*path, eqn),
            "name": name,
            "rule": rec.rule,
            "ran_in": _ran_in(name, rec.operands, rec.outs, rec.notes, eqn.params),
            "outs": [(tuple(np.shape(o)), np.dtype(dtype_of(o))) for o in rec.outs],
            "notes": rec.notes,
            "island": island,
            "seq": len(self.entries) + len(self.widened),
        }


class _Reference(_Walker):
    """The float32 run: keeps every value, by the variable it is bound to."""

    def __init__(self, table: Mapping[str, Any], handlers: Any, **kw):
        super().__init__(_F32, table, handlers, **kw)
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


class Compare(_Walker):
    """The autocast run, compared with a float32 run of the same jaxpr made just
    before it (the first ``eval_closed`` is the function's own jaxpr)."""

    def __init__(self, dtype: np.dtype, table: Mapping[str, Any], handlers: Any, **kw):
        super().__init__(dtype, table, handlers, **kw)
        # float32 throughout: a rule passed in runs no site (it has no extension).
        self.reference = _Reference(table, handlers, classes=self.classes)
        # The fields of an AutocastSite per operation.
        self.sites: dict[tuple[int, ...], dict[str, Any]] = {}
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
        if key in self.sites or self.recurses_into(rec.eqn):
            return
        tracer = jax.core.Tracer
        if any(isinstance(v, tracer) for v in (*vals, *rec.operands, *rec.outs)):
            return  # inside a loop or a branch: no values
        ids = tuple(map(id, path))
        ref = [self.reference.value(ids, v) for v in rec.eqn.outvars]
        pairs = [
            (o, r)
            for o, r in zip(rec.outs, ref, strict=True)
            if r is not None and floating(dtype_of(o))
        ]
        if not pairs:
            return
        abs_error, rel_error, nonfinite = _errors(pairs, self._big)
        source, location = source_of((*path, rec.eqn))
        out = rec.outs[0]
        self.sites[key] = dict(
            primitive=rec.eqn.primitive.name,
            source=source,
            location=location,
            shape=tuple(np.shape(out)),
            dtype=np.dtype(dtype_of(out)).name,
            note=f"{rec.rule.value}, ran in "
            f"{_ran_in('', rec.operands, rec.outs, rec.notes)}",
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
        eqn, traced = rec.eqn, list(rec.traced)
        low, exact = [], []
        for atom, v, used, info, t in zip(
            eqn.invars, vals, rec.operands, infos, rec.traced, strict=True
        ):
            r = None
            if not isinstance(atom, jcore.Literal) and info.const is None:
                r = self.reference.value(ids, atom)
            if r is None or not floating(dtype_of(v)):
                low.append(used)
                exact.append(_cast_float(v, t))
            else:
                r = cast(r, np.dtype(dtype_of(v)))
                low.append(cast(r, np.dtype(dtype_of(used))))
                exact.append(_cast_float(r, t))
        try:
            cls = self.classes[rec.rule]
            outs = cls.emit(self, eqn, cls.adjust_params(self, eqn, low, traced), low)
            refs = rebind(eqn, exact)
        except Exception:  # a diagnostic: no local figure rather than no report
            return None
        pairs = [
            (_cast_float(o, dtype_of(a)), r)
            for o, r, a in zip(outs, refs, rec.outs, strict=True)
            if floating(dtype_of(a))
        ]
        _, rel, nonfinite = _errors(pairs, self._big)
        return float("inf") if nonfinite else rel


def _cast_float(x: Any, dtype: Any) -> Any:
    if floating(dtype_of(x)) and floating(dtype):
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
    sub = call_like_body(eqn)
    if sub is not None and len(sub.in_avals) == len(vals):
        return it.eval_closed(sub, vals, infos)
    return HANDLERS[construct_of(eqn.primitive)](it, eqn, vals, infos)


# The handlers of the comparison: the call-like constructs evaluated in place.
_CALLS = frozenset({"call", "custom_jvp", "custom_vjp", "jit", "remat"})
INLINE_HANDLERS: Mapping[str, Any] = MappingProxyType(
    {
        construct: _inline if construct in _CALLS else handler
        for construct, handler in HANDLERS.items()
    }
)
