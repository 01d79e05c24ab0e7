"""The optax transformation: unscale, check, skip on overflow, adjust the scale."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from optax import OptState, Params, Updates

from jaxscale import _distributed, _hooks, _nnx
from jaxscale._composition import (
    check_composition,
    check_inner,
    find_state,
    is_variable,
    unwrap_variable,
)
from jaxscale._loss_scale import (
    DynamicLossScale,
    LossScale,
    reciprocal_parts,
    unscale_leaf,
)
from jaxscale._structure import (
    check_updates_match_params,
    explain_structure_errors,
)
from jaxscale._tree import is_float_leaf, saturating_increment, widen

__all__ = [
    "DynamicScalingState",
    "dynamic_scaling",
    "loss_scale_of",
    "value_and_grad",
]


class DynamicScalingState(NamedTuple):
    """State of :func:`dynamic_scaling`; every counter lives on device.

    Attributes:
      loss_scale: the :class:`LossScale` to use for the next step.
      inner_state: the wrapped transformation's state; bit-identical after a
        skipped step.
      steps: ``i32[]``, update calls so far (saturates at the int32 maximum).
      skipped_steps: ``i32[]``, of which skipped because a gradient was not finite.
      consecutive_skips: ``i32[]``, length of the current run of skipped steps.
      last_step_finite: ``bool[]``, whether the last step was applied (``True``
        before the first step).
      steps_at_floor: ``i32[]``, consecutive steps after which the scale sat at
        its floor (``min_scale`` of a :class:`DynamicLossScale`; always 0 for
        other kinds). Many in a row mean training diverges.
      nonfinite_leaves: one ``bool[n]`` array (with the leaves' names as static
        structure), true for each gradient leaf that was non-finite (after
        unscaling) on the last step; see :func:`nonfinite_paths`. They are the
        finite check's own per-leaf reductions, so they cost nothing more; one
        array rather than a flag per leaf, since on an accelerator every buffer
        of the state costs dispatch time. Their structure never depends on
        options, so a checkpoint restores into any ``dynamic_scaling`` of the
        same params.

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
    last_step_finite: jax.Array
    steps_at_floor: jax.Array
    nonfinite_leaves: Any = None  # ``None`` only in states of jaxscale 0.1.0


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


def _negative_zeros(tree: Any) -> Any:
    """``-0.0`` of each float leaf's shape and dtype (``0`` for other dtypes).

    ``p + (-0.0)`` is ``p`` for every float ``p``, ``-0.0`` included, whereas
    ``-0.0 + 0.0`` would be ``+0.0``: so ``optax.apply_updates`` with these
    updates leaves every parameter bit-identical.
    """

    def leaf(s):
        # ``lax.cond`` compares types: match the sharding (explicit mesh axes)
        # and the varying ``shard_map`` axes of the updates stood in for.
        fill = -0.0 if jnp.issubdtype(s.dtype, jnp.floating) else 0
        x = jnp.full(s.shape, fill, s.dtype, device=getattr(s, "sharding", None))
        return _distributed.match_varying(x, s)

    return jax.tree.map(leaf, tree)


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


def _nonfinite(g: Any, hi: jax.Array, lo: jax.Array) -> jax.Array:
    """``bool[]``: does the unscaled leaf hold an ``inf`` or a ``NaN``?

    Exact, in the leaf's own dtype (as :func:`unscale_leaf` rounds it), for
    every scale: one fused read of the gradient. (A float32 sum per leaf, finite
    only if every term is, reads as fast on XLA:CPU but needs an exact fallback
    where it overflows; a variadic ``reduce`` over "no inf" and "no NaN" is
    partitioned into all-gathers under sharded ``jit``: docs/performance.md.)
    """
    if not is_float_leaf(g):
        return jnp.zeros((), jnp.bool_)
    return ~jnp.all(jnp.isfinite(unscale_leaf(g, hi, lo)))


def _check(
    grads: Any, hi: jax.Array, lo: jax.Array, axis_name: Any
) -> tuple[jax.Array, jax.Array | None]:
    """``(finite, bad)``: whether every unscaled gradient is finite, and the
    per-leaf :func:`_nonfinite` flags as one ``bool[n]`` array, both agreed
    over ``axis_name`` (one collective, a ``pmax`` of the array, serves both).
    """
    leaves = jax.tree.leaves(grads)
    if not leaves:  # no flags array (see ``_hooks.no_flags``)
        return jnp.ones((), jnp.bool_), None
    bad = jnp.stack([_nonfinite(g, hi, lo) for g in leaves])
    if axis_name is not None:  # one decision and one set of flags per axis
        bad = _distributed.any_replica(bad, axis_name)
    return ~jnp.any(bad), bad


def dynamic_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | None = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer with loss scaling: unscale, skip on overflow, adjust.

    ``update`` takes the gradients of the *scaled* loss (see
    :func:`value_and_grad`). It unscales them, checks that every unscaled
    gradient is finite (exactly, in each leaf's dtype, for any scale: one
    reduction per leaf, a single read of the gradients), and then:

    * finite step: runs ``inner`` on the unscaled gradients and returns its
      updates;
    * non-finite step: does **not** run ``inner`` (a ``lax.cond``); returns
      updates of ``-0.0`` (so ``optax.apply_updates`` leaves every parameter
      bit-identical, signed zeros included) and the inner state unchanged.

    Either way the loss scale is adjusted (:meth:`LossScale.adjust`) and the
    counters in :class:`DynamicScalingState` advance. Everything happens in XLA:
    no host synchronisation, no retrace when the scale changes, fixed state shapes
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

    The per-leaf overflow flags (``nonfinite_leaves``, read with
    :func:`nonfinite_paths`) are always kept: they are the finite check's own
    per-leaf reductions. Host hooks (a callback on every skipped step, a
    warning when the scale sits at its floor) are a separate wrapper,
    :func:`monitor`. See the diagnostics guide.

    Several devices (see the multi-device guide): under ``jit`` with sharded
    parameters and gradients nothing is needed, as the finite check reduces
    whole (global) arrays, XLA inserts one scalar all-reduce, and every device
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
        ``vmap``): the finite flag is reduced over it (a ``lax.pmin``) so every
        replica skips or applies the same step and keeps the same scale; the
        per-leaf flags are or-ed over it too. Leave it ``None`` under plain
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
        inner_state = inner.init(jax.tree.map(widen, params))
        check_inner(inner, inner_state)
        state = DynamicScalingState(
            loss_scale=fresh_loss_scale(),
            inner_state=inner_state,
            steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            last_step_finite=jnp.ones((), jnp.bool_),
            steps_at_floor=jnp.zeros((), jnp.int32),
            nonfinite_leaves=_hooks.no_flags(params),
        )
        # On a multi-device mesh: the same replicated scale on every device.
        return _distributed.place_replicated(state, params, skip="inner_state")

    def update_fn(
        updates: Updates,
        state: DynamicScalingState,
        params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, DynamicScalingState]:
        check_updates_match_params(updates, params)
        ls = state.loss_scale
        hi, lo = reciprocal_parts(ls.loss_scale)
        finite, bad = _check(updates, hi, lo, axis_name)
        old_flags = state.nonfinite_leaves
        names = (
            old_flags.names
            if isinstance(old_flags, _hooks.LeafFlags)
            else tuple(_hooks.leaf_names(updates))
        )

        def apply(operand):
            grads, inner_state = operand
            # Half-precision leaves reach ``inner`` in float32 (master-weight
            # arithmetic): unscaled, but not cast back, with float32 params.
            # The unscale fuses into ``inner``'s own passes.
            unscaled = jax.tree.map(lambda g: unscale_leaf(widen(g), hi, lo), grads)
            wide_params = None if params is None else jax.tree.map(widen, params)
            new_updates, new_inner = inner.update(
                unscaled, inner_state, wide_params, **extra_args
            )
            like = grads if params is None else params
            return _cast_like(new_updates, like), new_inner

        def skip(operand):
            _, inner_state = operand
            out_updates, out_inner = jax.eval_shape(apply, operand)
            # The inner state comes back unchanged, typed as ``apply`` types it
            # (e.g. varying over ``shard_map`` axes, as its gradients are).
            kept = jax.tree.map(_distributed.match_varying, inner_state, out_inner)
            return _negative_zeros(out_updates), kept

        # ``inner`` runs on finite steps only. Measured against a select (inner
        # on every step, its effect masked away, fused with the caller's
        # ``apply_updates``): no faster on an H100, slower on XLA:CPU, where the
        # fused passes read transposed gradients with strides; and XLA fuses the
        # decision into every masked leaf, a compile time quadratic in the
        # number of leaves (docs/performance.md).
        with explain_structure_errors(updates, state.inner_state):
            new_updates, new_inner = lax.cond(
                finite, apply, skip, (updates, state.inner_state)
            )
        new_ls = ls.adjust(finite)
        new_state = DynamicScalingState(
            loss_scale=new_ls,
            inner_state=new_inner,
            steps=saturating_increment(state.steps),
            skipped_steps=jnp.where(
                finite, state.skipped_steps, saturating_increment(state.skipped_steps)
            ),
            consecutive_skips=jnp.where(
                finite, 0, saturating_increment(state.consecutive_skips)
            ).astype(jnp.int32),
            last_step_finite=finite,
            steps_at_floor=_hooks.count_at_floor(new_ls, state.steps_at_floor),
            nonfinite_leaves=_hooks.LeafFlags(bad, names),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Kept for the modules that import them from here.
_unwrap_variable, _is_variable = unwrap_variable, is_variable


def loss_scale_of(opt_state: Any) -> LossScale:
    """Finds the :class:`LossScale` inside any nested optimizer state.

    Looks through :func:`accumulate`, a Flax ``TrainState`` (or anything with
    an ``opt_state`` attribute, such as an ``nnx.Optimizer``) and any container,
    and unwraps the ``nnx.OptArray`` variables NNX puts around state leaves. A
    :class:`LossScale` passed in is returned as is.

    It also checks, from the structure of the state alone (at trace time, at no
    cost in the compiled step), that :func:`dynamic_scaling` is nested right: a
    transformation chained in front of it (it would see *scaled* gradients), or
    the wrapper inside ``optax.MultiSteps``, ``optax.multi_transform`` or
    ``optax.masked``, raises a ``ValueError`` that says how to nest it;
    ``optax.inject_hyperparams`` around it, or stateful transformations chained
    after it, warn (:class:`CompositionWarning`). :func:`value_and_grad` calls
    it, so every training step is checked.

    Args:
      opt_state: an optimizer state (or object holding one) that contains
        exactly one :class:`LossScale`.

    Returns:
      The :class:`LossScale`, with plain arrays as leaves.

    Raises:
      ValueError: if there is no loss scale, or more than one, in ``opt_state``,
        or if ``jxs.dynamic_scaling`` is nested wrongly (see
        :class:`CompositionWarning` for the orders that only warn).
      TypeError: if ``opt_state`` is a number (use :class:`StaticLossScale`).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.accumulate(jxs.dynamic_scaling(optax.adam(1e-3)), every_k=2)
      >>> jxs.loss_scale_of(tx.init(jnp.zeros(3))).loss_scale
      Array(65536., dtype=float32)

      Wrong nestings are refused, e.g. a clip that would see scaled gradients:

      >>> tx = optax.chain(optax.clip(1.0), jxs.dynamic_scaling(optax.adam(1e-3)))
      >>> jxs.loss_scale_of(tx.init(jnp.zeros(3)))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
        ...
      ValueError: `opt_state`: `jxs.dynamic_scaling` is element 1 of an ...: ...
    """
    return _find_loss_scale(opt_state, "opt_state")


def _find_loss_scale(opt_state: Any, name: str) -> LossScale:
    """:func:`loss_scale_of`, naming the argument ``name`` in its errors."""
    if isinstance(opt_state, LossScale):
        return jax.tree.map(unwrap_variable, opt_state, is_leaf=is_variable)
    if isinstance(opt_state, int | float | np.number) or (
        isinstance(opt_state, jax.Array | np.ndarray) and np.ndim(opt_state) == 0
    ):
        shown = (  # a Python number, also for a NumPy / concrete jax scalar
            opt_state
            if isinstance(opt_state, int | float | jax.core.Tracer)
            else opt_state.item()
        )
        raise TypeError(
            f"`{name}` must be a jxs.LossScale or an optimizer state holding one, "
            f"got the number {opt_state!r}. For a fixed scale pass "
            f"`jxs.StaticLossScale.create({shown!r})`; for dynamic scaling pass "
            "the state of `jxs.dynamic_scaling(inner)`."
        )
    _, found = find_state(opt_state, LossScale, name)
    check_composition(opt_state, name)
    return found


def _argnum_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, differentiating the *scaled* loss.

    The returned function computes ``fun(*args)``, multiplies the loss by the
    current scale (:meth:`LossScale.scale`) and differentiates that. It returns
    the **unscaled** loss (as ``fun`` returned it) and the **scaled** gradients,
    ready for the ``update`` of :func:`dynamic_scaling`, which unscales them.

    Compute the loss's final reduction in float32 (as torch's autocast does): a
    float16 loss cannot carry a scale above 65504 through the backward pass (the
    step overflows and the scale backs off until it fits).

    Flax NNX: pass the modules themselves, as to ``nnx.value_and_grad``
    (``jxs.value_and_grad(loss_fn, optimizer)(model, x)``). The ``wrt``
    variables (the optimizer's, else ``nnx.Param``) of the modules at
    ``argnums`` are differentiated and their gradients come back as
    ``nnx.State``; the modules' other state (BatchNorm statistics, RNG counts)
    and any other NNX object among the arguments (an ``nnx.Rngs``) are updated
    in place, as ``nnx.value_and_grad`` updates them. See the Flax guide.

    Args:
      fun: the loss function; returns a scalar, or ``(scalar, aux)`` with
        ``has_aux=True``.
      loss_scale: a :class:`LossScale`, or any state containing one (the
        optimizer state, a ``TrainState``, an ``nnx.Optimizer``; see
        :func:`loss_scale_of`).
      argnums: which positional argument(s) to differentiate, as in JAX.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s signature returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux=True``. It raises a ``TypeError``
      if ``argnums`` mixes NNX modules with other arguments, or if an argument
      holds an NNX object inside a container.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> ls = jxs.StaticLossScale.create(1024.0)
      >>> loss, grads = jxs.value_and_grad(lambda w: jnp.sum(w * w), ls)(jnp.ones(2))
      >>> loss, grads
      (Array(2., dtype=float32), Array([2048., 2048.], dtype=float32))
    """
    ls = _find_loss_scale(loss_scale, "loss_scale")

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return ls.scale(loss), (loss, aux)

    grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if _nnx.has_objects(args, kwargs):  # Flax NNX: split, differentiate, update
            split = _nnx.NnxArgs(args, kwargs, argnums, _nnx.default_wrt(loss_scale))
            call, rest, finish = split.grad_call(fun, ls, has_aux)
            out, grads, rest = call(args, kwargs, rest)
            return out, finish(grads, rest)
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped
