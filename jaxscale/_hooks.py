"""Host-side hooks around a loss-scaled optimizer: :func:`monitor`.

The callback fired on skipped steps and the warning when the scale sits at its
floor, as a wrapper in the style of ``optax.chain``: the core
:func:`jaxscale.dynamic_scaling` knows nothing of them, and the wrapper adds no
state (so checkpoints do not depend on it). Also the per-leaf overflow flags the
core computes on skipped steps.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxscale._tree import saturating_increment

__all__ = [
    "OverflowEvent",
    "ScaleAtFloorWarning",
    "monitor",
    "path_name",
]

#: Name of the single leaf of a tree that is just one array.
ROOT_NAME = "<root>"


def path_name(path: Any) -> str:
    """A readable name for a key path: ``"dense/kernel"``, ``"layers/0/w"``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or ROOT_NAME


def leaf_names(tree: Any) -> list[str]:
    """The :func:`path_name` of every leaf of ``tree``, in flattening order."""
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


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
    an exception of your own, test ``jxs.diagnostics.summary(opt_state)["steps_at_floor"]``
    where you log.

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.diagnostics.ScaleAtFloorWarning, RuntimeWarning)
      True
    """


# --------------------------------------------------------------------------- #
# Traced helpers: the flags (always, in ``dynamic_scaling``), the callbacks.
# --------------------------------------------------------------------------- #


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["flags"], meta_fields=["names"]
)
@dataclasses.dataclass(frozen=True)
class LeafFlags:
    """Per-leaf overflow flags: one ``bool[n]`` array and the leaves' names.

    ``DynamicScalingState.nonfinite_leaves`` holds one of these. One array
    whatever the number of gradient leaves: every buffer of a jitted step's
    state is an argument and a result of each call, and on an accelerator each
    costs dispatch time (a scalar flag per leaf made a 100-leaf step 1.3 times
    slower on an H100; docs/performance.md). The names are static (part of the
    tree structure), so they cost nothing on the device.

    Attributes:
      flags: ``bool[n]``, true for each leaf that was non-finite after
        unscaling on the last step, in flattening order of the gradients.
      names: ``tuple[str, ...]``, each leaf's :func:`path_name`.
    """

    flags: Any
    names: tuple[str, ...] = dataclasses.field(metadata={"static": True})


def no_flags(params: Any) -> LeafFlags:
    """All-``False`` :class:`LeafFlags` for the leaves of ``params`` (fresh)."""
    names = tuple(leaf_names(params))
    # No array at all for no leaves: checkpointers refuse zero-size arrays.
    return LeafFlags(jnp.zeros((len(names),), jnp.bool_) if names else None, names)


def flag_values(flags: Any) -> list[tuple[str, Any]]:
    """``(name, flag)`` per gradient leaf, from :class:`LeafFlags` or from a
    tree of ``bool[]`` flags (what a restored checkpoint or an ``nnx.State``
    may hold)."""
    if isinstance(flags, LeafFlags):
        values = flags.flags
        return [(n, values[i]) for i, n in enumerate(flags.names)]
    if isinstance(flags, Mapping) and set(flags.keys()) == {
        "flags"
    }:  # LeafFlags, as a dict
        values = flags["flags"]
        values = getattr(values, "value", values)  # an ``nnx`` variable
        return [(str(i), values[i]) for i in range(np.shape(values)[0])]
    return list(zip(leaf_names(flags), jax.tree.leaves(flags), strict=True))


def overflow_callback(
    on_overflow: Callable[[OverflowEvent], Any],
    skipped: jax.Array,
    flags: Any,
    step: jax.Array,
    loss_scale: jax.Array,
    next_loss_scale: jax.Array,
    consecutive_skips: jax.Array,
) -> None:
    """Calls ``on_overflow`` on the host, on skipped steps only (a ``lax.cond``)."""
    if isinstance(flags, LeafFlags):
        names, leaves = flags.names, flags.flags
    else:
        names = leaf_names(flags)
        leaves = jnp.stack(jax.tree.leaves(flags) or [jnp.zeros((), jnp.bool_)])

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


# --------------------------------------------------------------------------- #
# The options of ``monitor``.
# --------------------------------------------------------------------------- #


class Options(NamedTuple):
    """The hooks of one :func:`monitor` (static, validated)."""

    on_overflow: Callable[[OverflowEvent], Any] | None
    warn_at_floor_after: int | None


def make_options(on_overflow: Any, warn_at_floor_after: Any) -> Options | None:
    """Validates the hooks; ``None`` when neither is given."""
    if on_overflow is not None and not callable(on_overflow):
        raise TypeError(
            "`on_overflow` must be None or a callable taking a jxs.diagnostics.OverflowEvent, "
            f"got {on_overflow!r}."
        )
    if warn_at_floor_after is not None:
        if isinstance(warn_at_floor_after, bool) or not isinstance(
            warn_at_floor_after, int
        ):
            raise TypeError(
                f"`warn_at_floor_after` must be an int or None, got "
                f"{warn_at_floor_after!r}."
            )
        if not 1 <= warn_at_floor_after <= np.iinfo(np.int32).max:
            raise ValueError(
                f"`warn_at_floor_after` must be >= 1, got {warn_at_floor_after}."
            )
    if on_overflow is None and warn_at_floor_after is None:
        return None
    return Options(on_overflow, warn_at_floor_after)


def count_at_floor(loss_scale: Any, count: jax.Array) -> jax.Array:
    """``count + 1`` (saturating) if the new scale sits at its floor, else 0.

    Loss scales without a floor (static, no-op) keep ``count`` (always 0).
    """
    min_scale = getattr(loss_scale, "min_scale", None)
    if min_scale is None:
        return count
    at_floor = loss_scale.loss_scale <= jnp.float32(min_scale)
    return jnp.where(at_floor, saturating_increment(count), 0).astype(jnp.int32)


def diagnose(options: Options, old: Any, new: Any) -> None:
    """Fires the hooks for one ``update`` that turned scaling state ``old`` into
    ``new`` (both :class:`DynamicScalingState`).

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
        min_scale = getattr(new.loss_scale, "min_scale", None)
        if min_scale is None:
            raise ValueError(
                "`warn_at_floor_after` needs a loss scale with a floor (a "
                f"jxs.DynamicLossScale), got {type(new.loss_scale).__name__}, "
                "whose scale never changes."
            )
        floor_callback(
            stepped & (new.steps_at_floor == options.warn_at_floor_after),
            options.warn_at_floor_after,
            old.steps,
            min_scale,
        )


# --------------------------------------------------------------------------- #
# The composable wrapper.
# --------------------------------------------------------------------------- #


def monitor(
    tx: optax.GradientTransformation,
    *,
    on_overflow: Callable[[OverflowEvent], Any] | None = None,
    warn_at_floor_after: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adds host-side hooks to a loss-scaled optimizer, without adding state.

    Wraps a transformation holding one :func:`dynamic_scaling` (that one, or
    ``jxs.accumulate(jxs.dynamic_scaling(...), k)``): ``init`` and the state are
    ``tx``'s own, untouched, so a checkpoint written with or without the
    monitor restores into either. After each ``update`` it compares the scaling
    state before and after (no extra read of the gradients: the per-leaf flags
    are already in the state) and, through ``jax.debug.callback``:

    * ``on_overflow``: calls it with an :class:`OverflowEvent` on every skipped
      step, and only then (a ``lax.cond``);
    * ``warn_at_floor_after=n``: warns (:class:`ScaleAtFloorWarning`) once the
      scale has sat at its floor (``min_scale`` of a :class:`DynamicLossScale`)
      for ``n`` consecutive steps.

    Only the code of the hooks you pass is traced; the callbacks run
    asynchronously (call ``jax.effects_barrier()`` before reading what they
    recorded).

    Args:
      tx: the loss-scaled optimizer.
      on_overflow: ``None`` or a callable taking an :class:`OverflowEvent`.
      warn_at_floor_after: ``None`` or an int ``>= 1``; needs a
        :class:`DynamicLossScale` (checked when ``update`` is traced).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``tx``'s state.

    Raises:
      TypeError: if ``tx`` is not a transformation or a hook has the wrong type.
      ValueError: if no hook is given, ``warn_at_floor_after < 1``, or (when
        ``update`` is traced) ``warn_at_floor_after`` is given for a loss scale
        without a floor.

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
    options = make_options(on_overflow, warn_at_floor_after)
    if options is None:
        raise ValueError(
            "`jxs.diagnostics.monitor` needs at least one hook: pass `on_overflow=` and/or "
            "`warn_at_floor_after=`, got neither."
        )
    tx = optax.with_extra_args_support(tx)

    def update_fn(updates, state, params=None, **extra_args):
        from jaxscale._composition import find_state
        from jaxscale._transform import DynamicScalingState

        new_updates, new_state = tx.update(updates, state, params, **extra_args)
        old = find_state(state, DynamicScalingState, "state")[1]
        new = find_state(new_state, DynamicScalingState, "state")[1]
        diagnose(options, old, new)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(tx.init, update_fn)
