"""Tools to unit-test your own mixed-precision train step.

Import it as its own module (``import jaxscale`` does not load it)::

    import jaxscale.testing as jxt

* :func:`simulate`: a pure-Python reference of loss-scale trajectories, under
  jaxscale's rule, torch's ``GradScaler`` or Megatron-LM's
  ``DynamicGradScaler``, for a sequence of finite / non-finite steps.
* :func:`inject_nonfinite` and :func:`nonfinite_at`: put ``inf`` or ``NaN`` into
  chosen gradient leaves at chosen steps, inside ``jit``, without a host sync.
* :func:`assert_skipped`, :func:`assert_applied`,
  :func:`assert_trajectory_matches`, :func:`assert_bit_identical`: assertions
  whose messages name the offending leaf and step.

Only ``jax``, ``numpy`` and ``optax`` are needed (no test framework).
"""

from jaxscale.testing._asserts import assert_applied as assert_applied
from jaxscale.testing._asserts import assert_bit_identical as assert_bit_identical
from jaxscale.testing._asserts import assert_skipped as assert_skipped
from jaxscale.testing._asserts import (
    assert_trajectory_matches as assert_trajectory_matches,
)
from jaxscale.testing._faults import NonfiniteAtState as NonfiniteAtState
from jaxscale.testing._faults import inject_nonfinite as inject_nonfinite
from jaxscale.testing._faults import nonfinite_at as nonfinite_at
from jaxscale.testing._simulate import RULES as RULES
from jaxscale.testing._simulate import SimStep as SimStep
from jaxscale.testing._simulate import simulate as simulate

__all__ = [
    "NonfiniteAtState",
    "SimStep",
    "assert_applied",
    "assert_bit_identical",
    "assert_skipped",
    "assert_trajectory_matches",
    "inject_nonfinite",
    "nonfinite_at",
    "simulate",
]
