"""The optax transformation: unscale, check, skip on overflow, adjust the scale."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import OptState, Params, Updates

from jaxscale import _distributed
from jaxscale._composition import check_inner
from jaxscale._finite import leaf_flags
from jaxscale._loss_scale import (
    DynamicLossScale,
    LossScale,
    reciprocal_parts,
    unscale_leaf,
)
from jaxscale._skip import update_or_skip
from jaxscale._state import DynamicScalingState, LeafFlags, no_flags
from jaxscale._structure import (
    check_updates_match_params,
    explain_structure_errors,
)
from jaxscale._tree import (
    first_non_array,
    is_float_leaf,
    saturating_increment,
    widen,
)

__all__ = ["dynamic_scaling"]


def _fresh_copy_factory(loss_scale: LossScale) -> Callable[[], LossScale]:
    """Returns a function that builds a new copy of ``loss_scale`` on each call.

    The leaves are copied to host memory once, here, so a state handed out by
    ``init`` never shares a buffer with the argument or with an earlier ``init``:
    donating one (``jit(..., donate_argnums=...)``) cannot delete another.
    """
    leaves, treedef = jax.tree.flatten(loss_scale)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return lambda: loss_scale
    host = [np.array(x) for x in leaves]
    return lambda: jax.tree.unflatten(treedef, [jnp.array(x) for x in host])


def _cast_like(updates: Any, like: Any) -> Any:
    """Casts each float update to the dtype of its parameter (or gradient).

    ``inner`` computes half-precision leaves in float32; their updates go back
    to the leaf's own dtype, as ``optax.apply_updates`` expects.
    """

    def leaf(u: Any, p: Any) -> Any:
        if u is None or not is_float_leaf(u) or not is_float_leaf(p):
            return u
        dtype = jnp.result_type(p)
        return u if jnp.result_type(u) == dtype else jnp.asarray(u).astype(dtype)

    return jax.tree.map(leaf, updates, like, is_leaf=lambda x: x is None)


def _check(
    grads: Any, hi: jax.Array, lo: jax.Array, axis_name: Any
) -> tuple[jax.Array, jax.Array | None]:
    """``(finite, bad)``: whether every unscaled gradient is finite, and the
    per-leaf flags (:func:`leaf_flags`) as one ``bool[n]`` array, both agreed
    over ``axis_name`` (one collective, a ``pmax`` of the array, serves both).
    """
    # The scope names the check's collectives in the compiled program's
    # metadata (``jxs.diagnostics.collective_report`` reads it).
    with jax.named_scope(_distributed.FINITE_SCOPE):
        bad = leaf_flags(grads, hi, lo)
        if bad is None:  # no flags array (see ``_state.no_flags``)
            return jnp.ones((), jnp.bool_), None
        if axis_name is not None:  # one decision and one set of flags per axis
            bad = _distributed.any_replica(bad, axis_name)
    # ``any(bad)`` as the last element of the sorted flags: XLA simplifies a
    # reduction of the flags into an ``n``-operand ``or`` and fuses a copy of
    # it into every leaf's select (``n**2`` operands); a ``sort`` is not fused
    # into its consumers, so each select reads one ``bool``
    # (tests/test_compiled_step.py).
    return ~jnp.sort(bad)[-1], bad


def _check_array_leaves(params: Any) -> None:
    """``params`` must hold arrays (or ``None``): an equinox module's
    strings and functions go through ``eqx.filter`` first."""
    bad = first_non_array(params)
    if bad is not None:
        where, x = bad
        raise TypeError(
            f"`params` must hold arrays, got {type(x).__name__} {x!r:.40} at "
            f"{where}. For an equinox module pass its arrays: "
            "`tx.init(eqx.filter(model, eqx.is_inexact_array))` (and the same "
            "filter for `params` in `tx.update`)."
        )


def _master_weight_update(
    inner: optax.GradientTransformationExtraArgs,
    grads: Updates,
    inner_state: OptState,
    params: Params | None,
    hi: jax.Array,
    lo: jax.Array,
    extra_args: dict[str, Any],
) -> tuple[Updates, OptState]:
    """``inner`` on the unscaled gradients, with half-precision leaves in
    float32 (master-weight arithmetic), and its updates in each parameter's own
    dtype."""
    # Unscaled, but not cast back, with float32 params: the unscale fuses into
    # ``inner``'s own passes.
    unscaled = jax.tree.map(lambda g: unscale_leaf(widen(g), hi, lo), grads)
    wide_params = None if params is None else jax.tree.map(widen, params)
    new_updates, new_inner = inner.update(
        unscaled, inner_state, wide_params, **extra_args
    )
    return _cast_like(new_updates, grads if params is None else params), new_inner


def _advance(
    state: DynamicScalingState, finite: jax.Array, inner_state: OptState, bad: Any
) -> DynamicScalingState:
    """The state after a step: the scale adjusted, the counters advanced, this
    step's per-leaf flags."""
    return DynamicScalingState(
        loss_scale=state.loss_scale.adjust(finite),
        inner_state=inner_state,
        steps=saturating_increment(state.steps),
        skipped_steps=jnp.where(
            finite, state.skipped_steps, saturating_increment(state.skipped_steps)
        ),
        consecutive_skips=jnp.where(
            finite, 0, saturating_increment(state.consecutive_skips)
        ).astype(jnp.int32),
        nonfinite_leaves=LeafFlags(bad, state.nonfinite_leaves.names),
    )


def dynamic_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | None = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer with loss scaling: unscale, skip on overflow, adjust.

    ``update`` takes the gradients of the *scaled* loss (see
    :func:`value_and_grad`). It unscales them, checks that every unscaled
    gradient is finite (exactly, in each leaf's dtype, for any scale), and then:

    * finite step: returns the updates of ``inner`` on the unscaled gradients;
    * non-finite step: discards what ``inner`` computed; returns updates of
      ``-0.0`` (so ``optax.apply_updates`` leaves every parameter
      bit-identical, signed zeros included) and the inner state unchanged, bit
      for bit.

    Either way the loss scale is adjusted (:meth:`LossScale.adjust`) and the
    counters in :class:`DynamicScalingState` advance. Everything happens in XLA
    and without a branch (``inner`` runs on every step, its effect selected
    away on a skipped one, the selects fused into its own passes): no host
    round trip on a GPU for the decision, no host synchronisation, no retrace
    when the scale changes, fixed state shapes
    and dtypes (so a whole loop can run in ``lax.scan``), and ``init`` returns
    fresh buffers on every call (safe with ``donate_argnums``).

    Put clipping and other gradient transformations *inside* ``inner`` so they
    see unscaled gradients: ``jxs.dynamic_scaling(optax.chain(clip, adam))``.
    Wrong nestings that the optimizer state reveals (a transformation in front
    of the wrapper, the wrapper inside ``optax.MultiSteps`` or one
    ``optax.multi_transform`` group) are refused by :func:`value_and_grad` and
    :func:`loss_scale_of` at trace time.

    Half precision: ``inner`` always computes in at least float32. Gradients of
    float16, bfloat16 (and fp8) leaves are unscaled into float32 and passed to
    ``inner`` in float32 together with float32 copies of such parameters, so
    ``inner``'s state (e.g. adam's moments) is float32 for those leaves and
    stock optax is exact for them (a float16 ``eps=1e-8`` would be 0, a float16
    global norm would overflow); the updates come back in each parameter's own
    dtype. This is the master-weight arithmetic of apex and torch AMP; it costs
    the float32 state of half-precision leaves (float32 leaves are unchanged).
    Integer and ``None`` leaves pass through to ``inner`` untouched.

    Complex leaves (complex64, or complex128 under x64) are unscaled part by
    part (the real and the imaginary part by the same real factor, so a power
    of two scale is exact) and keep their dtype; an ``inf`` or ``NaN`` in
    either part skips the step. ``inner`` sees the complex gradients as stock
    optax does: a complex-aware optimizer (adam's second moment is ``|g|**2``)
    behaves exactly as without the wrapper. (Conjugate JAX's gradients before
    ``update``, ``optax.tree.conj(grads)``, as for any optax optimizer.)

    The per-leaf overflow flags (``nonfinite_leaves``, read with
    :func:`nonfinite_paths`) are always kept: they are what the finite check
    computes (one reduction per group of like leaves: the same parameter of
    every layer). Host hooks (a callback on every skipped step, a
    warning when the scale sits at its floor) are a separate wrapper,
    :func:`jaxscale.diagnostics.monitor`. See the diagnostics guide.

    Several devices (see the multi-device guide): under ``jit`` with sharded
    parameters and gradients nothing is needed, as the finite check reduces
    whole (global) arrays, XLA inserts one small all-reduce of the flags (none
    for replicated gradients; one per set of mesh axes that shards some
    gradient, so three for FSDP with tensor parallelism), and every device
    takes the same decision; ``init`` places the scale and counters replicated
    on the mesh of ``params``. Inside ``jax.shard_map``, ``jax.pmap`` or
    ``jax.vmap``, where each replica sees only its own gradients, pass
    ``axis_name`` so the replicas agree.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``) to protect.
      loss_scale: the initial :class:`LossScale`; default
        ``DynamicLossScale.create()`` (init ``2**16``, torch's defaults).
        ``NoOpLossScale`` keeps only the skipping of non-finite steps.
      axis_name: ``None`` (default), or the name (or tuple of names) of the
        mapped axis that ``update`` runs under (``shard_map``, ``pmap``,
        ``vmap``): the per-leaf flags are or-ed over it (one ``lax.pmax`` of the
        ``bool[n]`` flags array), so every replica skips or applies the same step,
        keeps the same scale and reports the same leaves. Leave it ``None`` under plain
        ``jit``, where XLA does the reduction. For data parallelism, average the
        scaled gradients over the axis yourself first (``lax.pmean``; see the
        multi-device guide).
    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra keyword arguments of
      ``update`` are forwarded to ``inner``.

    Raises:
      TypeError: if ``inner`` is not a transformation (``optax.MultiSteps``
        included: use :func:`accumulate` around the wrapper), ``loss_scale`` not
        a :class:`LossScale`, or ``axis_name`` not a str or tuple of str.
      ValueError: from ``init``, if ``inner`` holds what belongs outside (a
        :func:`accumulate`, another ``dynamic_scaling``).
      NameError: from ``update``, if ``axis_name`` is not bound there.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> optax.apply_updates(params, updates)
      {'w': Array([0.8, 0.8], dtype=float32)}
      >>> bad = {"w": jnp.array([jnp.inf, 1.0])}
      >>> updates, opt_state = tx.update(bad, opt_state, params)
      >>> int(opt_state.skipped_steps), opt_state.loss_scale.loss_scale
      (1, Array(32768., dtype=float32))

      Complex parameters are unscaled part by part:

      >>> z = jnp.array([1 + 2j], jnp.complex64)
      >>> tx.update(z * 2.0**16, tx.init(z), z)[0]  # the default scale
      Array([-0.1-0.2j], dtype=complex64)

      Two replicas on a mapped axis, one overflows: both skip.

      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1), axis_name="i")
      >>> def replica_update(grads, state, params):
      ...     grads = jax.lax.pmean(grads, "i")  # data parallel: average first
      ...     return tx.update(grads, state, params)
      >>> update = jax.vmap(
      ...     replica_update, in_axes=(0, None, None), out_axes=None, axis_name="i"
      ... )
      >>> grads = jnp.array([[1.0, 2.0], [jnp.inf, 2.0]])  # one row per replica
      >>> updates, opt_state = update(grads, tx.init(jnp.ones(2)), jnp.ones(2))
      >>> int(opt_state.skipped_steps), opt_state.loss_scale.loss_scale
      (1, Array(32768., dtype=float32))
    """
    if isinstance(inner, optax.MultiSteps):
        check_inner(inner, None)
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "`inner` must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
            f"got {type(inner).__name__}."
        )
    if loss_scale is None:
        loss_scale = DynamicLossScale.create()
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "`loss_scale` must be a jxs.LossScale (e.g. "
            f"jxs.DynamicLossScale.create()), got {type(loss_scale).__name__}."
        )
    _distributed.check_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)
    fresh_loss_scale = _fresh_copy_factory(loss_scale)

    def init_fn(params: Params) -> DynamicScalingState:
        _check_array_leaves(params)
        inner_state = inner.init(jax.tree.map(widen, params))
        check_inner(inner, inner_state)
        state = DynamicScalingState(
            loss_scale=fresh_loss_scale(),
            inner_state=inner_state,
            steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            nonfinite_leaves=no_flags(params),
        )
        # On a multi-device mesh: the same replicated scale on every device.
        return _distributed.place_replicated(state, params, skip="inner_state")

    def update_fn(
        updates: Updates,
        state: DynamicScalingState,
        params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, DynamicScalingState]:
        if not isinstance(state, DynamicScalingState):
            raise TypeError(
                "`state` must be the jxs.DynamicScalingState that this "
                f"optimizer's `init` returned, got {type(state).__name__}. "
                + (
                    "A checkpoint restored without a target comes back as plain "
                    "dicts: restore into the structure of `tx.init(params)` "
                    "(flax: `from_state_dict(tx.init(params), ...)`; orbax: pass "
                    "the abstract state as the restore target; a checkpoint of "
                    "an older jaxscale: `jxs.upgrade_checkpoint(restore, "
                    "tx.init(params))`)."
                    if isinstance(state, dict)
                    else "Pass the state of this transformation (not the state of "
                    "another optimizer, or a sub-state)."
                )
            )
        check_updates_match_params(updates, params)
        hi, lo = reciprocal_parts(state.loss_scale.loss_scale)
        finite, bad = _check(updates, hi, lo, axis_name)

        def apply(operand):
            grads, inner_state = operand
            return _master_weight_update(
                inner, grads, inner_state, params, hi, lo, extra_args
            )

        # ``inner`` runs on every step and a skipped step's effect is selected
        # away (``_skip``): no ``lax.cond``, whose predicate XLA:GPU copies to
        # the host before it branches (docs/performance.md).
        with explain_structure_errors(updates, state.inner_state):
            new_updates, new_inner = update_or_skip(
                finite, apply, (updates, state.inner_state), lambda op: op[1]
            )
        return new_updates, _advance(state, finite, new_inner, bad)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
