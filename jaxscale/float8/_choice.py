"""Which matmuls run in float8: the user's patterns and ``select``, ``min_dim``,
the cost model.

A ``dot_general`` without batch dimensions is a *candidate*; whether it becomes
a float8 site is decided here (:func:`choose`) by the recipe's selectors
(:mod:`jaxscale.float8._select`: each ``(site, shape) -> Format | None``), the
first with an opinion deciding, in this order:

1. the recipe's ``sites``: regular expressions searched in the candidate's name
   stack (Flax module paths, ``jax.named_scope``), the first that matches says
   ``True`` (float8) or ``False`` (16 bits) (:class:`~._select.Patterns`);
2. the recipe's ``select``, the user's selector (:class:`~._select.UserSelect`:
   a plan's ``Plan.select``, a torchao-style filter);
3. else, if the recipe has an integer ``min_dim``: float8 when M, K and N all
   reach it (the rule of jaxscale 0.3) (:class:`~._select.MinDim`);
4. else the cost model (:class:`SpeedModel`, :func:`predicted_ratio`): float8
   when its predicted time for the site's three products (forward, and both
   backward products) with their quantisation passes is below that of the
   16-bit products.

**The cost model** is the speed model's (:mod:`jaxscale._speed`) for two
formats: a site's three products in 16 bits, each operand wider than 16 bits
cast by a pass of its own, against the same products in float8 with their
quantisation passes (an amax and a cast per operand and for the gradient, a
transpose of each float8 tensor). Its figures are per device kind and its
constants ``e``, ``q`` and ``c`` fitted once, in the one cost model
(:mod:`jaxscale._cost`; ``docs/float8.md`` gives the fit).

**Which device kind** (:func:`target_device`): the recipe's ``device_kind``;
else the kind the traced program is for (:func:`jaxscale._cost.target_kind`):
the devices of the product's operands' sharding (arguments placed on a mesh, or
``ShapeDtypeStruct`` arguments with a sharding on a deviceless topology), the
mesh in context, JAX's default device. A kind not in the table (the CPU
included) takes the figures of the H100 SXM, the most common kind (where they
predict a gain, so do the H200's: checked in ``tests/test_float8_choice.py``),
with an :class:`~jaxscale.AutocastWarning` that says to pass ``device_kind``:
traced on a CPU for a GPU, the choice would otherwise silently be another
device's.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxscale._autocast.interp import AutocastWarning
from jaxscale._cost import (
    DEVICES,
    FALLBACK,
    DeviceCost,
    device_cost,
    is_known,
    target_kind,
)
from jaxscale._speed import Format, site_seconds
from jaxscale.float8._select import Choice, MinDim, Patterns, UserSelect, first

__all__ = [
    "Choice",
    "SpeedModel",
    "check_device_kind",
    "check_sites",
    "choose",
    "predicted_ratio",
    "predicted_times",
    "selectors",
    "target_device",
]


def predicted_times(
    m: int, k: int, n: int, x_bytes: int, w_bytes: int, cost: DeviceCost
) -> tuple[float, float]:
    """The predicted seconds of a site of sizes ``m``, ``k``, ``n`` (its three
    products) in 16 bits and in float8 (quantisation passes included);
    ``x_bytes`` and ``w_bytes`` are its operands' bytes per element: the
    speed model's two formats (:func:`jaxscale._speed.site_seconds`)."""
    sizes = (m, k, n, x_bytes, w_bytes, cost)
    return site_seconds(Format.HALF, *sizes), site_seconds(Format.FLOAT8, *sizes)


def predicted_ratio(
    m: int, k: int, n: int, x_bytes: int, w_bytes: int, cost: DeviceCost
) -> float:
    """:func:`predicted_times`' float8 time over its 16-bit time."""
    t16, t8 = predicted_times(m, k, n, x_bytes, w_bytes, cost)
    return t8 / t16


def target_device(
    device_kind: str | None, values: Iterable[Any] = ()
) -> tuple[DeviceCost, str]:
    """The figures the cost model uses and the name its notes give them: of
    ``device_kind`` if given, else of the kind the traced program is for
    (:func:`jaxscale._cost.target_kind` of ``values``, a product's operands).
    A kind the model has no figures for takes
    :data:`jaxscale._cost.FALLBACK`'s, with an :class:`~jaxscale.AutocastWarning`
    that names the kind, where it was found and how to name the target
    instead."""
    if device_kind is not None:
        return device_cost(device_kind)
    kind, source = target_kind(values)
    if not is_known(kind):
        known = ", ".join(repr(d.cost.name) for d in DEVICES)
        warnings.warn(
            "jxs.autocast(float8=...): the cost model that chooses which matmuls "
            f"run in float8 has no figures for the device kind {kind!r} (from "
            f"{source}), so it chose with the {FALLBACK.name}'s. Name the device "
            "the step will run on, e.g. `float8=jxs.float8.CurrentScaling("
            f'device_kind="NVIDIA H200")` (kinds with figures: {known}); or '
            "decide without the model with `min_dim=` or `sites=` "
            "(docs/float8.md: which device's figures).",
            AutocastWarning,
            stacklevel=2,
        )
    return device_cost(kind)


@dataclasses.dataclass(frozen=True)
class SpeedModel:
    """The cost model as a selector (:mod:`jaxscale.float8._select`): float8
    where the speed model predicts a site of ``shape`` faster in float8 than in
    16 bits, given its operands' bytes per element and the device kind's
    figures (``device()``, :func:`target_device`, asked at the first call);
    decides every site. What ``float8=True`` selects by."""

    itemsizes: tuple[int, int]
    device: Callable[[], tuple[DeviceCost, str]]
    dtype_name: str = "bfloat16"
    fmt: Format = Format.FLOAT8

    def explain(self, site: str, shape: tuple[int, int, int]) -> Choice:
        cost, name = self.device()
        r = predicted_ratio(*shape, *self.itemsizes, cost)
        fmt = "float8" if r < 1 else "16 bits"
        why = f"{fmt}: predicted {r:.2f} of {self.dtype_name} on {name}"
        return Choice(r < 1, why, "model")

    def __call__(self, site: str, shape: tuple[int, int, int]) -> Format:
        return self.fmt if self.explain(site, shape).float8 else Format.HALF


def selectors(
    recipe: Any,
    itemsizes: tuple[int, int],
    device: Callable[[], tuple[DeviceCost, str]],
    dtype_name: str,
) -> tuple[Any, ...]:
    """``recipe``'s selectors for a candidate whose operands have ``itemsizes``
    bytes per element, in the order they are asked: its ``sites`` patterns, its
    ``select``, then ``min_dim`` or the cost model (one of which decides)."""
    fmt = Format.FLOAT8_ROWWISE if getattr(recipe, "axiswise", False) else Format.FLOAT8
    chain: list[Any] = [Patterns(recipe.sites, fmt)] if recipe.sites else []
    if getattr(recipe, "select", None) is not None:
        chain.append(UserSelect(recipe.select, fmt))
    if recipe.min_dim is not None:
        return (*chain, MinDim(recipe.min_dim, fmt))
    return (*chain, SpeedModel(tuple(itemsizes), device, dtype_name, fmt))


def choose(
    recipe: Any,
    where: str,
    mkn: tuple[int, int, int],
    itemsizes: tuple[int, int],
    device: Callable[[], tuple[DeviceCost, str]],
    dtype_name: str,
) -> Choice:
    """Whether the candidate at name stack ``where`` of sizes ``mkn`` runs in
    float8 under ``recipe``, and why: the first of its :func:`selectors` with
    an opinion. ``device()`` gives the figures of the device kind
    (:func:`target_device`; called by the cost model only)."""
    choice = first(selectors(recipe, itemsizes, device, dtype_name), where, mkn)
    assert choice is not None  # min_dim and the cost model decide every site
    return choice


# --------------------------------------------------------------------------- #
# The recipe's fields
# --------------------------------------------------------------------------- #


def check_sites(value: Any) -> tuple[tuple[str, bool], ...]:
    """``sites`` as a tuple of ``(pattern, bool)`` pairs (hashable), checked."""
    what = (
        "`sites` must map name-stack patterns (regular expressions) to True "
        "(float8) or False (16 bits), as a dict or a tuple of (pattern, bool) "
        "pairs, e.g. `sites={'head': False}`"
    )
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        pairs = list(value)
    else:
        raise TypeError(f"{what}; got {type(value).__name__} {value!r}.")
    out: list[tuple[str, bool]] = []
    for pair in pairs:
        if not (isinstance(pair, Sequence) and len(pair) == 2):
            raise TypeError(f"{what}; got the entry {pair!r}.")
        pattern, flag = pair
        if not isinstance(pattern, str):
            raise TypeError(
                f"{what}; got the pattern {pattern!r} ({type(pattern).__name__})."
            )
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(
                f"{what}; got {flag!r} ({type(flag).__name__}) for pattern {pattern!r}."
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f"`sites`: the pattern {pattern!r} is not a regular expression "
                f"({err}). Escape special characters with `re.escape`."
            ) from None
        if any(pattern == p for p, _ in out):
            raise ValueError(
                f"`sites`: the pattern {pattern!r} is given twice; the first "
                "match wins, so the second would never apply. Keep one."
            )
        out.append((pattern, bool(flag)))
    return tuple(out)


def check_device_kind(value: Any) -> str | None:
    """``device_kind``: ``None`` or a kind :data:`jaxscale._cost.DEVICES`
    knows."""
    if value is None:
        return None
    known = [d.pattern for d in DEVICES]
    if not isinstance(value, str) or not is_known(value):
        raise ValueError(
            "`device_kind` must be None (the kind the traced step is for) or "
            f"name a kind the cost model has figures for (one of {known}, as in "
            f"`jax.devices()[0].device_kind`), got {value!r}."
        )
    return value
