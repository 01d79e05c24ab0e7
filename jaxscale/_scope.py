"""One convention for trace-time context: a named stack of values per thread.

A function that traces a user's function with something in scope (the float8
state that :func:`jaxscale.float8.value_and_grad` threads, the recorder of a
:func:`jaxscale.diagnostics.cotangent_report`) pushes it on a :class:`Scope`
for the duration of the trace; the code reached inside (a float8 site, a
cotangent probe) reads the innermost value. The stack is thread-local, so two
threads tracing at once do not see each other's values, and it is empty again
when the trace ends, whatever happens inside.

It also holds the names of the ``jax.named_scope`` around each of jaxscale's own
collectives: they reach the compiled program's metadata (``op_name``), where
:func:`jaxscale.diagnostics.collective_report` reads what a collective carries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "AMAX_SCOPE",
    "BLOCK_SCALES_SCOPE",
    "FINITE_SCOPE",
    "FLOAT8_GATHER_SCOPE",
    "REDUCE_MEAN_SCOPE",
    "Scope",
]

#: The finite check of :func:`jaxscale.dynamic_scaling` (its flags' reductions).
FINITE_SCOPE = "jaxscale_finite_check"
#: A float8 scale's amax reduced over devices (``jaxscale.float8``).
AMAX_SCOPE = "jaxscale_amax"
#: The float8 all-gather of :func:`jaxscale.float8.all_gather` (its bits).
FLOAT8_GATHER_SCOPE = "jaxscale_float8_gather"
#: The all-to-all and all-gather of :func:`jaxscale.reduce_mean` and
#: :func:`jaxscale.reduce_gradients`; inside it, :data:`BLOCK_SCALES_SCOPE`
#: around those of their float32 block scales.
REDUCE_MEAN_SCOPE = "jaxscale_reduce_mean"
BLOCK_SCALES_SCOPE = "jaxscale_block_scales"


class Scope:
    """A thread-local stack of trace-time values, named for its errors.

    Examples:
      >>> from jaxscale._scope import Scope
      >>> scope = Scope("example")
      >>> with scope.push(1):
      ...     with scope.push(2):
      ...         inner = scope.current()
      ...     outer = scope.current()
      >>> inner, outer, scope.current()
      (2, 1, None)
    """

    def __init__(self, name: str):
        self.name = name
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextlib.contextmanager
    def push(self, value: Any) -> Iterator[Any]:
        """``value`` is the innermost value while the block runs."""
        stack = self._stack()
        stack.append(value)
        try:
            yield value
        finally:
            stack.pop()

    def current(self) -> Any:
        """The innermost value in scope on this thread, or ``None``."""
        stack = self._stack()
        return stack[-1] if stack else None

    def __repr__(self) -> str:
        return f"Scope({self.name!r}, depth {len(self._stack())})"
