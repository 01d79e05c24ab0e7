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

What each rule class does is one object
(:class:`~jaxscale._autocast.classes.RuleClass`, in
:mod:`jaxscale._autocast.classes`), found through the registry
:data:`~jaxscale._autocast.classes.RULE_CLASSES`; the interpreter's loop knows no
class by name. Higher-order primitives are delegated
to handlers (:mod:`jaxscale._autocast.hop`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from jaxscale._autocast import attention
from jaxscale._autocast.classes import RULE_CLASSES, RuleClass
from jaxscale._autocast.fusion import Constants, chains
from jaxscale._autocast.lookahead import folds, widened
from jaxscale._autocast.rules import AutocastRule
from jaxscale._autocast.values import (
    Info,
    cast,
    const_info,
    dtype_of,
    input_info,
    is_castable,
)
from jaxscale._jax_private import (
    construct_of,
    convert_target,
    eqn_context,
    opaque_functions,
    subjaxprs,
)

__all__ = [
    "AutocastWarning",
    "Extension",
    "Loop",
    "Interpreter",
    "REGION_PREFIX",
    "Record",
    "Unrewritable",
    "is_higher_order",
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


class Loop:
    """What an extension adds to one ``scan`` (see :class:`Extension`): extra
    per-iteration inputs ``xs`` (stacked on a leading axis of the loop's length),
    and a scope around each trace of the body, given this iteration's slices of
    them. The default adds nothing."""

    xs: tuple[Any, ...] = ()

    def body(self, extra: Sequence[Any]) -> Any:
        return contextlib.nullcontext()


class Extension:
    """The hooks through which a rule that keeps trace-time state (a
    :class:`~jaxscale._autocast.classes.PluginRule`, such as a float8 recipe
    with its sites and delayed-scaling state) plugs into the interpreter; the
    handlers of the higher-order constructs call them and know no such rule.
    This default does nothing: an interpreter without an extension uses it.

    - ``inline_calls``: a ``jit`` body is evaluated in place instead of
      re-traced (its sites read the caller's values);
    - ``suspended()``: a scope in which the extension stays off (a custom
      derivative's rules, whose backward would not see it);
    - ``opaque()``: a scope for a sub-computation whose schema has no place for
      values the extension threads (``shard_map``, the schema-free rewrite);
    - ``loop(length)``: a :class:`Loop` for one ``scan``;
    - ``manual()``: a :class:`Loop` for one ``shard_map`` body: its ``xs``
      enter the body replicated (their cotangents summed over the devices),
      and its scope is the body's (default: none, under ``opaque()``);
    - ``fuses(chain)``: whether a written-out attention
      (:class:`jaxscale._autocast.fusion.Chain`) is taken as one chain,
      evaluated at its end (default: no); ``skipped(eqn)`` is then called for
      each of its equations where the program meets it, and
      ``may_fuse(eqns)`` at its end (and for ``jax.nn.dot_product_attention``'s
      body) says whether it may run as a fused kernel that evaluates none of
      ``eqns`` (default: yes).
    """

    inline_calls = False

    def fuses(self, chain: Any) -> bool:
        return False

    def may_fuse(self, eqns: Any) -> bool:
        return True

    def skipped(self, eqn: Any) -> None:
        pass

    def suspended(self) -> Any:
        return contextlib.nullcontext()

    def opaque(self) -> Any:
        return contextlib.nullcontext()

    def loop(self, length: int) -> Loop:
        return Loop()

    def manual(self) -> Loop:
        return _Opaque(self)


class _Opaque(Loop):
    """:meth:`Extension.manual`'s default: no inputs, the body opaque."""

    def __init__(self, ext: Extension):
        self.ext = ext

    def body(self, extra: Sequence[Any]) -> Any:
        return self.ext.opaque()


NO_EXTENSION = Extension()


# Constructs whose body takes the equation's inputs and gives its outputs.
_CALLS = frozenset({"call", "custom_jvp", "custom_vjp", "jit", "remat"})


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

    A region another autocast owns (a function ``jxs.autocast`` has already
    rewritten, as in the jaxpr of ``jax.grad(jxs.autocast(f))``) runs as
    traced. Its higher-order equations are re-bound whole, unless
    ``enters_owned`` (the report's census): then they are evaluated by their
    handlers like any other, every equation inside them as traced, so that an
    observer sees what is inside a gradient's ``jit`` and custom derivatives.
    """

    enters_owned = False
    # Whether attention may run fused (``autocast(..., fuse_attention=)``).
    fuse_attention = False
    # Whether a float32 statistic broadcast into a 16-bit activation (a batch
    # norm's mean) has its cotangent summed in float32: ``autocast`` sets it
    # from ``gradient_dtype`` (see ``jaxscale._autocast.classes._mark_norm``).
    wide_statistics = True

    def __init__(
        self,
        dtype: np.dtype,
        table: Mapping[str, AutocastRule],
        handlers: Mapping[str, Callable[..., Any]],
        classes: Mapping[AutocastRule, RuleClass] = RULE_CLASSES,
        extension: Extension | None = None,
    ):
        self.dtype = dtype
        # The trace-time state of a rule passed in (a float8 recipe's sites and
        # delayed-scaling state; see ``PluginRule.begin``), or None. Its rule
        # class reads it here; the handlers call its hooks through ``ext``.
        self.extension = extension
        self.table = table
        self.handlers = handlers
        self.classes = classes
        # Casts made in the jaxpr being evaluated, so that a value used by several
        # equations is cast once: id -> (value, dtype, cast value).
        self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}
        # Casts of float32 inputs whose gradients leave products in float32:
        # id -> (cast value, source), see ``mark_wide_gradient``.
        self._wide_gradients: dict[int, tuple[Any, Any]] = {}
        # Called with a Record after each first-order equation (the report).
        self.observer: Callable[[Record], None] | None = None
        self._notes: list[str] = []
        # The look-ahead (lookahead.widened): the variables of the jaxpr being
        # evaluated that widen to float32 anyway, per (jaxpr, outer) evaluated,
        # and which outputs of the call being entered widen in its caller.
        self._widening: frozenset[Any] = frozenset()
        self._lookahead: dict[tuple[Any, tuple[bool, ...]], frozenset[Any]] = {}
        self._outer: tuple[bool, ...] | None = None
        # The scalings that follow products (lookahead.folds) per jaxpr, those
        # of the jaxpr being evaluated, and the scalings whose outputs are
        # rounded to the autocast dtype (their product was widened to take the
        # scale in float32: ``Lower``).
        self._folds_of: dict[Any, dict[Any, Any]] = {}
        self._folds: dict[Any, Any] = {}
        self._narrowing: set[int] = set()
        # Written-out attentions (fusion.chains) per jaxpr.
        self._chains_of: dict[Any, dict[Any, Any]] = {}
        self._owned = 0  # the depth of owned higher-order equations entered

    @property
    def ext(self) -> Any:
        """The extension whose hooks the higher-order handlers call (see
        :class:`Extension`): the one given, else one that adds nothing."""
        return self.extension if self.extension is not None else NO_EXTENSION

    def mark_wide_gradient(self, low: Any, source: Any) -> None:
        """``low`` is the 16-bit cast of ``source``, a float32 input (or a
        view of one) whose gradient leaves a product in float32."""
        self._wide_gradients[id(low)] = (low, source)

    def wide_gradient_source(self, x: Any) -> Any:
        """The float32 value ``x`` was marked as the cast of, or ``None``."""
        hit = self._wide_gradients.get(id(x))
        return hit[1] if hit is not None and hit[0] is x else None

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
        outer = self._outer
        self._outer = None
        if outer is None or len(outer) != len(jaxpr.outvars):
            outer = (False,) * len(jaxpr.outvars)
        key = (jaxpr, outer)
        if key not in self._lookahead:
            self._lookahead[key] = widened(jaxpr, self.table, outer)
        saved_wide, self._widening = self._widening, self._lookahead[key]
        if jaxpr not in self._folds_of:
            self._folds_of[jaxpr] = folds(jaxpr)
        saved_folds, self._folds = self._folds, self._folds_of[jaxpr]

        def read(atom: Any) -> tuple[Any, Info]:
            if isinstance(atom, jcore.Literal):
                val = atom.val
                if not isinstance(val, jax.Array):
                    val = np.asarray(val, atom.aval.dtype)
                return val, const_info(val, param=False)
            return env[atom]

        found = self._attention_chains(jaxpr)
        inside = {id(e) for c in found.values() for e in c.eqns if e is not c.out}
        constants = None
        try:
            for eqn in jaxpr.eqns:
                if id(eqn) in inside:  # evaluated with its chain, at its end
                    self.ext.skipped(eqn)
                    continue
                if eqn in found:
                    if constants is None:  # what is known at trace time
                        constants = Constants(
                            jaxpr,
                            {
                                **dict(zip(jaxpr.constvars, consts, strict=True)),
                                **dict(zip(jaxpr.invars, args, strict=True)),
                            },
                        )
                    outs, out_infos = self._attention(found[eqn], read, constants)
                else:
                    pairs = [read(v) for v in eqn.invars]
                    vals = [p[0] for p in pairs]
                    in_infos = [p[1] for p in pairs]
                    with eqn_context(eqn):
                        outs, out_infos = self.eval_eqn(eqn, vals, in_infos)
                for var, o, i in zip(eqn.outvars, outs, out_infos, strict=True):
                    env[var] = (o, i)
        finally:
            self._widening = saved_wide
            self._folds = saved_folds
        results = [read(v) for v in jaxpr.outvars]
        return [r[0] for r in results], [r[1] for r in results]

    def _attention_chains(self, jaxpr: Any) -> dict[Any, Any]:
        """The written-out attentions of ``jaxpr`` this interpreter may fuse
        (:mod:`jaxscale._autocast.fusion`): none in float32, in a region
        another autocast owns, or for an observer of each equation; under an
        extension, those it lets run fused (:meth:`Extension.fuses`)."""
        if (
            not self.fuse_attention
            or self.dtype == _F32
            or self._owned
            or self.observer is not None
        ):
            return {}
        if jaxpr not in self._chains_of:
            self._chains_of[jaxpr] = chains(jaxpr)
        found = self._chains_of[jaxpr]
        if self.extension is not None:  # only the chains it lets pass it by
            found = {k: c for k, c in found.items() if self.extension.fuses(c)}
        return found

    def _attention(
        self, chain: Any, read: Callable[[Any], tuple[Any, Info]], constants: Any
    ) -> tuple[list[Any], list[Info]]:
        """A written-out attention: fused where it can be
        (:func:`jaxscale._autocast.attention.run_chain`), else its equations."""
        inputs = {v: read(v) for v in chain.inputs}
        names = list(inputs)

        def written(*vals: Any) -> tuple[list[Any], list[Info]]:
            local = {v: (x, inputs[v][1]) for v, x in zip(names, vals, strict=True)}

            def get(atom: Any) -> tuple[Any, Info]:
                return read(atom) if isinstance(atom, jcore.Literal) else local[atom]

            for eqn in chain.eqns:
                pairs = [get(v) for v in eqn.invars]
                with eqn_context(eqn):
                    outs, infos = self.eval_eqn(
                        eqn, [p[0] for p in pairs], [p[1] for p in pairs]
                    )
                for var, o, i in zip(eqn.outvars, outs, infos, strict=True):
                    local[var] = (o, i)
            out = [local[v] for v in chain.out.outvars]
            return [o for o, _ in out], [i for _, i in out]

        if not self.ext.may_fuse(chain.eqns):
            return written(*[v for v, _ in inputs.values()])
        return attention.run_chain(self, chain, inputs, constants, written)

    def widens(self, eqn: Any) -> bool:
        """Whether ``eqn``'s first output is widened to float32 anyway by what
        uses it (:func:`jaxscale._autocast.lookahead.widened`)."""
        return bool(eqn.outvars) and eqn.outvars[0] in self._widening

    def fold_of(self, eqn: Any) -> Any:
        """The scaling equation that follows the product ``eqn`` in the jaxpr
        being evaluated (:func:`jaxscale._autocast.lookahead.folds`), or None."""
        return self._folds.get(eqn)

    def narrow_after(self, eqn: Any) -> None:
        """Round the outputs of ``eqn`` (a scaling, evaluated next) to the
        autocast dtype: its product was widened only to take the scale."""
        self._narrowing.add(id(eqn))

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
        owned = self._owned > 0 or _in_owned_region(eqn)
        rule = Rule.TRACED if owned else self.table.get(name)
        retry = False  # an unknown first-order primitive: as traced if it refuses
        if owned and self.enters_owned and self.recurses_into(eqn):
            self._owned += 1
            try:
                result = self.eval_higher_order(eqn, vals, infos)
            finally:
                self._owned -= 1
            if result is not None:
                return result
        elif rule is None and is_higher_order(eqn):  # not overridden: recurse
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
        if id(eqn) in self._narrowing:  # a widened product's scale: round once
            self._narrowing.discard(id(eqn))
            outs = [self.cast(o, self.dtype) for o in outs]
            out_infos = [i._replace(lowered=True) for i in out_infos]
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
        if construct in _CALLS:  # its body's outputs are its outputs
            self._outer = tuple(v in self._widening for v in eqn.outvars)
        try:
            result = handler(self, eqn, vals, infos) if handler else None
            if result is None:
                result = self.handlers["generic"](self, eqn, vals, infos)
        except Unrewritable as e:
            known = "its parameters are not the ones this version expects, and "
            if not self._owned:  # owned: as traced, as its autocast ran it
                self.warn(eqn.primitive.name, (known if handler else "") + str(e))
            return None
        finally:
            self._outer = None
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
