"""Where the backward pass underflows: statistics of activation gradients per site.

The user marks activations with :func:`cotangent_probe` (the identity).
:func:`cotangent_report` evaluates the loss twice at trace time: once under
``jax.eval_shape`` to find the probes, then under ``jax.grad`` with one zero
*tap* array per probe call. Each probe becomes a ``custom_vjp`` identity of its
activation and its tap, whose backward returns the activation's cotangent
unchanged and, as the tap's cotangent, a row of statistics of it. The gradient
with respect to the taps is the report: no side effects, no host callbacks, and
it composes with ``jit``, ``vmap``, ``lax.scan`` and ``jax.checkpoint``.

The tap is a probe of kind :class:`_Tap` (:mod:`jaxscale._probe`), fields by
name. A gradient adds up the contributions of every use of an input, so a tap
read several times at run time (a probe inside the user's ``lax.scan``, or
under ``vmap``) gets the *sum* of its statistics: every field declares
``"sum"``. The largest magnitude is therefore also carried as a one-hot over
the top bits of its float32 bit pattern (``max_bins``), so that the highest set
bin bounds the maximum over all the calls.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata

from jaxscale import _nnx
from jaxscale._loss_scale import scale_tree
from jaxscale._probe import zeros
from jaxscale._scope import Scope
from jaxscale._tree import is_float_leaf
from jaxscale.diagnostics._underflow import cast_masks, half_dtype, scale_value

__all__ = ["CotangentStats", "cotangent_probe", "cotangent_report", "cotangent_table"]

_F32 = jnp.float32
# The maximum's bins: the top 12 bits (8 exponent bits and 4 mantissa bits) of
# a non-negative float32.
_SHIFT = 19
_NBINS = 1 << (31 - _SHIFT)


class _Tap(NamedTuple):
    """A probe site's statistics of its cotangent, summed over its calls."""

    calls: Any  # f32[]: backward runs
    size: Any  # f32[]: cotangent elements
    zero: Any  # f32[]: exactly zero
    flush: Any  # f32[]: flush to zero in the dtype
    subnormal: Any  # f32[]: subnormal in the dtype
    overflow: Any  # f32[]: overflow in the dtype
    nonfinite: Any  # f32[]: inf or NaN
    max_abs: Any  # f32[]: the largest finite magnitude (exact for one call)
    max_bins: Any  # f32[_NBINS]: its one-hot bin, see the module docstring


_Tap.COMBINE = dict.fromkeys(_Tap._fields, "sum")


class CotangentStats(NamedTuple):
    """Statistics of the cotangent at one probe site; every field an ``f32[]``.

    The cotangent is the gradient of the *scaled* loss with respect to the
    probed activation, as the backward pass computes it. Fractions are over all
    elements of all calls of the site.

    Attributes:
      loss_scale: the scale the loss was multiplied by.
      size: number of cotangent elements (summed over calls).
      calls: how many times the site's backward ran (a probe inside a
        ``lax.scan`` of ``n`` steps runs ``n`` times, under ``vmap`` once per
        example); 0 if the site does not reach the loss.
      zero_fraction: fraction exactly zero in the cotangent as computed. In a
        float16 model this includes what float16 already flushed; in a float32
        model, structural zeros (ReLU, masks).
      flush_fraction: fraction non-zero and finite that become 0 when cast to
        the analysed dtype (0 if the cotangent already is in that dtype).
      subnormal_fraction: fraction subnormal in the analysed dtype after the
        cast (precision lost).
      overflow_fraction: fraction finite that become ``inf`` in that dtype.
      nonfinite_fraction: fraction ``inf`` or ``NaN`` in the cotangent.
      max_abs: the largest finite magnitude. Exact when each probe call of the
        site ran once; otherwise rounded up to 5 significant bits (at most
        6.25% above the true maximum).
      headroom_log2: ``log2(finfo(dtype).max / max_abs)``: how many doublings of
        the loss scale the largest element still tolerates (negative: it
        overflows; ``inf`` if all zero).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> def loss(x):
      ...     return jnp.sum(jxs.diagnostics.cotangent_probe(x, "x") * 1e-9)
      >>> stats = jxs.diagnostics.cotangent_report(loss, 1.0)(jnp.ones(4))["x"]
      >>> isinstance(stats, jxs.diagnostics.CotangentStats), float(stats.flush_fraction)
      (True, 1.0)
    """

    loss_scale: jax.Array
    size: jax.Array
    calls: jax.Array
    zero_fraction: jax.Array
    flush_fraction: jax.Array
    subnormal_fraction: jax.Array
    overflow_fraction: jax.Array
    nonfinite_fraction: jax.Array
    max_abs: jax.Array
    headroom_log2: jax.Array


# --------------------------------------------------------------------------- #
# Trace-time context
# --------------------------------------------------------------------------- #


class _Recorder:
    """The active report: finds the probe calls, then hands each its tap."""

    def __init__(self, dtype: np.dtype, taps: list[jax.Array] | None = None):
        self.dtype = dtype
        self.taps = taps  # None while discovering
        self.sites: list[tuple[str, int | None]] = []


# The recorder of the report being traced (trace time only, per thread).
_RECORDERS = Scope("cotangent report")
_traces = itertools.count()


def _fresh_traces() -> Any:
    """A context in which JAX's trace caches miss.

    ``jax.jit``, ``jax.checkpoint`` and ``lax.scan`` cache the traces of the
    functions they wrap, keyed by the function, the shapes and the trace
    context; a cached trace made outside a report has no probes, and one made in
    an earlier report refers to that report's taps. A unique XLA metadata entry
    (part of the trace context; it only annotates the HLO) keys every pass anew.
    """
    return set_xla_metadata(jaxscale_cotangent_report=str(next(_traces)))


def _active() -> _Recorder | None:
    return _RECORDERS.current()


def _run(recorder: _Recorder, fun: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    with _RECORDERS.push(recorder):
        return fun(*args, **kw)


# --------------------------------------------------------------------------- #
# The probe
# --------------------------------------------------------------------------- #


def _row(gs: list[jax.Array], dt: np.dtype) -> _Tap:
    """One call's statistics of the cotangent leaves ``gs``."""
    counts = [jnp.zeros((), jnp.int32) for _ in range(5)]
    mx = jnp.zeros((), _F32)
    for g in gs:
        if g.size == 0:
            continue
        gf = g.astype(_F32)
        finite = jnp.isfinite(gf)
        masks = (gf == 0, *cast_masks(gf, dt), ~finite)
        for i, m in enumerate(masks):
            counts[i] = counts[i] + jnp.sum(m, dtype=jnp.int32)
        mx = jnp.maximum(mx, jnp.max(jnp.where(finite, jnp.abs(gf), 0)))
    top = lax.bitcast_convert_type(mx, jnp.uint32) >> _SHIFT
    onehot = (jnp.arange(_NBINS, dtype=jnp.uint32) == top) & (mx > 0)
    size = jnp.float32(sum(g.size for g in gs))
    # Stacked, then named: under ``vmap`` the constant fields (``calls``,
    # ``size``) are then batched like the others and summed over the examples.
    scalars = jnp.stack([jnp.ones((), _F32), size, *(c.astype(_F32) for c in counts)])
    return _Tap(*scalars, max_abs=mx, max_bins=onehot.astype(_F32))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _probe(dt: np.dtype, leaves: list[jax.Array], tap: _Tap) -> list[jax.Array]:
    del dt, tap
    return leaves


def _probe_fwd(dt, leaves, tap):
    del dt, tap
    return leaves, None


def _probe_bwd(dt, _, gs):
    return list(gs), _row(list(gs), dt)


_probe.defvjp(_probe_fwd, _probe_bwd)


def _check_probe_args(name: Any, index: Any, size: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"`name` must be a non-empty string, got {name!r}.")
    if (index is None) != (size is None):
        raise TypeError(
            "`index` and `size` go together: pass both (a row per index, e.g. "
            "per layer of a `lax.scan`) or neither; got "
            f"index={index!r}, size={size!r}."
        )
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or size < 1
    ):
        raise ValueError(f"`size` must be a positive Python int, got {size!r}.")
    if index is not None:
        dtype = getattr(index, "dtype", None)
        ok = isinstance(index, int) and not isinstance(index, bool)
        ok |= dtype is not None and jnp.issubdtype(dtype, jnp.integer)
        if not ok or np.ndim(index) != 0:
            raise TypeError(f"`index` must be an integer scalar, got {index!r}.")
        if isinstance(index, int) and not 0 <= index < size:
            raise ValueError(f"`index` must be in [0, {size}), got {index}.")


def cotangent_probe(
    x: Any, name: str, *, index: Any = None, size: int | None = None
) -> Any:
    """Marks an activation whose gradient :func:`cotangent_report` measures.

    Returns ``x`` unchanged. Outside :func:`cotangent_report` it does nothing
    at all (nothing is added to the jaxpr), so the probes can stay in a model
    that trains normally. Inside, the probe records statistics of the cotangent
    of ``x`` (the gradient of the scaled loss with respect to it), over all its
    floating leaves, without changing any value or gradient.

    Several calls with one ``name`` (a Python loop, or one call in a
    ``lax.scan`` body that runs many times) are aggregated into one entry. To
    keep the steps of a scan apart, pass the step's ``index`` (a traced integer
    in ``[0, size)``) and the number of steps ``size``: the report then has an
    entry ``f"{name}[{i}]"`` per index. An ``index`` out of range at run time
    makes every entry of that name ``NaN``.

    Args:
      x: an array or a pytree holding at least one floating array.
      name: the site's name in the report.
      index: with ``size``, the row of this call (e.g. the layer number).
      size: with ``index``, the number of rows (a Python int).

    Returns:
      ``x``.

    Raises:
      TypeError: if ``name`` is not a non-empty string, ``index`` is not an
        integer scalar, only one of ``index`` and ``size`` is given, or ``x``
        holds no floating array (inside a report).
      ValueError: if ``size`` is not a positive int, or a Python ``index`` is
        out of range.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def loss(w, x):
      ...     h = jxs.diagnostics.cotangent_probe(jnp.tanh(x @ w), "hidden")
      ...     return jnp.mean(h)
      >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
      >>> jax.grad(loss)(w, x).shape  # no report active: the identity
      (3, 2)
      >>> report = jxs.diagnostics.cotangent_report(loss, 2.0**10)(w, x)
      >>> float(report["hidden"].size), float(report["hidden"].max_abs)
      (8.0, 128.0)
    """
    _check_probe_args(name, index, size)
    rec = _active()
    if rec is None:
        return x
    leaves, treedef = jax.tree.flatten(x)
    floats = [i for i, v in enumerate(leaves) if is_float_leaf(v)]
    if not floats:
        raise TypeError(
            f"`x` of `cotangent_probe(x, {name!r})` must hold a floating array, "
            f"got {jax.tree.map(lambda v: getattr(v, 'dtype', type(v)), x)}."
        )
    k = len(rec.sites)
    rec.sites.append((name, size))
    if rec.taps is None:  # discovering
        return x
    if k >= len(rec.taps):
        raise RuntimeError(_RETRACE)
    tap = rec.taps[k]
    if index is not None:  # an out-of-range index writes to the extra last row
        index = jnp.asarray(index)
        index = jnp.where((index >= 0) & (index < size), index, size)
        tap = jax.tree.map(
            lambda t: lax.dynamic_index_in_dim(t, index, keepdims=False), tap
        )
    out = _probe(rec.dtype, [jnp.asarray(leaves[i]) for i in floats], tap)
    for i, v in zip(floats, out, strict=True):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


_RETRACE = (
    "`fun` called `cotangent_probe` differently in the two traces of "
    "`cotangent_report` (once under `jax.eval_shape`, once under `jax.grad`): "
    "the calls depend on concrete values. Make the probe calls depend on shapes "
    "and Python constants only, or jit the report function so that both traces "
    "see abstract values."
)


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


def _max_of(row: _Tap) -> jax.Array:
    """The largest magnitude of a tap: exact after one call, else the bin edge."""
    bins = row.max_bins > 0
    top = _NBINS - 1 - jnp.argmax(bins[::-1]).astype(jnp.uint32)
    edge = lax.bitcast_convert_type((top + 1) << _SHIFT, _F32)
    edge = jnp.minimum(edge, jnp.finfo(_F32).max)
    rounded = jnp.where(jnp.any(bins), edge, 0)
    return jnp.where(row.calls <= 1, row.max_abs, rounded)


def _stats(rows: list[_Tap], scale: jax.Array, dt: np.dtype) -> CotangentStats:
    total = rows[0]
    for r in rows[1:]:
        total = jax.tree.map(jnp.add, total, r)
    max_abs = jnp.max(jnp.stack([_max_of(r) for r in rows]))
    denom = jnp.maximum(total.size, 1)
    big = float(jnp.finfo(dt).max)
    safe = jnp.where(max_abs > 0, max_abs, 1)
    headroom = jnp.where(max_abs > 0, jnp.log2(_F32(big)) - jnp.log2(safe), jnp.inf)
    return CotangentStats(
        loss_scale=scale,
        size=total.size,
        calls=total.calls,
        zero_fraction=total.zero / denom,
        flush_fraction=total.flush / denom,
        subnormal_fraction=total.subnormal / denom,
        overflow_fraction=total.overflow / denom,
        nonfinite_fraction=total.nonfinite / denom,
        max_abs=max_abs,
        headroom_log2=headroom.astype(_F32),
    )


def _layout(sites: list[tuple[str, int | None]]) -> dict[str, list[int]]:
    """Probe calls grouped by name, checking that each name has one ``size``."""
    groups: dict[str, list[int]] = {}
    for k, (name, size) in enumerate(sites):
        first = groups.setdefault(name, [k])[0]
        if first != k:
            groups[name].append(k)
            if sites[first][1] != size:
                raise ValueError(
                    f"`cotangent_probe` site {name!r} is called with size="
                    f"{sites[first][1]!r} and with size={size!r}; give every call "
                    "of one name the same `size` (or none)."
                )
    keys = set()
    for name, calls in groups.items():
        size = sites[calls[0]][1]
        new = [name] if size is None else [f"{name}[{i}]" for i in range(size)]
        clash = keys.intersection(new)
        if clash:
            raise ValueError(
                f"`cotangent_probe` names collide on {sorted(clash)}: an indexed "
                f"site {name!r} and a site named like one of its rows. Rename one."
            )
        keys.update(new)
    return groups


def as_pure(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], list[Any]]:
    """``fun(*args, **kwargs)`` as a function of the arrays in its arguments.

    Returns ``(pure, arrays)`` with ``pure(arrays, *extra)`` calling
    ``fun(*extra, *args, **kwargs)``; other leaves are constants. A Flax NNX
    module is split into its graph and state and merged again inside, with new
    variables, so it may update its statistics in the trace (JAX forbids
    mutating variables from an outer trace) while the original keeps its own.
    """
    nnx = sys.modules.get("flax.nnx")
    graphs: dict[int | str, Any] = {}
    items = (list(args), dict(kwargs))
    if nnx is not None:
        for k, v in [*enumerate(args), *kwargs.items()]:
            if _nnx.is_object(v):
                graphs[k], state = nnx.split(v)
                items[isinstance(k, str)][k] = state
    leaves, treedef = jax.tree.flatten(items)
    dynamic = [isinstance(x, jax.Array | np.ndarray | np.generic) for x in leaves]

    def pure(arrays: list[Any], *extra: Any) -> Any:
        it = iter(arrays)
        full = [next(it) if d else x for x, d in zip(leaves, dynamic, strict=True)]
        a, kw = jax.tree.unflatten(treedef, full)
        for k, graphdef in graphs.items():
            container = kw if isinstance(k, str) else a
            container[k] = nnx.merge(graphdef, container[k])
        return fun(*extra, *a, **kw)

    return pure, [x for x, d in zip(leaves, dynamic, strict=True) if d]


def _finish(
    rows: list[_Tap],
    sites: list[tuple[str, int | None]],
    scale: jax.Array,
    dt: np.dtype,
) -> dict[str, CotangentStats]:
    """The report from the taps' gradients: one entry per name or index."""
    out: dict[str, CotangentStats] = {}
    for name, calls in _layout(sites).items():
        size = sites[calls[0]][1]
        if size is None:
            out[name] = _stats([rows[k] for k in calls], scale, dt)
            continue
        bad = sum(rows[k].calls[size] for k in calls) > 0
        for i in range(size):
            row = [jax.tree.map(lambda t, i=i: t[i], rows[k]) for k in calls]
            stats = _stats(row, scale, dt)
            out[f"{name}[{i}]"] = stats._replace(
                **{
                    f: jnp.where(bad, jnp.nan, v)
                    for f, v in stats._asdict().items()
                    if f != "loss_scale"
                }
            )
    return out


def cotangent_report(
    fun: Callable[..., Any],
    loss_scale: Any = None,
    dtype: Any = jnp.float16,
    *,
    has_aux: bool = False,
) -> Callable[..., dict[str, CotangentStats]]:
    """Per probe site, how the backward pass's activation gradients fare in a dtype.

    The returned function differentiates ``fun(*args) * loss_scale`` (the loss
    scaled as :func:`jaxscale.value_and_grad` scales it) and reports, for each
    :func:`cotangent_probe` site in ``fun``, the fraction of the cotangent that
    is zero, that would flush to zero, become subnormal or overflow when cast to
    ``dtype``, and the headroom of its largest element. It is one function of
    the arguments: jit it, or call it inside a jitted function; nothing is
    synchronised and the model's outputs are unchanged. Run it on a float32
    model to see what float16 would lose, or on the float16 model itself
    (``zero_fraction`` then holds what was flushed), at scale 1 and at the scale
    :func:`jaxscale.dynamic_scaling` settled on.

    ``fun`` is traced twice (under ``jax.eval_shape`` to find the probes, then
    under ``jax.grad``), afresh on every call even where it uses ``jax.jit``,
    ``jax.checkpoint`` or ``lax.scan`` (whose cached traces would miss the
    probes): jit the report function to trace it once. Flax NNX modules passed as
    arguments (positional or keyword) are evaluated on a copy, so BatchNorm
    statistics and RNG counts of the originals are not updated.

    Args:
      fun: the loss function with probes inside; returns a scalar floating
        loss, or ``(loss, aux)`` with ``has_aux=True`` (``aux`` is ignored).
      loss_scale: a number, a :class:`LossScale`, or an optimizer state holding
        one (its current scale); default 1.
      dtype: the half dtype to analyse, e.g. ``jnp.float16`` or
        ``jnp.bfloat16``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s signature returning a ``dict`` from site name
      (``f"{name}[{i}]"`` for indexed sites) to :class:`CotangentStats`, in the
      order the sites were first called.

    Raises:
      TypeError: if ``dtype`` is not floating, ``loss_scale`` not a scalar or a
        state, or the loss not a floating scalar.
      ValueError: if ``fun`` calls no probe, or one name is used inconsistently.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def loss(w, x):
      ...     h = jxs.diagnostics.cotangent_probe(x @ w, "logits")
      ...     return jnp.mean(h) * 1e-8  # a tiny loss: tiny cotangents
      >>> report_fn = jax.jit(jxs.diagnostics.cotangent_report(loss, 1.0, jnp.float16))
      >>> r = report_fn(jnp.ones((3, 2)), jnp.ones((4, 3)))["logits"]
      >>> float(r.flush_fraction)
      1.0
      >>> report = jxs.diagnostics.cotangent_report(loss, 2.0**15)
      >>> r = report(jnp.ones((3, 2)), jnp.ones((4, 3)))
      >>> float(r["logits"].flush_fraction), float(r["logits"].subnormal_fraction)
      (0.0, 1.0)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    dt = half_dtype(dtype)
    scale_value(loss_scale)  # validate now, read the value per call

    def scaled_loss(scale: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        out = fun(*args, **kwargs)
        loss = out[0] if has_aux else out
        if not is_float_leaf(loss) or jnp.ndim(loss) != 0:
            raise TypeError(
                "`fun` must return a floating scalar loss"
                + (" as the first element of `(loss, aux)`" if has_aux else "")
                + f", got {jax.tree.map(lambda v: getattr(v, 'dtype', v), loss)!r}."
            )
        return jnp.asarray(scale_tree(loss, scale))

    def report(*args: Any, **kwargs: Any) -> dict[str, CotangentStats]:
        pure, arrays = as_pure(scaled_loss, args, kwargs)
        scale = scale_value(loss_scale)
        finder = _Recorder(dt)
        with _fresh_traces():
            jax.eval_shape(lambda a, s: _run(finder, pure, a, s), arrays, scale)
        if not finder.sites:
            raise ValueError(
                "`fun` calls no `jxs.diagnostics.cotangent_probe`: mark the "
                "activations to measure, e.g. "
                "`h = jxs.diagnostics.cotangent_probe(h, 'block0')`, inside the "
                "loss."
            )
        _layout(finder.sites)  # name errors before anything is compiled

        def run(arrays: list[Any], scale: jax.Array) -> dict[str, CotangentStats]:
            def taps_loss(taps: list[_Tap]) -> jax.Array:
                rec = _Recorder(dt, taps)
                loss = _run(rec, pure, arrays, scale)
                if rec.sites != finder.sites:
                    raise RuntimeError(_RETRACE)
                return loss

            taps = [
                zeros(_Tap, () if n is None else (n + 1,), max_bins=(_NBINS,))
                for _, n in finder.sites
            ]
            return _finish(jax.grad(taps_loss)(taps), finder.sites, scale, dt)

        with _fresh_traces():  # one program: eager op-by-op would compile each op
            return jax.jit(run)(arrays, scale)

    return report


def cotangent_table(report: dict[str, CotangentStats]) -> str:
    """A plain-text table of a :func:`cotangent_report` result, one row per site.

    Reads the values on the host (a device synchronisation): call it outside
    ``jit``, e.g. every few hundred steps.

    Args:
      report: the ``dict`` :func:`cotangent_report`'s function returned.

    Returns:
      The table as a string, columns named as the fields of
      :class:`CotangentStats`: site, ``size``, ``calls``, percentages ``zero``,
      ``flush``, ``subnorm(al)``, ``over(flow)`` and ``nonfin(ite)``, ``max_abs``
      and ``headroom_log2``.

    Raises:
      TypeError: if ``report`` is not a dict of :class:`CotangentStats`.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> def loss(x):
      ...     x = jxs.diagnostics.cotangent_probe(x, "x")
      ...     return jnp.sum(x * jnp.array([1e-9, 1.0]))
      >>> report = jxs.diagnostics.cotangent_report(loss)(jnp.ones(2))
      >>> print(jxs.diagnostics.cotangent_table(report))
      site  size  calls  zero%  flush%  subnorm%  over%  nonfin%  max|g|  headroom
      x        2      1   0.00   50.00      0.00   0.00     0.00       1     16.00
    """
    if not isinstance(report, dict) or not all(
        isinstance(v, CotangentStats) for v in report.values()
    ):
        raise TypeError(
            "`report` must be the dict of jxs.diagnostics.CotangentStats that "
            "`jxs.diagnostics.cotangent_report(...)(...)` returns, got "
            f"{type(report).__name__}."
        )
    host = jax.device_get(report)
    head = ["site", "size", "calls", "zero%", "flush%", "subnorm%", "over%"]
    head += ["nonfin%", "max|g|", "headroom"]
    lines = [head]
    for name, s in host.items():
        pct = (s.zero_fraction, s.flush_fraction, s.subnormal_fraction)
        bad = (s.overflow_fraction, s.nonfinite_fraction)
        lines.append(
            [name, f"{s.size:.0f}", f"{s.calls:.0f}"]
            + [f"{100 * float(p):.2f}" for p in (*pct, *bad)]
            + [f"{float(s.max_abs):.4g}", f"{float(s.headroom_log2):.2f}"]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in lines
    )
