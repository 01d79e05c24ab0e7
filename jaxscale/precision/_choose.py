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
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jaxscale._cost import DeviceCost
from jaxscale._speed import Format
from jaxscale.precision._measure import (
    PRECISION,
    SiteMeasure,
    half_ratio,
    in_order,
    number,
    scores,
)

__all__ = [
    "by_range",
    "choose",
    "feasible_time",
    "frontier",
    "picoseconds",
    "range_why",
    "solver_why",
]

_MARGIN = 1e-9  # the bounds' relative margin for float rounding


def choose(
    measures: Sequence[SiteMeasure],
    cost: DeviceCost,
    budget: float,
    allowed: frozenset[Format],
    pinned: Mapping[str, Format] | None = None,
    by: str = "error",
) -> list[tuple[Format, str]] | None:
    """The exact optimum as ``(format, why)`` per site, or ``None`` if no
    choice meets ``budget``, a limit on the sum of the sites' scores ``by``
    (``"error"`` or ``"noise"``: :func:`~jaxscale.precision._measure.scores`).
    A site takes the formats both ``allowed`` and measured with a finite score
    (each site must have one); a site in ``pinned`` takes only its pinned
    format (its ``why`` is then ``""``: the caller keeps its own)."""
    pinned = pinned or {}
    ruled = {m.site: by_range(m, allowed) for m in measures if m.kind == "batched"}
    usable, candidates = [], []
    for m in measures:
        if m.site in pinned:
            usable.append([pinned[m.site]])
        elif ruled.get(m.site) is not None:
            usable.append([ruled[m.site]])
        else:
            usable.append([f for f in PRECISION if f in allowed and f in m.errors])
        candidates.append([f for f in usable[-1] if math.isfinite(scores(m, by)[f])])
    times, errors = [], []
    for m, fs in zip(measures, candidates, strict=True):
        times.append(np.array([picoseconds(m.seconds(f, cost)) for f in fs], np.int64))
        errors.append(np.array([scores(m, by)[f] for f in fs], np.float64))
    if sum(int(t.max()) for t in times) >= 2**62:
        raise ValueError(
            "`measures`: the sites' predicted times add up to more than "
            f"{2**62 / 1e12:.3g} s; check their shapes."
        )
    choice = frontier(times, errors, budget)
    if choice is None:
        return None
    out = []
    for m, fs, ts, us, j in zip(
        measures, candidates, times, usable, choice, strict=True
    ):
        if m.site in pinned:
            out.append((fs[j], ""))
            continue
        if ruled.get(m.site) is not None:
            out.append((fs[j], range_why(m, fs[j], cost, by)))
            continue
        faster = [f for f in us if picoseconds(m.seconds(f, cost)) < ts[j]]
        slower = [f for f in fs if f not in faster and f is not fs[j]]
        out.append((fs[j], solver_why(m, fs[j], cost, faster, slower, by)))
    return out


def by_range(m: SiteMeasure, allowed: frozenset[Format]) -> Format | None:
    """A batched site's format by the widening rule made per site: 16 bits
    where the sensor found its range holds (a finite 16-bit error: its
    largest output within the 16-bit dtype's, with headroom), else 16 bits
    with a float32 result, else float32 (the first allowed and measured with a
    finite error; ``None``: none is)."""
    for f in (Format.HALF, Format.HALF_WIDE, Format.FLOAT32):
        if f in allowed and math.isfinite(m.errors.get(f, math.inf)):
            return f
    return None


def range_why(m: SiteMeasure, fmt: Format, cost: DeviceCost, by: str) -> str:
    """Why a batched site runs in ``fmt``: the range rule, with the largest
    magnitude measured and the limit (the sensor's 16-bit note)."""
    why = f"{fmt.value}: the range rule, {half_ratio(m, fmt, cost):.2f}x the "
    why += f"16-bit time, {by} {number(scores(m, by)[fmt])}"
    note = m.notes.get(Format.HALF)
    return f"{why}; {note}" if note else why


def _describe(m: SiteMeasure, fmt: Format, cost: DeviceCost, by: str) -> str:
    """``float8 (0.71x, error 2.1e-3)``, with the sensor's note if it has one."""
    ratio = half_ratio(m, fmt, cost)
    note = f", {m.notes[fmt]}" if fmt in m.notes else ""
    return f"{fmt.value} ({ratio:.2f}x, {by} {number(scores(m, by)[fmt])}{note})"


def _failing(m: SiteMeasure, fmt: Format, cost: DeviceCost) -> str:
    """``float8 (0.85x, amax beyond e4m3)``: a format whose range fails, with
    the sensor's first reason."""
    ratio = half_ratio(m, fmt, cost)
    note = f", {m.notes[fmt].split('; ')[0]}" if fmt in m.notes else ""
    return f"{fmt.value} ({ratio:.2f}x{note})"


def solver_why(
    m: SiteMeasure,
    fmt: Format,
    cost: DeviceCost,
    faster: list[Format],
    slower: list[Format] = (),
    by: str = "error",
) -> str:
    """Why the solver chose ``fmt`` at site ``m``, each other format's reason
    in turn: ``faster`` lists the allowed, measured formats that were faster
    there (to the picosecond). Alone, each finite one would have taken the plan
    over the budget (rejected for its ``by`` score): with it the plan would be
    faster, so the solver would have taken it. Formats whose range fails at the
    site are named, faster or not (rejected for range); ``slower``, the
    allowed formats with a finite score that are no faster (rejected for
    time)."""
    values = scores(m, by)
    why = f"{fmt.value}: {half_ratio(m, fmt, cost):.2f}x the 16-bit time, {by} "
    why += f"{number(values[fmt])} within the budget"
    over = [_describe(m, f, cost, by) for f in faster if math.isfinite(values[f])]
    # Every format whose range fails here, faster or not: why it was not taken
    # (the sensor's first reason; the rest is in the measure's notes).
    fails = [_failing(m, f, cost) for f, e in values.items() if math.isinf(e)]
    if over:
        why += f"; {' or '.join(over)} here would take the plan over it"
    if fails:
        why += f"; {' and '.join(fails)} fail{'s' if len(fails) == 1 else ''} here"
    if slower:
        by_time = sorted(slower, key=lambda f: m.seconds(f, cost))
        named = [f"{f.value} ({half_ratio(m, f, cost):.2f}x)" for f in by_time]
        why += f"; {' and '.join(named)} no faster"
    return why


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


def picoseconds(seconds: float) -> int:
    """The solver's unit of time: whole picoseconds, so that sums are exact."""
    return round(seconds * 1e12)
