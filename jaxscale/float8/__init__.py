"""Float8 matmuls with per-tensor scaling: ``jxs.float8``.

The recipes and the state of :func:`jaxscale.autocast`'s ``float8=``
argument, the numerics they are built from, and the check that a compiled
step holds float8 GEMMs. ``docs/float8.md`` is the guide.
"""

from jaxscale._float8 import CurrentScaling as CurrentScaling
from jaxscale._float8 import DelayedScaling as DelayedScaling
from jaxscale._float8 import dequantize as dequantize
from jaxscale._float8 import quantize as quantize
from jaxscale._float8 import scale_from_amax as scale_from_amax
from jaxscale._float8_api import Float8State as Float8State
from jaxscale._float8_api import apply as apply
from jaxscale._float8_api import init as init
from jaxscale._float8_api import value_and_grad as value_and_grad
from jaxscale._float8_check import Float8GemmReport as Float8GemmReport
from jaxscale._float8_check import gemm_report as gemm_report

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "Float8GemmReport",
    "Float8State",
    "apply",
    "dequantize",
    "gemm_report",
    "init",
    "quantize",
    "scale_from_amax",
    "value_and_grad",
]
