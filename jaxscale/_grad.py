"""The gradient of the scaled loss: :func:`value_and_grad`, :func:`loss_scale_of`.

Above the finder (:mod:`jaxscale._composition`) and the NNX split
(:mod:`jaxscale._nnx`): it hands its own differentiation into the split as an
argument, so the split never calls back up.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import _nnx
from jaxscale._composition import check_composition
from jaxscale._find import locate
from jaxscale._loss_scale import LossScale
from jaxscale._tree import first_non_array

__all__ = [
    "HalfPrecisionLossWarning",
    "find_loss_scale",
    "loss_scale_of",
    "value_and_grad",
]


class HalfPrecisionLossWarning(UserWarning):
    """Warned, when :func:`value_and_grad` is traced, for a loss in float16 or
    bfloat16.

    The loss is multiplied by the scale in its own dtype: a float16 loss times
    the default scale (``2**16``) is ``inf`` for any loss above 1, so the first
    steps overflow and the scale backs off until the product fits; a bfloat16
    loss keeps 8 bits of mantissa, so the reduction that produced it has
    already lost the small terms. Reduce in float32 instead, as
    ``torch.autocast`` does: ``jnp.mean(x, dtype=jnp.float32)`` or
    ``jnp.mean(x.astype(jnp.float32))``. (Under :func:`autocast`, a loss
    whose last op is, e.g., a ``max`` comes out in float16: cast it.)

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.HalfPrecisionLossWarning, UserWarning)
      True
    """


def _check_loss(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from what ``fun`` returned, with the mistakes named
    before the loss is scaled (so no error shows a scaled value)."""
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError(
                "With `has_aux=True`, `fun` must return a pair `(loss, aux)`, got "
                f"{_describe(out)}."
            )
        loss, aux = out
    else:
        loss, aux = out, None
        if isinstance(out, tuple | list | dict):
            raise TypeError(
                f"`fun` returned {_describe(out)}, not a scalar loss. If it returns "
                "`(loss, aux)`, pass `has_aux=True`. (These are the values `fun` "
                "returned: jaxscale has not scaled them yet.)"
            )
    shape = jnp.shape(loss)
    if shape != ():
        raise TypeError(
            f"`fun` must return a scalar loss, got an array of shape {shape} (of "
            f"{_describe(loss)}): reduce it, e.g. with `jnp.mean`. (Unscaled: "
            "jaxscale has not scaled it yet.)"
        )
    dtype = jnp.result_type(loss)
    if dtype in (jnp.float16, jnp.bfloat16):
        warnings.warn(
            f"The loss is {jnp.dtype(dtype).name}: it is multiplied by the loss "
            "scale in that dtype (a float16 loss overflows at the default scale "
            "of 2**16 for any value above 1, so the first steps are skipped until "
            "the scale backs off). Reduce the loss in float32: "
            "`jnp.mean(x, dtype=jnp.float32)` or `jnp.mean(x.astype(jnp.float32))`.",
            HalfPrecisionLossWarning,
            stacklevel=4,
        )
    return loss, aux


def _check_differentiable(args: tuple[Any, ...], argnums: Any) -> None:
    """The arguments at ``argnums`` must hold arrays only: name the first leaf
    that is not (an equinox module's string or function) and the fix."""
    for i in (argnums,) if isinstance(argnums, int) else tuple(argnums):
        if not -len(args) <= i < len(args):
            continue  # JAX says what is wrong with the index
        bad = first_non_array(args[i])
        if bad is not None:
            where, x = bad
            raise TypeError(
                f"`jxs.value_and_grad` differentiates every leaf of argument {i}, "
                f"got {type(x).__name__} {x!r:.40} at {where}. For an equinox "
                "module use `jaxscale.equinox.filter_value_and_grad(loss_fn, "
                "opt_state)`, which differentiates its inexact arrays only (as "
                "`eqx.filter_value_and_grad` does); otherwise pass the arrays and "
                "close over the rest."
            )


def _describe(x: Any) -> str:
    """A short description of a value for an error message, without its data."""
    if isinstance(x, tuple | list):
        inner = ", ".join(_describe(v) for v in x[:4])
        more = ", ..." if len(x) > 4 else ""
        return f"a {type(x).__name__} of {len(x)} ({inner}{more})"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))[:6]}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def loss_scale_of(opt_state: Any) -> LossScale:
    """Finds the :class:`LossScale` inside any nested optimizer state.

    Looks through :func:`accumulate`, a Flax ``TrainState`` (or anything with
    an ``opt_state`` attribute, such as an ``nnx.Optimizer``) and any container,
    and unwraps the ``nnx.OptArray`` variables NNX puts around state leaves. A
    :class:`LossScale` passed in is returned as is.

    It also checks, from the structure of the state alone (at trace time, at no
    cost in the compiled step), that :func:`dynamic_scaling` is nested right: a
    transformation in front of it in an ``optax.chain`` or
    ``optax.named_chain``, or the wrapper inside ``optax.MultiSteps``,
    ``optax.masked``, ``optax.multi_transform``, ``optax.apply_if_finite``,
    ``optax.contrib.schedule_free`` and other wrappers that run outside it,
    raises a ``ValueError`` that says how to nest it;
    ``optax.inject_hyperparams``, ``optax.conditionally_mask`` or
    ``optax.lookahead`` around it, stateful transformations chained after it,
    and wrappers jaxscale does not know warn (:class:`CompositionWarning`).
    :func:`value_and_grad` calls it, so every training step is checked.

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
    return find_loss_scale(opt_state, "opt_state")


def find_loss_scale(opt_state: Any, name: str) -> LossScale:
    """:func:`loss_scale_of`, naming the argument ``name`` in its errors."""
    if isinstance(opt_state, LossScale):
        return jax.tree.map(_nnx.unwrap, opt_state, is_leaf=_nnx.is_variable)
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
    found = locate(opt_state, name)  # one walk: the scale and where it sits
    check_composition(opt_state, found.scaling_path, name)
    return found.loss_scale


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
    ls = find_loss_scale(loss_scale, "loss_scale")

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        loss, aux = _check_loss(fun(*args, **kwargs), has_aux)
        return ls.scale(loss), (loss, aux)

    grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)

    def scaled_grad(f: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        # What the NNX split differentiates its pure function with.
        return value_and_grad(f, ls, **options)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if _nnx.has_objects(args, kwargs):  # Flax NNX: split, differentiate, update
            split = _nnx.NnxArgs(args, kwargs, argnums, _nnx.default_wrt(loss_scale))
            call, rest, finish = split.grad_call(scaled_grad, fun, has_aux)
            out, grads, rest = call(args, kwargs, rest)
            return out, finish(grads, rest)
        _check_differentiable(args, argnums)
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped
