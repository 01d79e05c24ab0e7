"""Flax integration: a ``TrainState`` whose ``step`` counts applied updates.

Not imported by ``import jaxscale``; import it explicitly (it needs flax)::

    import jaxscale.flax as jxf

The stock ``flax.training.train_state.TrainState`` works with
``tx=jxs.dynamic_scaling(...)`` unchanged: a skipped step leaves ``params`` and
the inner optimizer state bit-identical. Its ``step``, however, advances on
every call of ``apply_gradients``, skipped or not (and on every micro-step under
:func:`jaxscale.accumulate`). :class:`TrainState` here differs in that one
respect: its ``step`` counts only the updates that were applied, so it stays
equal to the inner optimizer's own step count (the ``count`` that drives optax
learning-rate schedules).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state

from jaxscale import _nnx
from jaxscale._accumulate import AccumulateState
from jaxscale._checkpoint import register_flax_serialization
from jaxscale._find import scaling_state_of, scaling_states
from jaxscale._tree import all_finite, select_tree

__all__ = [
    "TrainState",
    "keep_on_skip",
    "register_flax_serialization",
    "update_applied",
]

# Importing this module means Flax is in use: teach flax.serialization the loss
# scales now (idempotent; the function stays public for explicit calls).
register_flax_serialization()


def update_applied(old_opt_state: Any, new_opt_state: Any) -> jax.Array:
    """Whether the ``update`` that turned one state into the other changed params.

    ``True`` when the :func:`jaxscale.dynamic_scaling` inside ran its inner
    optimizer on finite gradients; ``False`` when the step was skipped for an
    overflow, and (under :func:`jaxscale.accumulate`) on the calls that only
    accumulate. Works on optimizer states, ``TrainState`` and ``nnx.Optimizer``
    ``opt_state`` trees (``OptArray`` leaves are unwrapped).

    Args:
      old_opt_state: the optimizer state passed to ``update``.
      new_opt_state: the state it returned.

    Returns:
      ``bool[]``, computed on device.

    Raises:
      ValueError: if a state does not contain exactly one
        :class:`jaxscale.DynamicScalingState`.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.flax as jxf
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> s0 = tx.init(jnp.zeros(2))
      >>> _, s1 = tx.update(jnp.ones(2), s0)
      >>> _, s2 = tx.update(jnp.array([jnp.inf, 1.0]), s1)
      >>> jxf.update_applied(s0, s1), jxf.update_applied(s1, s2)
      (Array(True, dtype=bool), Array(False, dtype=bool))
    """
    old = scaling_state_of(old_opt_state, "old_opt_state")
    new = scaling_state_of(new_opt_state, "new_opt_state")
    return (new.steps != old.steps) & new.last_step_finite


def _accumulates(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds a :func:`jaxscale.accumulate` state (read
    from the structure, at trace time)."""
    is_acc = lambda x: isinstance(x, AccumulateState)  # noqa: E731
    return any(
        map(
            is_acc,
            jax.tree.leaves(
                opt_state, is_leaf=lambda x: is_acc(x) or _nnx.is_variable(x)
            ),
        )
    )


def _keep_old(old_opt_state: Any, new_opt_state: Any, new_values: Any) -> jax.Array:
    """``bool[]``: whether state written by this step's forward pass (e.g.
    BatchNorm statistics, now ``new_values``) should get its old value back.

    Yes on a step skipped for an overflow. Under :func:`jaxscale.accumulate`,
    on a call that only accumulates (the scaling state did not step): yes iff
    ``new_values`` are not all finite, so that each micro-batch still updates
    the statistics but an overflowing one cannot poison them.
    """
    old = scaling_state_of(old_opt_state, "old_opt_state")
    new = scaling_state_of(new_opt_state, "new_opt_state")
    skipped = jnp.logical_not(new.last_step_finite)
    if not _accumulates(new_opt_state):
        return skipped
    stepped = new.steps != old.steps
    return jnp.where(stepped, skipped, jnp.logical_not(all_finite(new_values)))


class TrainState(train_state.TrainState):
    """A Flax ``TrainState`` whose ``step`` counts applied updates only.

    A drop-in for ``flax.training.train_state.TrainState`` (same fields, same
    ``create`` and ``apply_gradients``, subclass it to add fields such as
    ``batch_stats``) for a ``tx`` built with :func:`jaxscale.dynamic_scaling`.
    ``apply_gradients`` updates ``params`` and ``opt_state`` exactly as the stock
    one does (on a skipped step both come back bit-identical), but increments
    ``step`` only when the update was applied (:func:`update_applied`): not on a
    step skipped for an overflow, not on the accumulating calls of
    :func:`jaxscale.accumulate`. So ``step`` equals the inner optimizer's own
    count (what drives an optax learning-rate schedule) and is a faithful label
    for checkpoints and logs. Update attempts and skips are counted in the
    optimizer state (``jxs.diagnostics.summary(state.opt_state)``).

    Forward-overflow guard: other fields passed to ``apply_gradients`` as
    keyword arguments (e.g. ``batch_stats`` from the forward pass) keep their
    old values on a step skipped for an overflow. torch (and the stock class)
    keep the BatchNorm statistics of a skipped step's forward pass, so one
    forward pass that overflows leaves them NaN for ever (measured: eval
    accuracy 0.25 instead of 0.61 on a small BatchNorm model); with this class
    a skipped step changes nothing but the loss scale and the counters. Under
    :func:`jaxscale.accumulate` the fields are replaced on every call (each
    micro-batch updates the statistics, as with the stock class) except when
    the new values are not finite, or when the window's update is skipped. To
    keep the stock behaviour, set the fields with ``replace`` afterwards.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.flax as jxf
      >>> import jax, jax.numpy as jnp, optax
      >>> import flax.linen as nn
      >>> model = nn.Dense(1)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
      >>> state = jxf.TrainState.create(
      ...     apply_fn=model.apply, params=params,
      ...     tx=jxs.dynamic_scaling(optax.sgd(0.1)))
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> state = state.apply_gradients(grads=grads)
      >>> bad = jax.tree.map(lambda g: g * jnp.inf, grads)
      >>> state = state.apply_gradients(grads=bad)  # skipped: step stays 1
      >>> int(state.step), int(state.opt_state.skipped_steps)
      (1, 1)
    """

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Like the stock ``apply_gradients``; ``step`` counts applied updates.

        Args:
          grads: the gradients of the *scaled* loss (see
            :func:`jaxscale.value_and_grad`), in the structure of ``params``.
          **kwargs: other fields to replace (e.g. ``batch_stats``), as in the
            stock class, except on a skipped step, where they keep their old
            values (see the class docstring for :func:`jaxscale.accumulate`).

        Returns:
          The new state; ``step`` is incremented iff the update was applied,
          and the other fields are replaced unless the step was skipped.

        Examples:
          >>> import jaxscale as jxs
          >>> import jaxscale.flax as jxf
          >>> import jax.numpy as jnp, optax
          >>> state = jxf.TrainState.create(
          ...     apply_fn=None, params={"w": jnp.zeros(2)},
          ...     tx=jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), 2))
          >>> state = state.apply_gradients(grads={"w": jnp.ones(2)})  # accumulates
          >>> int(state.step)
          0
        """
        new = super().apply_gradients(grads=grads, **kwargs)
        applied = update_applied(self.opt_state, new.opt_state)
        # Forward-overflow guard: a skipped step keeps the other fields too (one
        # overflowing forward pass would otherwise leave BatchNorm statistics NaN
        # for ever).
        kept = {}
        for k in kwargs:
            old, value = getattr(self, k), getattr(new, k)
            keep = _keep_old(self.opt_state, new.opt_state, value)
            kept[k] = select_tree(keep, old, value)
        return new.replace(step=self.step + jnp.where(applied, 1, 0), **kept)

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> Any:
        """Like the stock ``create``; checks that ``tx`` scales the loss.

        Args:
          apply_fn: usually ``model.apply``.
          params: the parameters (float32 master weights).
          tx: an optimizer built with :func:`jaxscale.dynamic_scaling`
            (possibly inside :func:`jaxscale.accumulate` or ``optax.chain``).
          **kwargs: other fields of a subclass.

        Returns:
          A state with ``step=0`` and ``opt_state = tx.init(params)``.

        Raises:
          ValueError: if ``tx``'s state does not contain exactly one
            :class:`jaxscale.DynamicScalingState`.

        Examples:
          >>> import jaxscale as jxs
          >>> import jaxscale.flax as jxf
          >>> import jax.numpy as jnp, optax
          >>> state = jxf.TrainState.create(
          ...     apply_fn=None, params={"w": jnp.zeros(2)},
          ...     tx=jxs.dynamic_scaling(optax.adam(1e-3)))
          >>> jxs.loss_scale_of(state).loss_scale
          Array(65536., dtype=float32)
        """
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        found = scaling_states(state.opt_state)
        if len(found) != 1:
            raise ValueError(
                "`tx` must contain exactly one jxs.dynamic_scaling (e.g. "
                "`jxs.dynamic_scaling(optax.adam(1e-3))`), got "
                f"{len(found)} in its state."
            )
        return state


@contextlib.contextmanager
def keep_on_skip(model: Any, optimizer: Any, *filters: Any) -> Iterator[None]:
    """Keeps an NNX ``model``'s non-parameter state unchanged on a skipped step.

    The forward-overflow guard for Flax NNX, where the forward pass mutates the
    module (BatchNorm statistics) before ``optimizer.update`` knows whether the
    step overflows. Wrap the forward pass and the update::

        with jxf.keep_on_skip(model, optimizer):
            loss, grads = jxs.value_and_grad(loss_fn, optimizer)(model, batch)
            optimizer.update(model, grads)

    On entry it copies the state selected by ``filters`` (default
    ``nnx.BatchStat``); on exit it keeps the new values if the update was
    applied and puts the copy back if it was skipped (a select on device: no
    host sync, fine under ``nnx.jit``). Without it, one forward pass that
    overflows leaves the running statistics NaN for ever (as in torch). Under
    :func:`jaxscale.accumulate` (one ``update`` per micro-batch) the new values
    of an accumulating call are kept unless they are not finite.

    RNG counts are not protected by default: that a skipped step advances them
    is harmless (the next step draws a fresh dropout mask, as torch does). To
    protect every variable but the parameters and the RNG state, pass
    ``nnx.Not(nnx.Any(nnx.Param, nnx.RngState))``.

    Args:
      model: the ``nnx.Module`` the step updates.
      optimizer: the ``nnx.Optimizer`` (or its ``opt_state``) holding one
        :func:`jaxscale.dynamic_scaling`; read on entry and after ``update``.
      *filters: NNX filters of the state to protect (default
        ``nnx.BatchStat``).

    Raises:
      ValueError: if ``optimizer`` holds no (or several) scaling states, or
        (on exit) if the protected variables were removed from ``model``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.flax as jxf
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(
      ...     model, jxs.dynamic_scaling(optax.sgd(0.1)), wrt=nnx.Param)
      >>> with jxf.keep_on_skip(model, optimizer):
      ...     _ = model(jnp.array([[jnp.inf, 1.0]]))  # an overflowing forward
      ...     grads = jax.tree.map(lambda p: p * jnp.inf, nnx.state(model, nnx.Param))
      ...     _ = optimizer.update(model, grads)  # skipped
      >>> model.mean[...]
      Array([0., 0.], dtype=float32)
    """
    from flax import nnx

    filters = filters or (nnx.BatchStat,)
    opt_state = getattr(optimizer, "opt_state", optimizer)
    # Detached copies: nnx.state returns the model's own variables, and the
    # optimizer's variables are updated in place.
    before = jax.tree.map(lambda x: x, nnx.state(model, *filters))
    old_opt_state = jax.tree.map(_nnx.unwrap, opt_state, is_leaf=_nnx.is_variable)
    scaling_state_of(old_opt_state, "optimizer")
    yield
    new_opt_state = getattr(optimizer, "opt_state", optimizer)
    after = _matching(nnx.state(model), before)
    keep = _keep_old(old_opt_state, new_opt_state, after)
    nnx.update(model, select_tree(keep, before, after))


def _matching(state: Any, like: Any) -> Any:
    """The leaves of ``state`` at the key paths of ``like`` (a sub-state of it),
    in the structure of ``like``."""
    flat = dict(jax.tree_util.tree_flatten_with_path(state)[0])
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    missing = [jax.tree_util.keystr(p) for p, _ in paths if p not in flat]
    if missing:
        raise ValueError(
            "`model` must keep the variables that `jxf.keep_on_skip` protects "
            f"until the end of the block; {missing[:3]} were removed (e.g. by "
            "`nnx.pop`): pop them after the block."
        )
    return jax.tree.unflatten(treedef, [flat[p] for p, _ in paths])
