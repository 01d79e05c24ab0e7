"""jaxscale: dynamic loss scaling for mixed-precision training in JAX.

The JAX counterpart of ``torch.amp.GradScaler``: a pytree loss-scale state and an
optax transformation that unscales gradients, skips non-finite steps and adjusts
the scale, all inside XLA.
"""

from jaxscale._accumulate import AccumulateState as AccumulateState
from jaxscale._accumulate import accumulate as accumulate
from jaxscale._accumulate import (
    accumulate_value_and_grad as accumulate_value_and_grad,
)
from jaxscale._autocast import autocast as autocast
from jaxscale._autocast_interp import AutocastWarning as AutocastWarning
from jaxscale._autocast_report import AutocastReport as AutocastReport
from jaxscale._autocast_report import AutocastSite as AutocastSite
from jaxscale._autocast_report import autocast_report as autocast_report
from jaxscale._autocast_rules import AutocastRule as AutocastRule
from jaxscale._autocast_rules import autocast_rules as autocast_rules
from jaxscale._checkpoint import upgrade_checkpoint as upgrade_checkpoint
from jaxscale._clip import clip_by_global_norm as clip_by_global_norm
from jaxscale._clip import global_norm as global_norm
from jaxscale._composition import CompositionWarning as CompositionWarning
from jaxscale._cotangents import CotangentStats as CotangentStats
from jaxscale._cotangents import cotangent_probe as cotangent_probe
from jaxscale._cotangents import cotangent_report as cotangent_report
from jaxscale._cotangents import cotangent_table as cotangent_table
from jaxscale._diagnostics import UnderflowReport as UnderflowReport
from jaxscale._diagnostics import layer_norms as layer_norms
from jaxscale._diagnostics import nonfinite_paths as nonfinite_paths
from jaxscale._diagnostics import summary as summary
from jaxscale._diagnostics import underflow_report as underflow_report
from jaxscale._hooks import OverflowEvent as OverflowEvent
from jaxscale._hooks import ScaleAtFloorWarning as ScaleAtFloorWarning
from jaxscale._hooks import monitor as monitor
from jaxscale._loss_scale import DynamicLossScale as DynamicLossScale
from jaxscale._loss_scale import LossScale as LossScale
from jaxscale._loss_scale import NoOpLossScale as NoOpLossScale
from jaxscale._loss_scale import StaticLossScale as StaticLossScale
from jaxscale._policy import Policy as Policy
from jaxscale._policy import cast_floating as cast_floating
from jaxscale._torch_interop import from_torch_state_dict as from_torch_state_dict
from jaxscale._torch_interop import to_torch_state_dict as to_torch_state_dict
from jaxscale._transform import DynamicScalingState as DynamicScalingState
from jaxscale._transform import dynamic_scaling as dynamic_scaling
from jaxscale._transform import loss_scale_of as loss_scale_of
from jaxscale._transform import value_and_grad as value_and_grad
from jaxscale._tree import all_finite as all_finite
from jaxscale._tree import select_tree as select_tree
from jaxscale._validate import validate_state as validate_state

__version__ = "0.2.0"

__all__ = [
    "AccumulateState",
    "AutocastReport",
    "AutocastRule",
    "AutocastSite",
    "AutocastWarning",
    "CompositionWarning",
    "CotangentStats",
    "DynamicLossScale",
    "DynamicScalingState",
    "LossScale",
    "NoOpLossScale",
    "OverflowEvent",
    "Policy",
    "ScaleAtFloorWarning",
    "StaticLossScale",
    "UnderflowReport",
    "accumulate",
    "accumulate_value_and_grad",
    "all_finite",
    "autocast",
    "autocast_report",
    "autocast_rules",
    "cast_floating",
    "clip_by_global_norm",
    "cotangent_probe",
    "cotangent_report",
    "cotangent_table",
    "dynamic_scaling",
    "from_torch_state_dict",
    "global_norm",
    "layer_norms",
    "loss_scale_of",
    "monitor",
    "nonfinite_paths",
    "select_tree",
    "summary",
    "to_torch_state_dict",
    "underflow_report",
    "upgrade_checkpoint",
    "validate_state",
    "value_and_grad",
]
