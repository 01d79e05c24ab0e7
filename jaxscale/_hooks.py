"""Opt-in diagnostics inside :func:`jaxscale.dynamic_scaling`'s update.

Per-leaf overflow flags, the host callback fired on skipped steps, and the
warning when the scale sits at its floor. Nothing here is traced unless the user
switches it on, so a step built with every option off compiles to the same
program as a plain one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._loss_scale import unscale_leaf
from jaxscale._tree import is_float_leaf

__all__ = [
    "OverflowEvent",
    "ScaleAtFloorWarning",
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
    """What the ``on_overflow`` hook of :func:`dynamic_scaling` receives.

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
      >>> import jax.numpy as jnp, optax
      >>> events = []
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1), on_overflow=events.append)
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

    Raised through ``jax.debug.callback`` by :func:`dynamic_scaling` built with
    ``warn_at_floor_after=n``, once each time the scale has been at
    ``min_scale`` after ``n`` consecutive steps. Gradients that overflow even at
    the smallest scale mean training is diverging (an ``inf`` or ``NaN`` in the
    forward pass, or exploding gradients), not underflowing. Filter it with the
    :mod:`warnings` module like any other warning.

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.ScaleAtFloorWarning, RuntimeWarning)
      True
    """


# --------------------------------------------------------------------------- #
# Traced helpers, called by ``dynamic_scaling`` only when an option is on.
# --------------------------------------------------------------------------- #


def nonfinite_flags(grads: Any, hi: jax.Array, lo: jax.Array) -> Any:
    """``bool[]`` per leaf of ``grads``: does the unscaled leaf hold inf or NaN?

    Non-float leaves get ``False``; ``None`` stays ``None``.
    """

    def leaf(g):
        if not is_float_leaf(g):
            return jnp.zeros((), jnp.bool_)
        return ~jnp.all(jnp.isfinite(unscale_leaf(g, hi, lo)))

    return jax.tree.map(leaf, grads)


def no_flags(params: Any) -> Any:
    """All-``False`` flags in the structure of ``params`` (fresh arrays)."""
    return jax.tree.map(lambda _: jnp.zeros((), jnp.bool_), params)


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
    names = leaf_names(flags)

    def host(step, loss_scale, next_loss_scale, consecutive_skips, leaves):
        paths = tuple(n for n, f in zip(names, leaves, strict=True) if bool(f))
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
        jax.tree.leaves(flags),
    )
    lax.cond(skipped, fire, lambda _: None, operands)


def floor_callback(
    steps_at_floor: jax.Array,
    after: int,
    step: jax.Array,
    min_scale: float,
) -> None:
    """Warns (:class:`ScaleAtFloorWarning`) when ``steps_at_floor`` reaches
    ``after``: once per stay at the floor, since the counter saturates."""

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
        steps_at_floor == after,
        lambda s: jax.debug.callback(host, s),
        lambda s: None,
        step,
    )


# --------------------------------------------------------------------------- #
# The options of ``dynamic_scaling``.
# --------------------------------------------------------------------------- #


class Options(NamedTuple):
    """The diagnostic options of one ``dynamic_scaling`` (static, validated)."""

    track_nonfinite: bool
    on_overflow: Callable[[OverflowEvent], Any] | None
    warn_at_floor_after: int | None
    min_scale: float | None

    @property
    def any(self) -> bool:
        return self.on_overflow is not None or self.warn_at_floor_after is not None


def make_options(
    loss_scale: Any,
    track_nonfinite: Any,
    on_overflow: Any,
    warn_at_floor_after: Any,
) -> Options | None:
    """Validates the keyword options; ``None`` when every one is off."""
    if not isinstance(track_nonfinite, bool):
        raise TypeError(f"`track_nonfinite` must be a bool, got {track_nonfinite!r}.")
    if on_overflow is not None and not callable(on_overflow):
        raise TypeError(
            "`on_overflow` must be None or a callable taking a jxs.OverflowEvent, "
            f"got {on_overflow!r}."
        )
    min_scale = getattr(loss_scale, "min_scale", None)
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
        if min_scale is None:
            raise ValueError(
                "`warn_at_floor_after` needs a loss scale with a floor (a "
                "jxs.DynamicLossScale), got "
                f"{type(loss_scale).__name__}, whose scale never changes."
            )
    options = Options(track_nonfinite, on_overflow, warn_at_floor_after, min_scale)
    return options if options.any else None


def count_at_floor(loss_scale: Any, count: jax.Array) -> jax.Array:
    """``count + 1`` (saturating) if the new scale sits at its floor, else 0.

    Loss scales without a floor (static, no-op) keep ``count`` (always 0).
    """
    min_scale = getattr(loss_scale, "min_scale", None)
    if min_scale is None:
        return count
    at_floor = loss_scale.loss_scale <= jnp.float32(min_scale)
    bumped = jnp.where(count < np.iinfo(np.int32).max, count + 1, count)
    return jnp.where(at_floor, bumped, 0).astype(jnp.int32)


def diagnose(options: Options, state: Any, new_state: Any, finite: jax.Array) -> None:
    """The opt-in part of ``update``: the overflow hook and the floor warning.

    The per-leaf flags are always in ``new_state.nonfinite_leaves`` (computed on
    skipped steps only), so nothing here reads the gradients again.
    """
    if options.on_overflow is not None:
        overflow_callback(
            options.on_overflow,
            ~finite,
            new_state.nonfinite_leaves,
            state.steps,
            state.loss_scale.loss_scale,
            new_state.loss_scale.loss_scale,
            new_state.consecutive_skips,
        )
    if options.warn_at_floor_after is not None:
        floor_callback(
            new_state.steps_at_floor,
            options.warn_at_floor_after,
            state.steps,
            options.min_scale,
        )
