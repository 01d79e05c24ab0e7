"""The exact solver: the fastest plan within an error budget.

Choose one format per site to minimise the predicted time ``sum_i t_i(f_i)``
subject to ``sum_i e_i(f_i) <= budget``: a multiple-choice knapsack. The solver
is a dynamic programme over partial plans, site by site, that keeps only the
*Pareto frontier*: a partial plan is dropped when another of the same sites is
no slower, no less accurate, and first in the tie order. Every completion of
the dropped one is then matched by the same completion of the other, as fast,
as accurate and as early in the order, so the optimum survives every step:
the answer is exact, not greedy.

Exact in what arithmetic:

- **Time** is counted in whole picoseconds (Python and NumPy integers), so sums
  are exact and a tie in time is a real tie (a difference under a picosecond is
  no difference).
- **Error** is added in site order in float64, as :attr:`Plan.error` adds it:
  rounding is monotone, so a partial plan with the smaller sum keeps the smaller
  (or an equal) sum after any completion, and a plan is feasible exactly when
  that sum is within the budget.
- **Ties** in time go to the smaller total error, then to the more precise
  format (``PRECISION``) at the first site where two plans differ. The frontier
  is kept sorted by (time, that site-by-site order), and each point must be more
  accurate than every point before it: both orders are unchanged by a common
  completion.

Two bounds keep the frontier small (:func:`frontier`): a partial plan is dropped
when its error plus the least error the remaining sites can add exceeds the
budget, or when its time plus the least time of the remaining sites' linear
relaxation, within the error left, exceeds a limit; the limit grows from the
relaxation's optimum until the best plan found lies within it. Both bounds
allow a relative margin of ``1e-9`` for float rounding. On a model's few
hundred sites in five formats the solve takes a fraction of a second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from jaxscale._cost import DeviceCost, device_cost
from jaxscale._speed import Format
from jaxscale.precision._measure import (
    PRECISION,
    SiteMeasure,
    half_ratio,
    in_order,
    number,
)
from jaxscale.precision._plan import Plan, site_plan

__all__ = ["feasible_time", "frontier", "half_error", "picoseconds", "solve"]

_BUDGETS = ("16-bit", "bfloat16")  # the sum of the 16-bit errors
_MARGIN = 1e-9  # the bounds' relative margin for float rounding


def _describe(m: SiteMeasure, fmt: Format, cost: DeviceCost) -> str:
    """``float8 (0.71x, error 2.1e-3)``, with the sensor's note if it has one."""
    ratio = half_ratio(m, fmt, cost)
    note = f", {m.notes[fmt]}" if fmt in m.notes else ""
    return f"{fmt.value} ({ratio:.2f}x, error {number(m.errors[fmt])}{note})"


def _failing(m: SiteMeasure, fmt: Format, cost: DeviceCost) -> str:
    """``float8 (0.85x, amax beyond e4m3)``: a format whose range fails, with
    the sensor's first reason."""
    ratio = half_ratio(m, fmt, cost)
    note = f", {m.notes[fmt].split('; ')[0]}" if fmt in m.notes else ""
    return f"{fmt.value} ({ratio:.2f}x{note})"


def solver_why(
    m: SiteMeasure, fmt: Format, cost: DeviceCost, faster: list[Format]
) -> str:
    """Why the solver chose ``fmt`` at site ``m``; ``faster`` lists the allowed,
    measured formats that were faster there (to the picosecond). Alone, each
    finite one would have taken the plan over the budget: with it the plan
    would be faster, so the solver would have taken it. Formats whose range
    fails at the site are named, faster or not."""
    why = f"{fmt.value}: {half_ratio(m, fmt, cost):.2f}x the 16-bit time, error "
    why += f"{number(m.errors[fmt])} within the budget"
    over = [_describe(m, f, cost) for f in faster if math.isfinite(m.errors[f])]
    # Every format whose range fails here, faster or not: why it was not taken
    # (the sensor's first reason; the rest is in the measure's notes).
    fails = [_failing(m, f, cost) for f, e in m.errors.items() if math.isinf(e)]
    if over:
        why += f"; {' or '.join(over)} here would take the plan over it"
    if fails:
        why += f"; {' and '.join(fails)} fail{'s' if len(fails) == 1 else ''} here"
    return why


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


def half_error(m: SiteMeasure, budget: str = "16-bit") -> float:
    """What site ``m`` adds to the budget ``"16-bit"``: its 16-bit error; where
    16 bits fails (``inf``: float16 overflows there), the error of the nearest
    more precise format measured (16-bit with a float32 result, then float32),
    since the 16-bit model would have to run that site so."""
    if Format.HALF not in m.errors:
        raise ValueError(
            f"`budget={budget!r}` is the sum of the sites' 16-bit errors, but site "
            f"{m.site!r} has no 16-bit error. Measure it in 16 bits, or give the "
            "budget as a number."
        )
    for fmt in (Format.HALF, Format.HALF_WIDE, Format.FLOAT32):
        if fmt in m.errors and not math.isinf(m.errors[fmt]):
            return m.errors[fmt]
    raise ValueError(
        f"`budget={budget!r}` is the sum of the sites' 16-bit errors, but site "
        f"{m.site!r} fails in 16 bits (error inf) and in every more precise format "
        "measured. Give the budget as a number."
    )


def _check_budget(budget: Any, measures: tuple[SiteMeasure, ...]) -> float:
    if isinstance(budget, str):
        if budget not in _BUDGETS:
            raise ValueError(
                f"`budget` must be a number or one of {list(_BUDGETS)} (the sum of "
                f"the 16-bit errors), got {budget!r}."
            )
        return in_order(half_error(m, budget) for m in measures)
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(
            f"`budget` must be a number or one of {list(_BUDGETS)}, got "
            f"{type(budget).__name__} {budget!r}."
        )
    if math.isnan(budget) or budget < 0:
        raise ValueError(
            f"`budget` must be a non-negative number (math.inf: no limit), got "
            f"{budget!r}."
        )
    return float(budget)


def _hull(t: np.ndarray, e: np.ndarray) -> list[int]:
    """Site candidates on the lower convex hull of (error, time), from the least
    error to the least time: the moves of the linear relaxation."""
    pareto: list[int] = []
    for j in np.lexsort((t, e)):  # error up; time strictly down
        if not pareto or t[j] < t[pareto[-1]]:
            pareto.append(int(j))
    hull: list[int] = []
    for j in pareto:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]  # drop b if it lies on or above a-j
            if (t[b] - t[a]) * (e[j] - e[a]) >= (t[j] - t[a]) * (e[b] - e[a]):
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


class _Rest(NamedTuple):
    """The linear relaxation of the sites after some site: with every site at
    its fastest candidate, their time ``fast`` and error ``excess``; then the
    moves along the sites' hulls, cheapest time per unit of error saved first,
    as the cumulative error they save (``saved``) and time they add
    (``spent``), both from 0; ``least``: the least error the sites can add."""

    fast: float
    excess: float
    saved: np.ndarray
    spent: np.ndarray
    least: float

    def time(self, room: np.ndarray) -> np.ndarray:
        """The relaxation's least time with an error of at most ``room``: a
        lower bound on the time of every choice within it."""
        return self.fast + np.interp(self.excess - room, self.saved, self.spent)


def _relaxations(times: list[np.ndarray], errors: list[np.ndarray]) -> list[_Rest]:
    """``_Rest`` of the sites after ``i``, for ``i`` from ``-1`` to ``n - 1``."""
    rests = [_Rest(0.0, 0.0, np.zeros(1), np.zeros(1), 0.0)]
    slopes, saved, spent = np.zeros(0), np.zeros(0), np.zeros(0)
    for t, e in zip(reversed(times), reversed(errors), strict=True):
        h = _hull(t, e)
        de = np.array([e[h[k]] - e[h[k - 1]] for k in range(1, len(h))])
        dt = np.array([float(t[h[k - 1]] - t[h[k]]) for k in range(1, len(h))])
        slopes = np.concatenate([slopes, dt / de])
        by = np.argsort(slopes, kind="stable")
        slopes = slopes[by]
        saved, spent = np.concatenate([saved, de])[by], np.concatenate([spent, dt])[by]
        last = rests[-1]
        rests.append(
            _Rest(
                last.fast + float(t[h[-1]]),
                last.excess + float(e[h[-1]]),
                np.concatenate([[0.0], np.cumsum(saved)]),
                np.concatenate([[0.0], np.cumsum(spent)]),
                float(e.min()) + last.least,
            )
        )
    return rests[::-1]


def feasible_time(
    times: list[np.ndarray], errors: list[np.ndarray], budget: float
) -> int:
    """The time of a plan within ``budget`` (a start for the exact search): the
    greedy of the linear relaxation (every site at its fastest candidate, then
    the moves along the sites' hulls that cost the least time per unit of error
    saved, until the budget holds), improved by single faster swaps that keep
    it. The least-error plan must be within ``budget``."""
    hulls = [_hull(t, e) for t, e in zip(times, errors, strict=True)]
    pick = [h[-1] for h in hulls]
    moves = sorted(  # (price, site, order along its hull, the move's target)
        (float(t[h[k - 1]] - t[h[k]]) / float(e[h[k]] - e[h[k - 1]]), i, -k, h[k - 1])
        for i, (t, e, h) in enumerate(zip(times, errors, hulls, strict=True))
        for k in range(len(h) - 1, 0, -1)
    )
    total = estimate = in_order(e[j] for e, j in zip(errors, pick, strict=True))
    for _, i, _, j in moves:  # down to the least-error plan, within the budget
        if total <= budget:
            break
        estimate += errors[i][j] - errors[i][pick[i]]
        pick[i] = j
        if estimate <= budget * (1 + _MARGIN):
            total = in_order(e[p] for e, p in zip(errors, pick, strict=True))
    total = in_order(e[j] for e, j in zip(errors, pick, strict=True))
    swaps = sorted(
        (int(t[j] - t[pick[i]]), i, j)
        for i, t in enumerate(times)
        for j in range(len(t))
        if t[j] < t[pick[i]]
    )
    for _, i, j in swaps:  # the largest saving first
        if times[i][j] >= times[i][pick[i]]:
            continue  # an earlier swap at this site saved more
        if total - errors[i][pick[i]] + errors[i][j] <= budget * (1 + _MARGIN):
            trial = [*pick[:i], j, *pick[i + 1 :]]
            exact = in_order(e[p] for e, p in zip(errors, trial, strict=True))
            if exact <= budget:
                pick, total = trial, exact
    return sum(int(t[j]) for t, j in zip(times, pick, strict=True))


def frontier(
    times: list[np.ndarray], errors: list[np.ndarray], budget: float
) -> list[int] | None:
    """The exact optimum: per site the index of its chosen candidate.

    ``times[i]`` (int64 picoseconds) and ``errors[i]`` (float64, finite) are
    site ``i``'s candidates, from the most to the least precise; the optimum
    minimises (total time, total error, site-by-site precision) subject to the
    total error, added in site order, being at most ``budget``. ``None`` if no
    choice meets the budget.

    Two bounds drop partial plans that cannot be optimal: their error plus the
    least error the sites after them can add exceeds the budget; or their time
    plus the least time of the linear relaxation of the rest within the error
    left (:class:`_Rest`) exceeds a time ``limit``. Both hold for every
    completion within the budget, with a relative margin of ``1e-9`` for the
    rounding of float sums, so a plan of time at most ``limit`` survives them.
    ``limit`` starts a little above the relaxation's time and doubles its
    distance from it until the best plan found is within it (then no plan is
    faster); it is at most the time of a known plan within the budget
    (:func:`feasible_time`), where the search is exact.
    """
    if in_order(float(e.min()) for e in errors) > budget:
        return None
    rests = _relaxations(times, errors)
    feasible = feasible_time(times, errors, budget)
    hi = budget * (1 + _MARGIN)
    lower = float(rests[0].time(np.array([hi]))[0])
    margin = _MARGIN * feasible + 1
    gap = max((feasible - lower) / 1024, 1.0)
    while True:
        # Once ``limit`` reaches ``feasible`` the known plan survives the
        # bounds, so a plan is found within it and returned: the loop ends.
        limit = min(lower + gap, feasible) + margin
        found = _search(times, errors, budget, rests, limit)
        if found is not None and found[0] <= limit - margin:
            return found[1]  # and no plan is faster: it would have survived
        if found is not None:  # a plan within the budget: a better start
            feasible = min(feasible, found[0])
        gap *= 2


def _search(
    times: list[np.ndarray],
    errors: list[np.ndarray],
    budget: float,
    rests: list[_Rest],
    limit: float,
) -> tuple[int, list[int]] | None:
    """The best plan among those that survive :func:`frontier`'s bounds, with
    its time; ``None`` if none does."""
    hi = budget * (1 + _MARGIN)
    t_front = np.zeros(1, np.int64)
    e_front = np.zeros(1, np.float64)
    order_front = np.zeros(1, np.int64)  # rank in site-by-site precision order
    back = []
    for i, (t, e) in enumerate(zip(times, errors, strict=True)):
        c, rest = len(t), rests[i + 1]
        nt = (t_front[:, None] + t[None, :]).ravel()
        ne = (e_front[:, None] + e[None, :]).ravel()
        no = (order_front[:, None] * c + np.arange(c)[None, :]).ravel()
        room = hi - ne + _MARGIN * (rest.excess + hi)
        live = (
            (ne <= budget) & (ne + rest.least <= hi) & (nt + rest.time(room) <= limit)
        )
        live = np.flatnonzero(live)
        if not live.size:
            return None
        nt, ne, no = nt[live], ne[live], no[live]
        by = np.lexsort((no, nt))  # time, then precision order
        es = ne[by]
        keep = np.ones(len(es), bool)
        keep[1:] = es[1:] < np.minimum.accumulate(es)[:-1]
        kept = by[keep]
        t_front, e_front = nt[kept], ne[kept]
        order_front = np.empty(len(kept), np.int64)
        order_front[np.argsort(no[kept])] = np.arange(len(kept))
        back.append((live[kept], c))
    best = int(np.lexsort((order_front, e_front, t_front))[0])
    found = int(t_front[best])
    choice = []
    for flat, c in reversed(back):
        parent, j = divmod(int(flat[best]), c)
        choice.append(j)
        best = parent
    return found, choice[::-1]


def solve(
    measures: Iterable[SiteMeasure],
    *,
    cost: DeviceCost | str,
    budget: float | str,
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
      budget: the largest total error score; or ``"16-bit"`` (alias
        ``"bfloat16"``): the sum of the sites' 16-bit errors, no worse than the
        whole model in 16 bits.
      allowed: the formats a site may take (a set of ``Format``); ``None``:
        every format. A site takes only formats both allowed and measured.

    Returns:
      The :class:`~jaxscale.precision.Plan`.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if a site has no allowed, measured format with a finite
        error (the message names it); if two sites share a name; if no plan
        meets the budget (the message gives the smallest total error reachable).

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
      >>> print(plan.sites[1].why)
      float8: 0.82x the 16-bit time, error 1.0e-4 within the budget
    """
    measures = _check_measures(measures)
    cost, device = _check_cost(cost)
    allowed = _check_allowed(allowed)
    limit = _check_budget(budget, measures)
    usable, candidates = [], []
    for m in measures:
        usable.append([f for f in PRECISION if f in allowed and f in m.errors])
        candidates.append([f for f in usable[-1] if math.isfinite(m.errors[f])])
        if not candidates[-1]:
            _no_format(m, usable[-1], allowed)
    times, errors = [], []
    for m, fs in zip(measures, candidates, strict=True):
        times.append(np.array([picoseconds(m.seconds(f, cost)) for f in fs], np.int64))
        errors.append(np.array([m.errors[f] for f in fs], np.float64))
    if sum(int(t.max()) for t in times) >= 2**62:
        raise ValueError(
            "`measures`: the sites' predicted times add up to more than "
            f"{2**62 / 1e12:.3g} s; check their shapes."
        )
    choice = frontier(times, errors, limit)
    if choice is None:
        least = in_order(float(e.min()) for e in errors)
        raise ValueError(
            f"no plan meets `budget` {number(limit)}: the smallest total error the "
            f"allowed formats reach is {number(least)} (each site in its most "
            "accurate measured format). Raise `budget`, allow more precise formats "
            f"(`allowed`: {', '.join(f.value for f in PRECISION if f in allowed)}), "
            "or measure float32 where it is missing."
        )
    sites = []
    for m, fs, ts, us, j in zip(
        measures, candidates, times, usable, choice, strict=True
    ):
        faster = [f for f in us if picoseconds(m.seconds(f, cost)) < ts[j]]
        sites.append(site_plan(m, fs[j], cost, solver_why(m, fs[j], cost, faster)))
    return Plan(tuple(sites), measures, limit, device, cost)


def picoseconds(seconds: float) -> int:
    """The solver's unit of time: whole picoseconds, so that sums are exact."""
    return round(seconds * 1e12)


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
