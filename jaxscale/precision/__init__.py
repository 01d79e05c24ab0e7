"""Adaptive precision: each matmul site in the cheapest format that keeps the
model where float32 is.

A :class:`Sensor` measures, per site and per format, an error score on
calibration batches (:class:`SiteMeasure`); the speed model predicts per site
and per format the time (``jaxscale/_speed.py``); :func:`solve` chooses,
exactly, the fastest :class:`Plan` whose total error is within a budget (by
default a tenth of the minibatch gradient noise, :class:`NoiseBudget`);
:func:`plan_precision` (also ``jxs.plan_precision``) does all three, and
``jxs.autocast(f, dtype, plan=plan)`` runs it. A plan is a readable, editable
value: ``print(plan)``, :meth:`Plan.replace`, :meth:`Plan.to_json`.
``docs/precision.md`` is the guide.

Examples:
    >>> import jaxscale as jxs
    >>> import jaxscale.precision
    >>> F = jxs.precision.Format
    >>> m = jxs.precision.SiteMeasure(
    ...     "mlp", (16384, 4096, 28672), (2, 4), {F.HALF: 1e-4, F.FLOAT8: 1e-4})
    >>> jxs.precision.solve([m], cost="H100", budget="16-bit").formats()
    {'mlp': <Format.FLOAT8: 'float8'>}
"""

from jaxscale._cost import DeviceCost as DeviceCost
from jaxscale._speed import Format as Format
from jaxscale.precision._budget import NoiseBudget as NoiseBudget
from jaxscale.precision._measure import SiteMeasure as SiteMeasure
from jaxscale.precision._monitor import Monitor as Monitor
from jaxscale.precision._monitor import MonitorState as MonitorState
from jaxscale.precision._plan import Plan as Plan
from jaxscale.precision._plan import PlanBudgetWarning as PlanBudgetWarning
from jaxscale.precision._plan import SitePlan as SitePlan
from jaxscale.precision._sensor import Sensor as Sensor
from jaxscale.precision._sensor import plan_precision as plan_precision
from jaxscale.precision._solve import solve as solve

__all__ = [
    "DeviceCost",
    "Format",
    "Monitor",
    "MonitorState",
    "NoiseBudget",
    "Plan",
    "PlanBudgetWarning",
    "Sensor",
    "SiteMeasure",
    "SitePlan",
    "plan_precision",
    "solve",
]
