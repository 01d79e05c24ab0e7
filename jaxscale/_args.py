"""Argument checks shared by the factories (one home for each rule)."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["check_int"]

INT32_MAX = int(np.iinfo(np.int32).max)


def check_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` as a Python int in ``[minimum, int32 max]``, or a clear error.

    The counters it configures are ``int32`` on device, hence the upper bound.

    Raises:
      TypeError: if ``value`` is not an integer (``bool`` included).
      ValueError: if it is out of range; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r}.")
    value = int(value)
    if not minimum <= value <= INT32_MAX:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return value
