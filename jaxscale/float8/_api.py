"""The float8 API: delayed scaling's state and how it is threaded.

:class:`Float8State` holds one amax history and one set of scales per float8
site; :func:`init` finds the sites by tracing the function once;
:func:`value_and_grad` differentiates the function with the state in scope and
returns the new state (each site's new amax history comes back as the
cotangent of its state, see :mod:`jaxscale.float8._site`);
:func:`accumulate_value_and_grad` does so over micro-batches (one update per
window, from the maximum of their amaxes); :func:`apply` runs it forward with
the state (evaluation).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale._accumulate import accumulated
from jaxscale._grad import value_and_grad as _scaled_value_and_grad
from jaxscale._loss_scale import NoOpLossScale
from jaxscale.float8._recipes import DelayedScaling
from jaxscale.float8._site import Context, SiteState, using_state

__all__ = [
    "Float8State",
    "accumulate_value_and_grad",
    "apply",
    "init",
    "value_and_grad",
]


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata={"static": True}, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Float8State:
    """Delayed scaling's state: per float8 site, amax histories and scales.

    A pytree of ``2 * len(sites)`` float32 arrays (checkpoint it with the rest
    of the train state); the recipe and the sites are static. Rows of each
    site's arrays are its left operand (the activation of ``x @ w``; the
    weight of equinox's ``weight @ x``), its right operand and the gradient.

    Attributes:
      history: per site, ``f32[3, history_len]``, the newest amax first; zeros
        until the site has run in a training step.
      scale: per site, ``f32[3]``, the dequantisation scales the next step
        uses (``x ~ q * scale``; Transformer Engine's ``scale_inv``).
      recipe: the :class:`~jaxscale.float8.DelayedScaling` recipe (static).
      sites: what identifies each site (static): where it is in the function
        and its contracting size.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16,
      ...                  float8=jxs.float8.DelayedScaling(16, min_dim=0))
      >>> state = jxs.float8.init(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> len(state.sites), state.history[0].shape
      (1, (3, 16))
    """

    history: tuple[jax.Array, ...]
    scale: tuple[jax.Array, ...]
    recipe: DelayedScaling = _static()
    sites: tuple[str, ...] = _static()

    def site_states(self) -> list[SiteState]:
        return [SiteState(h, s) for h, s in zip(self.history, self.scale, strict=True)]


def _check_state(state: Any, name: str = "state") -> Float8State:
    if not isinstance(state, Float8State):
        raise TypeError(
            f"`{name}` must be a `jxs.float8.Float8State` (from `jxs.float8.init`), "
            f"got {type(state).__name__}."
        )
    n, h = len(state.sites), state.recipe.history_len
    if len(state.history) != n or len(state.scale) != n:
        raise ValueError(
            f"`{name}` has {len(state.history)} histories and {len(state.scale)} "
            f"scales for {n} sites: it was not made by `jxs.float8.init` (or was "
            "restored into another structure)."
        )
    for i, (hist, scale) in enumerate(zip(state.history, state.scale, strict=True)):
        if jnp.shape(hist) != (3, h) or jnp.shape(scale) != (3,):
            raise ValueError(
                f"`{name}`: site {i} has a history of shape {jnp.shape(hist)} and "
                f"scales of shape {jnp.shape(scale)}, but the recipe's "
                f"`history_len` is {h} (expected (3, {h}) and (3,)): was it restored "
                "from a run with another `history_len`? Make a new state with "
                "`jxs.float8.init`, or restore with the recipe it was saved with."
            )
    return state


def _check_fun(fun: Any) -> None:
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {type(fun).__name__}.")


def init(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Float8State:
    """A fresh delayed-scaling state for the float8 sites of ``fun``.

    ``fun`` is traced once (abstractly: nothing is computed) on ``args``; every
    float8 site of every ``jxs.autocast(..., float8=DelayedScaling(...))`` call
    it makes gets empty histories and unit scales. A site whose history is
    empty scales by its current amax, so the first step is scaled as current
    scaling would, and the state takes over from the second.

    Sites are numbered in the order the function meets them and identified by
    where they are (the name stack: Flax modules' names, ``jax.named_scope``)
    and their contracting size. If the function changes (another layer, another
    width), :func:`value_and_grad` and :func:`apply` raise rather than give one
    site another's history: make a new state.

    Args:
      fun: the function, as it will be passed to :func:`value_and_grad`.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments.

    Returns:
      A :class:`Float8State`.

    Raises:
      ValueError: if ``fun`` runs no autocast region with delayed scaling, or
        that region has no float8 site (the recipe chose none).

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> recipe = jxs.float8.DelayedScaling(history_len=4, min_dim=0)
      >>> f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16, float8=recipe)
      >>> state = jxs.float8.init(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> state.sites
      ('(top level): dot_general contracting 8',)
    """
    _check_fun(fun)
    ctx = Context(None)  # recording: the first autocast sets the recipe
    with using_state(ctx):
        jax.eval_shape(functools.partial(fun, **kwargs), *args)
    if ctx.recipe is None:
        raise ValueError(
            "`fun` runs no `jxs.autocast(..., float8=DelayedScaling(...))` region "
            "(or `float8='delayed'`): there is no delayed-scaling state to make. "
            "Current scaling (`float8=True`) needs none."
        )
    if not ctx.seen:
        md = ctx.recipe.min_dim
        rule = (
            "is predicted faster in float8 by the cost model"
            if md is None
            else f"has all sizes >= `min_dim` ({md})"
        )
        raise ValueError(
            f"`fun` has no float8 site: no `dot_general` without batch dimensions "
            f"{rule}, and no pattern of the recipe's `sites` asks for one "
            "(`jxs.diagnostics.autocast_report(..., float8=recipe)` says why for "
            "each). Set a `min_dim` (0: every matmul without batch dimensions) or "
            "`sites` in the recipe, or use a 16-bit autocast."
        )
    h = ctx.recipe.history_len
    return Float8State(
        history=tuple(jnp.zeros((3, h), jnp.float32) for _ in ctx.seen),
        scale=tuple(jnp.ones((3,), jnp.float32) for _ in ctx.seen),
        recipe=ctx.recipe,
        sites=tuple(ctx.seen),
    )


def _scoped(
    fun: Callable[..., Any], state: Float8State, evaluating: bool = False
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = Context(
            state.recipe, state.site_states(), state.sites, evaluating=evaluating
        )
        with using_state(ctx):
            out = fun(*args, **kwargs)
        ctx.finish()
        return out

    return run


def apply(fun: Callable[..., Any], state: Float8State) -> Callable[..., Any]:
    """``fun`` with the delayed-scaling ``state`` in scope, forward only.

    For evaluation: the float8 sites quantise with the state's scales; the
    state is not updated (amaxes are recorded by training steps only). The
    function must not be differentiated (under ``jax.grad``, or
    ``jxs.accumulate_value_and_grad``): that raises at trace time rather than
    drop the step's amaxes; train through :func:`value_and_grad` or
    :func:`accumulate_value_and_grad`.

    Args:
      fun: the function (the one :func:`init` was given).
      state: its :class:`Float8State`.

    Returns:
      A function with ``fun``'s signature and outputs.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> recipe = jxs.float8.DelayedScaling(history_len=4, min_dim=0)
      >>> f = jxs.autocast(lambda w, x: x @ w, jnp.bfloat16, float8=recipe)
      >>> w, x = jnp.eye(8), jnp.ones((4, 8))
      >>> state = jxs.float8.init(f, w, x)
      >>> jxs.float8.apply(f, state)(w, x)[0, :3]
      Array([1., 1., 1.], dtype=float32)
    """
    _check_fun(fun)
    return _scoped(fun, _check_state(state), evaluating=True)


def value_and_grad(
    fun: Callable[..., Any],
    state: Float8State,
    loss_scale: Any = None,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Float8State]]:
    """``jax.value_and_grad(fun)`` that also returns the new delayed-scaling state.

    ``fun``'s float8 sites read ``state``; each site's amaxes of this step
    (activation and weight in the forward pass, gradient in the backward) go
    into its history, and the scales for the next step are computed from the
    histories. A site inside ``lax.scan`` records the largest amax over the
    iterations. A site that did not run (an untaken ``lax.cond`` branch) keeps
    its state.

    With ``loss_scale`` (an optimizer state holding a
    :class:`~jaxscale.DynamicScalingState`, or a loss scale), the loss is scaled
    as :func:`jaxscale.value_and_grad` does, for float16 compute.

    Args:
      fun: a function of parameters (its first argument, a pytree of arrays)
        and more, returning a scalar loss (or ``(loss, aux)``).
      state: the :class:`Float8State` from :func:`init`.
      loss_scale: ``None`` (no loss scaling: bfloat16 compute) or what
        :func:`jaxscale.value_and_grad` takes.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads, new_state)``;
      ``value`` is ``loss`` or ``(loss, aux)``, ``grads`` the gradients with
      respect to the first argument (of the scaled loss when ``loss_scale`` is
      given).

    Raises:
      ValueError: if ``fun`` no longer has the sites ``state`` was made for.
      TypeError: if ``state`` is not a :class:`Float8State`.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> recipe = jxs.float8.DelayedScaling(history_len=4, min_dim=0)
      >>> f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16, float8=recipe)
      >>> w, x = jnp.full((8, 8), 0.5), jnp.full((4, 8), 2.0)
      >>> state = jxs.float8.init(f, w, x)
      >>> loss, grads, state = jxs.float8.value_and_grad(f, state)(w, x)
      >>> float(loss), grads.shape
      (256.0, (8, 8))
      >>> state.history[0][:, 0]  # amaxes of x, w and the gradient
      Array([2. , 0.5, 1. ], dtype=float32)
    """
    _check_fun(fun)
    state = _check_state(state)
    _check_has_aux(has_aux)

    inner = _with_state(fun)
    if loss_scale is None:
        grad_fn = jax.value_and_grad(inner, has_aux=has_aux)
    else:
        grad_fn = _scaled_value_and_grad(inner, loss_scale, has_aux=has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, Float8State]:
        _check_args(args, "value_and_grad")
        value, (grads, ct) = grad_fn((args[0], state), *args[1:], **kwargs)
        return value, grads, _updated(state, ct)

    return wrapped


def _check_has_aux(has_aux: Any) -> None:
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {type(has_aux).__name__}.")


def _check_args(args: tuple[Any, ...], name: str) -> None:
    if not args:
        raise TypeError(
            f"The function returned by `jxs.float8.{name}` needs the parameters as "
            "its first positional argument."
        )


def _with_state(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` as a function of ``(params, state)`` and the rest: what is
    differentiated, so that the state's cotangent carries the new histories."""

    def inner(both: tuple[Any, Float8State], *rest: Any, **kwargs: Any) -> Any:
        params, st = both
        return _scoped(fun, st)(params, *rest, **kwargs)

    return inner


def _updated(state: Float8State, ct: Float8State) -> Float8State:
    """The new state from the cotangent of the old one (the sites' records)."""
    new = [
        state.recipe.update(old, (h, s))
        for old, h, s in zip(state.site_states(), ct.history, ct.scale, strict=True)
    ]
    return dataclasses.replace(
        state,
        history=tuple(n.history for n in new),
        scale=tuple(n.scale for n in new),
    )


def accumulate_value_and_grad(
    fun: Callable[..., Any],
    state: Float8State,
    loss_scale: Any = None,
    *,
    num_microbatches: int | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Float8State]]:
    """:func:`value_and_grad` over micro-batches accumulated in one step.

    :func:`jaxscale.accumulate_value_and_grad` for a function with delayed
    float8 scaling: the batch arguments are split into ``k`` micro-batches,
    run one after the other in a ``lax.scan``, and the mean gradients come
    back with the new state. Every micro-batch quantises with the scales
    ``state`` holds; each site's amaxes (left operand, right operand, gradient)
    are combined by the maximum over the micro-batches (as over the iterations
    of a ``scan``) and go into its history once: one history update per
    accumulation window, as one step on the whole batch would make.

    Args:
      fun: a function of parameters (its first argument) and more, returning
        a scalar loss (or ``(loss, aux)``), as for :func:`value_and_grad`.
      state: the :class:`Float8State` from :func:`init`.
      loss_scale: ``None`` (no loss scaling: bfloat16 compute) or what
        :func:`jaxscale.accumulate_value_and_grad` takes.
      num_microbatches: as for :func:`jaxscale.accumulate_value_and_grad`
        (``None``: the batch arguments already have a leading micro-batch
        axis).
      batch_argnums: which positional arguments hold the batch (never the
        first); default: every positional argument but the first.
      has_aux: whether ``fun`` returns ``(loss, aux)``; ``aux`` comes back
        stacked along a leading axis of size ``k``.

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads,
      new_state)``: ``value`` is the mean loss (or ``(loss, aux)``), ``grads``
      the mean gradients with respect to the first argument (of the scaled
      loss when ``loss_scale`` is given).

    Raises:
      ValueError: if ``fun`` no longer has the sites ``state`` was made for,
        or the micro-batches cannot be formed (see
        :func:`jaxscale.accumulate_value_and_grad`).
      TypeError: if ``state`` is not a :class:`Float8State`.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> recipe = jxs.float8.DelayedScaling(history_len=4, min_dim=0)
      >>> f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16, float8=recipe)
      >>> w = jnp.full((8, 8), 0.5)
      >>> x = jnp.concatenate([jnp.full((4, 8), 2.0), jnp.full((4, 8), 3.0)])
      >>> state = jxs.float8.init(f, w, x[:4])
      >>> grad_fn = jxs.float8.accumulate_value_and_grad(f, state, num_microbatches=2)
      >>> loss, grads, state = grad_fn(w, x)  # two micro-batches of 4 rows
      >>> float(loss), grads.shape
      (320.0, (8, 8))
      >>> state.history[0][:, :2]  # one update: the larger amaxes of the two
      Array([[3. , 0. ],
             [0.5, 0. ],
             [1. , 0. ]], dtype=float32)
    """
    _check_fun(fun)
    state = _check_state(state)
    _check_has_aux(has_aux)
    grad_fn = accumulated(
        _with_state(fun),
        NoOpLossScale() if loss_scale is None else loss_scale,
        num_microbatches=num_microbatches,
        argnums=0,
        batch_argnums=batch_argnums,
        has_aux=has_aux,
        combine=("mean", "max"),  # the gradients, the new histories
    )

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, Float8State]:
        _check_args(args, "accumulate_value_and_grad")
        value, (grads, ct) = grad_fn((args[0], state), *args[1:], **kwargs)
        return value, grads, _updated(state, ct)

    return wrapped
