"""A precision plan: one format per matmul site, with what it costs and why.

:class:`Plan` is what :func:`~jaxscale.precision.solve` chose from the sites'
:class:`~jaxscale.precision.SiteMeasure`, one :class:`SitePlan` per site, with
the speed model's predicted times (:mod:`jaxscale._speed`). A plan is a value:
frozen and hashable (an unchanged plan is an unchanged static argument, so it
hits JAX's compilation cache), printable as a table, saved and loaded as JSON,
and edited with :meth:`Plan.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxscale._cost import DeviceCost, device_cost
from jaxscale._speed import Format
from jaxscale.internal import check_dtype
from jaxscale.precision._apply import PlanRule
from jaxscale.precision._choose import choose
from jaxscale.precision._json import (
    duration,
    plan_doc,
    plan_fields,
)
from jaxscale.precision._measure import (
    FORMATS,
    KINDS,
    PRECISION,
    SiteMeasure,
    half_ratio,
    in_order,
    kind_formats,
    number,
    score,
    scores,
)
from jaxscale.precision._sites import select_site

__all__ = ["Plan", "PlanBudgetWarning", "SitePlan", "site_plan"]

_BUDGET_IN = ("error", "noise")  # what a plan's budget counts


class PlanBudgetWarning(UserWarning):
    """An edited plan (:meth:`Plan.replace`, :meth:`Plan.from_formats`) whose
    measured error exceeds its budget: the message names the sites and the
    error against the budget. Silence it where that is meant::

        warnings.filterwarnings("ignore", category=PlanBudgetWarning)

    Examples:
      >>> import jaxscale as jxs
      >>> import warnings
      >>> import jaxscale.precision
      >>> F = jxs.precision.Format
      >>> m = jxs.precision.SiteMeasure("mlp", (64, 32, 32), (4, 4),
      ...                               {F.HALF: 1e-4, F.FLOAT8: 1e-2})
      >>> plan = jxs.precision.solve([m], cost="H100", budget=1e-3)
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = plan.replace("mlp", F.FLOAT8)
      >>> caught[0].category.__name__
      'PlanBudgetWarning'
    """


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """One site of a :class:`Plan`: the format chosen for it, and why.

    Attributes:
      site: the site's name-stack path.
      shape: ``(m, k, n)``.
      format: the :class:`~jaxscale.precision.Format` it runs in.
      error: the error score measured in that format.
      seconds: the speed model's predicted seconds in that format (the three
        products and the passes the format adds).
      half_seconds: the predicted seconds of the same site in 16 bits, what
        ``why`` compares with.
      why: the reason, in words: ``"float8: 0.71x the 16-bit time, error
        2.1e-4 within the budget"`` and why each other format was not taken
        (over the budget, its range fails, no faster), or that the user chose
        it.
      noise: the fraction of the minibatch gradient noise the format adds
        there (``SiteMeasure.noise``), or ``None`` where it was not measured.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> F = jxs.precision.Format
      >>> m = jxs.precision.SiteMeasure(
      ...     "mlp", (16384, 4096, 28672), (2, 4), {F.HALF: 1e-4, F.FLOAT8: 2e-3})
      >>> plan = jxs.precision.solve([m], cost="H100", budget=1e-2)
      >>> s = plan.sites[0]
      >>> s.format, s.error, round(s.seconds / s.half_seconds, 2)
      (<Format.FLOAT8: 'float8'>, 0.002, 0.82)
    """

    site: str
    shape: tuple[int, int, int]
    format: Format
    error: float
    seconds: float
    half_seconds: float
    why: str
    noise: float | None = None


def site_plan(m: SiteMeasure, fmt: Format, cost: DeviceCost, why: str) -> SitePlan:
    """The :class:`SitePlan` of site ``m`` in ``fmt``."""
    half = m.seconds(Format.HALF, cost)
    noise = None if m.noise is None else m.noise[fmt]
    return SitePlan(
        m.site, m.shape, fmt, m.errors[fmt], m.seconds(fmt, cost), half, why, noise
    )


def _user_why(
    m: SiteMeasure,
    fmt: Format,
    cost: DeviceCost,
    reason: str = "chosen by the user",
    by: str = "error",
) -> str:
    ratio = half_ratio(m, fmt, cost)
    value = scores(m, by if m.noise is not None else "error")[fmt]
    label = by if m.noise is not None else "error"
    return (
        f"{fmt.value}: {reason}; {ratio:.2f}x the 16-bit time, {label} {number(value)}"
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One format per matmul site: the fastest the speed model predicts within
    an error budget, as :func:`~jaxscale.precision.solve` chose it.

    A plan is frozen and hashable. ``print(plan)`` gives a table;
    :meth:`to_json` and :meth:`from_json` save and load it exactly;
    :meth:`formats` gives ``{site: Format}``; :meth:`replace` edits one site.

    Each site is stored once: its measure and its ``(format, why)``;
    :attr:`sites` is derived from them (and the cost).

    Attributes:
      measures: the :class:`SiteMeasure` of each site, in the order the
        function meets them (what :meth:`replace` and :meth:`at` read).
      choices: ``(format, why)`` per site, in the same order.
      budget: the budget the plan was solved for, a limit on the sum of the
        sites' scores of :attr:`budget_in`.
      device: the device kind whose figures the times are predicted with.
      cost: those figures (a ``DeviceCost``).
      dtype: the 16-bit dtype the sites were measured in (``bfloat16`` or
        ``float16``), what its 16-bit sites run in: ``jxs.autocast(f, dtype,
        plan=plan)`` with another dtype raises. ``None``: unknown (a plan
        :func:`~jaxscale.precision.solve` made from bare measures, or a
        version-1 JSON file): it runs in the autocast dtype given, unchecked.
      loss_scale: the loss scale the gradients were measured at (``None``:
        unknown).
      allowed: the formats the solver may choose (``solve``'s ``allowed``).
      pinned: the sites whose format the user chose (:meth:`replace`,
        :meth:`from_formats`): kept when the plan is re-solved (:meth:`at`).
      traced: whether the sites' shapes are a traced step's (:meth:`at`), not
        the calibration batch's.
      budget_in: what :attr:`budget` counts: ``"error"``, the sites' error
        scores (a budget of ``"16-bit"`` or a number); ``"noise"``, their
        fractions of the minibatch gradient noise (a
        :class:`~jaxscale.precision.NoiseBudget`).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> F = jxs.precision.Format
      >>> measures = [
      ...     jxs.precision.SiteMeasure(
      ...         "qkv", (16384, 4096, 6144), (2, 4), {F.HALF: 1e-4, F.FLOAT8: 3e-3}),
      ...     jxs.precision.SiteMeasure(
      ...         "mlp", (16384, 4096, 28672), (2, 4), {F.HALF: 1e-4, F.FLOAT8: 1e-3}),
      ... ]
      >>> plan = jxs.precision.solve(measures, cost="H100", budget=2e-3)
      >>> plan.formats()
      {'qkv': <Format.HALF: '16-bit'>, 'mlp': <Format.FLOAT8: 'float8'>}
      >>> round(plan.error, 6), plan.within_budget
      (0.0011, True)
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     edited = plan.replace("qkv", F.FLOAT8)
      >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
      Plan.replace takes the plan over its budget: measured error 0.004 > budget
      0.002; the edited sites, by error: 'qkv' (0.003). Choose more precise
      formats there, or re-solve with a larger `budget` (`jxs.precision.solve`).
      >>> edited.sites[0].why.startswith("float8: chosen by the user")
      True
      >>> edited.within_budget
      False
      >>> jxs.precision.Plan.from_json(plan.to_json()) == plan
      True
    """

    measures: tuple[SiteMeasure, ...]
    choices: tuple[tuple[Format, str], ...]
    budget: float
    device: str
    cost: DeviceCost
    dtype: np.dtype | None = None
    loss_scale: float | None = None
    allowed: tuple[Format, ...] = PRECISION
    pinned: frozenset[str] = frozenset()
    traced: bool = False
    budget_in: str = "error"

    def __post_init__(self):
        object.__setattr__(self, "pinned", frozenset(self.pinned))
        if self.budget_in not in _BUDGET_IN:
            raise ValueError(
                f"`budget_in` must be one of {list(_BUDGET_IN)} (what the budget "
                f"counts), got {self.budget_in!r}."
            )
        if self.dtype is not None:
            dtype = check_dtype(self.dtype)
            if dtype == np.float32:
                raise ValueError(
                    "`dtype` must be the 16-bit dtype the plan was measured in "
                    "(bfloat16 or float16) or None (unknown), got float32."
                )
            object.__setattr__(self, "dtype", dtype)
        if self.loss_scale is not None:  # a number (TypeError), >= 0, not NaN
            scale = score("`loss_scale`", self.loss_scale)
            if not 0 < scale < math.inf:
                raise ValueError(f"`loss_scale` must be finite and > 0, got {scale}.")
            object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "measures", tuple(self.measures))
        object.__setattr__(self, "choices", tuple(map(tuple, self.choices)))
        names = [m.site for m in self.measures]
        if not names or len(set(names)) != len(names):
            raise ValueError(
                f"`sites` must name at least one site, each once, got {names}."
            )
        if len(self.choices) != len(names):
            raise ValueError(
                f"`choices` must give one (format, why) per site of `measures` "
                f"({len(names)}), got {len(self.choices)}."
            )
        for m, (fmt, _) in zip(self.measures, self.choices, strict=True):
            if fmt not in m.errors:
                raise ValueError(
                    f"site {m.site!r} is planned in {fmt}, which it has no error for."
                )
            if self.budget_in == "noise" and m.noise is None:
                raise ValueError(
                    f"site {m.site!r} has no noise figures (`SiteMeasure.noise`), "
                    "but the plan's budget counts the gradient noise "
                    "(`budget_in='noise'`): measure it again with a "
                    "`jxs.precision.Sensor`, or solve with `budget='16-bit'`."
                )

    @functools.cached_property
    def sites(self) -> tuple[SitePlan, ...]:
        """One :class:`SitePlan` per site (derived from :attr:`measures`,
        :attr:`choices` and the cost), in site order."""
        return tuple(
            site_plan(m, fmt, self.cost, why)
            for m, (fmt, why) in zip(self.measures, self.choices, strict=True)
        )

    # ----------------------------------------------------------------- totals

    @property
    def seconds(self) -> float:
        """The predicted seconds of every site in its format."""
        return math.fsum(s.seconds for s in self.sites)

    @property
    def half_seconds(self) -> float:
        """The predicted seconds of every site in 16 bits."""
        return math.fsum(s.half_seconds for s in self.sites)

    @property
    def error(self) -> float:
        """The sum of the sites' error scores, added in site order (as
        :func:`~jaxscale.precision.solve` adds them against the budget)."""
        return in_order(s.error for s in self.sites)

    @property
    def noise(self) -> float | None:
        """The sum of the sites' fractions of the minibatch gradient noise,
        added in site order; ``None`` if a site has none measured."""
        if any(s.noise is None for s in self.sites):
            return None
        return in_order(s.noise for s in self.sites)

    @property
    def spent(self) -> float:
        """What the plan adds up against its :attr:`budget`: :attr:`noise` if
        :attr:`budget_in` is ``"noise"``, else :attr:`error`."""
        return self.noise if self.budget_in == "noise" else self.error

    def _spent_at(self, s: SitePlan) -> float:
        return s.noise if self.budget_in == "noise" else s.error

    @property
    def within_budget(self) -> bool:
        """Whether :attr:`spent` is within :attr:`budget` (an edit may not be)."""
        return self.spent <= self.budget

    def formats(self) -> dict[str, Format]:
        """``{site: Format}``, in site order: the formats at the shapes in
        :attr:`sites` (the calibration batch's, unless :attr:`traced`). A step
        of other shapes runs :meth:`at` its own shapes."""
        return {s.site: s.format for s in self.sites}

    def at(self, shapes: Mapping[str, tuple[int, int, int]]) -> Plan:
        """This plan re-solved for a step of other shapes: each site priced at
        ``shapes[site]`` (``(m, k, n)``) and the formats chosen again under the
        plan's budget, with the errors measured, the ``allowed`` formats and the
        user's choices (:attr:`pinned`) kept. What ``jxs.autocast(f, dtype,
        plan=plan)`` runs at the shapes it traces. Deterministic, and cached.

        Args:
          shapes: ``{site: (m, k, n)}`` for every site of the plan.

        Returns:
          The :class:`Plan` at those shapes (``traced`` set).

        Raises:
          ValueError: if ``shapes`` names other sites, or no plan of those
            shapes meets the budget.

        Examples:
          >>> import jaxscale as jxs
          >>> import jaxscale.precision
          >>> F = jxs.precision.Format
          >>> m = jxs.precision.SiteMeasure("mlp", (64, 768, 3072), (4, 4),
          ...     {F.FLOAT32: 0.0, F.HALF: 1e-4})
          >>> plan = jxs.precision.solve([m], cost="H100", budget=1e-4)
          >>> plan.formats()  # 64 rows: launch-bound, float32 as fast
          {'mlp': <Format.FLOAT32: 'float32'>}
          >>> plan.at({"mlp": (8192, 768, 3072)}).formats()
          {'mlp': <Format.HALF: '16-bit'>}
        """
        names = [s.site for s in self.sites]
        if not isinstance(shapes, Mapping) or set(shapes) != set(names):
            got = list(shapes) if isinstance(shapes, Mapping) else shapes
            raise ValueError(
                f"`shapes` must give (m, k, n) for each site of the plan, {names}; "
                f"got {got!r}."
            )
        return _at(self, tuple(tuple(shapes[n]) for n in names))

    def autocast_rule(self) -> PlanRule:
        """The autocast rule that runs each site in its format: what
        ``jxs.autocast(f, dtype, plan=plan)`` calls this for. At trace time
        it runs the plan :meth:`at` the traced shapes."""
        formats = tuple((s.site, s.format) for s in self.sites)
        kinds = frozenset(m.kind for m in self.measures)
        origin = f"the plan ({len(formats)} sites)"
        return PlanRule(formats, origin, _AtShapes(self), kinds)

    def with_dtype(self, dtype: Any, loss_scale: float | None = None) -> Plan:
        """This plan's formats, to run in ``dtype``: an explicit override.

        The errors stay those measured in the plan's own dtype: for a plan
        of another dtype they are no measurement of ``dtype`` (float16's
        range and bfloat16's precision differ), so measure again where you
        can (``jxs.plan_precision(loss, dtype)``).

        Args:
          dtype: the 16-bit dtype (bfloat16 or float16).
          loss_scale: the loss scale to record (default: the plan's).

        Returns:
          The :class:`Plan` with ``dtype`` (and ``loss_scale``) set.

        Examples:
          >>> import jaxscale as jxs
          >>> import jax.numpy as jnp
          >>> import jaxscale.precision
          >>> F = jxs.precision.Format
          >>> m = jxs.precision.SiteMeasure("mlp", (64, 32, 32), (4, 4),
          ...                               {F.HALF: 1e-4, F.FLOAT32: 0.0})
          >>> plan = jxs.precision.solve([m], cost="H100", budget=1e-3)
          >>> plan.dtype is None, plan.with_dtype(jnp.float16).dtype
          (True, dtype('float16'))
        """
        scale = self.loss_scale if loss_scale is None else loss_scale
        return dataclasses.replace(self, dtype=dtype, loss_scale=scale)

    @classmethod
    def from_formats(
        cls,
        formats: Mapping[str, Format],
        measures: Iterable[SiteMeasure],
        *,
        cost: DeviceCost | str,
        budget: float = math.inf,
        why: str = "chosen by the user",
    ) -> Plan:
        """A plan of formats chosen without the solver (a shape rule, another
        library's choice, a hand-written table), priced and explained as
        :meth:`replace` prices an edit.

        Args:
          formats: ``{site: Format}``, one entry per site of ``measures``.
          measures: one :class:`~jaxscale.precision.SiteMeasure` per site, in
            the order the function meets them (a sensor's ``measures()``).
          cost: the device kind's figures: a ``DeviceCost`` or a device kind
            (``"H100"``; a kind without figures takes the H100 SXM's).
          budget: the error budget the plan states (default: none, ``inf``).
          why: the reason each site records.

        Returns:
          The :class:`Plan`.

        Raises:
          ValueError: if ``formats`` and ``measures`` name different sites, or
            a format was not measured at its site or fails there.

        Examples:
          >>> import jaxscale as jxs
          >>> import jaxscale.precision
          >>> F = jxs.precision.Format
          >>> m = jxs.precision.SiteMeasure(
          ...     "mlp", (16384, 4096, 28672), (2, 4), {F.HALF: 1e-4, F.FLOAT8: 2e-3})
          >>> plan = jxs.precision.Plan.from_formats(
          ...     {"mlp": F.FLOAT8}, [m], cost="H100", why="torchao's shape rule")
          >>> plan.formats(), plan.sites[0].why.startswith("float8: torchao's")
          ({'mlp': <Format.FLOAT8: 'float8'>}, True)
        """
        measures = tuple(measures)
        if isinstance(cost, str):
            cost, device = device_cost(cost)
        else:
            device = cost.name
        names = [m.site for m in measures]
        if set(formats) != set(names):
            raise ValueError(
                f"`formats` must name the sites of `measures`, {names}; got "
                f"{list(formats)}."
            )
        # Any measured format first, then each site edited to its own (which
        # checks that it was measured there and holds).
        start = tuple((min(m.errors, key=m.errors.get), why) for m in measures)
        plan = cls(measures, start, float(budget), device, cost)
        for m in measures:
            plan = plan._edit(m.site, formats[m.site], why)
        plan._warn_over("Plan.from_formats", list(formats))
        return plan

    # ------------------------------------------------------------------ edits

    def _warn_over(self, what: str, edited: list[str]) -> None:
        """Warns (:class:`PlanBudgetWarning`) if this plan is over its budget,
        naming the ``edited`` sites that add the most error."""
        if self.within_budget:
            return
        errors = {s.site: self._spent_at(s) for s in self.sites}
        worst = sorted(edited, key=lambda n: -errors[n])[:8]
        named = ", ".join(f"{n!r} ({number(errors[n])})" for n in worst)
        more = " ..." if len(edited) > 8 else ""
        by = self.budget_in
        warnings.warn(
            f"{what} takes the plan over its budget: measured {by} "
            f"{number(self.spent)} > budget {number(self.budget)}; the edited "
            f"sites, by {by}: {named}{more}. Choose more precise formats there, "
            "or re-solve with a larger `budget` (`jxs.precision.solve`).",
            PlanBudgetWarning,
            stacklevel=3,
        )

    def replace(self, site: str, fmt: Format, why: str | None = None) -> Plan:
        """A copy of this plan with ``site`` in ``fmt``: the user's choice.

        The site's time, error and ``why`` ("chosen by the user") are
        recomputed, and so are the totals; the budget stays, and the edited plan
        may exceed it (:attr:`within_budget` says so, and so does ``print``):
        an edit that adds error to a plan and leaves it over its budget warns
        (:class:`PlanBudgetWarning`).

        Args:
          site: a site of the plan, by its name-stack path.
          fmt: a :class:`~jaxscale.precision.Format` measured at that site with
            a finite error.
          why: the reason to record (default ``"chosen by the user"``).

        Returns:
          The edited :class:`Plan`.

        Raises:
          TypeError: if ``fmt`` is not a ``Format``.
          ValueError: if the plan has no such site, ``fmt`` is not a format
            of the site's kind (no float8 at a batched product or a
            convolution), or ``fmt`` was not measured there or its range
            fails there (error ``inf``).
        """
        reason = "chosen by the user" if why is None else str(why)
        edited = self._edit(site, fmt, reason)
        if edited.spent > self.spent:
            edited._warn_over("Plan.replace", [site])
        return edited

    def _edit(self, site: str, fmt: Format, reason: str) -> Plan:
        """:meth:`replace` without the warning."""
        where = {s.site: i for i, s in enumerate(self.sites)}
        if site not in where:
            raise ValueError(
                f"`site` must be a site of the plan, got {site!r}; its sites are "
                f"{list(where)}."
            )
        if not isinstance(fmt, Format):
            raise TypeError(
                f"`fmt` must be a Format ({FORMATS}), got {type(fmt).__name__} {fmt!r}."
            )
        m = self.measures[where[site]]
        if fmt not in KINDS[m.kind]:
            raise ValueError(
                f"`fmt` must be a format a {m.kind} site runs in "
                f"({kind_formats(m.kind)}) at site {site!r}, got {fmt}."
            )
        if fmt not in m.errors:
            raise ValueError(
                f"`fmt` must be a format measured at site {site!r} (one of "
                f"{', '.join(str(f) for f in m.errors)}), got {fmt}: its error "
                "is unknown. Measure it first."
            )
        if not math.isfinite(m.errors[fmt]):
            note = f" ({m.notes[fmt]})" if fmt in m.notes else ""
            raise ValueError(
                f"`fmt` {fmt} fails at site {site!r}: its error is inf{note}. "
                "Choose a format whose range holds there."
            )
        i, choices = where[site], list(self.choices)
        choices[i] = (fmt, _user_why(m, fmt, self.cost, reason, self.budget_in))
        pinned = self.pinned | {site}
        return dataclasses.replace(self, choices=tuple(choices), pinned=pinned)

    # ------------------------------------------------------------------- text

    def __str__(self) -> str:
        state = "within" if self.within_budget else "OVER"
        lines = [
            f"precision plan: {len(self.sites)} sites on {self.device}, "
            f"measured in {_measured(self.dtype, self.loss_scale)}",
            f"  predicted {duration(self.seconds)}: "
            f"{self.seconds / self.half_seconds:.2f}x the 16-bit time "
            f"({duration(self.half_seconds)})",
            (
                f"  error {number(self.error)}, {state} the budget "
                f"{number(self.budget)}"
                if self.budget_in == "error"
                else f"  noise {number(self.spent)}, {state} the budget "
                f"{number(self.budget)} (fractions of the minibatch gradient noise)"
            ),
            "  formats for the shapes below: "
            + (
                "a traced step's"
                if self.traced
                else "the calibration batch's (a step of other shapes is "
                "re-solved at its own)"
            ),
            "",
        ]
        rows = [["site", "m x k x n", "format", "time", self.budget_in, "why"]]
        for s, m in zip(self.sites, self.measures, strict=True):
            runs = f" (x{m.runs})" if m.runs > 1 else ""
            rows.append(
                [
                    s.site,
                    " x ".join(map(str, s.shape)) + runs,
                    s.format.value,
                    duration(s.seconds),
                    number(self._spent_at(s)),
                    s.why,
                ]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            cells = [
                c.rjust(w) if i in (3, 4) else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append(("  " + "  ".join(cells)).rstrip())
        return "\n".join(lines)

    # ------------------------------------------------------------------- JSON

    def to_json(self) -> str:
        """The plan as JSON text (``inf`` written as the string ``"inf"``):
        :meth:`from_json` reads it back equal to this plan."""
        return json.dumps(plan_doc(self), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan :meth:`to_json` wrote.

        Args:
          text: JSON text.

        Returns:
          The :class:`Plan`, equal to the one saved.

        Raises:
          ValueError: if ``text`` is not JSON, is not a plan, has a version this
            jaxscale does not read, or lacks or adds a field.
        """
        return cls(*plan_fields(text))

    # ------------------------------------------------------------- selector

    def select(
        self, site: str, shape: tuple[int, int, int] | None = None
    ) -> Format | None:
        """The plan as a per-site selector: the format of ``site``, or ``None``
        if the plan does not name it ("no opinion").

        ``float8=jxs.float8.CurrentScaling(select=plan.select)`` puts the
        plan's float8 sites in float8 and its 16-bit sites in 16 bits. A float8
        recipe names a matmul by its name stack alone (``""`` at the top
        level), so ``site`` matches the plan's site of that name and its
        numbered repeats (``name#1``, ...); where they differ in format, those
        of the same ``shape`` decide. ``shape`` is otherwise not compared (as
        ``jxs.autocast(f, dtype, plan=plan)`` does not: a plan measured on a
        small batch serves a large one).

        Args:
          site: a name stack, or a site name of the plan.
          shape: the matmul's ``(m, k, n)``, or ``None``.

        Returns:
          The site's :class:`~jaxscale.precision.Format`, or ``None``.

        Raises:
          ValueError: if the plan's sites of that name (and shape) are in
            different formats: a name stack cannot tell them apart.

        Examples:
          >>> import jaxscale as jxs
          >>> import jaxscale.precision
          >>> F = jxs.precision.Format
          >>> m = jxs.precision.SiteMeasure(
          ...     "mlp", (16384, 4096, 28672), (2, 4), {F.HALF: 1e-4, F.FLOAT8: 2e-3})
          >>> plan = jxs.precision.Plan.from_formats(
          ...     {"mlp": F.FLOAT8}, [m], cost="H100")
          >>> plan.select("mlp", (16384, 4096, 28672)), plan.select("head")
          (<Format.FLOAT8: 'float8'>, None)
          >>> recipe = jxs.float8.CurrentScaling(select=plan.select)
        """
        return select_site(self.sites, site, shape)


def _measured(dtype: np.dtype | None, loss_scale: float | None) -> str:
    scale = "" if loss_scale is None else f" at loss scale {number(loss_scale)}"
    return ("an unknown dtype" if dtype is None else dtype.name) + scale


@dataclasses.dataclass(frozen=True)
class _AtShapes:
    """The ``(site, Format)`` pairs of ``plan`` :meth:`~Plan.at` the traced
    shapes (a plan's rule's ``resolve``); equal for equal plans, so equal
    plans give equal rules (JAX's compilation cache)."""

    plan: Plan

    def __call__(self, shapes: Mapping[str, tuple]) -> tuple:
        if set(shapes) != {m.site for m in self.plan.measures}:
            return tuple(self.plan.formats().items())  # PlanRule says which
        return tuple(self.plan.at(shapes).formats().items())


@functools.lru_cache(maxsize=64)
def _at(plan: Plan, shapes: tuple[tuple[int, int, int], ...]) -> Plan:
    """:meth:`Plan.at`, cached per plan and shapes."""
    measures = tuple(
        dataclasses.replace(m, shape=shape)
        for m, shape in zip(plan.measures, shapes, strict=True)
    )
    pinned = {s.site: s.format for s in plan.sites if s.site in plan.pinned}
    chosen = choose(
        measures,
        plan.cost,
        plan.budget,
        frozenset(plan.allowed),
        pinned,
        plan.budget_in,
    )
    if chosen is None:
        raise ValueError(
            f"`plan` at the traced shapes: no choice meets its budget "
            f"{number(plan.budget)} with the user's choices kept "
            f"({', '.join(sorted(plan.pinned))}). Edit fewer sites, or re-solve."
        )
    choices = []
    for m, (_, old), (fmt, why) in zip(measures, plan.choices, chosen, strict=True):
        if m.site in plan.pinned:  # "fmt: reason; 0.93x the 16-bit time, ..."
            reason = old.split(": ", 1)[-1].rsplit("; ")[0]
            why = _user_why(m, fmt, plan.cost, reason, plan.budget_in)
        choices.append((fmt, why))
    return dataclasses.replace(
        plan, measures=measures, choices=tuple(choices), traced=True
    )
