"""What a sensor measured at one matmul site: :class:`SiteMeasure`.

A site is named as float8's per-matmul choice names it (``float8/_choice.py``):
by its name-stack path (Flax module path, ``jax.named_scope``), with its shape
``(m, k, n)`` beside it, so that a plan can reach :func:`jaxscale.autocast` the
way a float8 recipe's ``sites`` do. Its error scores are per format
(:class:`~jaxscale._speed.Format`), in :data:`PRECISION` order.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxscale._cost import DeviceCost
from jaxscale._speed import Format, site_seconds

__all__ = [
    "FORMATS",
    "KINDS",
    "PRECISION",
    "SiteMeasure",
    "kind_formats",
    "measured_formats",
    "half_ratio",
    "in_order",
    "number",
    "score",
    "scores",
]

# From the most to the least precise: ties in a plan go to the first.
PRECISION = (
    Format.FLOAT32,
    Format.HALF_WIDE,
    Format.HALF,
    Format.FLOAT8_ROWWISE,
    Format.FLOAT8,
)
FORMATS = ", ".join(f"Format.{f.name}" for f in PRECISION)  # for messages
# The kinds of site and the formats each runs in (``docs/precision.md``, "Score
# and convolution sites"): a ``dot_general`` without batch dimensions (every
# format), one with batch dimensions on two activations (attention's score and
# value products: 16 bits, 16 bits with a float32 result, float32) and a
# ``conv_general_dilated`` (16 bits or float32: no float8 convolution).
KINDS = MappingProxyType(
    {
        "dense": PRECISION,
        "batched": (Format.FLOAT32, Format.HALF_WIDE, Format.HALF),
        "conv": (Format.FLOAT32, Format.HALF),
    }
)


def measured_formats(
    kind: str, dtype: Any, formats: Iterable[Format]
) -> tuple[Format, ...]:
    """Those of ``formats`` the sensor measures at a site of ``kind`` when
    autocast runs in ``dtype``: the kind's, but a float32 score (``HALF_WIDE``
    at a batched site) under bfloat16, whose 16-bit scores have float32's range
    (the range rule keeps them; XLA:CPU of jax 0.7 cannot run that product)."""
    out = tuple(f for f in formats if f in KINDS[kind])
    if kind == "batched" and np.dtype(dtype) == np.dtype(jnp.bfloat16):
        out = tuple(f for f in out if f is not Format.HALF_WIDE)
    return out


def kind_formats(kind: str) -> str:
    """The formats a site of ``kind`` runs in, for messages."""
    return ", ".join(f"Format.{f.name}" for f in KINDS[kind])


_BYTES = (1, 2, 4, 8)


def in_order(values: Iterable[float]) -> float:
    """The sum of error scores as a plan adds them: one float64 addition at a
    time, in site order (not ``sum``, which compensates on Python 3.12 and
    later, and not ``math.fsum``): rounding is then monotone in each partial
    sum, which the solver's exactness rests on."""
    total = 0.0
    for v in values:
        total = total + float(v)
    return total


def number(x: float) -> str:
    """``2.1e-4``, ``0.0021``, ``0``, ``inf``: an error score or a budget."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def score(where: str, value: Any) -> float:
    """An error score: a non-negative float (``inf`` allowed), or a clear error."""
    if isinstance(value, bool) or not (
        isinstance(value, numbers.Real) or getattr(value, "shape", None) == ()
    ):
        raise TypeError(
            f"{where} must be a non-negative number, got "
            f"{type(value).__name__} {value!r}."
        )
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"{where} must be a non-negative number (math.inf where the "
            f"format's range fails), got {value!r}."
        )
    return value


def _by_format(name: str, site: str, value: Any, check: Any) -> Mapping[Format, Any]:
    """``value`` as a read-only mapping in :data:`PRECISION` order (so that equal
    mappings hash alike), its keys checked to be formats, its values by ``check``."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"SiteMeasure {site!r}: `{name}` must map a Format to a value, got "
            f"{type(value).__name__} {value!r}."
        )
    for key in value:
        if not isinstance(key, Format):
            raise TypeError(
                f"SiteMeasure {site!r}: the keys of `{name}` must be Formats "
                f"({FORMATS}), got {key!r}."
            )
    return MappingProxyType(
        {
            f: check(f"SiteMeasure {site!r}: `{name}[{f}]`", value[f])
            for f in PRECISION
            if f in value
        }
    )


def _note(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a string, got {type(value).__name__}.")
    return value


def _ints(name: str, site: str, value: Any, size: int, rule: str) -> tuple[int, ...]:
    ok = isinstance(value, tuple | list) and len(value) == size
    ok = ok and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    )
    if not ok:
        raise TypeError(
            f"SiteMeasure {site!r}: `{name}` must be {rule}, got {value!r}."
        )
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class SiteMeasure:
    """What a sensor measured at one matmul site: its error score per format.

    A site is a ``dot_general`` ``[m, k] x [k, n]`` (with its two backward
    products), named by its name-stack path as float8's per-matmul choice names
    it. The error scores are measured on calibration batches against float32;
    :func:`~jaxscale.precision.solve` adds them up over the sites and keeps the
    sum within a budget. A format missing from ``errors`` was not measured and
    is never chosen for this site.

    Attributes:
      site: the site's name-stack path, e.g. ``"GPT/block_0/mlp_up"``; unique
        within a plan.
      shape: ``(m, k, n)``, positive integers.
      operand_bytes: ``(x_bytes, w_bytes)``: the operands' bytes per element as
        they arrive (4: float32, 2: a 16-bit type), each one of 1, 2, 4, 8.
      errors: a read-only mapping from :class:`~jaxscale.precision.Format` to the
        error score measured in it, non-negative; ``math.inf`` where the format's
        range fails (float16 overflows, say).
      notes: optional, per format: why, in words (``"max |x| 9.1e4 overflows
        float16"``).
      runs: how many times a step runs the site (a ``scan`` of length 12
        around it: 12); its predicted time is multiplied by it.
      noise: optional, per format: the gradient error the format adds at the
        site as a fraction of the model's minibatch gradient noise (what a
        noise budget, :class:`~jaxscale.precision.NoiseBudget`, adds up);
        the same formats as ``errors``, ``math.inf`` exactly where ``errors``
        is. ``None``: not measured (a noise budget then refuses the site).
      kind: ``"dense"`` (a ``dot_general`` without batch dimensions, every
        format), ``"batched"`` (with batch dimensions on two activations:
        attention's products; ``FLOAT32``, ``HALF_WIDE``, ``HALF``) or
        ``"conv"`` (a ``conv_general_dilated``; ``FLOAT32``, ``HALF``), its
        ``shape`` the equivalent GEMM's.

    Raises:
      TypeError: if a field has the wrong type.
      ValueError: if ``site`` is empty, a size is not positive, a byte count is
        not one of 1, 2, 4, 8, ``errors`` is empty, an error is negative or NaN,
        a note names a format that ``errors`` does not, ``noise`` names
        other formats than ``errors`` or is ``inf`` elsewhere, or ``kind`` is
        unknown or ``errors`` holds a format its kind does not run in.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.precision
      >>> F = jxs.precision.Format
      >>> m = jxs.precision.SiteMeasure(
      ...     "GPT/block_0/mlp_up", (8192, 768, 3072), (4, 4),
      ...     {F.FLOAT32: 0.0, F.HALF: 1e-4, F.FLOAT8: 2e-3},
      ... )
      >>> m.errors[F.HALF]
      0.0001
      >>> F.FLOAT8_ROWWISE in m.errors  # not measured: never chosen here
      False
    """

    site: str
    shape: tuple[int, int, int]
    operand_bytes: tuple[int, int]
    errors: Mapping[Format, float]
    notes: Mapping[Format, str] = dataclasses.field(default_factory=dict)
    runs: int = 1
    noise: Mapping[Format, float] | None = None
    kind: str = "dense"

    def __post_init__(self):
        site = self.site
        if not isinstance(site, str) or not site:
            raise (TypeError if not isinstance(site, str) else ValueError)(
                "`site` must be a non-empty string (the site's name-stack path, "
                f"e.g. 'GPT/block_0/mlp_up'), got {site!r}."
            )
        if self.kind not in KINDS:
            raise ValueError(
                f"SiteMeasure {site!r}: `kind` must be one of {list(KINDS)}, got "
                f"{self.kind!r}."
            )
        rule = "three positive integers (m, k, n) of the product [m, k] x [k, n]"
        shape = _ints("shape", site, self.shape, 3, rule)
        if min(shape) < 1:
            raise ValueError(
                f"SiteMeasure {site!r}: `shape` must be {rule}, got {shape}."
            )
        rule = (
            "two byte counts (x_bytes, w_bytes), each one of 1, 2, 4, 8 (the "
            "operands' bytes per element as they arrive: 4 for float32)"
        )
        nbytes = _ints("operand_bytes", site, self.operand_bytes, 2, rule)
        if any(b not in _BYTES for b in nbytes):
            raise ValueError(
                f"SiteMeasure {site!r}: `operand_bytes` must be {rule}, got {nbytes}."
            )
        errors = _by_format("errors", site, self.errors, score)
        if not errors:
            raise ValueError(
                f"SiteMeasure {site!r}: `errors` must hold at least one format's "
                "error score, got an empty mapping."
            )
        foreign = [f.value for f in errors if f not in KINDS[self.kind]]
        if foreign:
            raise ValueError(
                f"SiteMeasure {site!r}: a {self.kind} site runs in "
                f"{kind_formats(self.kind)} only, got errors for {', '.join(foreign)}."
            )
        notes = _by_format("notes", site, self.notes, _note)
        unmeasured = [str(f) for f in notes if f not in errors]
        if unmeasured:
            raise ValueError(
                f"SiteMeasure {site!r}: `notes` must be about measured formats, "
                f"got notes for {', '.join(unmeasured)}, which `errors` lacks."
            )
        runs = self.runs
        if isinstance(runs, bool) or not isinstance(runs, numbers.Integral) or runs < 1:
            wrong = isinstance(runs, bool) or not isinstance(runs, numbers.Integral)
            raise (TypeError if wrong else ValueError)(
                f"SiteMeasure {site!r}: `runs` must be a positive int (how many "
                f"times a step runs the site), got {runs!r}."
            )
        noise = self.noise
        if noise is not None:
            noise = _by_format("noise", site, noise, score)
            if set(noise) != set(errors) or any(
                math.isinf(noise[f]) != math.isinf(errors[f]) for f in errors
            ):
                raise ValueError(
                    f"SiteMeasure {site!r}: `noise` must hold the formats of "
                    f"`errors` ({', '.join(str(f) for f in errors)}), inf exactly "
                    f"where `errors` is, got {dict(noise)}."
                )
        for name, value in (
            ("noise", noise),
            ("runs", int(runs)),
            ("shape", shape),
            ("operand_bytes", nbytes),
            ("errors", errors),
            ("notes", notes),
        ):
            object.__setattr__(self, name, value)

    def __hash__(self) -> int:
        return hash(
            (
                self.site,
                self.shape,
                self.operand_bytes,
                tuple(self.errors.items()),
                tuple(self.notes.items()),
                self.runs,
                None if self.noise is None else tuple(self.noise.items()),
                self.kind,
            )
        )

    def seconds(self, fmt: Format, cost: DeviceCost) -> float:
        """The speed model's predicted seconds of this site in ``fmt``, its
        ``runs`` runs included."""
        return self.runs * site_seconds(fmt, *self.shape, *self.operand_bytes, cost)


def scores(m: SiteMeasure, by: str) -> Mapping[Format, float]:
    """Site ``m``'s scores that a budget in ``by`` adds up: ``"error"``, its
    error scores; ``"noise"``, its gradient-noise fractions (which it must
    have: :func:`~jaxscale.precision.solve` checks)."""
    if by == "noise":
        if m.noise is None:
            raise ValueError(f"site {m.site!r} has no noise figures.")
        return m.noise
    return m.errors


def half_ratio(m: SiteMeasure, fmt: Format, cost: DeviceCost) -> float:
    """The predicted time of site ``m`` in ``fmt`` over its time in 16 bits (the
    ratio a plan's ``why`` states)."""
    return m.seconds(fmt, cost) / m.seconds(Format.HALF, cost)
