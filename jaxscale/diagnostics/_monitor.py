"""Host-side hooks around a loss-scaled optimizer: :func:`monitor`.

The callback fired on skipped steps and the warning when the scale sits at its
floor, as a wrapper in the style of ``optax``'s monitors: the core
:func:`jaxscale.dynamic_scaling` decides, the monitor observes. It reads the
per-leaf flags the core keeps in its state; the one counter only it needs
(steps at the floor) lives in its own :class:`MonitorState`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxscale import _nnx
from jaxscale._args import check_int
from jaxscale._find import scaling_state_of
from jaxscale._state import LeafFlags
from jaxscale._tree import saturating_increment

__all__ = [
    "MonitorState",
    "NoOverflowWarning",
    "OverflowEvent",
    "ScaleAtFloorWarning",
    "monitor",
]

_I32_MAX = 2**31 - 1


class OverflowEvent(NamedTuple):
    """What the ``on_overflow`` hook of :func:`monitor` receives.

    Built on the host from a skipped step's device values, so every field is a
    plain Python value.

    Attributes:
      step: ``int``, 0-based index of the skipped update (the value of
        ``DynamicScalingState.steps`` before it).
      loss_scale: ``float``, the scale the skipped step was computed with.
      next_loss_scale: ``float``, the scale after backing off (or not, within
        the hysteresis budget, or at the floor).
      consecutive_skips: ``int``, skipped steps in a row, this one included.
      paths: ``tuple[str, ...]``, the gradient leaves holding an ``inf`` or a
        ``NaN`` after unscaling, e.g. ``("dense/kernel",)``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp, optax
      >>> events = []
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> tx = jxs.diagnostics.monitor(tx, on_overflow=events.append)
      >>> params = {"w": jnp.ones(2), "b": jnp.zeros(1)}
      >>> grads = {"w": jnp.array([jnp.inf, 1.0]), "b": jnp.ones(1)}
      >>> _ = tx.update(grads, tx.init(params), params)
      >>> jax.effects_barrier()
      >>> events[0].step, events[0].loss_scale, events[0].paths
      (0, 65536.0, ('w',))
    """

    step: int
    loss_scale: float
    next_loss_scale: float
    consecutive_skips: int
    paths: tuple[str, ...]


class ScaleAtFloorWarning(RuntimeWarning):
    """Warned when the loss scale has sat at its floor for too many steps.

    Raised through ``jax.debug.callback`` by :func:`monitor` built with
    ``warn_at_floor_after=n``, once each time the scale has been at
    ``min_scale`` after ``n`` consecutive steps. Gradients that overflow even at
    the smallest scale mean training is diverging (an ``inf`` or ``NaN`` in the
    forward pass, or exploding gradients), not underflowing. Filter it with the
    :mod:`warnings` module like any other warning.

    Turned into an error (``warnings.simplefilter("error", ScaleAtFloorWarning)``)
    it stops the run, but not with its own type: an exception raised in a host
    callback reaches your loop as ``jax.errors.JaxRuntimeError`` (on CPU:
    ``INTERNAL: CpuCallback error calling callback: ...``), raised by the step
    that fired, whose message ends with this warning's text. To stop a run with
    an exception of your own, test the monitor's own counter where you log
    (``opt_state.steps_at_floor``, a :class:`MonitorState` field).

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.diagnostics.ScaleAtFloorWarning, RuntimeWarning)
      True
    """


class NoOverflowWarning(RuntimeWarning):
    """Warned when no step has overflowed while the loss scale grew many times.

    Raised through ``jax.debug.callback`` by :func:`monitor` built with
    ``warn_no_overflow_after=n``, once, when the scale of a
    :class:`DynamicLossScale` has grown ``n`` times (``n * growth_interval``
    steps) and no step has ever been skipped. A float16 step overflows from
    time to time at the largest scale that fits; one that never does, while
    its scale grows thousands-fold, has one of two causes:

    * nothing in the step computes in float16 (float32 or bfloat16 compute):
      loss scaling does nothing there, use :class:`NoOpLossScale` or none;
    * the gradients handed to ``update`` are not the scaled ones of
      :func:`jaxscale.value_and_grad` (``jax.grad`` of the loss, or a scale
      multiplied in elsewhere): ``update`` divides them by the scale, so every
      update shrinks as the scale grows and training stalls.

    Filter it with the :mod:`warnings` module like any other warning.

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.diagnostics.NoOverflowWarning, RuntimeWarning)
      True
    """


# --------------------------------------------------------------------------- #
# Traced helpers: the callbacks.
# --------------------------------------------------------------------------- #


def overflow_callback(
    on_overflow: Callable[[OverflowEvent], Any],
    skipped: jax.Array,
    flags: LeafFlags,
    step: jax.Array,
    loss_scale: jax.Array,
    next_loss_scale: jax.Array,
    consecutive_skips: jax.Array,
) -> None:
    """Calls ``on_overflow`` on the host, on skipped steps only (a ``lax.cond``)."""
    names = flags.names
    leaves = _nnx.unwrap(flags.flags)
    if leaves is None:  # no gradient leaves
        leaves = jnp.zeros((0,), jnp.bool_)

    def host(step, loss_scale, next_loss_scale, consecutive_skips, leaves):
        leaves = np.asarray(leaves).reshape(-1)
        paths = tuple(n for n, f in zip(names, leaves, strict=False) if bool(f))
        on_overflow(
            OverflowEvent(
                step=int(step),
                loss_scale=float(loss_scale),
                next_loss_scale=float(next_loss_scale),
                consecutive_skips=int(consecutive_skips),
                paths=paths,
            )
        )

    def fire(operands):
        jax.debug.callback(host, *operands)

    operands = (
        step,
        loss_scale,
        next_loss_scale,
        consecutive_skips,
        leaves,
    )
    lax.cond(skipped, fire, lambda _: None, operands)


def floor_callback(
    fire: jax.Array,
    after: int,
    step: jax.Array,
    min_scale: float,
) -> None:
    """Warns (:class:`ScaleAtFloorWarning`) where ``fire`` (``bool[]``) is true:
    when the scale has just sat at its floor for ``after`` steps."""

    def host(step):
        warnings.warn(
            f"jaxscale: the loss scale has sat at its floor (min_scale="
            f"{float(np.float32(min_scale))!r}) for {after} consecutive steps, up "
            f"to step {int(step)}. Gradients overflow even at the smallest scale: "
            "training is probably diverging (inf/NaN in the forward pass or "
            "exploding gradients), not underflowing.",
            ScaleAtFloorWarning,
            stacklevel=2,
        )

    lax.cond(
        fire,
        lambda s: jax.debug.callback(host, s),
        lambda s: None,
        step,
    )


def no_overflow_callback(fire: jax.Array, growths: int, state: Any) -> None:
    """Warns (:class:`NoOverflowWarning`) where ``fire`` (``bool[]``) is true:
    when the scale of ``state`` has just grown ``growths`` times and no step
    has ever overflowed."""

    def host(steps, scale):
        warnings.warn(
            f"jaxscale: no step has overflowed in {int(steps)} steps, while the "
            f"loss scale grew {growths} times (to {float(scale):g}). Either "
            "nothing in the step computes in float16 (loss scaling then does "
            "nothing: use jxs.NoOpLossScale(), or no scaling), or the gradients "
            "passed to `update` are not the scaled ones of "
            "`jxs.value_and_grad(loss_fn, opt_state)` (unscaled gradients are "
            "divided by the scale, so the updates shrink as it grows and "
            "training stalls).",
            NoOverflowWarning,
            stacklevel=2,
        )

    lax.cond(
        fire,
        lambda s: jax.debug.callback(host, *s),
        lambda s: None,
        (state.steps, state.loss_scale.loss_scale),
    )


# --------------------------------------------------------------------------- #
# The options of ``monitor``.
# --------------------------------------------------------------------------- #


class Options(NamedTuple):
    """The hooks of one :func:`monitor` (static, validated)."""

    on_overflow: Callable[[OverflowEvent], Any] | None
    warn_at_floor_after: int | None
    warn_no_overflow_after: int | None = None


def make_options(
    on_overflow: Any, warn_at_floor_after: Any, warn_no_overflow_after: Any = None
) -> Options | None:
    """Validates the hooks; ``None`` when none is given."""
    if on_overflow is not None and not callable(on_overflow):
        raise TypeError(
            "`on_overflow` must be None or a callable taking a "
            "jxs.diagnostics.OverflowEvent, "
            f"got {on_overflow!r}."
        )
    if warn_at_floor_after is not None:
        warn_at_floor_after = check_int("warn_at_floor_after", warn_at_floor_after)
    if warn_no_overflow_after is not None:
        warn_no_overflow_after = check_int(
            "warn_no_overflow_after", warn_no_overflow_after
        )
    if on_overflow is None and warn_at_floor_after is None:
        if warn_no_overflow_after is None:
            return None
    return Options(on_overflow, warn_at_floor_after, warn_no_overflow_after)


class MonitorState(NamedTuple):
    """State of :func:`monitor` with ``warn_at_floor_after``: the monitored
    optimizer's state and the one counter only the floor warning needs.

    (A monitor with ``on_overflow`` alone adds no state: its state is ``tx``'s.)

    Attributes:
      inner_state: the state of the monitored transformation.
      steps_at_floor: ``i32[]``, consecutive scaling steps after which the scale
        sat at its floor (:meth:`LossScale.at_floor`).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.diagnostics.monitor(
      ...     jxs.dynamic_scaling(optax.sgd(0.1)), warn_at_floor_after=100)
      >>> int(tx.init(jnp.zeros(2)).steps_at_floor)
      0
    """

    inner_state: Any
    steps_at_floor: jax.Array


def count_at_floor(stepped: jax.Array, new: Any, count: jax.Array) -> jax.Array:
    """``count + 1`` (saturating) after a scaling step that left the scale at
    its floor, 0 after one that did not, ``count`` on other calls."""
    at_floor = new.loss_scale.at_floor()
    counted = jnp.where(at_floor, saturating_increment(count), 0)
    return jnp.where(stepped, counted, count).astype(jnp.int32)


def diagnose(options: Options, old: Any, new: Any, steps_at_floor: Any) -> None:
    """Fires the hooks for one ``update`` that turned scaling state ``old`` into
    ``new`` (both :class:`DynamicScalingState`), after which the scale has sat
    at its floor for ``steps_at_floor`` scaling steps (``None``: not counted).

    Only calls that ran the scaling step count (under ``jxs.accumulate`` the
    accumulating calls leave the state as it was). The per-leaf flags are in
    ``new.nonfinite_leaves``: nothing here reads the gradients.
    """
    stepped = new.steps != old.steps
    if options.on_overflow is not None:
        overflow_callback(
            options.on_overflow,
            stepped & ~new.last_step_finite,
            new.nonfinite_leaves,
            old.steps,
            old.loss_scale.loss_scale,
            new.loss_scale.loss_scale,
            new.consecutive_skips,
        )
    if options.warn_at_floor_after is not None:
        min_scale = new.loss_scale.floor
        if min_scale is None:
            raise ValueError(
                "`warn_at_floor_after` needs a loss scale with a floor (a "
                f"jxs.DynamicLossScale), got {type(new.loss_scale).__name__}, "
                "whose scale never changes."
            )
        floor_callback(
            stepped & (steps_at_floor == options.warn_at_floor_after),
            options.warn_at_floor_after,
            old.steps,
            min_scale,
        )
    if options.warn_no_overflow_after is not None:
        interval = getattr(new.loss_scale, "growth_interval", None)
        if interval is None:
            raise ValueError(
                "`warn_no_overflow_after` counts the growths of a "
                "jxs.DynamicLossScale, got "
                f"{type(new.loss_scale).__name__}, whose scale never grows."
            )
        at = options.warn_no_overflow_after * interval
        if at <= _I32_MAX:  # beyond, the step counter saturates first
            fire = stepped & (new.skipped_steps == 0) & (new.steps == at)
            no_overflow_callback(fire, options.warn_no_overflow_after, new)


# --------------------------------------------------------------------------- #
# The composable wrapper.
# --------------------------------------------------------------------------- #


def monitor(
    tx: optax.GradientTransformation,
    *,
    on_overflow: Callable[[OverflowEvent], Any] | None = None,
    warn_at_floor_after: int | None = None,
    warn_no_overflow_after: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adds host-side hooks to a loss-scaled optimizer, without adding state.

    Wraps a transformation holding one :func:`dynamic_scaling` (that one, or
    ``jxs.accumulate(jxs.dynamic_scaling(...), k)``): ``init`` and the state are
    ``tx``'s own, untouched, so a checkpoint written with or without an
    ``on_overflow`` monitor restores into either; ``warn_at_floor_after`` adds one
    counter (:class:`MonitorState`). After each ``update`` it compares the scaling
    state before and after (no extra read of the gradients: the per-leaf flags
    are already in the state) and, through ``jax.debug.callback``:

    * ``on_overflow``: calls it with an :class:`OverflowEvent` on every skipped
      step, and only then (a ``lax.cond``: the one conditional jaxscale puts in
      a step, and only here; on a GPU it costs a host round trip per step
      unless XLA runs it in a CUDA graph, see the performance page);
    * ``warn_at_floor_after=n``: warns (:class:`ScaleAtFloorWarning`) once the
      scale has sat at its floor (``min_scale`` of a :class:`DynamicLossScale`)
      for ``n`` consecutive steps, counted in :class:`MonitorState`;
    * ``warn_no_overflow_after=n``: warns (:class:`NoOverflowWarning`) once,
      when the scale of a :class:`DynamicLossScale` has grown ``n`` times
      (``n * growth_interval`` steps) without any step ever overflowing: a
      step that computes nothing in float16, or gradients that are not the
      scaled ones of :func:`jaxscale.value_and_grad` (``8`` is a good value:
      the scale has then grown 256-fold). Adds no state.

    Only the code of the hooks you pass is traced; the callbacks run
    asynchronously (call ``jax.effects_barrier()`` before reading what they
    recorded).

    Args:
      tx: the loss-scaled optimizer.
      on_overflow: ``None`` or a callable taking an :class:`OverflowEvent`.
      warn_at_floor_after: ``None`` or an int ``>= 1``; needs a
        :class:`DynamicLossScale` (checked when ``update`` is traced).
      warn_no_overflow_after: ``None`` or an int ``>= 1``, growths of the
        scale; needs a :class:`DynamicLossScale` (checked when ``update`` is
        traced).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``tx``'s, or
      a :class:`MonitorState` around it with ``warn_at_floor_after``.

    Raises:
      TypeError: if ``tx`` is not a transformation or a hook has the wrong type.
      ValueError: if no hook is given, ``warn_at_floor_after < 1`` or
        ``warn_no_overflow_after < 1``, or (when ``update`` is traced) either
        is given for a loss scale that is not a :class:`DynamicLossScale`.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp, optax
      >>> events = []
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> tx = jxs.diagnostics.monitor(tx, on_overflow=events.append)
      >>> params = {"w": jnp.ones(2), "b": jnp.zeros(1)}
      >>> grads = {"w": jnp.array([jnp.inf, 1.0]), "b": jnp.ones(1)}
      >>> _ = tx.update(grads, tx.init(params), params)
      >>> jax.effects_barrier()
      >>> events[0].step, events[0].loss_scale, events[0].paths
      (0, 65536.0, ('w',))
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "`tx` must be an optax.GradientTransformation built with "
            f"`jxs.dynamic_scaling(...)`, got {type(tx).__name__}."
        )
    options = make_options(on_overflow, warn_at_floor_after, warn_no_overflow_after)
    if options is None:
        raise ValueError(
            "`jxs.diagnostics.monitor` needs at least one hook: pass "
            "`on_overflow=`, `warn_at_floor_after=` and/or "
            "`warn_no_overflow_after=`, got none."
        )
    tx = optax.with_extra_args_support(tx)
    counts = options.warn_at_floor_after is not None

    def init_fn(params):
        state = tx.init(params)
        if not counts:
            return state
        return MonitorState(state, jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        inner = state.inner_state if counts else state
        new_updates, new_inner = tx.update(updates, inner, params, **extra_args)
        old = scaling_state_of(inner, "state")
        new = scaling_state_of(new_inner, "state")
        if not counts:
            diagnose(options, old, new, None)
            return new_updates, new_inner
        stepped = new.steps != old.steps
        at_floor = count_at_floor(stepped, new, state.steps_at_floor)
        diagnose(options, old, new, at_floor)
        return new_updates, MonitorState(new_inner, at_floor)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
