"""The sensor: :class:`Sensor` runs the tap (:mod:`jaxscale.precision._tap`) on
calibration batches and turns its sums into
:class:`~jaxscale.precision.SiteMeasure` scores; :func:`plan_precision`
measures and solves in one call."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._cost import DeviceCost, current_device
from jaxscale._distributed import differing_processes, from_every_process
from jaxscale._speed import Format
from jaxscale.internal import autocast, check_dtype
from jaxscale.precision._budget import NoiseBudget
from jaxscale.precision._measure import (
    KINDS,
    PRECISION,
    SiteMeasure,
    measured_formats,
    number,
)
from jaxscale.precision._plan import Plan
from jaxscale.precision._solve import solve
from jaxscale.precision._tap import (
    FIELDS,
    REFERENCE,
    SESSION,
    SensorRule,
    Session,
    TapStats,
)

__all__ = ["Sensor", "plan_precision"]

_F32 = np.dtype("float32")
# The backward products' squared errors, each over its reference's squares.
_GRAD_ERRORS = (("dx", "dx_ref"), ("dw", "dw_ref"))


def _loss_scale(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(
            "`loss_scale` must be a number (the loss scale the model trains with, "
            f"e.g. 2.0**15 for float16), got {type(value).__name__} {value!r}."
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`loss_scale` must be finite and positive, got {value!r}.")
    return float(value)


# The rows each format is measured on by default (``Sensor(rows=)``).
ROWS = 64


def _rows(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            "`rows` must be an int (the rows each format is measured on) or None "
            f"(every row: exact sums), got {type(value).__name__} {value!r}."
        )
    if value < 1:
        raise ValueError(f"`rows` must be >= 1 (or None: every row), got {value!r}.")
    return int(value)


def _formats(formats: Any) -> tuple[Format, ...]:
    """The formats to measure, in :data:`PRECISION` order, 16 bits always
    (the budget's reference and the scores' scale)."""
    if formats is None:
        return PRECISION
    if isinstance(formats, Format | str) or not isinstance(formats, Iterable):
        raise TypeError(
            "`formats` must be a collection of `jxs.precision.Format`s (or None: "
            f"all five), got {formats!r}."
        )
    given = set(formats)
    bad = [f for f in given if not isinstance(f, Format)]
    if bad:
        raise TypeError(f"`formats` must hold `jxs.precision.Format`s, got {bad[0]!r}.")
    return tuple(f for f in PRECISION if f in given or f is Format.HALF)


class Sensor:
    """Measures, per matmul site of ``fun`` and per format, the error each
    format would add, on calibration batches.

    ``fun`` takes arrays and returns a scalar loss, written in float32 (as for
    :func:`jaxscale.autocast`). Each :meth:`update` runs one jitted forward and
    backward pass of ``fun`` in float32 (the reference), and at each site
    (a ``dot_general`` without batch dimensions: what
    ``jxs.autocast(fun, dtype, plan=...)`` runs per format) computes the site's
    three products again in each :class:`~jaxscale.precision.Format` from the
    same operands, with the gradient scaled by ``loss_scale`` and cast as that
    format would take it. :meth:`measures` gives the scores
    (``docs/precision.md``, "What the sensor measures"):

    - ``fisher``: ``sum((g * dy)**2)``, the variance the format's output error
      ``dy`` adds to the loss to first order (``g``: the site's gradient), and
      ``grad``: the relative squared error of its backward products; the score
      is ``fisher / F + grad / G``, ``F`` and ``G`` their sums over the sites in
      16 bits, so the model in 16 bits scores 2;
    - ``noise``: the gradient error the format adds, as a fraction of the
      minibatch gradient noise (the noise budget's score, ``docs/precision.md``,
      "The noise budget"): the squared error of its weight gradient ``x^T g``,
      plus its input gradient's relative squared error times the squares of
      the weight gradients of the sites met before it (those it reaches, to
      first order: a conservative estimate), over the noise of all the sites'
      weight gradients, estimated from two halves of each batch's rows;
    - ``inf`` where the format's range fails on a batch: an output that
      overflows, an operand it cannot hold, a gradient beyond 16 bits even
      unscaled. A gradient that overflows only at ``loss_scale`` is noted, not
      failed: dynamic loss scaling lowers the scale until it fits.

    Sites are named as ``jxs.autocast(..., plan=)`` names them: by name stack,
    ``#1``, ``#2`` for repeats, a scanned layer once.

    Args:
      fun: the loss function.
      dtype: the autocast dtype the plan will run in (bfloat16 or float16): the
        format ``Format.HALF`` is.
      loss_scale: the loss scale the model trains with (the backward's
        gradients are measured scaled by it; 1.0 for bfloat16).
      rules: the ``rules`` of :func:`jaxscale.autocast`, if the plan will run
        with some.
      formats: the formats to measure (default: all five; ``HALF`` always,
        the budget's reference). Fewer formats, fewer products to compile
        and run; a format not measured is never chosen.
      rows: the rows (a site's examples and positions) each format's
        products are measured on, one in each of ``rows`` strata of the
        batch, their sums scaled up to the batch's; each format's weight
        gradient error is sketched over every row from the operands it
        multiplies; attention's and convolutions' products run on a sample
        of their slices or examples (``docs/precision.md``, "What the sensor
        measures"): estimates whose cost grows slowly with the batch;
        ``None``: every row, exact sums. The reference's own sums (the noise
        among them) and the range checks always read every row.

    Raises:
      TypeError: if ``rows`` is not an int or None.
      ValueError: if ``rows`` is below 1.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> import jaxscale.precision
      >>> def loss(p, x):
      ...     return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
      >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
      >>> p = {"w1": jax.random.normal(k1, (16, 32)),
      ...      "w2": jax.random.normal(k2, (32, 4))}
      >>> sensor = jxs.precision.Sensor(loss, jnp.bfloat16)
      >>> sensor.update(p, jax.random.normal(k3, (8, 16))).batches
      1
      >>> [m.site for m in sensor.measures()]
      ['(top level)', '(top level)#1']
      >>> F = jxs.precision.Format
      >>> all(m.errors[F.FLOAT8] > m.errors[F.HALF] for m in sensor.measures())
      True
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        dtype: Any = jnp.bfloat16,
        *,
        loss_scale: float = 1.0,
        rules: Any = None,
        formats: Iterable[Format] | None = None,
        rows: int | None = ROWS,
    ):
        if not callable(fun):
            raise TypeError(f"`fun` must be callable, got {type(fun).__name__}.")
        self.dtype = check_dtype(dtype)
        if self.dtype == _F32:
            raise ValueError(
                "`dtype` must be bfloat16 or float16 (the 16-bit dtype the plan "
                "runs in), got float32."
            )
        self.loss_scale = _loss_scale(loss_scale)
        self.formats = _formats(formats)
        self.rows = _rows(rows)
        rule = SensorRule(
            loss_scale=self.loss_scale, formats=self.formats, rows=self.rows
        )
        self._run = autocast(fun, self.dtype, rules=rules, plan=rule)
        self._sites: dict[str, tuple[Any, ...]] = {}
        self._kinds: dict[str, str] = {}
        self._order: list[str] = []
        self._sums: list[TapStats] | None = None  # per site, float64 sums
        self.batches = 0
        self._mine = 0  # the batches in `_sums` (`_spans_processes`)
        self._step = jax.jit(self._probe_grads)

    def _loss(self, probes: Any, args: tuple, kwargs: dict) -> Any:
        with SESSION.push(Session(probes)):
            out = self._run(*args, **kwargs)
        if not (
            hasattr(out, "shape")
            and jnp.shape(out) == ()
            and jnp.issubdtype(out.dtype, jnp.floating)
        ):
            got = jax.typeof(out) if hasattr(out, "shape") else type(out).__name__
            raise TypeError(
                "`fun` must return a scalar floating loss (the sensor "
                f"differentiates it), got {got}."
            )
        return out.astype(_F32)

    def _probe_grads(self, probes: Any, args: tuple, kwargs: dict) -> Any:
        return jax.grad(self._loss)(probes, args, kwargs)

    def _count(self, args: tuple, kwargs: dict) -> None:
        session = Session()
        with SESSION.push(session):
            jax.eval_shape(lambda a, k: self._run(*a, **k), args, kwargs)
        if not session.order:
            raise ValueError(
                "`fun` has no site (a `dot_general` or a `conv_general_dilated`, "
                "outside custom-derivative rules): there is "
                "nothing to plan."
            )
        self._sites, self._order = session.sites, session.order
        self._kinds = session.kinds

    def update(self, *args: Any, **kwargs: Any) -> Sensor:
        """Measures one calibration batch (``fun(*args, **kwargs)``); returns
        the sensor. The first call traces ``fun`` to find its sites; later
        calls must have the same sites."""
        if not self._order:
            self._count(args, kwargs)
        probes = tuple(TapStats.zeros() for _ in self._order)
        grads = self._step(probes, args, kwargs)
        sums = [jax.tree.map(lambda a: np.asarray(a, np.float64), g) for g in grads]
        mine = not _spans_processes(grads) or jax.process_index() == 0
        if not mine:  # a global batch: process 0 keeps its sums for all
            sums = jax.tree.map(np.zeros_like, sums)
        if self._sums is not None:
            sums = [_add(a, b) for a, b in zip(self._sums, sums, strict=True)]
        self._sums = sums
        self.batches += 1
        self._mine += mine
        return self

    def _forget(self) -> Sensor:
        """Drops the batches measured so far (the sites and the compiled pass
        stay); returns the sensor."""
        self._sums, self.batches, self._mine = None, 0, 0
        return self

    def stats(self) -> dict[str, dict[Any, dict[str, float]]]:
        """The raw sums per site, per format (and ``"reference"``), per field,
        averaged over the batches: ``linear`` is the first-order change of
        the loss, ``sum(g * dy)``; see :data:`~jaxscale.precision._tap.FIELDS`.
        Under ``jax.distributed``, the sums and batches of every process
        (:func:`_agree`): every process must call it."""
        if self._sums is None:
            raise ValueError("the sensor has measured no batch: call `update` first.")
        all_sums, batches = _agree(self._sums, self._mine, self._order, self._sites)
        out = {}
        for name, sums in zip(self._order, all_sums, strict=True):
            mean = sums._asdict()
            mean = {k: v if k == "amax" else v / batches for k, v in mean.items()}
            row: dict[Any, dict[str, float]] = {
                f: {k: mean[k][j] for k in FIELDS} for j, f in enumerate(PRECISION)
            }
            row["reference"] = {k: mean[k] for k in REFERENCE}
            out[name] = row
        return out

    def measures(self) -> tuple[SiteMeasure, ...]:
        """One :class:`~jaxscale.precision.SiteMeasure` per site, in order,
        with its ``noise`` figures where the batches' rows split in two
        (:meth:`noise_problem` says why not)."""
        stats = self.stats()
        noise = _noise_fractions(stats, self.formats, self._kinds)
        fisher, grad, notes = {}, {}, {}
        for name, row in stats.items():
            ref = row["reference"]
            for f in self._formats_at(name):
                s = row[f]
                fisher[name, f] = s["fisher"]
                grad[name, f] = sum(
                    s[k] / ref[r] for k, r in _GRAD_ERRORS if ref[r] > 0
                )
                notes[name, f] = _trouble(s, ref, f, self.dtype, self.loss_scale)
            if self._kinds.get(name) == "batched" and Format.HALF in self.formats:
                notes[name, Format.HALF] = _range_rule(
                    notes[name, Format.HALF], ref["amax"], self.dtype
                )
        half = [n for n in stats if not notes[n, Format.HALF][0]]
        big_f = math.fsum(fisher[n, Format.HALF] for n in half)
        big_g = math.fsum(grad[n, Format.HALF] for n in half)
        out = []
        for name in self._order:
            errors, words = {}, {}
            for f in self._formats_at(name):
                failed, note = notes[name, f]
                e = (fisher[name, f] / big_f if big_f > 0 else 0.0) + (
                    grad[name, f] / big_g if big_g > 0 else 0.0
                )
                errors[f] = math.inf if failed else e
                if note:
                    words[f] = note
            mkn, nbytes, runs = self._sites[name]
            fractions = None
            if noise is not None:
                fractions = {
                    f: math.inf if math.isinf(errors[f]) else noise[name][f]
                    for f in errors
                }
            kind = self._kinds.get(name, "dense")
            out.append(
                SiteMeasure(name, mkn, nbytes, errors, words, runs, fractions, kind)
            )
        return tuple(out)

    def _formats_at(self, name: str) -> tuple[Format, ...]:
        """The formats measured at site ``name``: those its kind runs in."""
        kind = self._kinds.get(name, "dense")
        return measured_formats(kind, self.dtype, self.formats)

    def noise_problem(self) -> str | None:
        """Why the batches measured give no noise figures (``None``: they do).
        The noise is measured between two halves of a batch's rows at each site;
        a batch of one row cannot split. Every process must call it (as
        :meth:`stats`)."""
        return _noise_problem(self.stats())

    def plan(
        self,
        *,
        budget: NoiseBudget | float | str = "noise",
        allowed: Iterable[Format] | None = None,
        cost: DeviceCost | str | None = None,
    ) -> Plan:
        """:func:`~jaxscale.precision.solve` on :meth:`measures`, by default
        within a tenth of the minibatch gradient noise (``budget="noise"``,
        :class:`~jaxscale.precision.NoiseBudget`; ``"16-bit"``: no worse than
        the model in 16 bits); ``cost`` ``None`` is the device JAX runs on (the
        H100 SXM's figures for a kind the speed model does not know, the CPU
        included). The plan records the sensor's ``dtype`` and ``loss_scale``.

        Raises:
          ValueError: for a noise budget, if the batches gave no noise figures
            (every site met one row per batch): give batches of more rows, or
            ``budget="16-bit"``.
        """
        if budget == "noise" or isinstance(budget, NoiseBudget):
            problem = self.noise_problem()
            if problem is not None:
                raise ValueError(
                    f"`budget` {budget!r} is relative to the minibatch gradient "
                    f"noise, but {problem} Give calibration batches of more rows "
                    "(the batch size you train with), or use `budget='16-bit'` or "
                    "a number."
                )
        if cost is None:
            cost = current_device(None)[0]
        plan = solve(self.measures(), cost=cost, budget=budget, allowed=allowed)
        return plan.with_dtype(self.dtype, self.loss_scale)


def _noise_problem(stats: dict) -> str | None:
    """Why ``stats`` give no noise figures, or ``None``."""
    refs = [row["reference"] for row in stats.values()]
    if not any(r["halves"] > 0 for r in refs):
        return (
            "no site could measure it: the noise is measured between the two "
            "halves of a batch's rows, and every site met a single row."
        )
    if not math.fsum(r["noise"] for r in refs) > 0:
        return (
            "the noise measured is zero (every row's weight gradient alike): "
            "there is nothing to be relative to."
        )
    return None


def _noise_fractions(
    stats: dict, formats: tuple[Format, ...], kinds: dict[str, str] | None = None
) -> dict[str, dict[Format, float]] | None:
    """Per site and format, the gradient error the format adds as a fraction
    of the model's minibatch gradient noise (``None`` without noise figures):
    the weight gradient's squared error ``dw``, plus the input gradient's
    relative squared error ``dx / dx_ref`` times ``dw_ref`` summed over the
    sites met before this one (the gradient it reaches to first order; as if
    the error were as coherent over the rows as the gradient: an upper
    estimate), over the sum of the sites' ``noise``."""
    if _noise_problem(stats) is not None:
        return None
    kinds = kinds or {}
    total = math.fsum(row["reference"]["noise"] for row in stats.values())
    below, out = 0.0, {}
    for name, row in stats.items():
        ref = row["reference"]
        kind = kinds.get(name, "dense")
        out[name] = {}
        for f in (f for f in formats if f in KINDS[kind]):
            s = row[f]
            reach = s["dx"] / ref["dx_ref"] * below if ref["dx_ref"] > 0 else 0.0
            if kind == "batched":  # both operands activations: no weight
                own = s["dw"] / ref["dw_ref"] * below if ref["dw_ref"] > 0 else 0.0
                out[name][f] = (own + reach) / total
            else:
                out[name][f] = (s["dw"] + reach) / total
        if kind != "batched":
            below += ref["dw_ref"]
    return out


def _spans_processes(tree: Any) -> bool:
    """Whether the arrays of ``tree`` span several processes (the step ran on
    global arrays: its sums are the global batch's, the same everywhere)."""
    return any(
        isinstance(a, jax.Array) and not a.is_fully_addressable
        for a in jax.tree.leaves(tree)
    )


def _agree(
    sums: list[TapStats], batches: int, order: list[str], sites: dict
) -> tuple[list[TapStats], int]:
    """The sensor's sums and batch count over every ``jax.distributed``
    process, the same on each: every process's float64 sums, gathered bit for
    bit (as ``uint32`` words: no float64 on the device needed) and added in
    process order; with one process, ``(sums, batches)`` unchanged.

    Raises:
      ValueError: if the processes traced different sites (names, sizes): the
        plans would differ, and so would the programs.
    """
    if jax.process_count() == 1:
        return sums, batches
    differ = differing_processes([(n, sites[n]) for n in order])
    if differ:
        raise ValueError(
            "`Sensor`: the processes traced different matmul sites (names or "
            f"sizes): process {jax.process_index()} has {len(order)} sites, "
            f"processes {differ} differ from process 0. Give every process "
            "calibration batches of the same shapes (and the same function)."
        )
    leaves, tree = jax.tree.flatten(sums)
    flat = np.concatenate([np.ravel(a) for a in leaves] + [np.float64([batches])])
    every = from_every_process(flat.astype(np.float64).view(np.uint32)).view(np.float64)
    total = every[0].copy()
    for row in every[1:]:  # in process order: the same bits on every process
        total += row
    at = 0  # each site's ``amax``: the largest over the processes, not the sum
    for path, a in jax.tree_util.tree_flatten_with_path(sums)[0]:
        if getattr(path[-1], "name", None) == "amax":
            total[at : at + a.size] = every[:, at : at + a.size].max(axis=0)
        at += np.size(a)
    out, at = [], 0
    for a in leaves:
        out.append(total[at : at + a.size].reshape(np.shape(a)))
        at += a.size
    return jax.tree.unflatten(tree, out), int(total[-1])


# A batched site keeps 16-bit results where its largest output measured (after
# the scale rule's scale) times this stays within the 16-bit dtype's range: the
# margin for batches not seen (``Monitor``'s default headroom too).
SCORE_HEADROOM = 4.0


def _add(a: TapStats, b: TapStats) -> TapStats:
    """Two batches' sums: added, ``amax`` the larger."""
    return TapStats(
        *(
            np.maximum(x, y) if k == "amax" else np.add(x, y)
            for k, x, y in zip(TapStats._fields, a, b, strict=True)
        )
    )


def _range_rule(
    trouble: tuple[bool, str], amax: float, dtype: np.dtype
) -> tuple[bool, str]:
    """A batched site's 16-bit verdict, the widening rule made per site:
    failed (16 bits with a float32 result instead) where its measured ``amax``
    times :data:`SCORE_HEADROOM` exceeds ``dtype``'s largest value; the note
    says the amax and the limit. bfloat16 (float32's range) never fails."""
    failed, note = trouble
    top = float(jnp.finfo(dtype).max)
    if top > 1e30:
        words = f"measured amax {number(amax)}, {dtype.name} has float32's range"
    else:
        limit = top / SCORE_HEADROOM
        over = amax > limit
        failed = failed or over
        words = (
            f"measured amax {number(amax)} {'>' if over else '<='} "
            f"{limit:.6g} ({dtype.name}'s {top:.6g} / headroom {SCORE_HEADROOM:g})"
        )
    return failed, "; ".join(w for w in (words, note) if w)


def _share(count: float, total: float) -> str:
    return f"{100 * count / max(total, 1):.2g}%"


def _trouble(s: dict, ref: dict, fmt: Format, dtype: np.dtype, scale: float):
    """``(failed, note)`` for one site in one format. A format fails where its
    forward range does (an output that overflows, an operand it cannot hold)
    or where the gradient overflows its 16 bits unscaled; a gradient that
    overflows only at the loss scale is noted (dynamic loss scaling lowers
    the scale until it fits), not failed."""
    name, words = dtype.name, []
    if s["overflow"] > 0:
        words.append(
            f"{_share(s['overflow'], ref['outputs'])} of outputs overflow {name}"
        )
    if s["range"] > 0:
        words.append(f"{_share(s['range'], ref['inputs'])} of operands beyond {name}")
    if fmt is not Format.FLOAT32 and ref["grad_beyond"] > 0:
        share = _share(ref["grad_beyond"], ref["outputs"])
        words.append(f"{share} of the gradient beyond {name}, unscaled")
    failed = bool(words)
    if s["grad_overflow"] > 0 and not (
        fmt is not Format.FLOAT32 and ref["grad_beyond"] > 0
    ):
        share = _share(s["grad_overflow"], ref["outputs"])
        words.append(
            f"{share} of the gradient overflows {name} at loss scale {number(scale)} "
            "(dynamic loss scaling would skip steps and lower it)"
        )
    if s["flush"] > 0 and ref["grads"] > 0:
        share = _share(s["flush"], ref["grads"])
        words.append(f"{share} of the gradient flushes to zero in {name}")
    return failed, "; ".join(words)


def plan_precision(
    fun: Callable[..., Any],
    dtype: Any = jnp.bfloat16,
    *,
    budget: NoiseBudget | float | str = "noise",
    allowed: Iterable[Format] | None = None,
    cost: DeviceCost | str | None = None,
    loss_scale: float = 1.0,
    rules: Any = None,
) -> Callable[..., Plan]:
    """A precision plan for ``fun``, measured on one calibration batch.

    ``jxs.plan_precision(loss, dtype)(*args)`` measures each matmul site of
    ``loss`` in every format on ``args`` (:class:`~jaxscale.precision.Sensor`)
    and returns the fastest :class:`~jaxscale.precision.Plan` within
    ``budget`` (:func:`~jaxscale.precision.solve`); run it with
    ``jxs.autocast(loss, dtype, plan=plan)``. For several batches, use a
    :class:`~jaxscale.precision.Sensor` and its ``plan``.

    Args:
      fun: the loss function (returns a scalar), written in float32.
      dtype: the 16-bit autocast dtype (bfloat16 or float16).
      budget: ``"noise"`` (default, ``NoiseBudget()``): the gradient error
        the formats add within a tenth of the calibration batch's minibatch
        gradient noise (measure at the batch size you train with);
        ``NoiseBudget(fraction)``: another fraction; ``"16-bit"``: the sum of
        the sites' 16-bit scores, no worse than the model in ``dtype``; or a
        number of error scores.
      allowed: the formats a site may take (default: all five); only these
        (and 16 bits, the budget's reference) are measured.
      cost: a device kind (``"H100"``, ``"H200"``) or a ``DeviceCost``;
        ``None``: the device JAX runs on.
      loss_scale: the loss scale the model trains with.
      rules: autocast ``rules`` the plan will run with.

    Returns:
      A function of ``fun``'s arguments that returns a ``Plan``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def loss(p, x):
      ...     return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
      >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
      >>> p = {"w1": jax.random.normal(k1, (16, 32)),
      ...      "w2": jax.random.normal(k2, (32, 4))}
      >>> x = jax.random.normal(k3, (8, 16))
      >>> plan = jxs.plan_precision(loss, jnp.bfloat16, cost="H100")(p, x)
      >>> sorted(plan.formats())
      ['(top level)', '(top level)#1']
      >>> float(jxs.autocast(loss, jnp.bfloat16, plan=plan)(p, x)) != 0
      True
    """
    if allowed is not None and isinstance(allowed, Iterable):
        allowed = tuple(allowed)  # read twice: by the sensor and by the solver
    sensor = Sensor(fun, dtype, loss_scale=loss_scale, rules=rules, formats=allowed)

    def planner(*args: Any, **kwargs: Any) -> Plan:
        sensor._forget()  # one batch per plan (the compiled step is kept)
        return sensor.update(*args, **kwargs).plan(
            budget=budget, allowed=allowed, cost=cost
        )

    return planner
