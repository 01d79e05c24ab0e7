"""Diagnostics: on-device counters, overflowing leaves, underflow analysis, norms.

Everything here is jit-safe and returns device arrays (no host synchronisation),
except :func:`nonfinite_paths`, which turns flags into names on the host.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._clip import overflow_safe_norm
from jaxscale._find import scaling_state_of, scaling_states
from jaxscale._loss_scale import DynamicLossScale
from jaxscale._state import LeafFlags, flag_values
from jaxscale._tree import is_float_leaf, is_inexact_leaf, path_name, real_parts
from jaxscale.diagnostics._underflow import cast_masks, half_dtype, scale_value

__all__ = [
    "UnderflowReport",
    "layer_norms",
    "nonfinite_paths",
    "summary",
    "underflow_report",
]

_NEVER = 2**31 - 1  # a growth interval this long never grows

_F32 = jnp.float32
# Powers of two a float32 loss scale can take and stay normal.
_MIN_EXP, _MAX_EXP = -126, 127


def summary(opt_state: Any) -> dict[str, jax.Array]:
    """The counters of :func:`dynamic_scaling` as a flat dict, for loggers.

    Reads device arrays only: no host synchronisation and no transfer, inside or
    outside ``jit``. The transfer happens when the caller converts a value
    (``float(...)``, ``jax.device_get``), e.g. every ``log_every`` steps.

    Keys (every value a scalar array):

    * ``steps`` (``i32``): update calls so far.
    * ``skipped_steps`` (``i32``): of which skipped for a non-finite gradient.
    * ``consecutive_skips`` (``i32``): length of the current run of skips.
    * ``last_step_finite`` (``bool``): whether the last step was applied.
    * ``loss_scale`` (``f32``): the scale for the next step.
    * ``growth_tracker``, ``hysteresis_tracker`` (``i32``): only for a
      :class:`DynamicLossScale`.
    * ``growths_without_overflow`` (``i32``): only for a
      :class:`DynamicLossScale` that grows (and not for a split
      ``nnx.State``, whose growth interval is in its GraphDef): growth
      intervals passed while no step has ever been skipped
      (``steps // growth_interval``), ``0`` once one has.
      A float16 step overflows now and then at the largest scale that fits; a
      count that keeps rising (8 means the scale grew 256-fold) says nothing
      computes in float16, or ``update`` is given gradients that are not the
      scaled ones of :func:`jaxscale.value_and_grad` (see
      :class:`NoOverflowWarning`).
    * ``nonfinite_leaves`` (``i32``): how many gradient leaves were non-finite
      on the last step (:func:`nonfinite_paths` names them).

    Args:
      opt_state: the state of :func:`dynamic_scaling`, or any state (``chain``,
        ``MultiSteps``, ``TrainState``, ``nnx.Optimizer``, or the ``nnx.State``
        of a functional NNX loop) holding exactly one.

    Returns:
      A ``dict`` from the names above to scalar ``jax.Array`` values.

    Raises:
      ValueError: if ``opt_state`` holds no :class:`DynamicScalingState`, or
        several.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.array([jnp.nan, 0.0]), state)
      >>> logs = {k: v.item() for k, v in jxs.diagnostics.summary(state).items()}
      >>> for key, value in logs.items():
      ...     print(f"{key}: {value}")
      steps: 1
      skipped_steps: 1
      consecutive_skips: 1
      last_step_finite: False
      loss_scale: 32768.0
      growth_tracker: 0
      hysteresis_tracker: 1
      growths_without_overflow: 0
      nonfinite_leaves: 1
    """
    state = scaling_state_of(opt_state)
    ls = state.loss_scale
    out = {
        "steps": state.steps,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_step_finite": state.last_step_finite,
        "loss_scale": ls.loss_scale,
    }
    if isinstance(ls, DynamicLossScale):
        out["growth_tracker"] = ls.growth_tracker
        out["hysteresis_tracker"] = ls.hysteresis_tracker
    if isinstance(ls, DynamicLossScale) and ls.growth_interval < _NEVER:
        # (A split nnx.State does not hold the interval: its GraphDef does.)
        out["growths_without_overflow"] = _growths_without_overflow(
            state.steps, state.skipped_steps, ls.growth_interval
        )
    count = state.steps - state.steps  # 0 on device: no transfer
    flags = state.nonfinite_leaves.flags
    if flags is not None:
        count = count + jnp.sum(jnp.asarray(flags).astype(jnp.int32))
    out["nonfinite_leaves"] = count
    return out


@functools.partial(jax.jit, static_argnums=2)
def _growths_without_overflow(
    steps: jax.Array, skipped: jax.Array, interval: int
) -> jax.Array:
    """``steps // interval`` while nothing was skipped, else 0 (jitted: its
    constants are compiled in, so an eager call transfers nothing)."""
    return jnp.where(skipped == 0, steps // interval, 0).astype(jnp.int32)


def nonfinite_paths(flags_or_state: Any) -> list[str]:
    """Names of the gradient leaves that were non-finite on the last step.

    :func:`dynamic_scaling` keeps a flag per gradient leaf in
    ``DynamicScalingState.nonfinite_leaves`` (one ``bool[n]`` array with the
    leaves' names). Names are key paths joined by ``/``, e.g.
    ``"encoder/layers/0/kernel"`` (``"<root>"`` for a tree that is one array).
    This reads the flags, so it synchronises with the device: call it on the
    host, e.g. when ``jxs.diagnostics.summary(state)["last_step_finite"]`` is false.

    Args:
      flags_or_state: an optimizer state holding a
        :class:`DynamicScalingState` (any object ``summary`` takes), or its
        ``nonfinite_leaves``.

    Returns:
      The names of the flagged leaves, in tree order (empty after a finite step).

    Raises:
      ValueError: if the state holds several scaling states.
      TypeError: if it holds none (a jaxscale 0.1.0 checkpoint: read it with
        :func:`jaxscale.upgrade_checkpoint`), if called on traced values
        (inside ``jit``), or if a flag is not a boolean.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}}
      >>> grads = {"dense": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.ones(1)}}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> jxs.diagnostics.nonfinite_paths(state)
      ['dense/kernel']
    """
    flags = flags_or_state
    if not isinstance(flags, LeafFlags):
        if not scaling_states(flags_or_state):
            raise TypeError(
                "`flags_or_state` must be an optimizer state holding a "
                "jxs.DynamicScalingState (or its `nonfinite_leaves`), got "
                f"{type(flags_or_state).__name__}. A checkpoint of jaxscale 0.1.0 "
                "(a tree of flags, or none) is read with `jxs.upgrade_checkpoint`."
            )
        flags = scaling_state_of(flags_or_state, "flags_or_state").nonfinite_leaves
    out = []
    for name, f in flag_values(flags):
        if isinstance(f, jax.core.Tracer):
            raise TypeError(
                "`flags_or_state` must hold concrete flags; `nonfinite_paths` reads "
                "them on the host and cannot run inside `jax.jit`. Return the state "
                "(or its `nonfinite_leaves`) from the step and call it outside."
            )
        f = np.asarray(f)
        if f.dtype != np.bool_ or f.shape != ():
            raise TypeError(
                f"`flags_or_state` leaf {name!r} must be a boolean scalar flag, got "
                f"{f.dtype}{list(f.shape)}."
            )
        if bool(f):
            out.append(name)
    return out


# --------------------------------------------------------------------------- #
# Underflow analysis
# --------------------------------------------------------------------------- #


class UnderflowReport(NamedTuple):
    """What :func:`underflow_report` finds; every field an ``f32[]`` array.

    Fractions are over every element of every floating leaf; elements that are
    already zero, ``inf`` or ``NaN`` in the input never count as flushed,
    subnormal or overflowed.

    Attributes:
      loss_scale: the scale analysed (1 when none was given).
      zero_fraction_unscaled: fraction of elements that become 0 when cast to
        the half dtype without scaling.
      subnormal_fraction_unscaled: fraction that become subnormal (precision
        lost) without scaling.
      zero_fraction: fraction that become 0 at ``loss_scale``.
      subnormal_fraction: fraction that become subnormal at ``loss_scale``.
      overflow_fraction: fraction that become ``inf`` at ``loss_scale``.
      max_abs: the largest finite magnitude.
      min_nonzero_abs: the smallest non-zero finite magnitude (``inf`` if none).
      headroom_log2: ``log2(dtype max / (max_abs * loss_scale))``: how many
        doublings of the scale the largest element still tolerates (negative:
        it overflows; ``inf`` for an all-zero tree).
      init_scale_low: the smallest power of two at which the smallest non-zero
        element is a normal number of the half dtype.
      init_scale_high: the largest power of two at which the largest element
        does not overflow. If ``low > high`` no scale fits the whole range:
        prefer ``high`` (nothing overflows) and accept the zeros it leaves.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> grads = {"w": jnp.array([1e-8, 2.0])}
      >>> r = jxs.diagnostics.underflow_report(grads, jnp.float16)
      >>> float(r.zero_fraction_unscaled), float(r.headroom_log2) > 14
      (0.5, True)
      >>> isinstance(r, jxs.diagnostics.UnderflowReport)
      True
    """

    loss_scale: jax.Array
    zero_fraction_unscaled: jax.Array
    subnormal_fraction_unscaled: jax.Array
    zero_fraction: jax.Array
    subnormal_fraction: jax.Array
    overflow_fraction: jax.Array
    max_abs: jax.Array
    min_nonzero_abs: jax.Array
    headroom_log2: jax.Array
    init_scale_low: jax.Array
    init_scale_high: jax.Array


def _pow2_at_most(x: jax.Array, limit: float) -> jax.Array:
    """The largest ``2**k`` (k in [-126, 127]) with ``x * 2**k <= limit``."""
    k = jnp.floor(jnp.log2(jnp.float32(limit)) - jnp.log2(x)).astype(jnp.int32)
    k = jnp.clip(k, _MIN_EXP, _MAX_EXP)
    k = jnp.where(x * jnp.ldexp(_F32(1), k) > limit, k - 1, k)
    k = jnp.where(x * jnp.ldexp(_F32(1), k + 1) <= limit, k + 1, k)
    k = jnp.clip(k, _MIN_EXP, _MAX_EXP)
    return jnp.where(x > 0, jnp.ldexp(_F32(1), k), jnp.ldexp(_F32(1), _MAX_EXP))


def _pow2_at_least(x: jax.Array, limit: float) -> jax.Array:
    """The smallest ``2**k`` (k in [-126, 127]) with ``x * 2**k >= limit``."""
    finite = jnp.isfinite(x)
    safe = jnp.where(finite, x, _F32(1))
    k = jnp.ceil(jnp.log2(jnp.float32(limit)) - jnp.log2(safe)).astype(jnp.int32)
    k = jnp.clip(k, _MIN_EXP, _MAX_EXP)
    k = jnp.where(safe * jnp.ldexp(_F32(1), k) < limit, k + 1, k)
    k = jnp.where(safe * jnp.ldexp(_F32(1), k - 1) >= limit, k - 1, k)
    k = jnp.clip(k, _MIN_EXP, _MAX_EXP)
    return jnp.where(finite, jnp.ldexp(_F32(1), k), jnp.ldexp(_F32(1), _MIN_EXP))


def underflow_report(
    grads: Any, dtype: Any = jnp.float16, loss_scale: Any = None
) -> UnderflowReport:
    """How a gradient tree fares in a half dtype, with and without a loss scale.

    Pass *true* (unscaled) gradients, e.g. from a float32 reference run of the
    same model. Each floating element is multiplied by the scale in float32 and
    classified as a round-to-nearest-even cast to ``dtype`` rounds it (by exact
    thresholds, which XLA:GPU cannot optimise away as it may a cast there and
    back), and the report says what
    fraction flushes to zero, becomes subnormal or overflows, how much headroom
    the largest element has, and which power-of-two ``init_scale`` range keeps
    the smallest element normal without overflowing the largest. Parameter
    gradients stand in for the activation gradients of the backward pass, which
    usually span a similar range.

    Jit-safe: every field is an ``f32[]`` device array.

    Args:
      grads: a pytree of gradients; non-floating and ``None`` leaves are ignored.
      dtype: the half dtype to analyse, e.g. ``jnp.float16`` or ``jnp.bfloat16``.
      loss_scale: the scale to analyse: a number, a :class:`LossScale`, or an
        optimizer state holding one (its current scale); default 1.

    Returns:
      An :class:`UnderflowReport`.

    Raises:
      TypeError: if ``dtype`` is not a floating dtype or ``loss_scale`` not a
        real scalar or state.
      ValueError: if ``loss_scale`` is a state without a loss scale.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> grads = {"w": jnp.array([1e-9, 1e-6, 1e-3, 1.0])}
      >>> r = jxs.diagnostics.underflow_report(grads, jnp.float16, loss_scale=2.0**10)
      >>> float(r.zero_fraction_unscaled), float(r.subnormal_fraction_unscaled)
      (0.25, 0.25)
      >>> float(r.zero_fraction), float(r.subnormal_fraction)
      (0.0, 0.25)
      >>> float(r.init_scale_low), float(r.init_scale_high)
      (65536.0, 32768.0)
    """
    dt = half_dtype(dtype)
    scale = scale_value(loss_scale)
    info = jnp.finfo(dt)
    tiny, big = float(info.smallest_normal), float(info.max)

    leaves = [jnp.asarray(x) for x in jax.tree.leaves(grads) if is_float_leaf(x)]
    total = sum(int(np.prod(x.shape)) for x in leaves)
    zero = jnp.zeros((), _F32)
    counts = {k: zero for k in ("z0", "s0", "z", "s", "o")}
    max_abs, min_nz = zero, jnp.full((), jnp.inf, _F32)

    def count(mask):
        return jnp.sum(mask, dtype=jnp.int32).astype(_F32)

    one = jnp.ones((), _F32)
    for x in leaves:
        if x.size == 0:
            continue
        xf = x.astype(_F32)
        z0, s0, _ = cast_masks(xf, dt, one)
        z, s, o = cast_masks(xf, dt, scale)
        for key, mask in zip("z0 s0 z s o".split(), (z0, s0, z, s, o), strict=True):
            counts[key] = counts[key] + count(mask)
        a = jnp.abs(xf)
        good = jnp.isfinite(a)
        max_abs = jnp.maximum(max_abs, jnp.max(jnp.where(good, a, 0)))
        min_nz = jnp.minimum(min_nz, jnp.min(jnp.where(good & (a > 0), a, jnp.inf)))
    denom = _F32(max(total, 1))
    frac = {k: v / denom for k, v in counts.items()}
    headroom = jnp.where(
        max_abs > 0,
        jnp.log2(_F32(big))
        - jnp.log2(jnp.where(max_abs > 0, max_abs, 1))
        - jnp.log2(scale),
        jnp.inf,
    )
    return UnderflowReport(
        loss_scale=scale,
        zero_fraction_unscaled=frac["z0"],
        subnormal_fraction_unscaled=frac["s0"],
        zero_fraction=frac["z"],
        subnormal_fraction=frac["s"],
        overflow_fraction=frac["o"],
        max_abs=max_abs,
        min_nonzero_abs=min_nz,
        headroom_log2=headroom.astype(_F32),
        init_scale_low=_pow2_at_least(min_nz, tiny),
        init_scale_high=_pow2_at_most(max_abs, big),
    )


# --------------------------------------------------------------------------- #
# Per-layer norms
# --------------------------------------------------------------------------- #


def layer_norms(tree: Any, *, depth: int | None = None) -> dict[str, jax.Array]:
    """The L2 norm of each leaf (or group of leaves) of a tree, in float32.

    For monitoring gradients per layer: every floating leaf is cast to float32
    (a complex leaf's real and imaginary parts, so it counts ``|z|**2``) and
    the norm is computed with a rescaling that cannot overflow float32 (a
    scaled float16 gradient of ``1e20`` still gives a finite norm). An ``inf``
    element gives ``inf``, a ``NaN`` gives ``NaN``. Jit-safe; returns device
    arrays.

    Args:
      tree: a pytree, typically gradients or parameters; non-floating and
        ``None`` leaves are ignored.
      depth: ``None`` (default) for one norm per leaf; an int ``d >= 1`` to group
        leaves by the first ``d`` components of their path (``depth=1`` on
        ``{"dense": {"kernel", "bias"}}`` gives one norm for ``"dense"``).

    Returns:
      A ``dict`` from path names (``"dense/kernel"``, ``"<root>"`` for a bare
      array) to ``f32[]`` norms, in tree order.

    Raises:
      TypeError: if ``depth`` is not an int.
      ValueError: if ``depth < 1``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> g = {"dense": {"kernel": jnp.array([3.0, 4.0], jnp.float16),
      ...                "bias": jnp.array([12.0])}}
      >>> {k: float(v) for k, v in jxs.diagnostics.layer_norms(g).items()}
      {'dense/bias': 12.0, 'dense/kernel': 5.0}
      >>> jxs.diagnostics.layer_norms(g, depth=1)
      {'dense': Array(13., dtype=float32)}
    """
    if depth is not None:
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"`depth` must be an int or None, got {depth!r}.")
        if depth < 1:
            raise ValueError(f"`depth` must be >= 1, got {depth}.")
    groups: dict[str, list[jax.Array]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_inexact_leaf(x):
            continue
        key = path_name(path if depth is None else tuple(path)[:depth])
        groups.setdefault(key, []).extend(p.astype(_F32) for p in real_parts(x))
    return {k: overflow_safe_norm(v, _F32) for k, v in groups.items()}
