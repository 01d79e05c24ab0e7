"""The jaxpr interpreter behind :func:`jaxscale.autocast`: first-order primitives.

:class:`Interpreter` evaluates a jaxpr equation by equation on the values it is
given (arrays or tracers of whatever trace is current: ``jit``, ``grad``,
``vmap``...). For each equation it casts the floating operands as the
primitive's rule says (:mod:`jaxscale._autocast.rules`) and binds the primitive
again, so the casts are ordinary ``convert_element_type`` operations that JAX
differentiates, batches and compiles like hand-written ones.

Next to each value it keeps a little provenance (:class:`Info`, in
:mod:`jaxscale._autocast.values`) for the rules that are not per-primitive: torch's
scalar rule (a rank-0 operand, or one broadcast from rank 0, does not decide a
promotion), the bias rule (the float32 vector added to a matmul's output runs in
the low dtype, as torch's ``linear`` does), the normalisation rule (float32
statistics and parameters applied to a low-precision activation in its dtype), and
the constant rule (a constant that would become inf or 0 when narrowed saturates or
widens its operation).

What each rule class does is one object (:class:`RuleClass`: casts, parameters,
emission, provenance), found through the registry :data:`RULE_CLASSES`; the
interpreter's loop knows no class by name. Higher-order primitives are delegated
to handlers (:mod:`jaxscale._autocast.hop`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jaxscale._autocast.rules import AutocastRule
from jaxscale._autocast.values import (
    Info,
    bias_kind,
    cast,
    const_info,
    const_misfit,
    dtype_of,
    floating,
    follow_operands,
    input_info,
    is_castable,
    promote,
    provenance,
    retype_combiner,
    size_of,
)
from jaxscale._jax_private import (
    bind,
    construct_of,
    convert_target,
    dot_dimension_numbers,
    eqn_context,
    integer_pow_exponent,
    opaque_functions,
    subjaxprs,
)
from jaxscale.float8._site import Context, eligible, float8_dot, signature, sizes

__all__ = [
    "AutocastWarning",
    "Bias",
    "Float8",
    "Float32",
    "Interpreter",
    "Keep",
    "Lookup",
    "Lower",
    "Promote",
    "REGION_PREFIX",
    "RULE_CLASSES",
    "Record",
    "RuleClass",
    "Traced",
    "Unrewritable",
    "promote",
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


class Unrewritable(Exception):  # noqa: N818 (a reason, not an error)
    """Raised by a higher-order handler that cannot rewrite its equation, with
    the reason (the equation then runs as traced, with an AutocastWarning)."""


class Record(NamedTuple):
    """One first-order equation as autocast ran it (for observers)."""

    eqn: Any
    rule: AutocastRule
    traced: tuple[Any, ...]  # operand dtypes when traced
    operands: tuple[Any, ...]  # the operands it ran on (after the casts)
    outs: tuple[Any, ...]
    notes: tuple[str, ...]  # decisions about constants and normalisation


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
    constant would not survive it); the outputs are *lowered* (the bias rule)."""

    __slots__ = ()

    def cast_operands(self, it, eqn, vals, infos, traced):
        target = it.dtype
        for v, i in zip(vals, infos, strict=True):
            misfit = const_misfit(v, i, target)
            if misfit is not None:
                it.note(f"constant {misfit[1]}: runs in float32")
                target = _F32
                break
        vals = [it.cast(v, target) if is_castable(dtype_of(v)) else v for v in vals]
        return promote(it, eqn, vals, infos, traced), None

    def out_infos(self, it, eqn, infos, outs):
        return [
            info._replace(lowered=dtype_of(o) == it.dtype)
            for info, o in zip(
                provenance(eqn, infos, outs, elementwise=False), outs, strict=True
            )
        ]


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
            return [it.cast(v, it.dtype) for v in vals], None
        if kind == "norm":
            it.note(
                f"float32 statistic or parameter applied to a {it.dtype.name} "
                f"activation: cast to {it.dtype.name}, saturating"
            )
            return [self.saturating_cast(it, v, it.dtype) for v in vals], None
        return promote(it, eqn, vals, infos, traced), None

    @staticmethod
    def saturating_cast(it: Interpreter, x: Any, dtype: np.dtype) -> Any:
        """``x`` in ``dtype``, its finite values clipped to ``dtype``'s finite
        range (a statistic such as ``rsqrt(var + eps)`` may exceed float16's);
        infinities and NaNs are kept."""
        src = dtype_of(x)
        if src == dtype or src.itemsize <= np.dtype(dtype).itemsize:
            return it.cast(x, dtype)
        fi = jax.numpy.finfo(dtype)
        lo, hi = np.asarray(fi.min, src), np.asarray(fi.max, src)
        if isinstance(x, np.ndarray | np.generic):
            with np.errstate(all="ignore"):
                return np.where(np.isfinite(x), np.clip(x, lo, hi), x).astype(dtype)
        clipped = lax.select(lax.is_finite(x), lax.clamp(lo, x, hi), x)
        return it.cast(clipped, dtype)


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


class Float8(RuleClass):
    """``"float8"``: a ``dot_general`` without batch dimensions and with every
    size at least the recipe's ``min_dim`` runs as a float8 matmul (a *site*:
    :func:`jaxscale.float8._site.float8_dot`); any other is ``"lower"``. The
    operands are not cast first: each is quantised from its own dtype."""

    __slots__ = ()

    @staticmethod
    def is_site(it: Interpreter, eqn: Any, vals: list[Any]) -> bool:
        ctx = it.float8
        return (
            ctx is not None
            and not ctx.suspended
            and eqn.primitive.name == "dot_general"
            and len(vals) == 2
            and all(is_castable(dtype_of(v)) for v in vals)
            and eligible(
                eqn.params,
                np.shape(vals[0]),
                np.shape(vals[1]),
                ctx.recipe.min_dim if ctx.recipe is not None else 0,
            )
        )

    def cast_operands(self, it, eqn, vals, infos, traced):
        if self.is_site(it, eqn, vals):
            return vals, None
        return _LOWER.cast_operands(it, eqn, vals, infos, traced)

    def emit(self, it, eqn, params, vals):
        if not self.is_site(it, eqn, vals):
            ctx = it.float8
            if ctx is not None and not ctx.suspended and len(vals) == 2:
                mkn = sizes(params, np.shape(vals[0]), np.shape(vals[1]))
                if mkn is not None:  # too small: 16 bits (a warning if all are)
                    ctx.declined.append(mkn)
            return bind(eqn.primitive, params, vals)
        ctx = it.float8
        where = str(eqn.source_info.name_stack)
        site = ctx.next_site(signature(params, np.shape(vals[0]), where))
        recipe = ctx.recipe
        it.note(
            f"float8 site {len(ctx.seen) - 1}: operands {recipe.fwd_dtype.name}, "
            f"gradient {recipe.bwd_dtype.name}, "
            f"{'delayed' if site is not None else 'current'} scaling"
        )
        dims = dot_dimension_numbers(params)
        return [float8_dot(vals[0], vals[1], dims, it.dtype, recipe, site)]

    def out_infos(self, it, eqn, infos, outs):
        return _LOWER.out_infos(it, eqn, infos, outs)


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
        Rule.FLOAT8: Float8(),
    }
)


# --------------------------------------------------------------------------- #
# The interpreter
# --------------------------------------------------------------------------- #


def _in_owned_region(eqn: Any) -> bool:
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return any(str(getattr(s, "name", "")).startswith(REGION_PREFIX) for s in stack)


def is_higher_order(eqn: Any) -> bool:
    """A higher-order equation: a construct jaxscale knows, or any primitive
    with sub-jaxprs or staged functions among its parameters."""
    return (
        construct_of(eqn.primitive) is not None
        or bool(subjaxprs(eqn))
        or bool(opaque_functions(eqn))
    )


class Interpreter:
    """Evaluates jaxprs with per-primitive dtype rules (see :func:`autocast`).

    ``table`` maps primitive names to :class:`~jaxscale.AutocastRule` members,
    ``classes`` the members to their behaviour (:data:`RULE_CLASSES`), and
    ``handlers`` higher-order constructs (``"scan"``, ``"call"``, ...,
    ``"generic"`` for any other) to the functions that evaluate them
    (:data:`jaxscale._autocast.hop.HANDLERS`).
    """

    def __init__(
        self,
        dtype: np.dtype,
        table: Mapping[str, AutocastRule],
        handlers: Mapping[str, Callable[..., Any]],
        classes: Mapping[AutocastRule, RuleClass] = RULE_CLASSES,
        float8: Context | None = None,
    ):
        self.dtype = dtype
        # The float8 context (recipe, sites, delayed-scaling state), or None.
        self.float8 = float8
        self.table = table
        self.handlers = handlers
        self.classes = classes
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
            with eqn_context(eqn):
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
        rule = Rule.TRACED if _in_owned_region(eqn) else self.table.get(name)
        retry = False  # an unknown first-order primitive: as traced if it refuses
        if rule is None and is_higher_order(eqn):  # not overridden: recurse
            result = self.eval_higher_order(eqn, vals, infos)
            if result is not None:
                return result
            rule = Rule.TRACED
        elif rule is None:  # unknown first-order primitive: at its inputs' dtypes
            rule, retry = Rule.PROMOTE, True
        traced = [v.aval.dtype for v in eqn.invars]
        if name == "convert_element_type" and traced[0] == convert_target(eqn.params):
            return [vals[0]], [infos[0]]  # a weak-type change only: stays a no-op
        rule = self.classes[rule].refine(eqn) or rule
        self._notes = []
        cls = self.classes[rule]
        used, out_dtype = cls.cast_operands(self, eqn, vals, infos, traced)
        params = cls.adjust_params(self, eqn, used, traced)
        try:
            outs = cls.emit(self, eqn, params, used)
        except (TypeError, ValueError) as e:
            if not retry:
                raise
            # An unknown primitive that refuses other dtypes runs as traced.
            self.warn(name, f"it refused its inputs' dtypes: {e}")
            rule = Rule.TRACED
            cls = self.classes[rule]
            used, out_dtype = cls.cast_operands(self, eqn, vals, infos, traced)
            outs = cls.emit(self, eqn, cls.adjust_params(self, eqn, used, traced), used)
        if out_dtype is not None:
            outs = [
                self.cast(o, out_dtype) if is_castable(dtype_of(o)) else o for o in outs
            ]
        out_infos = cls.out_infos(self, eqn, infos, outs)
        if self.observer is not None:
            self.observer(
                Record(
                    eqn,
                    rule,
                    tuple(traced),
                    tuple(used),
                    tuple(outs),
                    tuple(self._notes),
                )
            )
        return outs, out_infos

    def recurses_into(self, eqn: Any) -> bool:
        """Whether ``eqn`` is a higher-order equation this interpreter hands to
        a handler (unless a rule overrides it): a known construct, or a
        primitive the table does not list that holds sub-computations."""
        return construct_of(eqn.primitive) is not None or (
            eqn.primitive.name not in self.table and is_higher_order(eqn)
        )

    def eval_higher_order(
        self, eqn: Any, vals: list[Any], infos: list[Info]
    ) -> tuple[list[Any], list[Info]] | None:
        """``eqn`` by its construct's handler, else by the schema-free rewrite
        (``handlers["generic"]``); ``None`` (after an AutocastWarning saying
        why) if it must run as traced."""
        construct = construct_of(eqn.primitive)
        handler = self.handlers.get(construct) if construct is not None else None
        try:
            result = handler(self, eqn, vals, infos) if handler else None
            if result is None:
                result = self.handlers["generic"](self, eqn, vals, infos)
        except Unrewritable as e:
            known = "its parameters are not the ones this version expects, and "
            self.warn(eqn.primitive.name, (known if handler else "") + str(e))
            return None
        return result

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
