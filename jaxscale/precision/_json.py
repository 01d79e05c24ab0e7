"""A plan's text: :func:`duration` for its table; for its JSON, the checks
:meth:`~jaxscale.precision.Plan.from_json` reads fields with, and how error
scores are written (``inf`` as ``"inf"``)."""

from __future__ import annotations

import json
import math
from typing import Any

from jaxscale._cost import DeviceCost
from jaxscale._speed import Format
from jaxscale.precision._measure import PRECISION, SiteMeasure, score

JSON_KIND, JSON_VERSION = "jaxscale.precision.Plan", 4

__all__ = [
    "JSON_KIND",
    "JSON_VERSION",
    "PLAN_FIELDS",
    "SITE_FIELDS",
    "V2_FIELDS",
    "V3_FIELDS",
    "duration",
    "fields",
    "out",
    "plan_doc",
    "plan_fields",
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
# version 3, V3_FIELDS and a site's ``noise``; version 4, a site's ``kind``:
# before it every site was dense).
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
        "kind",
    }
)


def plan_doc(plan: Any) -> dict[str, Any]:
    """The JSON document of ``plan`` (:meth:`~jaxscale.precision.Plan.to_json`)."""
    sites = []
    for s, m in zip(plan.sites, plan.measures, strict=True):
        sites.append(
            {
                "site": s.site,
                "shape": list(s.shape),
                "operand_bytes": list(m.operand_bytes),
                "errors": {f.value: out(e) for f, e in m.errors.items()},
                "noise": None
                if m.noise is None
                else {f.value: out(e) for f, e in m.noise.items()},
                "notes": {f.value: n for f, n in m.notes.items()},
                "runs": m.runs,
                "format": s.format.value,
                "seconds": s.seconds,
                "half_seconds": s.half_seconds,
                "why": s.why,
                "pinned": s.site in plan.pinned,
                "kind": m.kind,
            }
        )
    doc = {
        "kind": JSON_KIND,
        "version": JSON_VERSION,
        "device": plan.device,
        "cost": plan.cost._asdict(),
        "budget": out(plan.budget),
        "budget_in": plan.budget_in,
        "dtype": None if plan.dtype is None else plan.dtype.name,
        "loss_scale": plan.loss_scale,
        "allowed": [f.value for f in plan.allowed],
        "traced": plan.traced,
        "sites": sites,
    }
    return doc


def plan_fields(text: str) -> tuple[Any, ...]:
    """The :class:`~jaxscale.precision.Plan` fields, in order, of the JSON text
    :meth:`~jaxscale.precision.Plan.to_json` wrote (versions 1 to 4).

    Raises:
      ValueError: if ``text`` is not JSON, is not a plan, has a version this
        jaxscale does not read, or lacks or adds a field.
    """
    try:
        doc = json.loads(text)
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"`text` must be a plan's JSON text: {err}.") from None
    if not isinstance(doc, dict) or doc.get("kind") != JSON_KIND:
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"`text` must be the JSON of a {JSON_KIND} (`Plan.to_json`), got "
            f"kind {kind!r}."
        )
    if doc.get("version") not in (1, 2, 3, JSON_VERSION):
        raise ValueError(
            "`text`: this jaxscale reads plans of versions 1 to "
            f"{JSON_VERSION}, got version {doc.get('version')!r}: load it "
            "with the jaxscale that wrote it, or solve the plan again."
        )
    try:
        # Version 1 has no dtype or loss scale: both unknown (None);
        # versions 1 and 2 no noise figures: a budget of error scores.
        v1, old = doc["version"] == 1, doc["version"] < 3
        v3 = doc["version"] < 4  # no kinds: every site dense
        expected = PLAN_FIELDS - V3_FIELDS if old else PLAN_FIELDS
        fields("the plan", doc, expected - V2_FIELDS if v1 else expected)
        fields("`cost`", doc["cost"], set(DeviceCost._fields))
        name, *figures = (doc["cost"][f] for f in DeviceCost._fields)
        cost = DeviceCost(string("`cost.name`", name), *map(real, figures))
        if not isinstance(doc["sites"], list):
            raise ValueError(f"`sites` must be a list, got {doc['sites']!r}.")
        sites, measures, pinned = [], [], []
        for entry in doc["sites"]:
            site_fields = SITE_FIELDS - {"noise"} if old else SITE_FIELDS
            site_fields = site_fields - {"pinned"} if v1 else site_fields
            site_fields = site_fields - {"kind"} if v3 else site_fields
            fields("a site", entry, site_fields, optional={"runs"})
            if v1 or entry["pinned"] is True:  # version 1: runs as saved
                pinned.append(entry["site"])
            errors = {Format(f): read_score(e) for f, e in entry["errors"].items()}
            notes = {Format(f): n for f, n in entry["notes"].items()}
            noise = entry.get("noise")
            if noise is not None:
                noise = {Format(f): read_score(e) for f, e in noise.items()}
            m = SiteMeasure(
                entry["site"],
                tuple(entry["shape"]),
                tuple(entry["operand_bytes"]),
                errors,
                notes,
                entry.get("runs", 1),
                noise,
                string("`kind`", entry.get("kind", "dense")),
            )
            fmt = Format(entry["format"])
            # The times are written for readers; the plan derives them.
            real(entry["seconds"]), real(entry["half_seconds"])
            sites.append((fmt, string("`why`", entry["why"])))
            measures.append(m)
        device = string("`device`", doc["device"])
        dtype, scale = doc.get("dtype"), doc.get("loss_scale")
        if dtype is not None:
            dtype = string("`dtype`", dtype)
        scale = None if scale is None else real(scale)
        allowed = tuple(map(Format, doc.get("allowed", [f.value for f in PRECISION])))
        return (
            tuple(measures),
            tuple(sites),
            read_score(doc["budget"]),
            device,
            cost,
            dtype,
            scale,
            allowed,
            frozenset(pinned),
            doc.get("traced", False) is True,
            string("`budget_in`", doc.get("budget_in", "error")),
        )
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"`text` is not a valid plan: {err}") from None
