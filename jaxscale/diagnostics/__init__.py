"""Diagnostics: what the loss scale did, which leaves overflowed, what underflows.

Everything here reads device arrays and adds no host synchronisation to a train
step, except :func:`monitor`, which calls back to the host only on the steps its
hooks ask for. Import it as ``jxs.diagnostics`` (``import jaxscale`` imports it):

    import jaxscale as jxs

    jxs.diagnostics.summary(opt_state)

Until 0.3.0 these names were also at the top level (``jxs.summary``); those aliases
still work for one release and warn with a :class:`DeprecationWarning`.

Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jaxscale as jxs
    >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> float(jxs.diagnostics.summary(state)["loss_scale"])
    65536.0
"""

from jaxscale._cotangents import CotangentStats as CotangentStats
from jaxscale._cotangents import cotangent_probe as cotangent_probe
from jaxscale._cotangents import cotangent_report as cotangent_report
from jaxscale._cotangents import cotangent_table as cotangent_table
from jaxscale._diagnostics import UnderflowReport as UnderflowReport
from jaxscale._diagnostics import layer_norms as layer_norms
from jaxscale._diagnostics import nonfinite_paths as nonfinite_paths
from jaxscale._diagnostics import summary as summary
from jaxscale._diagnostics import underflow_report as underflow_report
from jaxscale._monitor import MonitorState as MonitorState
from jaxscale._monitor import NoOverflowWarning as NoOverflowWarning
from jaxscale._monitor import OverflowEvent as OverflowEvent
from jaxscale._monitor import ScaleAtFloorWarning as ScaleAtFloorWarning
from jaxscale._monitor import monitor as monitor

__all__ = [
    "CotangentStats",
    "MonitorState",
    "NoOverflowWarning",
    "OverflowEvent",
    "ScaleAtFloorWarning",
    "UnderflowReport",
    "cotangent_probe",
    "cotangent_report",
    "cotangent_table",
    "layer_norms",
    "monitor",
    "nonfinite_paths",
    "summary",
    "underflow_report",
]
