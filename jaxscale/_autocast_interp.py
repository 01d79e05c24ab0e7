"""The jaxpr interpreter behind :func:`jaxscale.autocast`: first-order primitives.

:class:`Interpreter` evaluates a jaxpr equation by equation on the values it is
given (arrays or tracers of whatever trace is current: ``jit``, ``grad``,
``vmap``...). For each equation it casts the floating operands as the
primitive's rule says (:mod:`jaxscale._autocast_rules`) and binds the primitive
again, so the casts are ordinary ``convert_element_type`` operations that JAX
differentiates, batches and compiles like hand-written ones.

Next to each value it keeps a little provenance (:class:`Info`, in
:mod:`jaxscale._autocast_values`) for the rules that are not per-primitive: torch's
scalar rule (a rank-0 operand, or one broadcast from rank 0, does not decide a
promotion), the bias rule (the float32 vector added to a matmul's output runs in
the low dtype, as torch's ``linear`` does), the normalisation rule (float32
statistics and parameters applied to a low-precision activation in its dtype), and
the constant rule (a constant that would become inf or 0 when narrowed saturates or
widens its operation).

Higher-order primitives are delegated to handlers (:mod:`jaxscale._autocast_hop`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jaxscale._autocast_rules import HIGHER_ORDER, AutocastRule
from jaxscale._autocast_values import (
    SELECTIONS,
    Const,
    Info,
    bind,
    cast,
    const_fit,
    const_info,
    const_values,
    dtype_of,
    floating,
    fresh_info,
    input_info,
    is_castable,
    provenance,
    saturate,
    size_of,
    trace,
    widest,
)

__all__ = [
    "AutocastWarning",
    "Const",
    "Info",
    "Interpreter",
    "REGION_PREFIX",
    "Record",
    "bind",
    "cast",
    "const_fit",
    "const_info",
    "dtype_of",
    "fresh_info",
    "input_info",
    "is_castable",
    "saturate",
    "size_of",
    "trace",
    "widest",
]

_F32 = np.dtype("float32")
# Named-scope prefix of regions another autocast owns (an inner autocast, or a
# function under ``enabled=False``): their equations run as traced.
REGION_PREFIX = "jxs_autocast"
Rule = AutocastRule


class AutocastWarning(UserWarning):
    """A part of a function that :func:`jaxscale.autocast` runs as traced.

    Issued at trace time for a higher-order primitive the interpreter cannot
    rewrite (for example ``pallas_call``, ``custom_linear_solve`` or a ``pmap``
    inside the function): it runs at the dtypes it was traced with, its floating
    inputs cast back to them, so the result is right but nothing inside it runs in
    low precision. Silence it with ``rules={"<primitive>": "traced"}``, or filter
    it with :mod:`warnings`.

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.AutocastWarning, UserWarning)
      True
    """


class Record(NamedTuple):
    """One first-order equation as autocast ran it (for observers)."""

    eqn: Any
    rule: AutocastRule
    traced: tuple[Any, ...]  # operand dtypes when traced
    operands: tuple[Any, ...]  # the operands it ran on (after the casts)
    outs: tuple[Any, ...]
    notes: tuple[str, ...]  # decisions about constants and normalisation


def _in_owned_region(eqn: Any) -> bool:
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return any(str(getattr(s, "name", "")).startswith(REGION_PREFIX) for s in stack)


def _has_subcomputations(params: Mapping[str, Any]) -> bool:
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jcore.Jaxpr | jcore.ClosedJaxpr) or hasattr(
                v, "call_wrapped"
            ):
                return True
    return False


@contextlib.contextmanager
def _source_of(eqn: Any):
    """Emit under ``eqn``'s name stack and traceback (as ``jax.core.eval_jaxpr``
    does), so profiles and errors point at the user's code."""
    try:
        from jax._src import source_info_util as siu
    except ImportError:  # pragma: no cover
        yield
        return
    names = siu.current_name_stack() + eqn.source_info.name_stack
    ctx = getattr(eqn.ctx, "manager", None) or contextlib.nullcontext()
    with siu.user_context(eqn.source_info.traceback, name_stack=names), ctx:
        yield


class Interpreter:
    """Evaluates jaxprs with per-primitive dtype rules (see :func:`autocast`)."""

    def __init__(
        self,
        dtype: np.dtype,
        table: Mapping[str, AutocastRule],
        handlers: Mapping[str, Callable[..., Any]],
    ):
        self.dtype = dtype
        self.table = table
        self.handlers = handlers
        # Casts made in the jaxpr being evaluated, so that a value used by several
        # equations is cast once: id -> (value, dtype, cast value).
        self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}
        # Called with a Record after each first-order equation (the report).
        self.observer: Callable[[Record], None] | None = None
        self._notes: list[str] = []

    def cast(self, x: Any, dtype: np.dtype) -> Any:
        if dtype_of(x) == dtype:
            return x
        key = (id(x), np.dtype(dtype))
        hit = self._casts.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        out = cast(x, dtype)
        self._casts[key] = (x, out)
        return out

    # -- jaxprs -----------------------------------------------------------------

    def eval_closed(
        self, closed: Any, args: Sequence[Any], infos: Sequence[Info] | None = None
    ) -> tuple[list[Any], list[Info]]:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, infos)

    def _eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        infos: Sequence[Info] | None,
    ) -> tuple[list[Any], list[Info]]:
        env: dict[Any, tuple[Any, Info]] = {}
        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = (c, const_info(c))
        if infos is None:
            infos = [input_info(a) for a in args]
        for var, a, i in zip(jaxpr.invars, args, infos, strict=True):
            env[var] = (a, i)

        def read(atom: Any) -> tuple[Any, Info]:
            if isinstance(atom, jcore.Literal):
                val = atom.val
                if not isinstance(val, jax.Array):
                    val = np.asarray(val, atom.aval.dtype)
                return val, const_info(val, param=False)
            return env[atom]

        for eqn in jaxpr.eqns:
            pairs = [read(v) for v in eqn.invars]
            vals = [p[0] for p in pairs]
            in_infos = [p[1] for p in pairs]
            with _source_of(eqn):
                outs, out_infos = self.eval_eqn(eqn, vals, in_infos)
            for var, o, i in zip(eqn.outvars, outs, out_infos, strict=True):
                env[var] = (o, i)
        results = [read(v) for v in jaxpr.outvars]
        return [r[0] for r in results], [r[1] for r in results]

    def eval_jaxpr(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        infos: Sequence[Info] | None = None,
    ) -> tuple[list[Any], list[Info]]:
        saved, self._casts = self._casts, {}  # one cache per trace level
        try:
            return self._eval(jaxpr, consts, args, infos)
        finally:
            self._casts = saved

    # -- one equation -----------------------------------------------------------

    def eval_eqn(
        self, eqn: Any, vals: list[Any], infos: list[Info]
    ) -> tuple[list[Any], list[Info]]:
        name = eqn.primitive.name
        rule = self.table.get(name)
        if _in_owned_region(eqn):
            rule = Rule.TRACED
        if name in HIGHER_ORDER and rule is not Rule.TRACED:
            handler = self.handlers.get(name)
            result = handler(self, eqn, vals, infos) if handler else None
            if result is not None:
                return result
            self.warn(name, "its parameters are not the ones this version expects")
            rule = Rule.TRACED
        traced = [v.aval.dtype for v in eqn.invars]
        unknown = rule is None
        if unknown:
            if _has_subcomputations(eqn.params):
                self.warn(name, "autocast does not know this higher-order primitive")
                rule = Rule.TRACED
            else:  # unknown first-order primitive: at its inputs' dtypes
                rule = Rule.PROMOTE
        if name == "convert_element_type" and traced[0] == eqn.params["new_dtype"]:
            return [vals[0]], [infos[0]]  # a weak-type change only: stays a no-op
        if name == "integer_pow" and rule is Rule.KEEP:
            y = eqn.params["y"]
            if y == 2 or y < 0:  # a square or a reciprocal: float32, as torch's pow
                rule = Rule.FLOAT32
        self._notes = []
        given = vals
        vals, out_dtype = self.cast_operands(rule, name, vals, infos, traced)
        params = self.adjust_params(rule, eqn, vals, traced)
        try:
            outs = bind(eqn.primitive, params, vals)
        except (TypeError, ValueError) as e:
            if not unknown or rule is Rule.TRACED:
                raise
            # An unknown primitive that refuses other dtypes runs as traced.
            self.warn(name, f"it refused its inputs' dtypes: {e}")
            rule = Rule.TRACED
            vals, out_dtype = self.cast_operands(rule, name, given, infos, traced)
            outs = bind(eqn.primitive, eqn.params, vals)
        if out_dtype is not None:
            outs = [
                self.cast(o, out_dtype) if is_castable(dtype_of(o)) else o for o in outs
            ]
        out_infos = provenance(rule, name, eqn, infos, outs, self.dtype)
        if self.observer is not None:
            self.observer(
                Record(
                    eqn,
                    rule,
                    tuple(traced),
                    tuple(vals),
                    tuple(outs),
                    tuple(self._notes),
                )
            )
        return outs, out_infos

    def warn(self, name: str, why: str) -> None:
        warnings.warn(
            f"jxs.autocast runs `{name}` as traced ({why}): its floating inputs are "
            "cast back to the dtypes they were traced with, and nothing inside it "
            f"runs in {self.dtype.name}. Pass `rules={{{name!r}: 'traced'}}` to "
            "silence this.",
            AutocastWarning,
            stacklevel=2,
        )

    def note(self, text: str) -> None:
        self._notes.append(text)

    def cast_operands(
        self,
        rule: AutocastRule,
        name: str,
        vals: list[Any],
        infos: list[Info],
        traced: list[np.dtype],
    ) -> tuple[list[Any], np.dtype | None]:
        """The operands to bind, and the dtype the outputs are rounded to (or
        ``None``: as they come)."""
        if rule is Rule.KEEP:
            return vals, None
        if rule is Rule.LOOKUP:
            table, index = vals[0], vals[1]
            if (
                is_castable(dtype_of(table))
                and dtype_of(table).itemsize > self.dtype.itemsize
                and infos[0].param
                and np.ndim(table) >= 2
                and size_of(index) > 1
            ):
                return vals, self.dtype
            return vals, None
        if rule is Rule.TRACED:
            return [
                self.cast(v, t) if floating(dtype_of(v)) and floating(t) else v
                for v, t in zip(vals, traced, strict=True)
            ], None
        if rule is Rule.FLOAT32:
            vals = [self.cast(v, _F32) if is_castable(dtype_of(v)) else v for v in vals]
        elif rule is Rule.LOWER:
            target = self.dtype
            for v, i in zip(vals, infos, strict=True):
                misfit = self._misfit(v, i, target)
                if misfit is not None:
                    self.note(f"constant {misfit[1]}: runs in float32")
                    target = _F32
                    break
            vals = [
                self.cast(v, target) if is_castable(dtype_of(v)) else v for v in vals
            ]
        elif rule is Rule.BIAS:
            kind = self._bias_kind(name, vals, infos)
            if kind == "bias":
                return [self.cast(v, self.dtype) for v in vals], None
            if kind == "norm":
                self.note(
                    f"float32 statistic or parameter applied to a {self.dtype.name} "
                    f"activation: cast to {self.dtype.name}, saturating"
                )
                return [self.saturating_cast(v, self.dtype) for v in vals], None
        return self._promote(name, vals, infos, traced), None

    def saturating_cast(self, x: Any, dtype: np.dtype) -> Any:
        """``x`` in ``dtype``, its finite values clipped to ``dtype``'s finite
        range (a statistic such as ``rsqrt(var + eps)`` may exceed float16's);
        infinities and NaNs are kept."""
        src = dtype_of(x)
        if src == dtype or src.itemsize <= np.dtype(dtype).itemsize:
            return self.cast(x, dtype)
        fi = jax.numpy.finfo(dtype)
        lo, hi = np.asarray(fi.min, src), np.asarray(fi.max, src)
        if isinstance(x, np.ndarray | np.generic):
            with np.errstate(all="ignore"):
                return np.where(np.isfinite(x), np.clip(x, lo, hi), x).astype(dtype)
        clipped = lax.select(lax.is_finite(x), lax.clamp(lo, x, hi), x)
        return self.cast(clipped, dtype)

    def _misfit(self, v: Any, info: Info, target: np.dtype) -> tuple[str, str] | None:
        """Why the constant ``v`` does not survive a cast to ``target`` (see
        :func:`const_fit`) and a description, or None (not a constant, not
        narrowed, or it fits)."""
        src = dtype_of(v)
        if info.const is None or not is_castable(src):
            return None
        if not is_castable(target) or src.itemsize <= target.itemsize:
            return None
        why = const_fit(info.const, src, target)
        if why is None:
            return None
        value = const_values(info.const, src).ravel()[0] if size_of(v) else 0
        what = "overflows to inf" if why == "inf" else "rounds to 0"
        return why, f"{float(value):.6g} {what} in {np.dtype(target).name}"

    def _bias_kind(self, name: str, vals: list[Any], infos: list[Info]) -> str | None:
        """``"bias"``: ``low + bias`` or ``low - bias`` (either order), ``low`` in
        ``dtype`` from a "lower" op, ``bias`` a castable wider parameter of rank
        <= 1, broadcast or reshaped: the bias is cast to ``dtype`` (torch's
        ``linear``). ``"norm"``: an activation in ``dtype`` combined with a wider
        value broadcast from fewer elements that is a parameter, a statistic
        (reductions of activations, as a norm's mean and variance) or a constant
        that fits ``dtype``: the wider value is cast to ``dtype`` (saturating) and
        the operation runs in ``dtype``, so the activation stays in ``dtype`` as
        with torch's ``batch_norm`` and Flax's ``dtype=float16``."""
        if len(vals) != 2:
            return None
        for k in (0, 1):
            low, wide, lo_i, w_i = vals[k], vals[1 - k], infos[k], infos[1 - k]
            if dtype_of(low) != self.dtype or not is_castable(dtype_of(wide)):
                continue
            if dtype_of(wide).itemsize <= self.dtype.itemsize:
                continue
            if self._misfit(wide, w_i, self.dtype) is not None:
                return None
            if (
                name in ("add", "sub")
                and lo_i.lowered
                and w_i.param
                and w_i.src_rank <= 1
            ):
                return "bias"
            size = size_of(low)
            if (
                lo_i.src_size >= size > 1
                and 1 < w_i.src_size < size
                and (w_i.param or w_i.stat or w_i.const is not None)
            ):
                return "norm"
        return None

    def _promote(
        self,
        name: str,
        vals: list[Any],
        infos: list[Info],
        traced: list[np.dtype],
    ) -> list[Any]:
        """Operands that were traced with one floating dtype (so the primitive needs
        them equal) and now differ go to the widest; scalars decide only if all are
        scalars (torch's rule for zero-dimensional tensors). A constant that would
        not survive the narrowing (see :func:`const_fit`) widens the operation
        instead, or, in a selection, saturates to the narrow dtype's range."""
        groups: dict[np.dtype, list[int]] = {}
        for i, (v, t) in enumerate(zip(vals, traced, strict=True)):
            if floating(dtype_of(v)) and floating(t):
                groups.setdefault(np.dtype(t), []).append(i)
        out = list(vals)
        for idx in groups.values():
            if len({dtype_of(vals[i]) for i in idx}) < 2:
                continue
            deciding = [i for i in idx if infos[i].src_rank > 0] or idx
            target = widest([dtype_of(vals[i]) for i in deciding])
            saturated: dict[int, Any] = {}
            for i in idx:
                misfit = self._misfit(vals[i], infos[i], target)
                if misfit is None:
                    continue
                why, text = misfit
                if name in SELECTIONS and why == "inf":
                    self.note(f"constant {text}: saturated to the finite range")
                    src = dtype_of(vals[i])
                    saturated[i] = saturate(infos[i].const, src, target)
                else:
                    self.note(f"constant {text}: runs in float32")
                    target = widest([dtype_of(vals[j]) for j in idx])
                    saturated = {}
                    break
            for i in idx:
                out[i] = saturated[i] if i in saturated else self.cast(vals[i], target)
        return out

    def adjust_params(
        self, rule: AutocastRule, eqn: Any, vals: list[Any], traced: list[np.dtype]
    ) -> Mapping[str, Any]:
        params = eqn.params
        pref = params.get("preferred_element_type")
        if rule is not Rule.TRACED and pref is not None:
            floats = [t for t in traced if floating(t)]
            if floats and np.dtype(pref) == floats[0]:  # the default: follow inputs
                new = [dtype_of(v) for v in vals if floating(dtype_of(v))]
                params = dict(params, preferred_element_type=new[0])
        update = params.get("update_jaxpr")
        if update is not None and dtype_of(vals[0]) != traced[0]:
            # scatter-add & co. carry their combiner typed at the traced dtype.
            aval = jax.core.ShapedArray((), dtype_of(vals[0]))
            consts = params.get("update_consts", ())

            def combiner(a: Any, b: Any) -> list[Any]:
                return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(update, consts))(a, b)

            new_update = trace(combiner, [aval, aval])
            params = dict(
                params,
                update_jaxpr=new_update.jaxpr,
                update_consts=tuple(new_update.consts),
            )
        return params
