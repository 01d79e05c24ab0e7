"""Matmul sites under :func:`jaxscale.autocast`, and a plan applied to them.

A *site* is a ``dot_general`` without batch dimensions whose two operands are
floating, met while an autocast region is evaluated (outside custom-derivative
rules and ``shard_map`` bodies, where a plan does not reach). Sites are named
by their name stack (Flax module paths, ``jax.named_scope``; ``(top level)``
where there is none); the second site of the same name stack is ``name#1``,
the third ``name#2``, and so on, in the order the function meets them. A site
in a ``scan`` body is one site, whatever the length (a scanned stack of layers
shares one format). Calls (``jit``) are entered in place, so a layer called
twice is two sites.

:class:`SiteRule` is the :class:`~jaxscale._autocast.classes.PluginRule` that
names the sites (its extension, :class:`SiteContext`, counts them, across
retraces of a loop's body); :class:`PlanRule` runs each in its plan's format:

- ``FLOAT32``: float32 operands, float32 product (JAX's default precision);
- ``HALF``: the autocast rule (``"lower"``) as without a plan;
- ``HALF_WIDE``: operands in the autocast dtype, accumulated and returned in
  float32, its backward in the autocast dtype (the widening rule's product);
- ``FLOAT8`` / ``FLOAT8_ROWWISE``: float8 with current scaling per tensor /
  per row (:class:`jaxscale.float8.CurrentScaling` /
  :class:`~jaxscale.float8.RowwiseScaling`), the output in the autocast dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxscale._autocast.classes import RULE_CLASSES, PluginRule, wide_product
from jaxscale._autocast.interp import Extension, Loop
from jaxscale._autocast.rules import AutocastRule
from jaxscale._autocast.values import dtype_of, is_castable
from jaxscale._jax_private import bind, dot_dimension_numbers
from jaxscale._jax_private import with_preferred_element_type as _with_out
from jaxscale._speed import Format
from jaxscale.float8._recipes import CurrentScaling, RowwiseScaling
from jaxscale.float8._site import broadcast_max, float8_dot, sizes
from jaxscale.precision._measure import FORMATS

__all__ = [
    "FLOAT8_RECIPES",
    "TOP_LEVEL",
    "PlanRule",
    "ProbeContext",
    "SiteContext",
    "SiteRule",
    "site_name",
    "site_sizes",
]

_F32 = np.dtype("float32")
_LOWER = RULE_CLASSES[AutocastRule.LOWER]
_FLOAT32 = RULE_CLASSES[AutocastRule.FLOAT32]
TOP_LEVEL = "(top level)"
# The float8 recipes a plan's float8 sites run (current scaling: no state).
FLOAT8_RECIPES = MappingProxyType(
    {
        Format.FLOAT8: CurrentScaling(min_dim=0),
        Format.FLOAT8_ROWWISE: RowwiseScaling(min_dim=0),
    }
)


def site_name(where: str, seen: Sequence[str]) -> str:
    """The name of a site at name stack ``where``, after the sites ``seen``:
    ``where`` (``(top level)`` if empty), then ``where#1``, ``where#2``..."""
    base = where or TOP_LEVEL
    k = sum(1 for s in seen if s == base or s.startswith(base + "#"))
    return base if k == 0 else f"{base}#{k}"


class _SiteLoop(Loop):
    """:meth:`SiteContext.loop`: a ``scan`` whose body may be traced more than
    once; the sites met in it are counted once. An extension that threads
    per-site values (the sensor's probes) broadcasts them over the iterations."""

    def __init__(self, ctx: SiteContext, length: int):
        self.ctx, self.first, self.length = ctx, len(ctx.seen), length
        self.xs = ctx.loop_inputs(self.first, length)

    @contextlib.contextmanager
    def body(self, extra: Sequence[Any]) -> Iterator[None]:
        ctx = self.ctx
        del ctx.seen[self.first :]
        saved = ctx.enter_loop(self.first, extra)
        ctx.loops.append(self.length)
        try:
            yield
        finally:
            ctx.loops.pop()
            ctx.leave_loop(saved)


class SiteContext(Extension):
    """The sites met in one autocast evaluation, in order (``seen``), with
    the choice made for the equation being evaluated (``choice``: the
    equation, its site's name and its format)."""

    inline_calls = True  # a call's sites are the caller's, met at each call

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.loops: list[int] = []  # the lengths of the scans around, outermost first
        self.paused = 0
        self.choice: tuple[Any, str, Any] | None = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def opaque(self) -> Any:
        return self.suspended()

    def loop(self, length: int) -> Loop:
        return _SiteLoop(self, length)

    def loop_inputs(self, first: int, length: int) -> tuple[Any, ...]:
        """Per-iteration inputs of a loop entered after ``first`` sites."""
        return ()

    def enter_loop(self, first: int, extra: Sequence[Any]) -> Any:
        return None

    def leave_loop(self, saved: Any) -> None:
        pass

    def register(self, where: str) -> str:
        name = site_name(where, self.seen)
        self.seen.append(name)
        return name


class ProbeContext(SiteContext):
    """A :class:`SiteContext` whose sites read *probes*: zero inputs, one per
    site in the order met, whose cotangents carry what the site measured
    (``session.probes``; ``None`` while only counting). In a ``scan`` body the
    probes enter once per iteration; their cotangents combine over the
    iterations by ``session.combine``: ``"sum"`` or ``"max"``."""

    def __init__(self, session: Any):
        super().__init__()
        self.session = session

    def loop_inputs(self, first, length):
        probes = self.session.probes
        if probes is None or first >= len(probes):
            return ()
        block = jnp.stack(probes[first:])
        if self.session.combine == "max":
            return (broadcast_max(block, length),)
        return (jnp.broadcast_to(block, (length, *block.shape)),)

    def enter_loop(self, first, extra):
        saved = self.session.probes
        if extra:
            (block,) = extra
            rows = [block[i] for i in range(block.shape[0])]
            self.session.probes = [*saved[:first], *rows]
        return saved

    def leave_loop(self, saved):
        self.session.probes = saved

    def probe(self) -> Any:
        """The probe of the site registered last, or ``None``."""
        probes, index = self.session.probes, len(self.seen) - 1
        return None if probes is None or index >= len(probes) else probes[index]


def site_sizes(eqn: Any, vals: Sequence[Any]) -> tuple[int, int, int] | None:
    """``(m, k, n)`` if ``eqn`` on ``vals`` is a site, else ``None``."""
    if (
        eqn.primitive.name != "dot_general"
        or len(vals) != 2
        or not all(is_castable(dtype_of(v)) for v in vals)
    ):
        return None
    mkn = sizes(eqn.params, np.shape(vals[0]), np.shape(vals[1]))
    return None if mkn is None or min(mkn) < 1 else mkn


class SiteRule(PluginRule):
    """The base of the rules that act on sites: finds them (:meth:`decide`),
    and runs any other ``dot_general`` as the ``"lower"`` rule. A subclass
    defines :meth:`format_of` (the format of a site, given its name) and may
    override :meth:`emit_site`."""

    __slots__ = ()

    def check(self, dtype: np.dtype) -> None:
        if dtype == _F32:
            raise ValueError(
                "`plan` needs a 16-bit autocast `dtype` (bfloat16 or float16), the "
                "one its 16-bit sites run in: float32 switches autocast off. Got "
                f"dtype float32 with plan={self!r}."
            )

    def begin(self) -> SiteContext:
        return SiteContext()

    def format_of(self, ctx: SiteContext, name: str, mkn: tuple, infos: Any) -> Any:
        raise NotImplementedError

    def decide(self, it: Any, eqn: Any, vals: list, infos: Any) -> Any:
        """The format of ``eqn`` if it is a site (registering it), else ``None``."""
        ctx = it.extension
        if not isinstance(ctx, SiteContext) or ctx.paused:
            return None
        mkn = site_sizes(eqn, vals)
        if mkn is None:
            return None
        name = ctx.register(str(eqn.source_info.name_stack))
        fmt = self.format_of(ctx, name, mkn, infos)
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
    plan=plan)`` runs each site in ``formats[site]``. A site the plan does
    not name, or a site it names that ``f`` never meets, raises: the plan was
    made for another function (another depth, another layer), and a silent
    default would hide it."""

    formats: Any = ()
    origin: str = "the plan"

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", _plan_formats(self.formats))

    def format_of(self, ctx, name, mkn, infos):
        fmt = dict(self.formats).get(name)
        if fmt is None:
            known = ", ".join(s for s, _ in self.formats[:8]) or "none"
            more = " ..." if len(self.formats) > 8 else ""
            raise ValueError(
                f"`plan`: the function has a matmul site {name!r} (m, k, n = "
                f"{mkn}) that {self.origin} does not name (it names {known}{more}): "
                "it was made for another function. Make a plan for this one "
                "(`jxs.plan_precision`), or add the site with `Plan.replace`."
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
