"""Budgets: :class:`NoiseBudget` (the default: a fraction of the minibatch
gradient noise), ``"16-bit"`` (the sum of the sites' 16-bit error scores) or
a number of error scores, and :func:`check_budget`, which reads any of them
into ``(limit, by)``: the largest sum of the sites' scores, and which scores
(``"error"`` or ``"noise"``, :func:`~jaxscale.precision._measure.scores`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jaxscale._speed import Format
from jaxscale.precision._measure import SiteMeasure, in_order

__all__ = ["BUDGETS", "NoiseBudget", "check_budget", "half_error"]

# The strings a budget may be: the noise budget's default, the 16-bit one's.
BUDGETS = ("noise", "16-bit", "bfloat16")


@dataclasses.dataclass(frozen=True)
class NoiseBudget:
    """A budget relative to the minibatch gradient noise (the default budget).

    A plan is within it when the gradient error its formats add, summed over
    the sites, is at most ``fraction`` of the noise of the calibration batch's
    gradient (``docs/precision.md``, "The noise budget"). Unbiased noise of a
    fraction ``eps`` of the minibatch noise multiplies the steps training needs
    by ``(1 + (1 + eps) b) / (1 + b)``, ``b = B_noise / B`` (McCandlish et al.
    2018): at most ``1 + eps``, and ``1 + eps / 2`` at the batch size where the
    noise and the gradient balance (``B = B_noise``). The default ``0.1``: at
    most 5% more steps there (:meth:`more_steps`). ``budget="noise"`` is
    ``NoiseBudget()``.

    Measure at the batch size you train with: the noise is the calibration
    batch's (it shrinks as the batch grows; a format's error mostly does not).

    Attributes:
      fraction: the gradient error allowed, as a fraction of the minibatch
        gradient noise (of squared norms): finite and > 0.

    Raises:
      TypeError: if ``fraction`` is not a number.
      ValueError: if ``fraction`` is not finite and > 0.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> budget = jxs.precision.NoiseBudget()
      >>> budget.fraction, round(budget.more_steps(), 3)
      (0.1, 1.05)
      >>> round(jxs.precision.NoiseBudget(0.02).more_steps(), 3)
      1.01

    References:
      McCandlish, Kaplan, Amodei and the OpenAI Dota Team, "An Empirical Model
      of Large-Batch Training", arXiv:1812.06162 (2018).
    """

    fraction: float = 0.1

    def __post_init__(self):
        value = self.fraction
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                "`fraction` must be a number (the gradient error allowed, as a "
                "fraction of the minibatch gradient noise, e.g. 0.1), got "
                f"{type(value).__name__} {value!r}."
            )
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                "`fraction` must be finite and > 0 (the gradient error allowed, as "
                f"a fraction of the minibatch gradient noise, e.g. 0.1), got {value!r}."
            )
        object.__setattr__(self, "fraction", float(value))

    def more_steps(self, noise_over_batch: float = 1.0) -> float:
        """The factor by which noise of :attr:`fraction` of the minibatch noise
        multiplies the steps, ``(1 + (1 + fraction) b) / (1 + b)``, at
        ``b = noise_over_batch``: the noise scale ``B_noise`` over the batch
        size (default 1: the two equal)."""
        b = float(noise_over_batch)
        return (1 + (1 + self.fraction) * b) / (1 + b)


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


def check_budget(budget: Any, measures: tuple[SiteMeasure, ...]) -> tuple[float, str]:
    """``(limit, by)`` of ``budget`` for ``measures``: the largest sum of the
    sites' scores, and which scores (``"error"`` or ``"noise"``)."""
    if budget == "noise":
        budget = NoiseBudget()
    if isinstance(budget, NoiseBudget):
        bare = [m.site for m in measures if m.noise is None]
        if bare:
            raise ValueError(
                f"`budget` {budget} needs each site's gradient-noise figures "
                f"(`SiteMeasure.noise`), but {len(bare)} of {len(measures)} sites "
                f"have none (first {bare[0]!r}): measured before jaxscale measured "
                "the noise (a plan saved as version 1 or 2), or built by hand "
                "without `noise`. Measure again with a `jxs.precision.Sensor`, or "
                "give `budget='16-bit'` or a number."
            )
        return budget.fraction, "noise"
    if isinstance(budget, str):
        if budget not in BUDGETS:
            raise ValueError(
                f"`budget` must be a NoiseBudget, a number or one of {list(BUDGETS)} "
                f"('noise': NoiseBudget(); '16-bit', 'bfloat16': the sum of the "
                f"16-bit errors), got {budget!r}."
            )
        return in_order(half_error(m, budget) for m in measures), "error"
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(
            f"`budget` must be a NoiseBudget, a number or one of {list(BUDGETS)}, "
            f"got {type(budget).__name__} {budget!r}."
        )
    if math.isnan(budget) or budget < 0:
        raise ValueError(
            f"`budget` must be a non-negative number (math.inf: no limit), got "
            f"{budget!r}."
        )
    return float(budget), "error"
