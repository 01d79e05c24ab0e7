"""Reference simulator of loss-scale trajectories: :func:`simulate`."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxscale._loss_scale import DynamicLossScale

_F32 = np.float32
RULES = ("jaxscale", "megatron", "torch")

# --------------------------------------------------------------------------- #
# Reference simulator
# --------------------------------------------------------------------------- #


class SimStep(NamedTuple):
    """The loss-scale state after one simulated step (see :func:`simulate`).

    Attributes:
      loss_scale: the scale for the next step, a float32 value as a ``float``.
      growth_tracker: consecutive finite steps since the last change.
      hysteresis_tracker: overflows still tolerated (always 1 under torch's rule;
        Megatron-LM's goes to 0 and below while it keeps backing off).
      applied: whether this step's update was applied (the step was finite).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> jxt.simulate(jxs.DynamicLossScale.create(init_scale=4.0), [False])
      [SimStep(loss_scale=2.0, growth_tracker=0, hysteresis_tracker=1, applied=False)]
    """

    loss_scale: float
    growth_tracker: int
    hysteresis_tracker: int
    applied: bool


def _bools(name: str, values: Any) -> list[bool]:
    if isinstance(values, str) or not isinstance(values, Iterable | np.ndarray):
        raise TypeError(f"`{name}` must be a sequence of booleans, got {values!r}.")
    out = []
    for i, v in enumerate(np.asarray(values).reshape(-1).tolist()):
        if not isinstance(v, bool):
            raise TypeError(
                f"`{name}` must be a sequence of booleans, got {v!r} at index {i}."
            )
        out.append(v)
    return out


def concrete(name: str, x: Any) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"`{name}` must hold concrete values, got a traced value: call this "
            "outside `jax.jit`."
        )
    return np.asarray(x)


def simulate(
    loss_scale: DynamicLossScale, finite: Sequence[bool], *, rule: str = "jaxscale"
) -> list[SimStep]:
    """Replays a dynamic loss scale over a sequence of finite / non-finite steps.

    A plain-Python statement of each update rule, in float32 arithmetic (via
    numpy), to compare a real run against. It starts from the leaves and the
    static configuration of ``loss_scale``. Rules:

    * ``"jaxscale"``: :meth:`DynamicLossScale.adjust` exactly: the hysteresis
      budget refills on every finite step, the scale stays in
      ``[min_scale, max_scale]``, a growth above ``max_scale`` is dropped.
    * ``"torch"``: ``torch.amp.GradScaler.update`` (``_amp_update_scale_``)
      exactly: products in float64 rounded to float32, a growth to ``inf`` is
      dropped, and there is **no floor**: the scale can become subnormal and
      then 0 (pytorch#99640). ``min_scale`` and ``max_scale`` are ignored;
      ``hysteresis`` must be 1.
    * ``"megatron"``: Megatron-LM's ``DynamicGradScaler.update`` exactly: the
      hysteresis budget refills only when the scale grows (and the tracker goes
      on counting down below 1 while overflows continue), the floor is
      ``min_scale``, and there is no ceiling (``max_scale`` is ignored; the
      scale can grow to ``inf``).

    Args:
      loss_scale: the initial :class:`jaxscale.DynamicLossScale` (concrete).
      finite: one boolean per step: whether that step's gradients were finite.
      rule: ``"jaxscale"``, ``"torch"`` or ``"megatron"``.

    Returns:
      One :class:`SimStep` per step: the state *after* that step.

    Raises:
      TypeError: if ``loss_scale`` is not a concrete ``DynamicLossScale`` or
        ``finite`` not a sequence of booleans.
      ValueError: if ``rule`` is unknown, or ``rule="torch"`` with
        ``hysteresis != 1``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> ls = jxs.DynamicLossScale.create(init_scale=8.0, growth_interval=2)
      >>> [s.loss_scale for s in jxt.simulate(ls, [False, True, True, False])]
      [4.0, 4.0, 8.0, 4.0]
      >>> low = jxs.DynamicLossScale.create(init_scale=2.0**-126)
      >>> jxt.simulate(low, [False] * 24)[-1].loss_scale  # stays at the floor
      1.1754943508222875e-38
      >>> jxt.simulate(low, [False] * 24, rule="torch")[-1].loss_scale
      0.0
    """
    if not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            "`loss_scale` must be a jxs.DynamicLossScale (e.g. "
            f"jxs.DynamicLossScale.create()), got {type(loss_scale).__name__}."
        )
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {RULES}, got {rule!r}.")
    if rule == "torch" and loss_scale.hysteresis != 1:
        raise ValueError(
            "`loss_scale` must have hysteresis=1 for rule='torch' "
            "(torch.amp.GradScaler has no hysteresis), got "
            f"hysteresis={loss_scale.hysteresis}."
        )
    seq = _bools("finite", finite)
    scale = _F32(concrete("loss_scale", loss_scale.loss_scale))
    growth = int(concrete("loss_scale", loss_scale.growth_tracker))
    budget = int(concrete("loss_scale", loss_scale.hysteresis_tracker))
    step = {
        "jaxscale": _step_jaxscale,
        "torch": _step_torch,
        "megatron": _step_megatron,
    }
    fn = functools.partial(step[rule], loss_scale)
    out = []
    with np.errstate(over="ignore", under="ignore"):
        for ok in seq:
            scale, growth, budget = fn(scale, growth, budget, ok)
            out.append(SimStep(float(scale), growth, budget, ok))
    return out


def _step_jaxscale(c: DynamicLossScale, scale, growth, budget, finite):
    if finite:
        budget = c.hysteresis
        growth += 1
        if growth >= c.growth_interval:
            growth = 0
            grown = _F32(scale * _F32(c.growth_factor))
            if grown <= _F32(c.max_scale):
                scale = grown
    else:
        growth = 0
        if budget > 1:
            budget -= 1
        else:
            scale = max(_F32(scale * _F32(c.backoff_factor)), _F32(c.min_scale))
    return scale, growth, budget


def _step_torch(c: DynamicLossScale, scale, growth, budget, finite):
    # aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp: float * double factor.
    if finite:
        growth += 1
        if growth == c.growth_interval:
            grown = _F32(np.float64(scale) * np.float64(c.growth_factor))
            if math.isfinite(grown):
                scale = grown
            growth = 0
    else:
        scale = _F32(np.float64(scale) * np.float64(c.backoff_factor))
        growth = 0
    return scale, growth, 1


def _step_megatron(c: DynamicLossScale, scale, growth, budget, finite):
    # megatron/core/optimizer/grad_scaler.py: float32 tensors throughout.
    if finite:
        growth += 1
        if growth == c.growth_interval:
            growth = 0
            budget = c.hysteresis
            scale = _F32(scale * _F32(c.growth_factor))
    else:
        growth = 0
        budget -= 1
        if budget <= 0:
            scale = max(_F32(scale * _F32(c.backoff_factor)), _F32(c.min_scale))
    return scale, growth, budget
