"""The core state: :class:`DynamicScalingState` and its per-leaf flags.

Below every reader (the transformation, the finder, the monitor, the validator,
checkpoints, NNX, ``jaxscale.flax``, ``jaxscale.testing``): it imports only the
loss scales and pure tree helpers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from optax import OptState

from jaxscale import _nnx
from jaxscale._loss_scale import LossScale
from jaxscale._tree import leaf_names

__all__ = [
    "DynamicScalingState",
    "LeafFlags",
    "flag_values",
    "no_flags",
    "no_flags_named",
]


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
        unscaling on the last step, in flattening order of the gradients
        (``None`` when there are no leaves: checkpointers refuse empty arrays).
      names: ``tuple[str, ...]``, each leaf's key path joined by ``/``.
    """

    flags: Any
    names: tuple[str, ...] = dataclasses.field(metadata={"static": True})


def no_flags(params: Any) -> LeafFlags:
    """All-``False`` :class:`LeafFlags` for the leaves of ``params`` (fresh)."""
    return no_flags_named(tuple(leaf_names(params)))


def no_flags_named(names: tuple[str, ...]) -> LeafFlags:
    """All-``False`` :class:`LeafFlags` for leaves named ``names`` (fresh; no
    array at all for no leaves: checkpointers refuse zero-size arrays)."""
    return LeafFlags(jnp.zeros((len(names),), jnp.bool_) if names else None, names)


def flag_values(flags: LeafFlags) -> list[tuple[str, Any]]:
    """``(name, bool[])`` per gradient leaf. Every reader of the flags goes
    through here; other layouts (0.1.0's tree of flags, a split ``nnx.State``)
    are converted to :class:`LeafFlags` where they enter (restore, finder)."""
    values = _nnx.unwrap(flags.flags)
    return [(name, values[i]) for i, name in enumerate(flags.names)]


class DynamicScalingState(NamedTuple):
    """State of :func:`dynamic_scaling`: what the skip and scale decision needs.

    Every counter lives on device.

    Attributes:
      loss_scale: the :class:`LossScale` to use for the next step.
      inner_state: the wrapped transformation's state; bit-identical after a
        skipped step.
      steps: ``i32[]``, update calls so far (saturates at the int32 maximum).
      skipped_steps: ``i32[]``, of which skipped because a gradient was not finite.
      consecutive_skips: ``i32[]``, length of the current run of skipped steps
        (0 after an applied step, and before the first).
      nonfinite_leaves: one ``bool[n]`` array with the leaves' names as static
        structure (:class:`LeafFlags`), true for each gradient leaf that was
        non-finite (after unscaling) on the last step; see
        ``jxs.diagnostics.nonfinite_paths``. They are what the finite check
        computes, so they cost nothing more. Their structure never
        depends on options, so a checkpoint restores into any
        ``dynamic_scaling`` of the same params.

    ``last_step_finite`` (``bool[]``, whether the last step was applied) is
    derived: ``consecutive_skips == 0``. (0.1.0 and 0.2.0 stored it, and a
    monitor-only ``steps_at_floor`` counter; :func:`upgrade_checkpoint` reads
    their checkpoints.)

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> state = jxs.dynamic_scaling(optax.sgd(0.1)).init(jnp.zeros(3))
      >>> int(state.skipped_steps), bool(state.last_step_finite)
      (0, True)
    """

    loss_scale: LossScale
    inner_state: OptState
    steps: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    nonfinite_leaves: LeafFlags

    @property
    def last_step_finite(self) -> jax.Array:
        """``bool[]``: whether the last step was applied (true before the first)."""
        skips = _nnx.unwrap(self.consecutive_skips)
        return skips == skips - skips  # ``== 0``, with no host-to-device transfer
