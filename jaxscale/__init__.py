"""jaxscale: dynamic loss scaling for mixed-precision training in JAX.

The JAX counterpart of ``torch.amp.GradScaler``: a pytree loss-scale state and an
optax transformation that unscales gradients, skips non-finite steps and adjusts
the scale, all inside XLA.
"""

import importlib.metadata

from jaxscale import diagnostics as diagnostics
from jaxscale import float8 as float8
from jaxscale import precision as precision
from jaxscale._accumulate import AccumulateState as AccumulateState
from jaxscale._accumulate import accumulate as accumulate
from jaxscale._accumulate import (
    accumulate_value_and_grad as accumulate_value_and_grad,
)
from jaxscale._autocast.entry import autocast as autocast
from jaxscale._autocast.interp import AutocastWarning as AutocastWarning
from jaxscale._autocast.rules import AutocastRule as AutocastRule
from jaxscale._autocast.rules import autocast_rules as autocast_rules
from jaxscale._checkpoint import upgrade_checkpoint as upgrade_checkpoint
from jaxscale._clip import clip_by_global_norm as clip_by_global_norm
from jaxscale._clip import global_norm as global_norm
from jaxscale._composition import CompositionWarning as CompositionWarning
from jaxscale._grad import HalfPrecisionLossWarning as HalfPrecisionLossWarning
from jaxscale._grad import loss_scale_of as loss_scale_of
from jaxscale._grad import value_and_grad as value_and_grad
from jaxscale._loss_scale import DynamicLossScale as DynamicLossScale
from jaxscale._loss_scale import LossScale as LossScale
from jaxscale._loss_scale import NoOpLossScale as NoOpLossScale
from jaxscale._loss_scale import StaticLossScale as StaticLossScale
from jaxscale._policy import Policy as Policy
from jaxscale._policy import cast_floating as cast_floating
from jaxscale._reduce import ReduceGradientsState as ReduceGradientsState
from jaxscale._reduce import reduce_gradients as reduce_gradients
from jaxscale._reduce import reduce_mean as reduce_mean
from jaxscale._reduce import reduce_state_specs as reduce_state_specs
from jaxscale._state import DynamicScalingState as DynamicScalingState
from jaxscale._torch_interop import from_torch_state_dict as from_torch_state_dict
from jaxscale._torch_interop import to_torch_state_dict as to_torch_state_dict
from jaxscale._transform import dynamic_scaling as dynamic_scaling
from jaxscale._tree import all_finite as all_finite
from jaxscale._tree import select_tree as select_tree
from jaxscale._validate import validate_state as validate_state
from jaxscale.precision import plan_precision as plan_precision

try:
    __version__ = importlib.metadata.version("jaxscale")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    __version__ = "0+unknown"

__all__ = [
    "AccumulateState",
    "AutocastRule",
    "AutocastWarning",
    "CompositionWarning",
    "DynamicLossScale",
    "DynamicScalingState",
    "HalfPrecisionLossWarning",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "ReduceGradientsState",
    "StaticLossScale",
    "accumulate",
    "accumulate_value_and_grad",
    "all_finite",
    "autocast",
    "autocast_rules",
    "cast_floating",
    "clip_by_global_norm",
    "dynamic_scaling",
    "from_torch_state_dict",
    "global_norm",
    "loss_scale_of",
    "plan_precision",
    "reduce_gradients",
    "reduce_mean",
    "reduce_state_specs",
    "select_tree",
    "to_torch_state_dict",
    "upgrade_checkpoint",
    "validate_state",
    "value_and_grad",
]


# The diagnostics that were top-level names in 0.2.0 moved to ``jaxscale.diagnostics``
# in 0.3.0; those names (and only those: the diagnostics added since never were
# top-level) stay for one release as aliases that warn.
_MOVED_TO_DIAGNOSTICS = frozenset(
    (
        "AutocastReport",
        "AutocastSite",
        "CotangentStats",
        "OverflowEvent",
        "ScaleAtFloorWarning",
        "UnderflowReport",
        "autocast_report",
        "cotangent_probe",
        "cotangent_report",
        "cotangent_table",
        "layer_norms",
        "monitor",
        "nonfinite_paths",
        "summary",
        "underflow_report",
    )
)


def __getattr__(name: str):
    if name in _MOVED_TO_DIAGNOSTICS:
        import warnings

        warnings.warn(
            f"`jaxscale.{name}` moved to `jaxscale.diagnostics.{name}` in 0.3.0; the "
            "top-level alias will be removed in 0.4.0. Write "
            f"`jxs.diagnostics.{name}` instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(diagnostics, name)
    if name in diagnostics.__all__:
        raise AttributeError(
            f"module 'jaxscale' has no attribute {name!r}; it is "
            f"`jaxscale.diagnostics.{name}` (write `jxs.diagnostics.{name}`)"
        )
    raise AttributeError(f"module 'jaxscale' has no attribute {name!r}")
