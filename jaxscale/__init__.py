"""jaxscale: dynamic loss scaling for mixed-precision training in JAX.

The JAX counterpart of ``torch.amp.GradScaler``: a pytree loss-scale state and an
optax transformation that unscales gradients, skips non-finite steps and adjusts
the scale, all inside XLA.
"""

from jaxscale._loss_scale import DynamicLossScale as DynamicLossScale
from jaxscale._loss_scale import LossScale as LossScale
from jaxscale._loss_scale import NoOpLossScale as NoOpLossScale
from jaxscale._loss_scale import StaticLossScale as StaticLossScale
from jaxscale._transform import DynamicScalingState as DynamicScalingState
from jaxscale._transform import dynamic_scaling as dynamic_scaling
from jaxscale._transform import loss_scale_of as loss_scale_of
from jaxscale._transform import value_and_grad as value_and_grad
from jaxscale._tree import all_finite as all_finite
from jaxscale._tree import select_tree as select_tree

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "DynamicScalingState",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "dynamic_scaling",
    "loss_scale_of",
    "select_tree",
    "value_and_grad",
]
