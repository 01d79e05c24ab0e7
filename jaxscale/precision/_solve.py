"""The solver: :func:`solve` checks its arguments, chooses the fastest plan
within the budget exactly (:mod:`jaxscale.precision._choose`, which says why it
is exact) and returns it as a :class:`~jaxscale.precision.Plan`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from jaxscale._cost import DeviceCost, device_cost
from jaxscale._speed import Format
from jaxscale.precision._budget import NoiseBudget, check_budget, half_error
from jaxscale.precision._choose import (
    choose,
    feasible_time,
    frontier,
    picoseconds,
)
from jaxscale.precision._measure import (
    PRECISION,
    SiteMeasure,
    in_order,
    number,
    scores,
)
from jaxscale.precision._plan import Plan

__all__ = ["feasible_time", "frontier", "half_error", "picoseconds", "solve"]


def _check_measures(measures: Any) -> tuple[SiteMeasure, ...]:
    if isinstance(measures, str | bytes | Mapping) or not isinstance(
        measures, Iterable
    ):
        raise TypeError(
            "`measures` must be a sequence of SiteMeasure, got "
            f"{type(measures).__name__}."
        )
    measures = tuple(measures)
    if not measures:
        raise ValueError("`measures` must hold at least one SiteMeasure, got none.")
    seen: set[str] = set()
    for i, m in enumerate(measures):
        if not isinstance(m, SiteMeasure):
            raise TypeError(
                f"`measures[{i}]` must be a SiteMeasure, got {type(m).__name__} {m!r}."
            )
        if m.site in seen:
            raise ValueError(
                f"`measures` names the site {m.site!r} twice: each site needs a "
                "name of its own (its name-stack path; number repeated ones, "
                f"e.g. '{m.site}#1')."
            )
        seen.add(m.site)
    return measures


def _check_cost(cost: Any) -> tuple[DeviceCost, str]:
    if isinstance(cost, DeviceCost):
        return cost, cost.name
    if isinstance(cost, str):
        return device_cost(cost)
    raise TypeError(
        "`cost` must be a DeviceCost or a device kind such as 'H100' or "
        f"jax.devices()[0].device_kind, got {type(cost).__name__} {cost!r}."
    )


def _check_allowed(allowed: Any) -> frozenset[Format]:
    if allowed is None:
        return frozenset(PRECISION)
    names = ", ".join(f"Format.{f.name}" for f in PRECISION)
    if isinstance(allowed, Format | str) or not isinstance(allowed, Iterable):
        raise TypeError(
            f"`allowed` must be None (every format) or a set of Formats ({names}), "
            f"got {type(allowed).__name__} {allowed!r}."
        )
    allowed = frozenset(allowed)
    bad = [f for f in allowed if not isinstance(f, Format)]
    if bad:
        raise TypeError(
            f"`allowed` must be a set of Formats ({names}), got {bad[0]!r}."
        )
    if not allowed:
        raise ValueError(f"`allowed` must hold at least one format ({names}).")
    return allowed


def solve(
    measures: Iterable[SiteMeasure],
    *,
    cost: DeviceCost | str,
    budget: NoiseBudget | float | str = "noise",
    allowed: Iterable[Format] | None = None,
) -> Plan:
    """The fastest plan whose total error is within ``budget``: exactly.

    Chooses one format per site to minimise the speed model's predicted time
    (:mod:`jaxscale._speed`: each site's three products and the passes its
    format adds) subject to the sum of the chosen formats' error scores being at
    most ``budget``. The optimum is exact: a dynamic programme over the Pareto
    frontier of (time, error) of partial plans, site by site, dropping only
    partial plans another one matches in every completion (``_solve.py`` says
    why this is exact). Times are compared to the picosecond. Ties in time go to
    the smaller total error, then to the more precise format (float32, 16-bit
    with a float32 result, 16-bit, float8 rowwise, float8) at the first site
    where two plans differ. A format whose error is ``inf`` is never chosen.

    Args:
      measures: one :class:`~jaxscale.precision.SiteMeasure` per site, each
        named differently.
      cost: the device kind's figures: a ``DeviceCost``, or a device kind
        (``"H100"``, ``"NVIDIA H200"``, ``jax.devices()[0].device_kind``; a
        kind without figures, the CPU included, takes the H100 SXM's, and the
        plan's ``device`` says so).
      budget: ``"noise"`` (default), ``NoiseBudget()``: the sites' gradient
        errors add up to at most a tenth of the minibatch gradient noise
        (:class:`~jaxscale.precision.NoiseBudget`; another fraction:
        ``NoiseBudget(0.05)``); it needs the measures' ``noise`` figures (a
        :class:`~jaxscale.precision.Sensor`'s). ``"16-bit"`` (alias
        ``"bfloat16"``): the sum of the sites' 16-bit error scores, no worse
        than the whole model in 16 bits. A number: the largest total error
        score.
      allowed: the formats a site may take (a set of ``Format``); ``None``:
        every format. A site takes only formats both allowed and measured.

    Returns:
      The :class:`~jaxscale.precision.Plan`.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if a site has no allowed, measured format with a finite
        error (the message names it); if two sites share a name; if no plan
        meets the budget (the message gives the smallest total error
        reachable); if the budget is a noise budget and a site has no noise
        figures.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> F = jxs.precision.Format
      >>> measures = [
      ...     jxs.precision.SiteMeasure(
      ...         "GPT/block_0/qkv", (16384, 4096, 6144), (2, 4),
      ...         {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 3e-3}),
      ...     jxs.precision.SiteMeasure(
      ...         "GPT/block_0/mlp_up", (16384, 4096, 28672), (2, 4),
      ...         {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 1e-4}),
      ... ]
      >>> plan = jxs.precision.solve(measures, cost="H100", budget="16-bit")
      >>> [f.value for f in plan.formats().values()]
      ['16-bit', 'float8']
      >>> print(plan.sites[1].why)  # doctest: +NORMALIZE_WHITESPACE
      float8: 0.82x the 16-bit time, error 1.0e-4 within the budget; 16-bit
      (1.00x) and float32 (1.93x) no faster

      With noise figures (a sensor's), the default budget is the noise's:

      >>> noisy = [jxs.precision.SiteMeasure(
      ...     "mlp", (16384, 4096, 28672), (2, 4),
      ...     {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 3e-3},
      ...     noise={F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 0.02})]
      >>> plan = jxs.precision.solve(noisy, cost="H100")
      >>> plan.formats()["mlp"].value, plan.budget, plan.budget_in
      ('float8', 0.1, 'noise')
    """
    measures = _check_measures(measures)
    cost, device = _check_cost(cost)
    allowed = _check_allowed(allowed)
    limit, by = check_budget(budget, measures)
    for m in measures:
        usable = [f for f in PRECISION if f in allowed and f in m.errors]
        if not any(math.isfinite(m.errors[f]) for f in usable):
            _no_format(m, usable, allowed)
    chosen = choose(measures, cost, limit, allowed, by=by)
    if chosen is None:
        least = in_order(
            min(
                e for f, e in scores(m, by).items() if f in allowed and math.isfinite(e)
            )
            for m in measures
        )
        raise ValueError(
            f"no plan meets `budget` {number(limit)}: the smallest total {by} the "
            f"allowed formats reach is {number(least)} (each site in its most "
            "accurate measured format). Raise `budget`, allow more precise formats "
            f"(`allowed`: {', '.join(f.value for f in PRECISION if f in allowed)}), "
            "or measure float32 where it is missing."
        )
    allow = tuple(f for f in PRECISION if f in allowed)
    return Plan(
        measures, tuple(chosen), limit, device, cost, allowed=allow, budget_in=by
    )


def _no_format(m: SiteMeasure, usable: list[Format], allowed: frozenset[Format]):
    measured = ", ".join(f.value for f in m.errors)
    if not usable:
        raise ValueError(
            f"site {m.site!r} has no error measured in an allowed format: "
            f"measured {measured}; `allowed` is "
            f"{', '.join(f.value for f in PRECISION if f in allowed)}. Allow one "
            "of the measured formats, or measure the site in an allowed one."
        )
    fails = "; ".join(
        f.value + (f" ({m.notes[f]})" if f in m.notes else "") for f in usable
    )
    raise ValueError(
        f"site {m.site!r} fails in every allowed format (error inf): {fails}. "
        "Allow a format whose range holds there (float32, or 16 bits with a "
        "float32 result), or measure it in one."
    )
