"""Float8 matmuls with per-tensor scaling: ``jxs.float8``.

The recipes of :func:`jaxscale.autocast`'s ``float8=`` argument (rule classes
for ``dot_general`` that plug into autocast; :class:`Recipe` is their base),
delayed scaling's state, the numerics they are built from, and the check that
a compiled step holds float8 GEMMs. ``docs/float8.md`` is the guide.
"""

from jaxscale.float8._api import Float8State as Float8State
from jaxscale.float8._api import (
    accumulate_value_and_grad as accumulate_value_and_grad,
)
from jaxscale.float8._api import apply as apply
from jaxscale.float8._api import init as init
from jaxscale.float8._api import value_and_grad as value_and_grad
from jaxscale.float8._check import Float8GemmReport as Float8GemmReport
from jaxscale.float8._check import gemm_report as gemm_report
from jaxscale.float8._gather import all_gather as all_gather
from jaxscale.float8._numerics import dequantize as dequantize
from jaxscale.float8._numerics import quantize as quantize
from jaxscale.float8._numerics import scale_from_amax as scale_from_amax
from jaxscale.float8._recipes import CurrentScaling as CurrentScaling
from jaxscale.float8._recipes import DelayedScaling as DelayedScaling
from jaxscale.float8._recipes import Recipe as Recipe
from jaxscale.float8._recipes import RowwiseScaling as RowwiseScaling
from jaxscale.float8._site import checkpoint_policy as checkpoint_policy

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "Float8GemmReport",
    "Float8State",
    "Recipe",
    "RowwiseScaling",
    "accumulate_value_and_grad",
    "all_gather",
    "apply",
    "checkpoint_policy",
    "dequantize",
    "gemm_report",
    "init",
    "quantize",
    "scale_from_amax",
    "value_and_grad",
]
