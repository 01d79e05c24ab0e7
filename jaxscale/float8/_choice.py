"""Which matmuls run in float8: the user's patterns, ``min_dim``, the cost model.

A ``dot_general`` without batch dimensions is a *candidate*; whether it becomes
a float8 site is decided here, in this order (:func:`choose`):

1. the recipe's ``sites``: regular expressions searched in the candidate's name
   stack (Flax module paths, ``jax.named_scope``), the first that matches says
   ``True`` (float8) or ``False`` (16 bits);
2. else, if the recipe has an integer ``min_dim``: float8 when M, K and N all
   reach it (the rule of jaxscale 0.3);
3. else the cost model (:func:`predicted_ratio`): float8 when its predicted time
   for the site's three products (forward, and both backward products) with
   their quantisation passes is below that of the 16-bit products.

**The cost model.** For a site ``[M, K] x [K, N]`` with operands of ``b_x`` and
``b_w`` bytes per element and a 16-bit output, ``S = MK + KN + MN`` and
``F = 2MKN``:

- 16 bits: ``3F / (e P16) + 6S / B``: three GEMMs, each reading two of the
  three matrices and writing the third at 2 bytes; plus, for each operand wider
  than 16 bits, a cast (``b + 2`` bytes per element) as a pass of its own:
  ``bytes / (q B) + c``.
- float8: ``3F / (e P8) + 4S / B`` (float8 operands, 16-bit outputs), plus the
  quantisation passes, ``Q / (q B) + 9c``: an amax and a cast per operand and
  for the gradient (``2b + 1`` bytes per element each: ``(2b_x + 1)MK + (2b_w +
  1)KN + 5MN``) and one transpose of each float8 tensor (Hopper's float8 GEMMs
  take only K-major operands, and each tensor is used in both layouts: ``2S``);
  six reductions or casts and three transposes, nine kernels.

``P16``, ``P8`` (dense TFLOP/s) and ``B`` (HBM TB/s) are the vendor's figures
per device kind (:data:`DEVICES`). ``e`` (the fraction of the peak the GEMMs
reach), ``q`` (the fraction of ``B`` that XLA's quantisation passes reach) and
``c`` (the fixed cost of a kernel) were fitted to the one-site sweep measured
on an H200 (``docs/measurements.md``, "Float8 on a GPU"); ``docs/float8.md``
gives the fit. Other kinds reuse ``e``, ``q`` and ``c`` with their own figures.
A kind not in the table (the CPU included) takes the figures of the H100 SXM,
the most common kind: where they predict a gain, so do the H200's (checked in
``tests/test_float8_choice.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "DEVICES",
    "FALLBACK",
    "Choice",
    "DeviceCost",
    "check_device_kind",
    "check_sites",
    "choose",
    "current_device",
    "device_cost",
    "predicted_ratio",
    "predicted_times",
]

# Fitted to the H200 sweep (docs/float8.md, "Which matmuls run in float8").
GEMM_EFFICIENCY = 0.69  # e: the GEMMs' fraction of the dense peak, both formats
PASS_EFFICIENCY = 0.24  # q: the quantisation passes' fraction of HBM bandwidth
KERNEL_US = 3.1  # c: the fixed cost of one kernel, microseconds


class DeviceCost(NamedTuple):
    """A device kind's figures for the cost model: dense (not sparse) tensor
    throughput in bfloat16 and float8, and HBM bandwidth, from the vendor's
    data sheet."""

    name: str
    bf16_tflops: float
    f8_tflops: float
    hbm_tbs: float


# ``jax.devices()[0].device_kind`` is searched for each pattern, first match
# wins. NVIDIA H100 and H200 data sheets (2024), the "with sparsity" figures
# halved.
DEVICES: tuple[tuple[str, DeviceCost], ...] = (
    ("H100 PCIe", DeviceCost("NVIDIA H100 PCIe", 756.5, 1513.0, 2.0)),
    ("H100 NVL", DeviceCost("NVIDIA H100 NVL", 835.5, 1670.5, 3.9)),
    ("H200 NVL", DeviceCost("NVIDIA H200 NVL", 835.5, 1670.5, 4.8)),
    ("H200", DeviceCost("NVIDIA H200", 989.5, 1979.0, 4.8)),
    ("H100", DeviceCost("NVIDIA H100 SXM", 989.5, 1979.0, 3.35)),
)
FALLBACK = DEVICES[-1][1]  # the H100 SXM


class Choice(NamedTuple):
    """What :func:`choose` decided for one candidate: ``float8``, and ``why``
    in words; ``by`` is ``"pattern"``, ``"min_dim"`` or ``"model"``."""

    float8: bool
    why: str
    by: str


def device_cost(kind: str) -> tuple[DeviceCost, str]:
    """The figures for device kind ``kind`` and the name the notes give it
    (an unknown kind takes :data:`FALLBACK`'s figures, and says so)."""
    for pattern, cost in DEVICES:
        if pattern.lower() in kind.lower():
            return cost, cost.name
    return FALLBACK, f"{kind}, as {FALLBACK.name}"


def current_device(device_kind: str | None) -> tuple[DeviceCost, str]:
    """:func:`device_cost` of ``device_kind``, or of the first device of JAX's
    default backend (what the traced program will run on) if it is ``None``."""
    return device_cost(device_kind or jax.devices()[0].device_kind)


def predicted_times(
    m: int, k: int, n: int, x_bytes: int, w_bytes: int, cost: DeviceCost
) -> tuple[float, float]:
    """The predicted seconds of a site of sizes ``m``, ``k``, ``n`` (its three
    products) in 16 bits and in float8 (quantisation passes included);
    ``x_bytes`` and ``w_bytes`` are its operands' bytes per element."""
    e, q, c = GEMM_EFFICIENCY, PASS_EFFICIENCY, KERNEL_US * 1e-6
    p16, p8, bw = cost.bf16_tflops * 1e12, cost.f8_tflops * 1e12, cost.hbm_tbs * 1e12
    mk, kn, mn = m * k, k * n, m * n
    flops, s = 2.0 * m * k * n, mk + kn + mn
    wide = [(b, size) for b, size in ((x_bytes, mk), (w_bytes, kn)) if b > 2]
    t16 = 3 * flops / (e * p16) + 6 * s / bw
    t16 += sum((b + 2) * size for b, size in wide) / (q * bw) + len(wide) * c
    passes = (2 * x_bytes + 1) * mk + (2 * w_bytes + 1) * kn + 5 * mn + 2 * s
    t8 = 3 * flops / (e * p8) + 4 * s / bw + passes / (q * bw) + 9 * c
    return t16, t8


def predicted_ratio(
    m: int, k: int, n: int, x_bytes: int, w_bytes: int, cost: DeviceCost
) -> float:
    """:func:`predicted_times`' float8 time over its 16-bit time."""
    t16, t8 = predicted_times(m, k, n, x_bytes, w_bytes, cost)
    return t8 / t16


def choose(
    recipe: Any,
    where: str,
    mkn: tuple[int, int, int],
    itemsizes: tuple[int, int],
    device: Callable[[], tuple[DeviceCost, str]],
    dtype_name: str,
) -> Choice:
    """Whether the candidate at name stack ``where`` of sizes ``mkn`` runs in
    float8 under ``recipe``, and why. ``device()`` gives the figures of the
    device kind (:func:`current_device`; called by the cost model only)."""
    for pattern, flag in recipe.sites:
        if re.search(pattern, where):
            fmt = "float8" if flag else "16 bits"
            return Choice(flag, f"{fmt}: pattern '{pattern}' says so", "pattern")
    m, k, n = mkn
    if recipe.min_dim is not None:
        if min(mkn) >= max(recipe.min_dim, 1):
            why = f"float8: M, K, N >= min_dim {recipe.min_dim}"
            return Choice(True, why, "min_dim")
        why = f"16 bits: below min_dim {recipe.min_dim} (M={m}, K={k}, N={n})"
        return Choice(False, why, "min_dim")
    cost, name = device()
    r = predicted_ratio(m, k, n, *itemsizes, cost)
    fmt = "float8" if r < 1 else "16 bits"
    return Choice(r < 1, f"{fmt}: predicted {r:.2f} of {dtype_name} on {name}", "model")


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
    """``device_kind``: ``None`` or a kind :data:`DEVICES` knows."""
    if value is None:
        return None
    known = [p for p, _ in DEVICES]
    if not isinstance(value, str) or not any(p.lower() in value.lower() for p in known):
        raise ValueError(
            "`device_kind` must be None (the kind of the device JAX runs on) or "
            f"name a kind the cost model has figures for (one of {known}, as in "
            f"`jax.devices()[0].device_kind`), got {value!r}."
        )
    return value
