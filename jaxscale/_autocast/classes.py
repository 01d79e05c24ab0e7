"""The rule classes of :func:`jaxscale.autocast`: what each
:class:`~jaxscale.AutocastRule` member does to an equation.

One object per member (:class:`RuleClass`: casts, parameters, emission,
provenance), found through the registry :data:`RULE_CLASSES`; the interpreter
(:mod:`jaxscale._autocast.interp`) knows no class by name. The behaviour several
classes share lives here with them: torch's promotion of operands that must
share a dtype (:func:`promote`, with the scalar and constant rules), a
``preferred_element_type`` that follows the operands, a scatter's combiner
re-typed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jaxscale._autocast.gradients import (
    WIDE_ELEMENTWISE,
    WIDE_PRODUCTS,
    wide_elementwise,
    wide_product,
)
from jaxscale._autocast.rules import AutocastRule
from jaxscale._autocast.values import (
    SELECTIONS,
    Info,
    bias_kind,
    const_misfit,
    dtype_of,
    floating,
    is_castable,
    provenance,
    saturate,
    size_of,
    widest,
)
from jaxscale._jax_private import (
    bind,
    combiner,
    integer_pow_exponent,
    preferred_element_type,
    trace,
    with_combiner,
    with_preferred_element_type,
)

# The interpreter (``jaxscale._autocast.interp.Interpreter``) passes itself to
# the rule classes as ``it``: its ``dtype``, ``cast``, ``note`` and ``extension``.
Interpreter = Any

__all__ = [
    "RULE_CLASSES",
    "Bias",
    "Float32",
    "Keep",
    "Lookup",
    "Lower",
    "PluginRule",
    "Promote",
    "RuleClass",
    "Traced",
    "FOLD_NOTE",
    "WIDE_NOTE",
    "Wide",
    "Unplugged",
    "follow_operands",
    "plugin_classes",
    "plugin_names",
    "promote",
    "retype_combiner",
    "scaled_in_float32",
    "wide_product",
]

_F32 = np.dtype("float32")
Rule = AutocastRule


# --------------------------------------------------------------------------- #
# The rule classes: what each AutocastRule member does to an equation
# --------------------------------------------------------------------------- #


class RuleClass:
    """The behaviour of one :class:`~jaxscale.AutocastRule` member.

    The interpreter runs a first-order equation of the class in four steps, each
    a method: :meth:`cast_operands` (the operands to bind and the dtype the
    outputs are rounded to), :meth:`adjust_params` (``preferred_element_type``,
    a scatter's combiner), :meth:`emit` (bind the primitive; a class may emit
    several equations instead) and :meth:`out_infos` (the outputs' provenance).
    :meth:`refine` may hand one equation to another class first.

    Instances hold no state (``__slots__ = ()``); the interpreter ``it`` is
    passed in for the autocast dtype (``it.dtype``), cached casts
    (``it.cast(x, dtype)``) and the notes of the report (``it.note(text)``).
    :data:`RULE_CLASSES` maps each member to its instance: a new class is a new
    :class:`~jaxscale.AutocastRule` member, a subclass of this, and an entry there.
    """

    __slots__ = ()

    def refine(self, eqn: Any) -> AutocastRule | None:
        """The class that runs ``eqn`` instead of this one, or ``None``."""
        return None

    def cast_operands(
        self,
        it: Interpreter,
        eqn: Any,
        vals: list[Any],
        infos: list[Info],
        traced: list[np.dtype],
    ) -> tuple[list[Any], np.dtype | None]:
        """The operands to bind, and the dtype the outputs are rounded to (or
        ``None``: as they come)."""
        raise NotImplementedError

    def adjust_params(
        self, it: Interpreter, eqn: Any, vals: list[Any], traced: list[np.dtype]
    ) -> Mapping[str, Any]:
        """The equation's parameters for operands ``vals``: a
        ``preferred_element_type`` that was the operands' dtype follows them."""
        return retype_combiner(follow_operands(eqn.params, vals, traced), vals, traced)

    def emit(
        self, it: Interpreter, eqn: Any, params: Mapping[str, Any], vals: list[Any]
    ) -> list[Any]:
        """The equation's outputs: its primitive bound on ``vals``."""
        return bind(eqn.primitive, params, vals)

    def out_infos(
        self, it: Interpreter, eqn: Any, infos: list[Info], outs: list[Any]
    ) -> list[Info]:
        """The provenance of the outputs (see :func:`provenance`)."""
        return provenance(eqn, infos, outs)


class Promote(RuleClass):
    """``"promote"``: operands that must share a dtype go to the widest."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        return promote(it, eqn, vals, infos, traced), None


class Lower(RuleClass):
    """``"lower"``: castable operands to the autocast dtype (float32 if a
    constant would not survive it); the outputs are *lowered* (the bias rule).

    A float16 ``dot_general`` whose result is multiplied or divided by a scalar
    on its way to float32 work (attention scores ``q @ k.T * scale`` into a
    softmax: :mod:`jaxscale._autocast.lookahead`) accumulates in float32, takes
    its scale in float32 and is rounded to float16 once, after the scale: a
    score overflows only where the *scaled* score exceeds 65504, and the step
    keeps 16-bit scores, as a hand-cast one does (:func:`wide_product`; the
    interpreter rounds the scale's output). bfloat16 has float32's range: its
    products are never widened. ``"wide"`` (:class:`Wide`) keeps the whole
    product in float32 instead. Either way the product's float32 inputs
    (parameters) get their gradients as ``gradient_dtype`` says, widened or
    not (:func:`wide_product`, which does both)."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        target = it.dtype
        for v, i in zip(vals, infos, strict=True):
            misfit = const_misfit(v, i, target)
            if misfit is not None:
                it.note(f"constant {misfit[1]}: runs in float32")
                target = _F32
                break
        cast = [it.cast(v, target) if is_castable(dtype_of(v)) else v for v in vals]
        cast = promote(it, eqn, cast, infos, traced)
        if eqn.primitive.name in WIDE_PRODUCTS:
            for v, i, c in zip(vals, infos, cast, strict=True):
                if i.wide and dtype_of(v) == _F32 and dtype_of(c) == it.dtype:
                    it.mark_wide_gradient(c, v)
        return cast, None

    def wide_result(self, it: Interpreter, eqn: Any, params: Any, vals: list) -> bool:
        """Whether the product comes out in float32 (see the class docstring)."""
        return _widens(it, eqn, params, vals) and scaled_in_float32(it, eqn)

    def adjust_params(self, it, eqn, vals, traced):
        params = super().adjust_params(it, eqn, vals, traced)
        if self.wide_result(it, eqn, params, vals):
            params = with_preferred_element_type(params, _F32)
        return params

    def emit(self, it, eqn, params, vals):
        wide = self.wide_result(it, eqn, params, vals)
        if wide:
            self.note_wide(it, eqn)
        sources = [it.wide_gradient_source(v) for v in vals]
        if wide or any(s is not None for s in sources):
            return [wide_product(eqn.primitive, params, *vals, sources=sources)]
        return bind(eqn.primitive, params, vals)

    def note_wide(self, it: Interpreter, eqn: Any) -> None:
        it.note(FOLD_NOTE)
        it.narrow_after(it.fold_of(eqn))

    def out_infos(self, it, eqn, infos, outs):
        return [
            info._replace(lowered=dtype_of(o) == it.dtype)
            for info, o in zip(
                provenance(eqn, infos, outs, elementwise=False), outs, strict=True
            )
        ]


class Wide(Lower):
    """``"wide"``: ``"lower"``, except that a ``dot_general`` whose result the
    function widens to float32 anyway (attention scores into a softmax)
    accumulates and comes out in float32, in float16 and bfloat16 alike, its
    backward in the autocast dtype (a float32 input's gradient as
    ``gradient_dtype`` says): scores finite up to float32's range, at
    twice the 16-bit scores' memory and bytes on a GPU (docs/autocast.md)."""

    __slots__ = ()

    def wide_result(self, it, eqn, params, vals):
        return _widens(it, eqn, params, vals)

    def note_wide(self, it, eqn):
        it.note(WIDE_NOTE)


# The note of a product that comes out in float32 by the widening rule (the
# report counts it as float32 work, not as an island).
WIDE_NOTE = "float32 output: what uses it widens it to float32 anyway"
# The note of a float16 product whose scale is applied before it is rounded.
FOLD_NOTE = "float32 accumulation and scale, rounded to 16 bits after the scale"


def scaled_in_float32(it: Interpreter, eqn: Any) -> bool:
    """Whether ``"lower"`` returns the product ``eqn`` in float32, to take the
    scalar scale that follows it before it is rounded (float16 only)."""
    return (
        bool(it.widens(eqn)) and _narrow_range(it.dtype) and it.fold_of(eqn) is not None
    )


def _narrow_range(dtype: np.dtype) -> bool:
    """A 16-bit dtype whose range is far narrower than float32's (float16, not
    bfloat16, whose largest finite value is float32's to 3 digits)."""
    return float(jnp.finfo(dtype).max) < 1e30


def _widens(it: Interpreter, eqn: Any, params: Mapping[str, Any], vals: list) -> bool:
    """A ``dot_general`` on two operands in the autocast dtype whose result the
    function widens to float32 anyway."""
    return (
        eqn.primitive.name == "dot_general"
        and it.dtype != _F32
        and len(vals) == 2
        and all(dtype_of(v) == it.dtype for v in vals)
        and preferred_element_type(params) is not None
        and it.widens(eqn)
    )


class Float32(RuleClass):
    """``"float32"``: castable operands to float32."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        vals = [it.cast(v, _F32) if is_castable(dtype_of(v)) else v for v in vals]
        return promote(it, eqn, vals, infos, traced), None


class Bias(RuleClass):
    """``"bias"``: ``"promote"``, except a bias or a normalisation applied to an
    activation in the autocast dtype, which runs in that dtype."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        kind = bias_kind(it.dtype, eqn.primitive.name, vals, infos)
        if kind == "bias":
            cast = [it.cast(v, it.dtype) for v in vals]
        elif kind == "norm":
            it.note(
                f"float32 statistic or parameter applied to a {it.dtype.name} "
                f"activation: cast to {it.dtype.name}, saturating"
            )
            clipped = [self.saturated(v, it.dtype) for v in vals]
            cast = [it.cast(c, it.dtype) for c in clipped]
            _mark_norm(it, eqn, vals, infos, clipped, cast)
            return cast, None
        elif kind == "mask":
            it.note(
                f"float32 0/1 mask (a boolean converted in the function) "
                f"multiplied into a {it.dtype.name} activation: cast to "
                f"{it.dtype.name}, exactly"
            )
            cast = [it.cast(v, it.dtype) for v in vals]
        else:
            return promote(it, eqn, vals, infos, traced), None
        shape = np.shape(eqn.outvars[0].aval)
        if eqn.primitive.name in WIDE_ELEMENTWISE and len(vals) == 2:
            for v, i, c in zip(vals, infos, cast, strict=True):
                if i.wide and dtype_of(v) == _F32 and np.shape(v) != shape:
                    it.mark_wide_gradient(c, v)  # a broadcast parameter: emit
        return cast, None

    def emit(self, it, eqn, params, vals):
        sources = [it.wide_gradient_source(v) for v in vals]
        marked = [k for k, s in enumerate(sources) if s is not None]
        shape = np.shape(eqn.outvars[0].aval)
        if len(marked) == 1 and np.shape(vals[1 - marked[0]]) == shape:
            k = marked[0]
            return [wide_elementwise(eqn.primitive, params, vals, sources[k], k)]
        return bind(eqn.primitive, params, vals)

    @staticmethod
    def saturating_cast(it: Interpreter, x: Any, dtype: np.dtype) -> Any:
        """``x`` in ``dtype``, its finite values clipped to ``dtype``'s finite
        range (a statistic such as ``rsqrt(var + eps)`` may exceed float16's);
        infinities and NaNs are kept."""
        return it.cast(Bias.saturated(x, dtype), dtype)

    @staticmethod
    def saturated(x: Any, dtype: np.dtype) -> Any:
        """``x`` at its own dtype, its finite values clipped to ``dtype``'s
        finite range where ``dtype`` is narrower (what
        :meth:`saturating_cast` casts)."""
        src = dtype_of(x)
        if src == dtype or src.itemsize <= np.dtype(dtype).itemsize:
            return x
        fi = jax.numpy.finfo(dtype)
        lo, hi = np.asarray(fi.min, src), np.asarray(fi.max, src)
        if isinstance(x, np.ndarray | np.generic):
            with np.errstate(all="ignore"):
                return np.where(np.isfinite(x), np.clip(x, lo, hi), x)
        return lax.select(lax.is_finite(x), lax.clamp(lo, x, hi), x)


def _mark_norm(
    it: Interpreter,
    eqn: Any,
    vals: list[Any],
    infos: list[Info],
    clipped: list[Any],
    cast: list[Any],
) -> None:
    """In a normalisation (``"norm"`` of :func:`bias_kind`), marks the float32
    operand broadcast into the activation (a scale, a statistic such as a
    batch norm's mean or ``scale * rsqrt(var + eps)``) so that its cotangent is
    summed over the broadcast axes, the batch among them, in float32
    (:func:`wide_elementwise`): a parameter if its ``gradient_dtype`` is
    float32, a value computed from activations if ``it.wide_statistics``."""
    if eqn.primitive.name not in WIDE_ELEMENTWISE or len(vals) != 2:
        return
    shape = np.shape(eqn.outvars[0].aval)
    for v, i, s, c in zip(vals, infos, clipped, cast, strict=True):
        if dtype_of(v) != _F32 or np.shape(v) == shape or i.const is not None:
            continue
        if isinstance(s, np.ndarray | np.generic):
            continue
        if i.wide if i.param else i.stat and it.wide_statistics:
            it.mark_wide_gradient(c, s)


class Keep(RuleClass):
    """``"keep"``: nothing cast; ``x ** 2`` and negative integer powers are
    ``"float32"`` (torch's ``pow``)."""

    __slots__ = ()

    def refine(self, eqn):
        if eqn.primitive.name == "integer_pow":
            y = integer_pow_exponent(eqn.params)
            if y == 2 or y < 0:  # a square or a reciprocal: float32, as torch's pow
                return Rule.FLOAT32
        return None

    def cast_operands(self, it, eqn, vals, infos, traced):
        return vals, None


class Lookup(RuleClass):
    """``"lookup"``: ``"keep"``, except rows gathered from a wider parameter
    table by an index array, which are rounded to the autocast dtype."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        table, index = vals[0], vals[1]
        if (
            is_castable(dtype_of(table))
            and dtype_of(table).itemsize > it.dtype.itemsize
            and infos[0].param
            and np.ndim(table) >= 2
            and size_of(index) > 1
        ):
            return vals, it.dtype
        return vals, None


class Traced(RuleClass):
    """``"traced"``: floating operands back to their traced dtypes; the
    parameters as traced."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        return [
            it.cast(v, t) if floating(dtype_of(v)) and floating(t) else v
            for v, t in zip(vals, traced, strict=True)
        ], None

    def adjust_params(self, it, eqn, vals, traced):
        return retype_combiner(eqn.params, vals, traced)


class PluginRule(RuleClass):
    """A rule class the caller passes in: ``jxs.autocast(f, float8=r)``, or
    ``rules={"dot_general": r}``, of which ``float8=r`` is shorthand. It runs
    in the table's ``"float8"`` slot (:attr:`~jaxscale.AutocastRule.FLOAT8`)
    and, unlike the built-in classes, may hold configuration and keep
    trace-time state for one autocast evaluation: :meth:`begin` returns the
    :class:`~jaxscale._autocast.interp.Extension` whose hooks the higher-order
    handlers call, and the class's methods find it as ``it.extension``. The
    float8 recipes (:class:`jaxscale.float8.Recipe`) are such classes; the
    autocast wing knows none of them by name.

    A subclass lists in ``names`` the values of ``float8=`` that mean it with
    its defaults (``True`` and ``"current"`` for current scaling).
    """

    __slots__ = ()

    names: tuple[Any, ...] = ()

    def check(self, dtype: np.dtype) -> None:
        """Raises if this rule cannot run under autocast ``dtype``."""

    def begin(self) -> Any:
        """The extension for one autocast evaluation (``None``: the default,
        which adds nothing)."""
        return None

    def end(self, extension: Any) -> None:
        """Called after the evaluation that :meth:`begin` started."""

    def for_report(self) -> PluginRule:
        """The rule :func:`jaxscale.diagnostics.autocast_report` runs instead,
        outside any train step (a rule that reads state runs without it)."""
        return self


class Unplugged(RuleClass):
    """``"float8"`` with no rule object passed in: refused (``autocast``
    raises before evaluation; this guards any other caller)."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        raise ValueError(
            f"`rules`: {eqn.primitive.name} has the 'float8' rule but no rule "
            "object was passed in (`float8=` of `jxs.autocast`)."
        )


def plugin_classes() -> list[type[PluginRule]]:
    """Every :class:`PluginRule` class with ``names`` of its own, among the
    classes imported so far (definition order)."""
    out, todo = [], list(PluginRule.__subclasses__())
    while todo:
        c = todo.pop(0)
        todo.extend(c.__subclasses__())
        if c.__dict__.get("names") and c not in out:
            out.append(c)
    return out


def plugin_names(value: Any) -> list[type[PluginRule]]:
    """The classes of :func:`plugin_classes` whose ``names`` hold ``value``
    (``True`` matches only ``True``, a string only itself)."""

    def means(name: Any) -> bool:
        if isinstance(name, bool) or isinstance(value, bool):
            return name is value
        return isinstance(value, str) and name == value

    return [c for c in plugin_classes() if any(means(n) for n in c.names)]


_LOWER = Lower()

# The registry: one behaviour per AutocastRule member (tests pin that it covers
# every member).
RULE_CLASSES: Mapping[AutocastRule, RuleClass] = MappingProxyType(
    {
        Rule.LOWER: _LOWER,
        Rule.FLOAT32: Float32(),
        Rule.PROMOTE: Promote(),
        Rule.BIAS: Bias(),
        Rule.KEEP: Keep(),
        Rule.LOOKUP: Lookup(),
        Rule.TRACED: Traced(),
        Rule.FLOAT8: Unplugged(),
        Rule.WIDE: Wide(),
    }
)


# --------------------------------------------------------------------------- #
# Promotion and parameters: the behaviour several rule classes share
# --------------------------------------------------------------------------- #


def follow_operands(
    params: Mapping[str, Any], vals: list[Any], traced: list[np.dtype]
) -> Mapping[str, Any]:
    pref = preferred_element_type(params)
    if pref is not None:
        floats = [t for t in traced if floating(t)]
        if floats and np.dtype(pref) == floats[0]:  # the default: follow inputs
            new = [dtype_of(v) for v in vals if floating(dtype_of(v))]
            params = with_preferred_element_type(params, new[0])
    return params


def retype_combiner(
    params: Mapping[str, Any], vals: list[Any], traced: list[np.dtype]
) -> Mapping[str, Any]:
    """scatter-add & co. carry their combiner typed at the traced dtype."""
    update = combiner(params)
    if update is None or dtype_of(vals[0]) == traced[0]:
        return params
    aval = jax.core.ShapedArray((), dtype_of(vals[0]))
    new = trace(lambda a, b: jcore.jaxpr_as_fun(update)(a, b), [aval, aval])
    return with_combiner(params, new)


def promote(
    it: Any,  # the interpreter: its ``cast`` and ``note``
    eqn: Any,
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
            misfit = const_misfit(vals[i], infos[i], target)
            if misfit is None:
                continue
            why, text = misfit
            if eqn.primitive.name in SELECTIONS and why == "inf":
                it.note(f"constant {text}: saturated to the finite range")
                src = dtype_of(vals[i])
                saturated[i] = saturate(infos[i].const, src, target)
            else:
                it.note(f"constant {text}: runs in float32")
                target = widest([dtype_of(vals[j]) for j in idx])
                saturated = {}
                break
        for i in idx:
            out[i] = saturated[i] if i in saturated else it.cast(vals[i], target)
    return out
