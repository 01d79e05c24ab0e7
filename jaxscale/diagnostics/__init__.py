"""Diagnostics: what the loss scale did, which leaves overflowed, what underflows.

Everything here reads device arrays and adds no host synchronisation to a train
step, except :func:`monitor`, which calls back to the host only on the steps its
hooks ask for. Import it as ``jxs.diagnostics`` (``import jaxscale`` imports it):

    import jaxscale as jxs

    jxs.diagnostics.summary(opt_state)

The diagnostics of 0.2.0 were also top-level names (``jxs.summary``,
``jxs.autocast_report``); those aliases still work for one release and warn with a
:class:`DeprecationWarning`. Names added since live here only.

Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jaxscale as jxs
    >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> float(jxs.diagnostics.summary(state)["loss_scale"])
    65536.0
"""

from jaxscale.diagnostics._autocast_report import AutocastReport as AutocastReport
from jaxscale.diagnostics._autocast_report import AutocastSite as AutocastSite
from jaxscale.diagnostics._autocast_report import autocast_report as autocast_report
from jaxscale.diagnostics._collectives import Collective as Collective
from jaxscale.diagnostics._collectives import CollectiveReport as CollectiveReport
from jaxscale.diagnostics._collectives import (
    collective_report as collective_report,
)
from jaxscale.diagnostics._compression import CompressionRow as CompressionRow
from jaxscale.diagnostics._compression import CompressionTable as CompressionTable
from jaxscale.diagnostics._compression import (
    compression_table as compression_table,
)
from jaxscale.diagnostics._cotangents import CotangentStats as CotangentStats
from jaxscale.diagnostics._cotangents import cotangent_probe as cotangent_probe
from jaxscale.diagnostics._cotangents import cotangent_report as cotangent_report
from jaxscale.diagnostics._cotangents import cotangent_table as cotangent_table
from jaxscale.diagnostics._monitor import MonitorState as MonitorState
from jaxscale.diagnostics._monitor import NoOverflowWarning as NoOverflowWarning
from jaxscale.diagnostics._monitor import OverflowEvent as OverflowEvent
from jaxscale.diagnostics._monitor import ScaleAtFloorWarning as ScaleAtFloorWarning
from jaxscale.diagnostics._monitor import monitor as monitor
from jaxscale.diagnostics._summary import UnderflowReport as UnderflowReport
from jaxscale.diagnostics._summary import layer_norms as layer_norms
from jaxscale.diagnostics._summary import nonfinite_paths as nonfinite_paths
from jaxscale.diagnostics._summary import summary as summary
from jaxscale.diagnostics._summary import underflow_report as underflow_report
from jaxscale.diagnostics._wire_cost import Bandwidth as Bandwidth
from jaxscale.diagnostics._wire_cost import CollectiveTime as CollectiveTime
from jaxscale.diagnostics._wire_cost import WireTime as WireTime
from jaxscale.diagnostics._wire_cost import wire_time as wire_time

__all__ = [
    "AutocastReport",
    "AutocastSite",
    "Bandwidth",
    "Collective",
    "CollectiveReport",
    "CollectiveTime",
    "CompressionRow",
    "CompressionTable",
    "CotangentStats",
    "MonitorState",
    "NoOverflowWarning",
    "OverflowEvent",
    "ScaleAtFloorWarning",
    "UnderflowReport",
    "WireTime",
    "autocast_report",
    "collective_report",
    "compression_table",
    "cotangent_probe",
    "cotangent_report",
    "cotangent_table",
    "layer_norms",
    "monitor",
    "nonfinite_paths",
    "summary",
    "underflow_report",
    "wire_time",
]
