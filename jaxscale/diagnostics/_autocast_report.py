"""``jxs.diagnostics.autocast_report``: what :func:`jaxscale.autocast` did.

The function is run under autocast with an observing interpreter
(:mod:`jaxscale.diagnostics._census`), under ``jax.eval_shape``: nothing is
computed, so it works on models of any size. It records each equation of the
user's function once, and which float32 values descend from a low-precision
activation (the float32 islands); this module turns the records into an
:class:`AutocastReport` (:mod:`jaxscale.diagnostics._report_text` prints it).

With ``compare=True`` the function is also run eagerly twice on the same jaxpr:
at float32 (every value kept) and under autocast, and each operation's output is
compared with the float32 one, in total and for the operation alone (run at
autocast's dtypes on the float32 run's inputs).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._autocast.classes import FOLD_NOTE, WIDE_NOTE
from jaxscale._autocast.entry import interpret, resolve, with_plan
from jaxscale._autocast.gradients import gradient_policy
from jaxscale._autocast.hop import HANDLERS
from jaxscale._autocast.rules import AutocastRule, Slot
from jaxscale._autocast.values import floating
from jaxscale.diagnostics._census import INLINE_HANDLERS, Census, Compare, source_of
from jaxscale.diagnostics._cotangents import as_pure
from jaxscale.diagnostics._report_text import render

__all__ = ["AutocastReport", "AutocastSite", "autocast_report"]

# The default island threshold: outputs at least this fraction of the largest
# output of a "lower" operation (a matmul's or convolution's activation).
_ISLAND_FRACTION = 16


@dataclasses.dataclass(frozen=True)
class AutocastSite:
    """One operation of the function as :func:`autocast_report` saw it.

    Attributes:
      primitive: the JAX primitive (``"mul"``, ``"dot_general"``...), as
        :func:`jax.make_jaxpr` prints it.
      source: the Flax module path of the operation (``"CNN/BatchNorm_0"``, from
        JAX's name stack: linen modules and ``jax.named_scope`` put it there), or
        its ``location`` where there is none.
      location: ``file:line`` of the innermost frame outside JAX that created the
        operation (a Flax file, shown relative to ``site-packages``, or yours);
        ``""`` if unknown.
      shape: the shape of its (first) output.
      dtype: the dtype its (first) output has under autocast.
      note: what autocast decided there, in words.
      abs_error: ``compare=True`` only: the largest ``|autocast - float32|``
        over the output's elements that are finite in both runs.
      rel_error: ``abs_error / max|float32|``: the error relative to the
        output's scale (0 where both are 0).
      local_error: the same relative error for this operation alone: run at
        autocast's dtypes on the float32 run's inputs, so it measures what the
        operation itself loses, not what it inherits; ``inf`` if it alone turns
        finite values into ``inf`` or ``NaN``.
      nonfinite: the number of output elements that are ``inf`` or ``NaN``
        under autocast and finite in the float32 run.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> f = lambda x: jnp.log(jnp.tanh(x @ x) + 1e-8)
      >>> report = jxs.diagnostics.autocast_report(f)(jnp.ones((4, 4)))
      >>> site = report.constants[0]
      >>> site.primitive, site.shape, site.dtype
      ('add', (4, 4), 'float32')
      >>> site.note
      'constant 1e-08 rounds to 0 in float16: runs in float32'
    """

    primitive: str
    source: str
    location: str
    shape: tuple[int, ...]
    dtype: str
    note: str = ""
    abs_error: float | None = None
    rel_error: float | None = None
    local_error: float | None = None
    nonfinite: int | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class AutocastReport:
    """What :func:`jaxscale.autocast` does to a function, operation by operation.

    ``print(report)`` shows it as tables; the fields hold the same numbers.
    Every count is per equation of the function (a loop body's operations once,
    not once per iteration); dtypes are named as NumPy names them
    (``"float16"``, ``"float32"``, ``"int32"``, ``"bool"``).

    Attributes:
      dtype: the autocast dtype (``"float16"`` or ``"bfloat16"``; ``"float32"``
        when autocast is off).
      operations: the number of operations (first-order equations, in the
        function and in the bodies of its ``jit``, ``scan``, ``cond``, custom
        derivatives..., in a gradient's too).
      by_primitive: primitive name to {dtype it ran in: count}. The dtype an
        operation ran in is that of its floating operands after autocast's casts
        (a norm-rule operation, its float32 operand cast to ``dtype``, ran in
        ``dtype``), or its output's for casts and operations without floating
        operands.
      by_source: the same counts per source (:attr:`AutocastSite.source`), in
        the order the sources first appear in the function.
      bytes_by_dtype: the bytes of every operation's floating outputs, summed
        per dtype: what the program writes if nothing is fused. Compare the
        dtypes with each other, not with a memory profile.
      min_size: the smallest output (in elements) that counts as an activation
        for :attr:`islands`.
      islands: the float32 islands: every operation whose float32 output has at
        least ``min_size`` elements and descends from an activation in
        ``dtype`` through operations that autocast runs at their operands'
        dtypes (``promote``, ``bias`` and ``keep`` rules), not through a
        ``float32``-rule one (``exp``, ``log``, sums...: float32 by design, as in
        torch). An island starts where such an operation widens an activation
        in ``dtype`` (its note says which operand was float32) and continues
        through what is computed from it in float32, up to the next matmul.
        These are the float32 activations autocast did not intend: a BatchNorm
        computed in float32 between float16 convolutions, a residual stream
        kept in float32, a loss's difference with float32 targets.
      constants: the operations where a constant of the function would not
        survive narrowing (see :func:`autocast`): saturated to the finite range
        in a selection, or run in float32 elsewhere, as the note says.
      norms: the operations of the norm rule: a norm's float32 statistic or
        parameter (or a value computed from parameters alone, as ``1 +
        scale``) applied to an activation in ``dtype``, cast to ``dtype``
        (saturating at its finite range) so that the operation runs in
        ``dtype``; and of the mask rule: a 0/1 mask made in the function
        multiplied into such an activation, cast exactly.
      deviation: with ``compare=True``, every operation with floating outputs
        and concrete values, worst first (by ``local_error``, then
        ``nonfinite``, then ``rel_error``); ``None`` otherwise.
      float8: with ``float8=``, each matmul the recipe chose for or against
        float8, in order, its note saying which and why (``"float8 site 0:
        ...; float8: predicted 0.85 of bfloat16 on NVIDIA H200"``, ``"float8
        declined: 16 bits: pattern 'head' says so"``); ``()`` otherwise.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def f(w, x):
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> report_fn = jxs.diagnostics.autocast_report(f)
      >>> report = report_fn(jnp.ones((3, 2)), jnp.ones((4, 3)))
      >>> dict(report.by_primitive["dot_general"]), report.operations
      ({'float16': 1}, 3)
      >>> dict(report.bytes_by_dtype)  # f16[4,2] twice (dot, tanh), f32[] once
      {'float16': 32, 'float32': 4}
    """

    dtype: str
    operations: int
    by_primitive: Mapping[str, Mapping[str, int]]
    by_source: Mapping[str, Mapping[str, int]]
    bytes_by_dtype: Mapping[str, int]
    min_size: int
    islands: tuple[AutocastSite, ...]
    constants: tuple[AutocastSite, ...]
    norms: tuple[AutocastSite, ...]
    deviation: tuple[AutocastSite, ...] | None = None
    float8: tuple[AutocastSite, ...] = ()

    def __repr__(self) -> str:
        parts = [
            f"{self.operations} operations",
            f"{len(self.islands)} in float32 islands",
            f"{len(self.constants)} constants",
            f"{len(self.norms)} norm-rule",
        ]
        if self.deviation is not None:
            parts.append(f"{len(self.deviation)} compared")
        if self.float8:
            sites = sum(s.note.startswith("float8 site") for s in self.float8)
            parts.append(f"{sites} of {len(self.float8)} matmuls in float8")
        return f"AutocastReport({self.dtype}: {', '.join(parts)})"

    def __str__(self) -> str:
        return render(self)


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


def _counts(pairs: Sequence[tuple[str, str]]) -> Mapping[str, Mapping[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for group, dtype in pairs:
        row = out.setdefault(group, {})
        row[dtype] = row.get(dtype, 0) + 1
    return types.MappingProxyType(
        {k: types.MappingProxyType(v) for k, v in out.items()}
    )


def _site(entry: dict[str, Any], note: str) -> AutocastSite:
    source, location = source_of(entry["eqns"])
    shape, dtype = entry["outs"][0] if entry["outs"] else ((), np.dtype("float32"))
    return AutocastSite(
        entry["name"], source, location, shape, np.dtype(dtype).name, note
    )


def _build(
    census: Census, min_size: int | None, deviation: Sequence[AutocastSite] | None
) -> AutocastReport:
    entries = list(census.entries.values())
    lowered = [
        int(np.prod(shape, dtype=np.int64))
        for e in entries
        if e["rule"] in (AutocastRule.LOWER, Slot.PLUGIN)  # matmuls
        for shape, _ in e["outs"][:1]
    ]
    if min_size is None:
        min_size = max(max(lowered, default=0) // _ISLAND_FRACTION, 1)
    sources = {id(e): source_of(e["eqns"])[0] for e in entries}
    nbytes: dict[str, int] = {}
    for e in entries:
        for shape, dtype in e["outs"]:
            if floating(dtype):
                size = int(np.prod(shape, dtype=np.int64))
                nbytes[dtype.name] = nbytes.get(dtype.name, 0) + size * dtype.itemsize
    islands = tuple(
        _site(e, e["island"])
        for e in sorted([*entries, *census.widened.values()], key=lambda e: e["seq"])
        if e["island"] and int(np.prod(e["outs"][0][0], dtype=np.int64)) >= min_size
    )
    constants, norms, float8 = [], [], []
    for e in entries:
        for note in e["notes"]:
            if note.startswith("float8"):  # the recipe's choice, site or not
                float8.append(_site(e, note))
            elif note not in (WIDE_NOTE, FOLD_NOTE):
                group = constants if note.startswith("constant") else norms
                group.append(_site(e, note))
    if deviation is not None:
        deviation = tuple(
            sorted(
                deviation,
                key=lambda s: (
                    -(s.local_error if s.local_error is not None else 0.0),
                    -(s.nonfinite or 0),
                    -(s.rel_error or 0.0),
                ),
            )
        )
    return AutocastReport(
        dtype=census.dtype.name,
        operations=len(entries),
        by_primitive=_counts(sorted((e["name"], e["ran_in"]) for e in entries)),
        by_source=_counts([(sources[id(e)], e["ran_in"]) for e in entries]),
        bytes_by_dtype=types.MappingProxyType(dict(sorted(nbytes.items()))),
        min_size=min_size,
        islands=islands,
        constants=tuple(constants),
        norms=tuple(norms),
        deviation=deviation,
        float8=tuple(float8),
    )


def _abstract_pure(
    fun: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable[..., Any], list[Any]]:
    """:func:`as_pure`, with ``jax.ShapeDtypeStruct`` leaves as arrays too (for
    ``jax.eval_shape``): stand-ins of no size mark them, then they replace them."""
    shapes: dict[int, Any] = {}

    def stand_in(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        dummy = np.zeros((0,), np.float32)
        shapes[id(dummy)] = (dummy, x)
        return dummy

    is_sds = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    args, kwargs = jax.tree.map(stand_in, (args, kwargs), is_leaf=is_sds)
    pure, arrays = as_pure(fun, args, kwargs)
    return pure, [shapes[id(a)][1] if id(a) in shapes else a for a in arrays]


def autocast_report(
    fun: Callable[..., Any],
    dtype: Any = jnp.float16,
    *,
    rules: Mapping[Any, Any] | None = None,
    compare: bool = False,
    min_size: int | None = None,
    float8: Any = None,
    gradient_dtype: Any = None,
    plan: Any = None,
) -> Callable[..., AutocastReport]:
    """What :func:`autocast` does to ``fun``: each operation's dtype, and where.

    ``jxs.diagnostics.autocast_report(fun, dtype, rules=...)`` takes the arguments of
    ``jxs.autocast`` and returns a function with ``fun``'s signature that
    returns an :class:`AutocastReport` instead of ``fun``'s outputs: how many
    operations ran in which dtype, per primitive and per source (the Flax module
    path where there is one, else ``file:line``), the bytes of the activations
    per dtype, the float32 *islands* (float32 activations descended from
    low-precision ones, such as a BatchNorm computed in float32 between float16
    convolutions), the constants autocast had to treat specially (a mask's
    ``finfo(float32).min`` saturated in float16, an ``eps`` that would round to
    0 run in float32) and the operations of the norm rule. ``print(report)``
    shows it as tables.

    The report runs ``fun`` under ``jax.eval_shape``: nothing is computed, so
    it is as cheap for a large model as tracing it, and array arguments may be
    given as ``jax.ShapeDtypeStruct``. Every count is per equation of ``fun``
    (an operation in a ``lax.scan`` body counts once, one in a ``jit`` function
    called twice counts twice). The report of a gradient,
    ``jax.grad(jxs.autocast(loss))``, counts its operations as the inner
    autocast left them, inside its ``jit`` and custom derivatives too; a
    weight-gradient product widened by ``gradient_dtype`` counts as one
    ``dot_general`` in ``dtype``, as it runs on a GPU (of a
    ``lax.platform_dependent`` computation, the first platform's branch is
    counted). With ``compare=True`` it
    also runs the function eagerly (operation by operation, not under ``jit``),
    once in float32 and once under autocast, on the same jaxpr and the given
    arguments, and lists every operation's deviation from float32, worst first:
    the first step of debugging a loss that mixed precision broke. The
    comparison keeps every intermediate value of both runs: use a small batch.
    Operations inside ``lax.scan``, ``while_loop`` and ``cond`` bodies have no
    concrete values and are left out of it (their results are compared where
    they are used); ``jit``, ``checkpoint`` and custom-derivative functions are
    evaluated in place, as autocast evaluates them.

    Flax NNX modules passed as arguments are run on a copy (their BatchNorm
    statistics and RNG counts are not updated). Call the report function
    outside ``jax.jit``: it returns a Python object. ``docs/autocast_report.md``
    shows the report of a BatchNorm CNN and of Flax's attention with a mask.

    Args:
      fun: the function, as passed to :func:`autocast`.
      dtype: the autocast dtype, as for :func:`autocast` (float16 by default,
        bfloat16; float32 reports autocast switched off).
      rules: overrides of the table, as for :func:`autocast`.
      compare: whether to run the comparison with float32 (eagerly).
      min_size: the smallest float32 output, in elements, that counts as an
        activation for the islands. Default: the largest output of a matmul or
        convolution (``lower`` rule) divided by 16, at least 1, so that the
        statistics of a norm and other per-channel values do not count.
      float8: as for :func:`autocast`. :attr:`AutocastReport.float8` lists
        each matmul the recipe chose for or against float8 and why (a float8
        site's note starts ``float8 site k``), and with ``compare=True`` its
        error against float32 is listed with the others: where float8 lost
        most. A delayed recipe is reported with current scaling (the report
        has no state).
      gradient_dtype: as for :func:`autocast`: the report then runs what a
        step with this ``gradient_dtype`` runs (the report of a gradient
        counts its weight-gradient products in that dtype).
      plan: as for :func:`autocast`: a :class:`jaxscale.precision.Plan`, each
        matmul site in its plan's format (not with ``float8``).

    Returns:
      A function with ``fun``'s signature returning an :class:`AutocastReport`.

    Raises:
      TypeError: if ``fun`` is not callable, ``compare`` is not a bool,
        ``min_size`` is not an int, or ``rules`` is not a mapping; from the
        report function, with ``compare=True``, if an argument is a tracer or a
        ``jax.ShapeDtypeStruct``.
      ValueError: if ``dtype`` is not one :func:`autocast` accepts, a rule is
        unknown, ``min_size`` is below 1, ``gradient_dtype`` is neither
        float32 nor ``dtype``, or both ``plan`` and ``float8`` are given.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def mlp(params, x):
      ...     h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
      ...     return jax.nn.softmax(h @ params["w2"])
      >>> params = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 3))}
      >>> report = jxs.diagnostics.autocast_report(mlp)(params, jnp.ones((2, 4)))
      >>> dict(report.by_primitive["dot_general"]), dict(report.by_primitive["exp"])
      ({'float16': 2}, {'float32': 1})
      >>> report.islands  # every activation stays float16
      ()

      A float32 input subtracted from an activation makes a float32 island, up
      to the next matmul:

      >>> def net(params, x, y):
      ...     return jax.nn.relu(x @ params["w1"] - y) @ params["w2"]
      >>> y = jnp.full((2, 8), 0.1)
      >>> report = jxs.diagnostics.autocast_report(net)(params, jnp.ones((2, 4)), y)
      >>> for site in report.islands:
      ...     print(site.primitive, site.shape, site.note)
      sub (2, 8) float16 widened by f32[2,8], a float32 parameter or input
      max (2, 8) from an island

      ``compare=True`` finds the operation that loses most against float32
      (here a matmul whose result, 80000, overflows float16's 65504):

      >>> w, x = jnp.full((4, 4), 200.0), jnp.full((2, 4), 100.0)
      >>> f = lambda w, x: jnp.mean(jnp.log(jax.nn.relu(x @ w) @ w))
      >>> worst = jxs.diagnostics.autocast_report(f, compare=True)(w, x).deviation[0]
      >>> worst.primitive, worst.nonfinite, worst.local_error
      ('dot_general', 8, inf)
      >>> report = jxs.diagnostics.autocast_report(f, compare=True)(w, x)
      >>> print(report)  # doctest: +ELLIPSIS
      autocast report: float16, 7 operations (3 float16, 4 float32)
      ...
    """
    if not callable(fun):
        raise TypeError(
            f"`fun` must be callable, got {type(fun).__name__}: "
            "`jxs.diagnostics.autocast_report(fun, dtype)(*args)` reports what "
            "`jxs.autocast(fun, dtype)(*args)` does."
        )
    dt, table, classes, plugin = resolve(dtype, rules, with_plan(plan, float8))
    wide = gradient_policy(gradient_dtype, dt)
    if plugin is not None:  # outside a train step: no state (delayed: current)
        plugin = plugin.for_report()
        classes = {**classes, Slot.PLUGIN: plugin}
    if not isinstance(compare, bool | np.bool_):
        raise TypeError(f"`compare` must be a Python bool, got {compare!r}.")
    if min_size is not None:
        if isinstance(min_size, bool) or not isinstance(min_size, int | np.integer):
            raise TypeError(f"`min_size` must be an int or None, got {min_size!r}.")
        if min_size < 1:
            raise ValueError(f"`min_size` must be >= 1, got {min_size}.")

    def report(*args: Any, **kwargs: Any) -> AutocastReport:
        leaves = jax.tree.leaves((args, kwargs))
        if compare and any(
            isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct) for x in leaves
        ):
            raise TypeError(
                "`autocast_report(..., compare=True)` compares concrete values: "
                "pass arrays (not `jax.ShapeDtypeStruct`), and call its function "
                "outside `jax.jit` and other transformations."
            )
        rule, ruled = plugin, classes
        if getattr(plugin, "prepare", None) is not None:  # a plan: at these shapes

            def trace(r: Any) -> None:
                c = Census(
                    dt,
                    table,
                    HANDLERS,
                    classes={**classes, Slot.PLUGIN: r},
                    extension=r.begin(),
                )
                pure, arrays = _abstract_pure(
                    lambda *a, **kw: interpret(fun, c, a, kw, wide=wide), args, kwargs
                )
                jax.eval_shape(pure, arrays)

            rule = plugin.prepare(trace)
            ruled = {**classes, Slot.PLUGIN: rule}
        ext = rule.begin() if rule is not None else None
        census = Census(dt, table, HANDLERS, classes=ruled, extension=ext)
        pure, arrays = _abstract_pure(
            lambda *a, **kw: interpret(fun, census, a, kw, wide=wide), args, kwargs
        )
        jax.eval_shape(pure, arrays)
        deviation = None
        if compare:
            ext = rule.begin() if rule is not None else None
            it = Compare(dt, table, INLINE_HANDLERS, classes=ruled, extension=ext)
            pure, arrays = as_pure(
                lambda *a, **kw: interpret(fun, it, a, kw, wide=wide), args, kwargs
            )
            pure(arrays)
            deviation = [AutocastSite(**s) for s in it.sites.values()]
        return _build(census, min_size, deviation)

    return report
