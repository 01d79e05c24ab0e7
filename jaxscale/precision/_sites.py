"""Sites under :func:`jaxscale.autocast`: which equations they are and their
names, for the three stages that meet them (the sensor, a plan, the monitor).

A *site* is a product on two floating operands met while an autocast region is
evaluated (outside custom-derivative rules, whose backward is the user's; in a
``shard_map`` body at its per-device shapes: :class:`_SiteManual`), of one of
three kinds (:data:`KINDS`): ``"dense"``, a
``dot_general`` without batch dimensions; ``"batched"``, one with batch
dimensions whose operands are both activations (attention's score and value
products); ``"conv"``, a ``conv_general_dilated``. Sites are named
by their name stack (Flax linen module paths, NNX's as
:func:`jaxscale._nnx_names.named_modules` pushes them, ``jax.named_scope``; ``(top
level)`` where there is none); the second site of the same name stack is ``name#1``,
the third ``name#2``, and so on, in the order the function meets them. A site
in a ``scan`` body is one site, whatever the length (a scanned stack of layers
shares one format). Calls (``jit``) are entered in place, so a layer called
twice is two sites. Sites are named in program order: a written-out
attention evaluated as one chain at its end (:mod:`jaxscale._autocast.fusion`)
*reserves* its score product's name where the program meets it.

:class:`SiteContext` (the extension of the rules that act on sites) counts
them, across retraces of a loop's body; :class:`ProbeContext` also hands each
site its probe (:mod:`jaxscale._probe`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxscale._jax_private import (
    conv_dimension_numbers,
    dot_dimension_numbers,
    manual_axes,
    mark_varying,
)
from jaxscale._probe import spread, stack, unstack
from jaxscale.internal import Extension, Loop, dot_sizes, dtype_of, is_castable
from jaxscale.precision._measure import KINDS

__all__ = [
    "ALL_KINDS",
    "TOP_LEVEL",
    "ProbeContext",
    "SiteContext",
    "site_kind",
    "site_name",
    "site_sizes",
]

TOP_LEVEL = "(top level)"
ALL_KINDS = frozenset(KINDS)


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
        leaves, self.tree = jax.tree.flatten(ctx.loop_inputs(self.first, length))
        self.xs = tuple(leaves)

    @contextlib.contextmanager
    def body(self, extra: Sequence[Any]) -> Iterator[None]:
        ctx = self.ctx
        del ctx.seen[self.first :]
        inputs = jax.tree.unflatten(self.tree, list(extra)) if extra else None
        saved = ctx.enter_loop(self.first, inputs)
        ctx.loops.append(self.length)
        try:
            yield
        finally:
            ctx.loops.pop()
            ctx.leave_loop(saved)


class _SiteManual(Loop):
    """:meth:`SiteContext.manual`: a ``shard_map`` body, whose sites are sites
    like any other (named by their name stack, at the body's per-device
    shapes). An extension that threads per-site values (the sensor's probes)
    passes them in replicated, marked varying over the manual axes inside, so
    that each device's measurement is summed over the devices by the
    transpose: the whole batch's sums, as without the ``shard_map``."""

    def __init__(self, ctx: SiteContext):
        self.ctx, self.first = ctx, len(ctx.seen)
        leaves, self.tree = jax.tree.flatten(ctx.loop_inputs(self.first, None))
        self.xs = tuple(leaves)

    @contextlib.contextmanager
    def body(self, extra: Sequence[Any]) -> Iterator[None]:
        inputs = None
        if extra:
            axes, checked = manual_axes()
            if checked and axes:
                extra = [mark_varying(x, axes) for x in extra]
            inputs = jax.tree.unflatten(self.tree, list(extra))
        saved = self.ctx.enter_loop(self.first, inputs, per_iteration=False)
        try:
            yield
        finally:
            self.ctx.leave_loop(saved)


class SiteContext(Extension):
    """The sites of ``kinds`` met in one autocast evaluation, in order
    (``seen``), with the choice made for the equation being evaluated
    (``choice``: the equation, its site's name and its format)."""

    inline_calls = True  # a call's sites are the caller's, met at each call

    def __init__(self, kinds: frozenset[str] = ALL_KINDS) -> None:
        self.kinds = frozenset(kinds)
        self.seen: list[str] = []
        self.loops: list[int] = []  # the lengths of the scans around, outermost first
        self.paused = 0
        self.choice: tuple[Any, str, Any] | None = None
        self.reserved: dict[int, tuple[Any, str]] = {}  # id(eqn) -> (eqn, name)

    def fuses(self, chain: Any) -> bool:
        """A written-out attention is taken as one chain (its products named in
        program order all the same: :meth:`skipped`); :meth:`may_fuse` decides
        at its end whether it runs fused."""
        return True

    def may_fuse(self, eqns: Any) -> bool:
        """Whether products among ``eqns`` may run in a fused kernel that
        evaluates none of them: never while measuring (the sensor, the
        monitor and the shape count must meet every site)."""
        return False

    def skipped(self, eqn: Any) -> None:
        """Reserves the name of ``eqn``, a product the interpreter passes in
        program order and evaluates later (a chain's score product)."""
        if self.paused or eqn.primitive.name != "dot_general":
            return
        avals = [v.aval for v in eqn.invars]
        found = site_kind(eqn, avals)
        if found is not None and found[0] in self.kinds:
            name = self.register(str(eqn.source_info.name_stack))
            self.reserved[id(eqn)] = (eqn, name)

    def name_of(self, eqn: Any) -> str:
        """The name of site ``eqn``: reserved, or registered now."""
        hit = self.reserved.pop(id(eqn), None)
        if hit is not None and hit[0] is eqn:
            return hit[1]
        return self.register(str(eqn.source_info.name_stack))

    def predict(self, eqns: Any) -> list[tuple[Any, str]]:
        """``(eqn, name)`` for the products among ``eqns`` that would be
        sites of this context's kinds if evaluated next, in order (their
        operands taken as activations)."""
        seen, out = list(self.seen), []
        for e in eqns:
            if e.primitive.name not in ("dot_general", "conv_general_dilated"):
                continue
            found = site_kind(e, [v.aval for v in e.invars])
            if found is None or found[0] not in self.kinds:
                continue
            hit = self.reserved.get(id(e))
            if hit is not None and hit[0] is e:
                out.append((e, hit[1]))
                continue
            name = site_name(str(e.source_info.name_stack), seen)
            seen.append(name)
            out.append((e, name))
        return out

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def opaque(self) -> Any:
        return self.suspended()

    def manual(self) -> Loop:
        if self.paused:
            return super().manual()
        return _SiteManual(self)

    def loop(self, length: int) -> Loop:
        return _SiteLoop(self, length)

    def loop_inputs(self, first: int, length: int | None) -> Any:
        """Per-iteration inputs of a loop entered after ``first`` sites (a
        pytree of arrays stacked along a leading axis of ``length``; ``None``:
        none), or of a ``shard_map`` body (``length`` ``None``: not stacked)."""
        return None

    def enter_loop(self, first: int, inputs: Any, per_iteration: bool = True) -> Any:
        """Enters one trace of a loop's body, given this iteration's slice of
        :meth:`loop_inputs` (``None`` if none; ``per_iteration=False``: a
        ``shard_map`` body's, not stacked); returns what :meth:`leave_loop`
        restores."""
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
    (``session.probes``, probes of one kind; ``None`` while only counting). In
    a ``scan`` body the probes enter once per iteration (:func:`spread`): their
    cotangents combine over the iterations as their kind declares."""

    def __init__(self, session: Any, kinds: frozenset[str] = ALL_KINDS):
        super().__init__(kinds)
        self.session = session

    def loop_inputs(self, first, length):
        probes = self.session.probes
        if probes is None or first >= len(probes):
            return None
        if length is None:
            return list(probes[first:])
        return spread(stack(probes[first:]), length)

    def enter_loop(self, first, inputs, per_iteration=True):
        saved = self.session.probes
        if inputs is not None:
            inner = unstack(inputs) if per_iteration else list(inputs)
            self.session.probes = [*saved[:first], *inner]
        return saved

    def leave_loop(self, saved):
        self.session.probes = saved

    def probe(self) -> Any:
        """The probe of the site registered last, or ``None``."""
        probes, index = self.session.probes, len(self.seen) - 1
        return None if probes is None or index >= len(probes) else probes[index]


def site_sizes(eqn: Any, vals: Sequence[Any]) -> tuple[int, int, int] | None:
    """``(m, k, n)`` if ``eqn`` on ``vals`` is a dense site, else ``None``."""
    found = site_kind(eqn, vals)
    return found[1] if found is not None and found[0] == "dense" else None


def site_kind(
    eqn: Any, vals: Sequence[Any], infos: Sequence[Any] | None = None
) -> tuple[str, tuple[int, int, int]] | None:
    """``(kind, (m, k, n))`` if ``eqn`` on ``vals`` is a site (``infos``: the
    operands' provenance; a batched product on a parameter is no site), else
    ``None``. ``(m, k, n)`` is the equivalent GEMM's: a batched product's
    batch counts in ``m`` (its second operand once, a lower bound on its
    traffic); a convolution's ``m`` is the batch times the output's spatial
    size, ``k`` its input channels (per group) times the kernel's spatial
    size, ``n`` its output channels."""
    name = eqn.primitive.name
    if (
        name not in ("dot_general", "conv_general_dilated")
        or len(vals) != 2
        or not all(is_castable(dtype_of(v)) for v in vals)
    ):
        return None
    x, w = np.shape(vals[0]), np.shape(vals[1])
    if name == "conv_general_dilated":
        kind, mkn = "conv", conv_sizes(eqn.params, w, eqn.outvars[0].aval.shape)
    else:
        (lc, rc), (lb, rb) = dot_dimension_numbers(eqn.params)
        if not lb:
            kind, mkn = "dense", dot_sizes(eqn.params, x, w)
        else:
            if infos is not None and any(getattr(i, "param", False) for i in infos):
                return None
            batch = math.prod(x[d] for d in lb)
            m = math.prod(s for d, s in enumerate(x) if d not in (*lc, *lb))
            k = math.prod(x[d] for d in lc)
            n = math.prod(s for d, s in enumerate(w) if d not in (*rc, *rb))
            kind, mkn = "batched", (batch * m, k, n)
    if mkn is None or min(mkn) < 1:
        return None
    return kind, tuple(int(v) for v in mkn)


def conv_sizes(params: Any, w: tuple, out: tuple) -> tuple[int, int, int]:
    """A convolution's equivalent GEMM ``(m, k, n)`` (:func:`site_kind`)."""
    _, rhs, spec = conv_dimension_numbers(params)
    m = out[spec[0]] * math.prod(out[d] for d in spec[2:])
    k = w[rhs[1]] * math.prod(w[d] for d in rhs[2:])
    return int(m), int(k), int(w[rhs[0]])


def select_site(sites: Sequence[Any], site: str, shape: tuple | None) -> Any:
    """The format of the :class:`~jaxscale.precision.SitePlan` among ``sites``
    that a float8 recipe's ``site`` (a name stack) names, or ``None``
    (:meth:`Plan.select <jaxscale.precision.Plan.select>`)."""
    base = site or TOP_LEVEL
    same = [
        s
        for s in sites
        if s.site == site
        or s.site == base
        or (s.site.startswith(base + "#") and s.site[len(base) + 1 :].isdigit())
    ]
    if shape is not None:
        same = [s for s in same if s.shape == tuple(shape)] or same
    formats = {s.format for s in same}
    if len(formats) > 1:
        got = ", ".join(f"{s.site}: {s.format.value}" for s in same)
        raise ValueError(
            f"`site` {site!r} (shape {shape}) names {len(same)} sites of the "
            f"plan in different formats ({got}): a name stack cannot tell "
            "them apart. Run the plan with `jxs.autocast(f, dtype, plan=plan)`, "
            "which counts the sites, or name the layers apart "
            "(`jax.named_scope`)."
        )
    return formats.pop() if formats else None
