"""Gradient accumulation that respects the loss scale.

Two ways to train on an effective batch of ``k`` micro-batches, both with one
loss scale for the whole effective batch, one finiteness check at its end, and
one run of the inner optimizer:

* :func:`accumulate_value_and_grad`: one jitted step loops over the
  micro-batches with ``lax.scan`` and hands the mean scaled gradients to
  ``tx.update`` once. :func:`jaxscale.float8.accumulate_value_and_grad` is
  the same loop for delayed float8 scaling, whose new amax histories are
  combined by the maximum over the micro-batches (:func:`accumulated` is
  their common body).
* :func:`accumulate`: an optax wrapper for loops that call ``update`` once per
  micro-batch (the ``optax.MultiSteps`` pattern), without its trap: the
  accumulator is reset to real zeros, so an overflowing window cannot poison the
  next one with ``0 * inf = NaN``. Like ``MultiSteps`` it is branch-free: the
  inner update runs on every call and is kept on the ``k``-th only.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from optax import OptState, Params, Updates

from jaxscale import _nnx
from jaxscale._args import check_int
from jaxscale._grad import loss_scale_of, value_and_grad
from jaxscale._scope import Scope
from jaxscale._skip import update_or_skip
from jaxscale._structure import check_updates_match_params
from jaxscale._tree import compute_dtype, is_float_leaf, is_inexact_leaf, map_parts

__all__ = [
    "ACCUMULATING",
    "AccumulateState",
    "accumulate",
    "accumulate_value_and_grad",
    "accumulated",
]

# In scope while a micro-batch of `accumulate_value_and_grad` is traced (trace
# time only): float8's errors name the accumulating entry point there.
ACCUMULATING = Scope("gradient accumulation")


def _zeros_acc(x: Any) -> jax.Array:
    """A fresh accumulator for one leaf: float32 zeros for f16/bf16/f32 leaves
    (a complex leaf's own dtype)."""
    x = jnp.asarray(x) if not hasattr(x, "shape") else x
    if is_float_leaf(x):
        return jnp.zeros(x.shape, compute_dtype(x.dtype))
    return jnp.zeros(x.shape, x.dtype)


def _add(acc: jax.Array, g: Any) -> jax.Array:
    if not is_inexact_leaf(g):
        return acc
    return acc + jnp.asarray(g).astype(acc.dtype)


def _mean(total: jax.Array, like: Any, k: int) -> Any:
    """``total / k`` in ``like``'s dtype (a complex leaf part by part, so that
    the division by a real ``k`` is exact per part); ``like`` if it is not an
    inexact leaf."""
    if not is_inexact_leaf(like):
        return like
    return map_parts(lambda t: t / k, total).astype(jnp.result_type(like))


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      micro_step: ``i32[]``, calls to ``update`` so far in the current window,
        ``0`` to ``every_k - 1``; it is ``0`` right after an effective step.
      grad_sum: the sum of this window's gradients, in the structure of the
        parameters: float32 for float16, bfloat16 and float32 leaves (float64 for
        float64 ones; complex leaves in their own dtype). Reset to zeros (never
        multiplied by zero) after each effective step, so it is finite again
        after a window that overflowed.
      inner_state: the wrapped transformation's state; changes only on the
        ``every_k``-th call.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), every_k=4)
      >>> state = tx.init({"w": jnp.zeros(2, jnp.float16)})
      >>> int(state.micro_step), state.grad_sum["w"].dtype
      (0, dtype('float32'))
    """

    micro_step: jax.Array
    grad_sum: Updates
    inner_state: OptState


def accumulate(
    inner: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
    """Accumulates gradients over ``every_k`` calls, then updates once.

    For training loops that call ``update`` once per micro-batch. Wrap the whole
    loss-scaled optimizer, ``jxs.accumulate(jxs.dynamic_scaling(inner), k)``
    (not the other way round), and compute each micro-batch's gradients with
    ``jxs.value_and_grad(loss_fn, opt_state)``:

    * calls ``1`` to ``every_k - 1`` of a window add the (scaled) gradients to
      ``grad_sum`` (float32 for half-precision leaves) and return ``-0.0``
      updates (``optax.apply_updates`` leaves parameters bit-identical); the
      inner state, and so the loss scale, does not change within the window;
    * the ``every_k``-th call passes the mean ``grad_sum / every_k``, cast back
      to the gradients' dtype, to ``inner`` and keeps what it returns. The
      other calls run ``inner`` too and discard its result (selects, no
      ``lax.cond``: XLA:GPU reads a conditional's predicate on the host, a
      round trip per call; see the performance page), so host callbacks inside
      ``inner`` fire on every call. Inside :func:`dynamic_scaling` this
      is the one finiteness check of the window: an ``inf`` or ``NaN`` in any
      micro-batch makes the mean non-finite, the whole effective step is
      skipped and the scale backs off;
    * then ``grad_sum`` is reset to real zeros (a select, never ``0 * sum``), so
      the window after an overflow trains normally.

    Unlike ``optax.MultiSteps``, which resets its accumulator as
    ``(1 - emit) * acc`` (``0 * inf = NaN`` after an overflowing window, so
    every later window is skipped); see the accumulation guide.

    Args:
      inner: the transformation to run once per effective batch, normally
        ``jxs.dynamic_scaling(...)``.
      every_k: micro-batches per effective batch, ``>= 1``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`AccumulateState`;
      extra keyword arguments of ``update`` are forwarded to ``inner`` on the
      ``every_k``-th call.

    Raises:
      TypeError: if ``inner`` is not a transformation or ``every_k`` not an int.
      ValueError: if ``every_k`` is < 1.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(1.0)), every_k=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> scale = jxs.loss_scale_of(state).loss_scale  # 2**16 for both calls
      >>> g1, g2 = {"w": jnp.ones(2) * scale}, {"w": 3 * jnp.ones(2) * scale}
      >>> u, state = tx.update(g1, state, params)  # accumulates only
      >>> u["w"], int(state.micro_step)
      (Array([-0., -0.], dtype=float32), 1)
      >>> u, state = tx.update(g2, state, params)  # sgd on the mean, unscaled
      >>> u["w"], int(state.micro_step)
      (Array([-2., -2.], dtype=float32), 0)
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "`inner` must be an optax.GradientTransformation (e.g. "
            f"jxs.dynamic_scaling(optax.adam(1e-3))), got {type(inner).__name__}."
        )
    every_k = check_int("every_k", every_k)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Params) -> AccumulateState:
        return AccumulateState(
            micro_step=jnp.zeros((), jnp.int32),
            grad_sum=jax.tree.map(_zeros_acc, params),
            inner_state=inner.init(params),
        )

    def update_fn(
        updates: Updates,
        state: AccumulateState,
        params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, AccumulateState]:
        check_updates_match_params(updates, params)
        su, sa = jax.tree.structure(updates), jax.tree.structure(state.grad_sum)
        if su != sa:
            raise ValueError(
                "`updates` (the gradients) must have the tree structure of the "
                f"params given to `init`, got {su} and {sa}."
            )
        emit = state.micro_step >= every_k - 1
        total = jax.tree.map(_add, state.grad_sum, updates)

        def apply(operand):
            # The mean is computed here, so the other calls do not pay for it.
            total, grads, inner_state = operand
            mean = jax.tree.map(lambda t, g: _mean(t, g, every_k), total, grads)
            return inner.update(mean, inner_state, params, **extra_args)

        new_updates, new_inner = update_or_skip(
            emit, apply, (total, updates, state.inner_state), lambda op: op[2]
        )
        new_sum = jax.tree.map(lambda t: lax.select(emit, jnp.zeros_like(t), t), total)
        new_state = AccumulateState(
            micro_step=jnp.where(emit, 0, state.micro_step + 1).astype(jnp.int32),
            grad_sum=new_sum,
            inner_state=new_inner,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_tuple(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
    items = (value,) if isinstance(value, numbers.Integral) else tuple(value)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise ValueError(
                f"`{name}` must be a non-negative int or a sequence of them, got "
                f"{value!r}."
            )
    return tuple(int(i) for i in items)


def accumulate_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any,
    *,
    num_microbatches: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Like :func:`value_and_grad`, over micro-batches accumulated in one step.

    The returned function splits its batch arguments into ``k`` micro-batches,
    runs :func:`value_and_grad` on each inside a ``lax.scan`` (so only one
    micro-batch's activations are live at a time), sums the scaled gradients in
    float32 (float64 for float64 leaves, a complex leaf in its own dtype) and
    returns their mean, cast back to the gradients' dtype, together with the
    mean loss. Feed the gradients to
    ``tx.update`` of :func:`dynamic_scaling` once per effective batch: every
    micro-batch uses the same loss scale, finiteness is checked once (an
    ``inf``/``NaN`` in any micro-batch makes the sum non-finite, so the whole
    step is skipped), and the inner optimizer runs once.

    With equal-sized micro-batches and a ``fun`` that averages over its batch,
    the result equals :func:`value_and_grad` on the whole batch up to float
    rounding.

    Flax NNX modules and ``nnx.Rngs`` are passed as to :func:`value_and_grad`;
    their state other than the differentiated parameters (BatchNorm statistics,
    RNG counts) is carried from one micro-batch to the next (a fresh dropout
    mask for each) and written back at the end. They are never part of the
    batch.

    A function with delayed float8 scaling reads and updates a
    :class:`jaxscale.float8.Float8State`: use
    :func:`jaxscale.float8.accumulate_value_and_grad` (this one raises and
    names it).

    Args:
      fun: the loss function; returns a scalar, or ``(scalar, aux)`` with
        ``has_aux=True``.
      loss_scale: a :class:`LossScale`, or any state containing one (the
        optimizer state, a ``TrainState``; see :func:`loss_scale_of`).
      num_microbatches: ``None`` (default): every batch argument already has a
        leading micro-batch axis of size ``k``. An int ``k >= 1``: the leading
        axis of every batch argument (of size ``B``, divisible by ``k``) is split
        into ``k`` micro-batches of ``B // k``, in order.
      argnums: which positional argument(s) to differentiate, as in JAX.
      batch_argnums: which positional arguments hold the batch (every leaf is
        split); default: every positional argument not in ``argnums`` and not
        an NNX object. Keyword arguments and the other positional arguments
        are passed to each micro-step unchanged (put per-micro-batch PRNG keys
        in the batch, or pass an ``nnx.Rngs``).
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s signature returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux=True``: ``loss`` is the mean of the
      micro-batch losses (in the loss's dtype), ``aux`` is stacked along a
      leading axis of size ``k``, ``grads`` are the mean *scaled* gradients.

    Raises:
      TypeError: if ``num_microbatches`` is not an int.
      ValueError: if ``num_microbatches`` is < 1 or does not divide the batch
        size, if ``batch_argnums`` and ``argnums`` overlap or name no argument,
        or if the batch leaves disagree on the leading micro-batch axis.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> ls = jxs.StaticLossScale.create(1024.0)
      >>> loss_fn = lambda w, x: jnp.mean((x * w) ** 2)
      >>> x = jnp.arange(8.0)
      >>> grad_fn = jxs.accumulate_value_and_grad(loss_fn, ls, num_microbatches=4)
      >>> loss, grads = grad_fn(jnp.float32(1.0), x)  # four micro-batches of 2
      >>> loss, grads
      (Array(17.5, dtype=float32), Array(35840., dtype=float32))
      >>> jxs.value_and_grad(loss_fn, ls)(jnp.float32(1.0), x)  # same, in one go
      (Array(17.5, dtype=float32), Array(35840., dtype=float32))
    """
    return accumulated(
        fun,
        loss_scale,
        num_microbatches=num_microbatches,
        argnums=argnums,
        batch_argnums=batch_argnums,
        has_aux=has_aux,
    )


def accumulated(
    fun: Callable[..., Any],
    loss_scale: Any,
    *,
    num_microbatches: int | None,
    argnums: int | Sequence[int],
    batch_argnums: int | Sequence[int] | None,
    has_aux: bool,
    combine: Any = "mean",
) -> Callable[..., tuple[Any, Any]]:
    """:func:`accumulate_value_and_grad`, with ``combine``: a prefix of the
    gradients' tree whose leaves say how each part is combined over the
    micro-batches, ``"mean"`` (gradients) or ``"max"`` (the element-wise
    maximum: the cotangent of a :class:`jaxscale.float8.Float8State`, new amax
    histories, of which a window keeps the largest)."""
    ls = loss_scale_of(loss_scale)
    if num_microbatches is not None:
        num_microbatches = check_int("num_microbatches", num_microbatches)
    diff = _as_tuple("argnums", argnums)
    batch = None if batch_argnums is None else _as_tuple("batch_argnums", batch_argnums)
    if batch is not None and set(batch) & set(diff):
        raise ValueError(
            "`batch_argnums` must not overlap `argnums` (the batch is not "
            f"differentiated), got batch_argnums={batch_argnums!r} and "
            f"argnums={argnums!r}."
        )
    grad_fn = value_and_grad(fun, ls, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        idx = (
            tuple(
                i
                for i in range(len(args))
                if i not in diff and not _nnx.is_object(args[i])
            )
            if batch is None
            else batch
        )
        if any(i < len(args) and _nnx.is_object(args[i]) for i in idx):
            raise ValueError(
                "`batch_argnums` must name arguments holding arrays to split into "
                f"micro-batches, got {batch_argnums!r}, which names a Flax NNX "
                "object; pass modules and `nnx.Rngs` outside `batch_argnums`."
            )
        if not idx or max(idx) >= len(args):
            raise ValueError(
                "`batch_argnums` must name positional arguments holding the batch, "
                f"got {batch_argnums!r} for a call with {len(args)} positional "
                "argument(s)."
            )
        xs = _split(tuple(args[i] for i in idx), num_microbatches)
        k = jax.tree.leaves(xs)[0].shape[0]
        call, carry0, finish = _grad_call(args, kwargs)

        def micro(mb: tuple[Any, ...], carry: Any) -> tuple[Any, Any, Any]:
            full = list(args)
            for i, x in zip(idx, mb, strict=True):
                full[i] = x
            with ACCUMULATING.push(True):
                return call(full, carry)

        first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
        with _nnx.explain_trace_errors():
            _, grads_shape, _ = jax.eval_shape(micro, first, carry0)
        acc0 = jax.tree.map(_zeros_acc, grads_shape)

        def body(state, mb):
            acc, carry = state
            out, grads, carry = micro(mb, carry)
            return (jax.tree.map(_fold, combine, acc, grads), carry), out

        (acc, carry), outs = lax.scan(body, (acc0, carry0), xs)
        grads = jax.tree.map(
            lambda how, t, s: _result(how, t, s, k), combine, acc, grads_shape
        )
        grads = finish(grads, carry)
        losses, aux = outs if has_aux else (outs, None)
        losses = jnp.asarray(losses)
        loss = jnp.mean(losses.astype(compute_dtype(losses.dtype)), axis=0)
        loss = loss.astype(losses.dtype)
        return ((loss, aux) if has_aux else loss), grads

    def _grad_call(args: tuple[Any, ...], kwargs: dict[str, Any]):
        """``(call, carry0, finish)``: one micro-batch's ``(out, grads, carry)``.

        Plain arguments: ``carry`` is unused. Flax NNX objects among the
        arguments (modules, ``nnx.Rngs``) are split once, outside the scan;
        their state other than the differentiated parameters (BatchNorm
        statistics, RNG counts) is the carry, so it advances micro-batch by
        micro-batch, and ``finish`` writes it back into the objects.
        """
        if not _nnx.has_objects(args, kwargs):

            def plain(full, carry):
                out, grads = grad_fn(*full, **kwargs)
                return out, grads, carry

            return plain, None, lambda grads, carry: grads
        split = _nnx.NnxArgs(args, kwargs, argnums, _nnx.default_wrt(loss_scale))
        scaled_grad = functools.partial(value_and_grad, loss_scale=ls)
        call, rest, finish = split.grad_call(scaled_grad, fun, has_aux)
        return lambda full, carry: call(full, kwargs, carry), rest, finish

    return wrapped


def _fold(how: str, acc: Any, grads: Any) -> Any:
    """One more micro-batch's gradients into the accumulator (a subtree)."""
    if how == "mean":
        return jax.tree.map(_add, acc, grads)
    return jax.tree.map(
        lambda a, g: (
            jnp.maximum(a, jnp.asarray(g).astype(a.dtype)) if is_float_leaf(g) else a
        ),
        acc,
        grads,
    )


def _result(how: str, acc: Any, shapes: Any, k: int) -> Any:
    """The accumulator's subtree as the result: the mean, or the maximum."""

    def leaf(t: jax.Array, s: Any) -> Any:
        if not is_inexact_leaf(s):
            return t
        return _mean(t, s, k) if how == "mean" else t.astype(s.dtype)

    return jax.tree.map(leaf, acc, shapes)


def _split(xs: tuple[Any, ...], k: int | None) -> tuple[Any, ...]:
    """Gives every leaf of ``xs`` a leading micro-batch axis (checks sizes)."""
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError(
            "`batch_argnums` must name arguments with array leaves to split into "
            "micro-batches, got none."
        )
    for x in leaves:
        if jnp.ndim(x) == 0:
            raise ValueError(
                "Every leaf of the batch arguments needs a leading batch axis, got "
                "a scalar. Pass non-batch arguments outside `batch_argnums`."
            )
    if k is None:
        sizes = {jnp.shape(x)[0] for x in leaves}
        if len(sizes) != 1:
            raise ValueError(
                "With `num_microbatches=None` every batch leaf needs the same "
                f"leading micro-batch axis, got sizes {sorted(sizes)}."
            )
        return xs

    def split(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        n = x.shape[0]
        if n % k:
            raise ValueError(
                f"`num_microbatches` must divide the batch size, got {k} for a "
                f"batch axis of size {n}."
            )
        return x.reshape(k, n // k, *x.shape[1:])

    return jax.tree.map(split, xs)
