"""Equinox integration: :func:`filter_value_and_grad` on the scaled loss.

Not imported by ``import jaxscale``; import it explicitly (it needs equinox)::

    import jaxscale.equinox as jxe

An equinox module is a pytree whose leaves are not all arrays (BatchNorm's
``axis_name``, an MLP's activation function, Dropout's ``p``), so it cannot go
through ``jax.value_and_grad`` (or :func:`jaxscale.value_and_grad`) as it is.
Equinox's answer is filtering: differentiate the floating arrays of the model,
treat everything else as static. :func:`filter_value_and_grad` is
``eqx.filter_value_and_grad`` on the loss times the current scale, and
:func:`keep_on_skip` keeps an ``eqx.nn.State`` (BatchNorm statistics) unchanged
on a step that :func:`jaxscale.dynamic_scaling` skips. The rest is equinox's own
idiom, unchanged: ``tx.init(eqx.filter(model, eqx.is_inexact_array))``,
``tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))`` and
``eqx.apply_updates(model, updates)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jaxscale._accumulate import AccumulateState
from jaxscale._find import scaling_state_of
from jaxscale._grad import find_loss_scale, value_and_grad
from jaxscale._tree import all_finite, select_tree

__all__ = ["filter_value_and_grad", "keep_on_skip"]


def filter_value_and_grad(
    fun: Callable[..., Any], loss_scale: Any, *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Like ``eqx.filter_value_and_grad``, differentiating the *scaled* loss.

    The returned function computes ``fun(model, *args, **kwargs)``, multiplies
    the loss by the current scale (:meth:`jaxscale.LossScale.scale`) and
    differentiates that with respect to the floating arrays of its first
    positional argument (``eqx.is_inexact_array``), as equinox does:
    everything else in it (strings, functions, Python numbers, integer arrays)
    and every other argument is static or closed over, not differentiated. It
    returns the **unscaled** loss (as ``fun`` returned it) and the **scaled**
    gradients, a pytree shaped like the model with ``None`` where equinox puts
    ``None``: ready for
    ``tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))``
    with ``tx`` built by :func:`jaxscale.dynamic_scaling`, which unscales them,
    and then for ``eqx.apply_updates(model, updates)``.

    Compute the loss's final reduction in float32 (:func:`jaxscale.autocast`
    does): a float16 loss cannot carry a scale above 65504 through the backward
    pass. To run a float32 model in float16, wrap the loss:
    ``jxe.filter_value_and_grad(jxs.autocast(loss_fn), opt_state)``.

    Args:
      fun: the loss function, ``fun(model, *args, **kwargs)``; returns a
        scalar, or ``(scalar, aux)`` with ``has_aux=True`` (e.g. the new
        ``eqx.nn.State`` as aux).
      loss_scale: a :class:`jaxscale.LossScale`, or any state containing one
        (the optimizer state of :func:`jaxscale.dynamic_scaling`; see
        :func:`jaxscale.loss_scale_of`). Read once, here: build the function
        inside the jitted step, from the step's own optimizer state.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function with ``fun``'s signature returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux=True``. Called without a
      positional argument, or with a first argument that holds no floating
      array, it raises a ``TypeError``; what ``fun`` returns is checked as by
      :func:`jaxscale.value_and_grad`, which does the scaling.

    Raises:
      TypeError: if ``fun`` is not callable or ``has_aux`` is not a bool, or if
        ``loss_scale`` is a number.
      ValueError: if ``loss_scale`` holds no loss scale, or several, or
        :func:`jaxscale.dynamic_scaling` is nested wrongly in it.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.equinox as jxe
      >>> import equinox as eqx, jax, jax.numpy as jnp, optax
      >>> model = eqx.nn.MLP(2, 1, width_size=8, depth=1, key=jax.random.key(0))
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
      >>> def loss_fn(model, x):
      ...     return jnp.mean(jax.vmap(model)(x) ** 2)
      >>> x = jnp.ones((4, 2))
      >>> loss, grads = jxe.filter_value_and_grad(loss_fn, opt_state)(model, x)
      >>> bool(loss == loss_fn(model, x)), grads.activation  # unscaled; static: None
      (True, None)
      >>> plain = eqx.filter_grad(loss_fn)(model, x)
      >>> bool(jnp.all(grads.layers[0].weight == 65536.0 * plain.layers[0].weight))
      True
      >>> params = eqx.filter(model, eqx.is_inexact_array)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> model = eqx.apply_updates(model, updates)
    """
    if not callable(fun):
        raise TypeError(
            "`fun` must be callable (the loss function, `fun(model, ...)`), got "
            f"{type(fun).__name__}. The order is "
            "`jxe.filter_value_and_grad(loss_fn, opt_state)`."
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {type(has_aux).__name__}.")
    ls = find_loss_scale(loss_scale, "loss_scale")

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not args:
            raise TypeError(
                "The function returned by `jxe.filter_value_and_grad` "
                "differentiates its first positional argument (the model): call "
                f"it as `f(model, ...)`, got no positional argument (keywords "
                f"{sorted(kwargs)})."
            )
        model, *rest = args
        arrays, static = eqx.partition(model, eqx.is_inexact_array)
        if not jax.tree.leaves(arrays):
            raise TypeError(
                "The first positional argument is what `jxe.filter_value_and_grad` "
                "differentiates (the model), and it must hold floating arrays; "
                f"got {type(model).__name__} with none. Put the model first: "
                "`f(model, x, ...)`."
            )

        def on_arrays(arrays: Any, /, *rest: Any, **kwargs: Any) -> Any:
            return fun(eqx.combine(arrays, static), *rest, **kwargs)

        # The scaling, and its checks of what ``fun`` returns, are the core's.
        grad_fn = value_and_grad(on_arrays, ls, has_aux=has_aux)
        return grad_fn(arrays, *rest, **kwargs)

    return wrapped


def _accumulates(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds a :func:`jaxscale.accumulate` state (read
    from the structure, at trace time)."""
    is_acc = lambda x: isinstance(x, AccumulateState)  # noqa: E731
    return any(map(is_acc, jax.tree.leaves(opt_state, is_leaf=is_acc)))


def _check_like(state: Any, new_state: Any) -> None:
    """``new_state`` must have the structure, shapes and dtypes of ``state``."""
    a, b = jax.tree.structure(state), jax.tree.structure(new_state)
    if a != b:
        raise ValueError(
            "`new_state` must have the tree structure of `state` (the state "
            f"returned by the forward pass and the one passed to it), got {b} "
            f"and {a}."
        )
    for path, x, y in zip(
        *zip(*jax.tree_util.tree_flatten_with_path(state)[0], strict=True),
        jax.tree.leaves(new_state),
        strict=True,
    ):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} of `new_state` is "
                f"{y.dtype}{list(y.shape)}, of `state` {x.dtype}{list(x.shape)}: "
                "they must agree (the old value is kept on a skipped step)."
            )


def keep_on_skip(state: Any, new_state: Any, opt_state: Any, new_opt_state: Any) -> Any:
    """``new_state``, or ``state`` back if the optimizer update was skipped.

    The forward-overflow guard for equinox, where the forward pass returns a new
    ``eqx.nn.State`` (BatchNorm statistics, SpectralNorm's power-iteration
    vectors) before ``tx.update`` knows whether the step overflows. One forward
    pass that overflows in float16 writes ``inf``/``NaN`` into BatchNorm's
    running statistics; torch's ``GradScaler`` keeps them, and inference is
    ruined for ever. With this, a skipped step changes nothing but the loss
    scale and the counters: the model (its updates are ``-0.0``), the optimizer
    state and the ``eqx.nn.State`` all come back bit-identical.

    A select on device (``lax.select`` per leaf), decided by
    ``new_opt_state``: no host sync, fine under ``eqx.filter_jit``. Under
    :func:`jaxscale.accumulate` (one ``update`` per micro-batch) the new state
    of an accumulating call is kept unless it is not finite, so each
    micro-batch still updates the statistics; on the window's last call it is
    kept iff the update is applied.

    Args:
      state: the state passed to the forward pass (any pytree of arrays).
      new_state: the state it returned, with the same structure, shapes and
        dtypes.
      opt_state: the optimizer state passed to ``tx.update`` (holding one
        :func:`jaxscale.dynamic_scaling`).
      new_opt_state: the optimizer state ``tx.update`` returned.

    Returns:
      ``new_state`` if the update was applied, else ``state``.

    Raises:
      ValueError: if an optimizer state does not hold exactly one
        :func:`jaxscale.dynamic_scaling` state, or if ``state`` and
        ``new_state`` differ in structure, shape or dtype.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.equinox as jxe
      >>> import equinox as eqx, jax, jax.numpy as jnp, optax
      >>> bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
      ...     2, axis_name="batch", mode="batch")
      >>> forward = jax.vmap(
      ...     bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
      >>> _, new_state = forward(jnp.array([[jnp.inf, 1.0]]), state)  # overflows
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> params = eqx.filter(bn, eqx.is_inexact_array)
      >>> opt_state = tx.init(params)
      >>> grads = jax.tree.map(lambda p: p * jnp.inf, params)
      >>> _, new_opt_state = tx.update(grads, opt_state, params)  # skipped
      >>> state = jxe.keep_on_skip(state, new_state, opt_state, new_opt_state)
      >>> state.get(bn.batch_state_index)[0]  # the running mean, not NaN
      Array([0., 0.], dtype=float32)
    """
    old = scaling_state_of(opt_state, "opt_state")
    new = scaling_state_of(new_opt_state, "new_opt_state")
    _check_like(state, new_state)
    skipped = jnp.logical_not(new.last_step_finite)
    if _accumulates(new_opt_state):
        stepped = new.steps != old.steps
        keep = jnp.where(stepped, skipped, jnp.logical_not(all_finite(new_state)))
    else:
        keep = skipped
    return select_tree(keep, state, new_state)
