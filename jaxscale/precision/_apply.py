"""A plan applied: each site (:mod:`jaxscale.precision._sites`) run in its
format.

:class:`SiteRule` is the :class:`~jaxscale.internal.PluginRule` that finds the
sites (its extension, a :class:`~jaxscale.precision._sites.SiteContext`, names
them); :class:`PlanRule` runs each in its plan's format:

- ``FLOAT32``: float32 operands, float32 product (JAX's default precision);
- ``HALF``: the autocast rule (``"lower"``) as without a plan;
- ``HALF_WIDE``: operands in the autocast dtype, accumulated and returned in
  float32, its backward in the autocast dtype (the widening rule's product);
- ``FLOAT8`` / ``FLOAT8_ROWWISE``: float8 with current scaling per tensor /
  per row (:class:`jaxscale.float8.CurrentScaling` /
  :class:`~jaxscale.float8.RowwiseScaling`), the output in the autocast dtype
  (dense sites only: :data:`~jaxscale.precision._measure.KINDS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from jaxscale._jax_private import bind, dot_dimension_numbers
from jaxscale._jax_private import with_preferred_element_type as _with_out
from jaxscale._speed import Format
from jaxscale.float8 import CurrentScaling, RowwiseScaling
from jaxscale.internal import (
    RULE_CLASSES,
    AutocastRule,
    PluginRule,
    dtype_of,
    float8_dot,
    wide_product,
)
from jaxscale.precision._measure import FORMATS, KINDS, kind_formats
from jaxscale.precision._sites import ALL_KINDS, SiteContext, site_kind

__all__ = ["FLOAT8_RECIPES", "PlanRule", "SiteRule"]

_F32 = np.dtype("float32")
_LOWER = RULE_CLASSES[AutocastRule.LOWER]
_FLOAT32 = RULE_CLASSES[AutocastRule.FLOAT32]
# The float8 recipes a plan's float8 sites run (current scaling: no state).
FLOAT8_RECIPES = MappingProxyType(
    {
        Format.FLOAT8: CurrentScaling(min_dim=0),
        Format.FLOAT8_ROWWISE: RowwiseScaling(min_dim=0),
    }
)


class SiteRule(PluginRule):
    """The base of the rules that act on sites: finds them (:meth:`decide`),
    those of :attr:`kinds`, and runs any other product as the ``"lower"``
    rule. A subclass defines :meth:`format_of` (the format of a site, given
    its name and kind) and may override :meth:`emit_site`."""

    __slots__ = ()
    # The kinds of site the rule acts on (the others run as without a plan).
    kinds: frozenset[str] = ALL_KINDS
    # The primitives it takes in autocast's table (``entry.resolve``).
    primitives = ("dot_general", "conv_general_dilated")

    def check(self, dtype: np.dtype) -> None:
        if dtype == _F32:
            raise ValueError(
                "`plan` needs a 16-bit autocast `dtype` (bfloat16 or float16), the "
                "one its 16-bit sites run in: float32 switches autocast off. Got "
                f"dtype float32 with plan={self!r}."
            )

    def begin(self) -> SiteContext:
        return SiteContext(self.kinds)

    def format_of(
        self,
        ctx: SiteContext,
        name: str,
        mkn: tuple,
        eqn: Any,
        vals: list,
        infos: Any,
        kind: str = "dense",
    ) -> Any:
        raise NotImplementedError

    def decide(self, it: Any, eqn: Any, vals: list, infos: Any) -> Any:
        """The format of ``eqn`` if it is a site (registering it), else ``None``."""
        ctx = it.extension
        if not isinstance(ctx, SiteContext) or ctx.paused:
            return None
        found = site_kind(eqn, vals, infos)
        if found is None or found[0] not in ctx.kinds:
            return None
        kind, mkn = found
        name = ctx.name_of(eqn)
        fmt = self.format_of(ctx, name, mkn, eqn, vals, infos, kind)
        ctx.choice = (eqn, name, fmt)
        return fmt

    def chosen(self, it: Any, eqn: Any) -> tuple[str, Any] | None:
        ctx = it.extension
        if isinstance(ctx, SiteContext) and ctx.choice and ctx.choice[0] is eqn:
            return ctx.choice[1], ctx.choice[2]
        return None

    def cast_operands(self, it, eqn, vals, infos, traced):
        fmt = self.decide(it, eqn, vals, infos)
        if fmt is None or fmt is Format.HALF or fmt is Format.HALF_WIDE:
            return _LOWER.cast_operands(it, eqn, vals, infos, traced)
        if fmt is Format.FLOAT32:
            return _FLOAT32.cast_operands(it, eqn, vals, infos, traced)
        return vals, None  # float8 quantises each operand from its own dtype

    def adjust_params(self, it, eqn, vals, traced):
        c = self.chosen(it, eqn)
        if c is None or c[1] is Format.HALF:
            return _LOWER.adjust_params(it, eqn, vals, traced)
        params = super().adjust_params(it, eqn, vals, traced)
        if c[1] is Format.HALF_WIDE:
            return _with_out(params, _F32)
        return params

    def emit(self, it, eqn, params, vals):
        c = self.chosen(it, eqn)
        if c is None:
            return _LOWER.emit(it, eqn, params, vals)
        return self.emit_site(it, eqn, params, vals, *c)

    def emit_site(self, it, eqn, params, vals, name: str, fmt: Format) -> list:
        """A site's product in format ``fmt``."""
        it.note(f"site {name}: {fmt.value}")
        if fmt is Format.HALF:
            return _LOWER.emit(it, eqn, params, vals)
        if fmt is Format.FLOAT32:
            return bind(eqn.primitive, params, vals)
        if fmt is Format.HALF_WIDE:
            if all(dtype_of(v) == it.dtype for v in vals):
                sources = [it.wide_gradient_source(v) for v in vals]
                return [wide_product(eqn.primitive, params, *vals, sources=sources)]
            return bind(eqn.primitive, params, vals)  # a constant kept it float32
        dims = dot_dimension_numbers(params)
        recipe = FLOAT8_RECIPES[fmt]
        return [float8_dot(vals[0], vals[1], dims, it.dtype, recipe, None)]

    def out_infos(self, it, eqn, infos, outs):
        return _LOWER.out_infos(it, eqn, infos, outs)


class _PlanContext(SiteContext):
    """The sites of a plan being run: whatever is not a site, or is a 16-bit
    site, runs as autocast runs it without a plan. A plan threads no values
    through the function, so a ``jit`` body is re-traced, not inlined (JAX
    sums a value's cotangents in another order across an inlined call, which
    moves a 16-bit gradient by an ulp), and a written-out attention whose
    sites are all 16-bit runs fused where autocast fuses it."""

    inline_calls = False

    def __init__(self, rule: PlanRule):
        super().__init__(rule.kinds)
        self.formats = dict(rule.formats)

    def may_fuse(self, eqns: Any) -> bool:
        """A written-out attention (or ``jax.nn.dot_product_attention``) runs
        fused, as without a plan, when each of its sites is 16-bit in the plan
        (or not named: :meth:`PlanRule.format_of` then raises)."""
        return all(
            self.formats.get(name, Format.HALF) is Format.HALF
            for _, name in self.predict(eqns)
        )


class _ShapeRule(SiteRule):
    """Finds each site's ``(m, k, n)`` (in ``shapes``) and kind (in
    ``kinds_met``), running it in 16 bits; ``kinds``: the kinds it counts."""

    __slots__ = ("kinds", "kinds_met", "shapes")

    def __init__(self, kinds: frozenset[str] = ALL_KINDS) -> None:
        self.shapes: dict[str, tuple[int, int, int]] = {}
        self.kinds_met: dict[str, str] = {}
        self.kinds = frozenset(kinds)

    def format_of(self, ctx, name, mkn, eqn, vals, infos, kind="dense"):
        self.shapes.setdefault(name, tuple(mkn))
        self.kinds_met.setdefault(name, kind)
        return Format.HALF


def _plan_formats(value: Any) -> tuple[tuple[str, Format], ...]:
    if isinstance(value, Mapping):
        value = tuple(value.items())
    if not isinstance(value, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 for p in value
    ):
        raise TypeError(
            "`formats` must map site names to Formats (a dict, or a tuple of "
            f"(site, Format) pairs), got {type(value).__name__}."
        )
    for site, fmt in value:
        if not isinstance(site, str) or not isinstance(fmt, Format):
            raise TypeError(
                f"`formats`: each entry must be a site name (str) and a Format "
                f"({FORMATS}), got {site!r}: {fmt!r}."
            )
    names = [s for s, _ in value]
    twice = sorted({s for s in names if names.count(s) > 1})
    if twice:
        raise ValueError(f"`formats` names sites twice: {', '.join(twice)}.")
    return value


@dataclasses.dataclass(frozen=True)
class PlanRule(SiteRule):
    """A plan's formats as an autocast rule: ``jxs.autocast(f, dtype,
    plan=plan)`` runs each site of ``kinds`` in ``formats[site]``. A site of
    those kinds the plan does not name, or a site it names that ``f`` never
    meets, raises: the plan was made for another function (another depth,
    another layer), and a silent default would hide it. Sites of other kinds
    (a plan made before batched products and convolutions were sites) run as
    autocast runs them without a plan, unnamed."""

    formats: Any = ()
    origin: str = "the plan"
    # ``{site: (m, k, n)} -> ((site, Format), ...)``: the formats at a traced
    # step's shapes (``Plan.at``); ``None``: the formats as given.
    resolve: Any = None
    kinds: frozenset[str] = frozenset({"dense"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", _plan_formats(self.formats))
        kinds = frozenset(self.kinds)
        if not kinds <= ALL_KINDS:
            raise ValueError(
                f"`kinds` must be kinds of site ({sorted(ALL_KINDS)}), got "
                f"{sorted(kinds)}."
            )
        object.__setattr__(self, "kinds", kinds)

    def prepare(self, trace: Any) -> PlanRule:
        """The rule for one traced step: with ``resolve``, the formats at the
        step's shapes, which ``trace(rule)`` (an abstract evaluation of the
        function under ``rule``) finds; else this rule."""
        if self.resolve is None:
            return self
        counter = _ShapeRule(self.kinds)
        trace(counter)
        formats = self.resolve(MappingProxyType(counter.shapes))
        origin = f"{self.origin} at the traced shapes"
        return PlanRule(formats, origin, kinds=self.kinds)

    def begin(self) -> SiteContext:
        return _PlanContext(self)

    def format_of(self, ctx, name, mkn, eqn, vals, infos, kind="dense"):
        fmt = dict(self.formats).get(name)
        if fmt is None:
            known = ", ".join(s for s, _ in self.formats[:8]) or "none"
            more = " ..." if len(self.formats) > 8 else ""
            raise ValueError(
                f"`plan`: the function has a {kind} site {name!r} (m, k, n = "
                f"{mkn}) that {self.origin} does not name (it names {known}{more}): "
                "it was made for another function. Make a plan for this one "
                "(`jxs.plan_precision`), or add the site with `Plan.replace`."
            )
        if fmt not in KINDS[kind]:
            raise ValueError(
                f"`plan`: site {name!r} is a {kind} site (m, k, n = {mkn}), which "
                f"runs in {kind_formats(kind)}; {self.origin} gives it "
                f"Format.{fmt.name}."
            )
        return fmt

    def end(self, extension: Any) -> None:
        if not isinstance(extension, SiteContext) or extension.paused:
            return
        unmet = [s for s, _ in self.formats if s not in extension.seen]
        if unmet:
            raise ValueError(
                f"`plan`: {self.origin} names {len(unmet)} site(s) the function "
                f"never met: {', '.join(unmet[:8])}{' ...' if len(unmet) > 8 else ''}"
                f" (it met {len(extension.seen)}: "
                f"{', '.join(extension.seen[:8]) or 'none'}). It was made for "
                "another function: make a plan for this one."
            )

    def __repr__(self) -> str:
        return f"PlanRule({len(self.formats)} sites)"
