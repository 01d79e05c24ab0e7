"""Conversion to and from ``torch.amp.GradScaler.state_dict()``, without torch."""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxscale._grad import loss_scale_of
from jaxscale._loss_scale import (
    DEFAULT_MAX_SCALE,
    DEFAULT_MIN_SCALE,
    DynamicLossScale,
)

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]

_A = {int: "an int", float: "a float"}
_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval")
_TRACKER = "_growth_tracker"
_OVERRIDES = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
)


def _number(key: str, value: Any, kind: type) -> Any:
    """``float(value)`` / ``int(value)`` of a Python number or a one-element tensor."""
    if isinstance(value, bool) or value is None or isinstance(value, str | bytes):
        raise TypeError(
            f"`state_dict[{key!r}]` must be {_A[kind]} (or a one-element "
            f"tensor), got {value!r}."
        )
    if kind is int:
        try:  # exact for integer tensors and NumPy ints, never through a float
            return operator.index(value)
        except TypeError:
            pass  # a float (or float tensor): accepted if integral, below
    try:
        x = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`state_dict[{key!r}]` must be {_A[kind]} (or a one-element "
            f"tensor), got {type(value).__name__}."
        ) from e
    if kind is int:
        if not (math.isfinite(x) and x == int(x)):
            raise ValueError(
                f"`state_dict[{key!r}]` must be an integer, got {value!r}."
            )
        return int(x)
    return x


def from_torch_state_dict(state_dict: dict[str, Any], **overrides: Any) -> Any:
    """Builds a :class:`DynamicLossScale` from ``torch.amp.GradScaler.state_dict()``.

    Reads the five keys torch writes (``scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``_growth_tracker``); values may be
    Python numbers or one-element tensors (read with ``float()``, integers with
    ``operator.index()`` so that they stay exact; torch is never imported here).
    The result continues the torch run exactly: its next
    :meth:`DynamicLossScale.adjust` calls follow the same scale trajectory as the
    torch scaler would.

    Keyword ``overrides`` are arguments of :meth:`DynamicLossScale.create`
    (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``hysteresis``, ``min_scale``, ``max_scale``) and win over the state dict's
    values; ``init_scale`` replaces ``scale``. Torch has no hysteresis and no
    bounds: by default ``hysteresis=1`` (torch's rule) and jaxscale's default
    bounds ``[2**-126, float32 max]``; with ``hysteresis=n`` the budget starts
    full. The growth tracker is kept; it must be below ``growth_interval``.

    Args:
      state_dict: the dict returned by ``GradScaler.state_dict()``.
      **overrides: arguments of :meth:`DynamicLossScale.create` to use instead.

    Returns:
      A new :class:`DynamicLossScale` (pass it to :func:`dynamic_scaling`, or put
      it into a restored state with ``state._replace(loss_scale=...)``).

    Raises:
      ValueError: if the dict is empty (saved from ``GradScaler(enabled=False)``),
        lacks a key, or holds a value outside jaxscale's rules (e.g. a scale of 0
        or below the floor: torch has none; override it with ``init_scale=``).
      TypeError: if an override is not an argument of ``create``, or a value is
        not a number.

    Examples:
      >>> import jaxscale as jxs
      >>> sd = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...       "growth_interval": 2000, "_growth_tracker": 17}
      >>> ls = jxs.from_torch_state_dict(sd, hysteresis=2)
      >>> ls.loss_scale, int(ls.growth_tracker), ls.hysteresis
      (Array(1024., dtype=float32), 17, 2)
    """
    if not isinstance(state_dict, dict):
        raise TypeError(
            "`state_dict` must be the dict returned by "
            f"`torch.amp.GradScaler.state_dict()`, got {type(state_dict).__name__}."
        )
    if not state_dict:
        raise ValueError(
            "`state_dict` is empty: torch's `GradScaler(enabled=False).state_dict()` "
            "returns {} because a disabled scaler has no state. To train without "
            "loss scaling use `jxs.NoOpLossScale()`; to start scaling afresh use "
            "`jxs.DynamicLossScale.create(...)` (torch's defaults)."
        )
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise TypeError(
            f"Unknown override(s) {unknown}; accepted: {list(_OVERRIDES)} (the "
            "arguments of `jxs.DynamicLossScale.create`)."
        )
    missing = [k for k in (*_KEYS, _TRACKER) if k not in state_dict]
    if missing:
        raise ValueError(
            f"`state_dict` lacks the key(s) {missing}; expected the keys "
            f"{[*_KEYS, _TRACKER]} of `torch.amp.GradScaler.state_dict()`, got "
            f"{sorted(state_dict)}."
        )
    kwargs = {
        "init_scale": _number("scale", state_dict["scale"], float),
        "growth_factor": _number("growth_factor", state_dict["growth_factor"], float),
        "backoff_factor": _number(
            "backoff_factor", state_dict["backoff_factor"], float
        ),
        "growth_interval": _number(
            "growth_interval", state_dict["growth_interval"], int
        ),
    }
    kwargs.update(overrides)
    tracker = _number(_TRACKER, state_dict[_TRACKER], int)
    try:
        ls = DynamicLossScale.create(**kwargs)
    except ValueError as e:
        if "init_scale" in overrides or "`init_scale`" not in str(e):
            raise
        raise ValueError(
            f"{e} (`init_scale` is the torch state's `scale`; torch has no floor, so "
            "a collapsed run can reach 0 or a subnormal. Pass `init_scale=...` to "
            "restart from a sane scale.)"
        ) from None
    if not 0 <= tracker < ls.growth_interval:
        raise ValueError(
            f"`state_dict['_growth_tracker']` must be in [0, growth_interval) = "
            f"[0, {ls.growth_interval}), got {tracker}."
        )
    return dataclasses.replace(ls, growth_tracker=jnp.asarray(tracker, jnp.int32))


def to_torch_state_dict(loss_scale: Any, *, strict: bool = True) -> dict[str, Any]:
    """Returns the ``torch.amp.GradScaler.state_dict()`` of a dynamic loss scale.

    The dict has torch's five keys and value types: ``scale``, ``growth_factor``
    and ``backoff_factor`` as Python floats, ``growth_interval`` and
    ``_growth_tracker`` as Python ints, ready for ``GradScaler.load_state_dict``.
    It reads the device values (a host transfer): call it when checkpointing,
    not in the train step.

    Torch's ``GradScaler`` has no hysteresis and no bounds on the scale. With
    ``strict=True`` (the default) a loss scale that uses either
    (``hysteresis > 1``, or ``min_scale`` / ``max_scale`` other than jaxscale's
    defaults) raises, because torch would continue on a different trajectory;
    ``strict=False`` drops them (torch then backs off on the first overflow of a
    streak, and has no floor or ceiling).

    Args:
      loss_scale: a :class:`DynamicLossScale`, or any state containing exactly one
        (the optimizer state, a ``TrainState``; see :func:`loss_scale_of`).
      strict: whether to refuse configurations torch cannot represent.

    Returns:
      A new ``dict`` with keys ``scale``, ``growth_factor``, ``backoff_factor``,
      ``growth_interval``, ``_growth_tracker``.

    Raises:
      TypeError: if the loss scale is not a :class:`DynamicLossScale` (a static or
        no-op scale has no torch counterpart).
      ValueError: with ``strict=True``, if hysteresis or bounds would be lost.

    Examples:
      >>> import jaxscale as jxs
      >>> jxs.to_torch_state_dict(jxs.DynamicLossScale.create(init_scale=1024))
      {'scale': 1024.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, \
'growth_interval': 2000, '_growth_tracker': 0}
    """
    ls = loss_scale_of(loss_scale)
    if not isinstance(ls, DynamicLossScale):
        raise TypeError(
            "`loss_scale` must be a jxs.DynamicLossScale (torch's GradScaler is "
            f"dynamic), got {type(ls).__name__}."
        )
    if strict:
        if ls.hysteresis > 1:
            raise ValueError(
                f"`hysteresis` must be 1 to convert to torch (GradScaler has no "
                f"hysteresis), got {ls.hysteresis}. Pass `strict=False` to drop it: "
                "torch then backs off on every overflow."
            )
        if ls.min_scale != DEFAULT_MIN_SCALE or ls.max_scale != DEFAULT_MAX_SCALE:
            raise ValueError(
                "`min_scale` and `max_scale` must be jaxscale's defaults to convert to "
                "torch (GradScaler has no bounds), got "
                f"[{ls.min_scale!r}, {ls.max_scale!r}]. Pass `strict=False` to "
                "drop them."
            )
    return {
        "scale": float(np.asarray(ls.loss_scale)),
        "growth_factor": float(ls.growth_factor),
        "backoff_factor": float(ls.backoff_factor),
        "growth_interval": int(ls.growth_interval),
        "_growth_tracker": int(np.asarray(ls.growth_tracker)),
    }
