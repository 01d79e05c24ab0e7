"""Fault injection: ``inf``/``NaN`` in chosen leaves at chosen steps, inside ``jit``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._tree import is_inexact_leaf, path_name, saturating_increment

_INT32_MAX = int(np.iinfo(np.int32).max)

# --------------------------------------------------------------------------- #
# Fault injection
# --------------------------------------------------------------------------- #

PathSpec = str | Sequence[str] | Callable[[str], bool] | None


def _selector(paths: PathSpec) -> Callable[[str], bool]:
    if paths is None:
        return lambda name: True
    if isinstance(paths, str):
        return lambda name: paths in name
    if callable(paths):
        return lambda name: bool(paths(name))
    if isinstance(paths, Sequence) and all(isinstance(p, str) for p in paths):
        subs = tuple(paths)
        return lambda name: any(s in name for s in subs)
    raise TypeError(
        "`paths` must be None, a path substring, a sequence of substrings or a "
        f"predicate on path names, got {paths!r}."
    )


def _at_steps(at_steps: Any) -> tuple[int, ...]:
    if isinstance(at_steps, numbers.Integral) and not isinstance(at_steps, bool):
        at_steps = (at_steps,)
    if isinstance(at_steps, str) or not isinstance(at_steps, Iterable | np.ndarray):
        raise TypeError(f"`at_steps` must be a sequence of ints, got {at_steps!r}.")
    out = []
    for s in np.asarray(at_steps).reshape(-1).tolist():
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"`at_steps` must be a sequence of ints, got {s!r}.")
        if not 0 <= s <= _INT32_MAX:
            raise ValueError(f"`at_steps` must be in [0, 2**31 - 1], got {s}.")
        out.append(s)
    return tuple(sorted(set(out)))


def _fill_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            "`value` must be a real number such as jnp.inf, -jnp.inf or jnp.nan, "
            f"got {value!r}."
        )
    return float(value)


def inject_nonfinite(
    tree: Any,
    *,
    step: jax.typing.ArrayLike,
    at_steps: int | Sequence[int],
    paths: PathSpec = None,
    value: float = math.inf,
) -> Any:
    """Replaces chosen leaves of ``tree`` by ``value`` when ``step`` is in ``at_steps``.

    Branch-free (``lax.select`` per chosen leaf) and without host
    synchronisation: ``step`` can be a traced counter inside ``jit`` or
    ``lax.scan``, e.g. ``opt_state.steps``, the 0-based index of the update
    about to run. Every element of a chosen leaf becomes ``value`` (cast to the
    leaf's dtype: a finite ``1e30`` becomes ``inf`` in float16; a complex leaf
    gets ``value + 0j``). Other leaves,
    and every leaf at other steps, are returned unchanged.

    Args:
      tree: a pytree, typically the (scaled) gradients.
      step: an integer scalar, the current step.
      at_steps: the steps (ints >= 0) at which to inject.
      paths: which floating (or complex) leaves: ``None`` for all; a substring
        of the path name (``"dense/kernel"``, ``"layers/0"``); a sequence of
        substrings (any matches); or a predicate ``f(name) -> bool``. Names are
        key paths joined by ``/``, as :func:`jaxscale.diagnostics.nonfinite_paths`
        reports them.
      value: the value to inject; ``jnp.inf`` (default), ``-jnp.inf``,
        ``jnp.nan`` or any real number.

    Returns:
      A pytree with the structure, shapes and dtypes of ``tree``.

    Raises:
      TypeError: if ``step`` is not an integer scalar, or ``at_steps``,
        ``paths`` or ``value`` has the wrong type.
      ValueError: if ``paths`` matches no floating leaf, or a step is negative.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax, jax.numpy as jnp
      >>> grads = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}}
      >>> f = jax.jit(lambda g, s: jxt.inject_nonfinite(
      ...     g, step=s, at_steps=[3], paths="kernel"))
      >>> f(grads, 3)["dense"]["kernel"], f(grads, 4)["dense"]["kernel"]
      (Array([inf, inf], dtype=float32), Array([1., 1.], dtype=float32))
      >>> bool(jxs.all_finite(f(grads, 3)["dense"]["bias"]))
      True
    """
    select = _selector(paths)
    at = _at_steps(at_steps)
    fill = _fill_value(value)
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(
            f"`step` must be an integer scalar, got {step.dtype}{list(step.shape)}."
        )
    hit = jnp.zeros((), jnp.bool_)
    for s in at:
        hit = hit | (step == s)
    chosen = []

    def leaf(path, x):
        if not is_inexact_leaf(x) or not select(path_name(path)):
            return x
        chosen.append(path_name(path))
        x = jnp.asarray(x)
        with np.errstate(over="ignore"):
            bad = np.full(x.shape, fill, np.float64).astype(x.dtype)
        return jax.lax.select(hit, jnp.asarray(bad), x) if at else x

    out = jax.tree_util.tree_map_with_path(leaf, tree)
    if not chosen:
        names = [
            path_name(p)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if is_inexact_leaf(x)
        ]
        raise ValueError(
            f"`paths` must match at least one floating leaf, got {paths!r}; the "
            f"floating leaves are {names}."
        )
    return out


class NonfiniteAtState(NamedTuple):
    """State of :func:`nonfinite_at`.

    Attributes:
      step: ``i32[]``, update calls so far (the step the next call injects at).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax.numpy as jnp
      >>> jxt.nonfinite_at([3]).init(jnp.zeros(2))
      NonfiniteAtState(step=Array(0, dtype=int32))
    """

    step: jax.Array


def nonfinite_at(
    at_steps: int | Sequence[int],
    paths: PathSpec = None,
    *,
    value: float = math.inf,
) -> optax.GradientTransformation:
    """A transformation that injects ``value`` into chosen updates at chosen steps.

    Put it in front of :func:`jaxscale.dynamic_scaling` with ``optax.chain`` to
    make a real train step overflow on schedule; it counts its own update calls
    (0-based) and calls :func:`inject_nonfinite` on the incoming updates.

    Args:
      at_steps: the 0-based update calls at which to inject.
      paths: which leaves, as in :func:`inject_nonfinite`.
      value: the value to inject, as in :func:`inject_nonfinite`.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`NonfiniteAtState`.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if a step is negative (``paths`` matching nothing raises on
        the first ``update``).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = optax.chain(jxt.nonfinite_at([1], paths="w"),
      ...                  jxs.dynamic_scaling(optax.sgd(0.1)))
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> step = jax.jit(tx.update)
      >>> for _ in range(3):
      ...     _, state = step({"w": jnp.ones(2)}, state, params)
      >>> int(jxs.diagnostics.summary(state)["skipped_steps"])
      1
    """
    at = _at_steps(at_steps)
    _selector(paths)
    _fill_value(value)

    def init_fn(params: Any) -> NonfiniteAtState:
        del params
        return NonfiniteAtState(step=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        out = inject_nonfinite(
            updates, step=state.step, at_steps=at, paths=paths, value=value
        )
        step = saturating_increment(state.step)
        return out, NonfiniteAtState(step=step)

    return optax.GradientTransformation(init_fn, update_fn)
