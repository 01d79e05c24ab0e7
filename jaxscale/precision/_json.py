"""A plan's text: :func:`duration` for its table; for its JSON, the checks
:meth:`~jaxscale.precision.Plan.from_json` reads fields with, and how error
scores are written (``inf`` as ``"inf"``)."""

from __future__ import annotations

import math
from typing import Any

from jaxscale.precision._measure import score

__all__ = [
    "PLAN_FIELDS",
    "SITE_FIELDS",
    "V2_FIELDS",
    "V3_FIELDS",
    "duration",
    "fields",
    "out",
    "read_score",
    "real",
    "string",
]


def fields(
    what: str,
    doc: Any,
    expected: frozenset[str] | set[str],
    optional: frozenset[str] | set[str] = frozenset(),
) -> None:
    if not isinstance(doc, dict):
        raise ValueError(f"{what} must be a JSON object, got {doc!r}.")
    missing = sorted(expected - set(doc) - set(optional))
    unknown = sorted(set(doc) - expected)
    if missing or unknown:
        raise ValueError(
            f"{what} must have the fields {sorted(expected)}; missing {missing}, "
            f"unknown {unknown}."
        )


def real(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ValueError(f"a time or figure must be a number, got {x!r}.")
    return float(x)


def string(what: str, x: Any) -> str:
    if not isinstance(x, str):
        raise ValueError(f"{what} must be a string, got {x!r}.")
    return x


def out(x: float) -> float | str:
    return "inf" if x == math.inf else x


def read_score(x: Any) -> float:
    return math.inf if x == "inf" else score("an error score or budget", x)


def duration(seconds: float) -> str:
    """``29.2 ms``, ``12 us``: a predicted time."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


# The fields of a saved plan (version 2 adds V2_FIELDS and a site's ``pinned``;
# version 3, V3_FIELDS and a site's ``noise``).
V2_FIELDS = frozenset({"dtype", "loss_scale", "allowed", "traced"})
V3_FIELDS = frozenset({"budget_in"})
PLAN_FIELDS = (
    frozenset({"kind", "version", "device", "cost", "budget", "sites"})
    | V2_FIELDS
    | V3_FIELDS
)
SITE_FIELDS = frozenset(
    {
        "site",
        "shape",
        "operand_bytes",
        "errors",
        "notes",
        "runs",
        "noise",
        "format",
        "seconds",
        "half_seconds",
        "why",
        "pinned",
    }
)
