"""Assertions on skipped and applied steps, trajectories and bit identity."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._find import scaling_state_of
from jaxscale._grad import loss_scale_of
from jaxscale._loss_scale import DynamicLossScale, LossScale
from jaxscale._tree import is_inexact_leaf, leaf_names
from jaxscale.testing._simulate import SimStep, concrete

_INT32_MAX = int(np.iinfo(np.int32).max)

# --------------------------------------------------------------------------- #
# Assertions
# --------------------------------------------------------------------------- #


def _leaf_bytes(x: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    return flat.view(np.uint8).reshape(flat.shape + (x.dtype.itemsize,))


def _isnan(x: np.ndarray) -> np.ndarray:
    """Flat NaN flags of a floating or complex array (any float8 or 16-bit type)."""
    wide = x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)
    return np.isnan(wide).reshape(-1)


def _fmt(x: np.ndarray, i: int) -> str:
    v = x.reshape(-1)[i].item()
    raw = _leaf_bytes(x)[i][::-1].tobytes().hex()  # little-endian to readable
    return f"{v!r} (0x{raw})"


def assert_bit_identical(
    expected: Any,
    actual: Any,
    *,
    names: tuple[str, str] = ("expected", "actual"),
    nan_bits: bool = False,
) -> None:
    """Asserts two pytrees are equal bit for bit, leaf by leaf.

    Compares the raw bytes of every leaf, so ``-0.0`` differs from ``0.0`` and
    ``inf`` from the largest finite value. A ``NaN`` matches any ``NaN`` (its
    sign and payload are not compared) unless ``nan_bits=True``: that is what a
    skipped step keeps. Parameters pass through ``optax.apply_updates``
    (``p + -0.0``), and arithmetic may canonicalise a NaN's payload (XLA:GPU
    does; XLA:CPU keeps it); every other value, signed zeros and infinities
    included, keeps its bits on every backend, and optimizer state is selected,
    never computed, so it keeps NaN payloads too. Structure, shapes and dtypes
    must match too.

    Args:
      expected: a pytree of arrays.
      actual: a pytree of arrays.
      names: how the two trees are called in the message.
      nan_bits: compare NaNs bit for bit too (payload and sign).

    Raises:
      AssertionError: naming the first differing leaf by path, with the number
        of differing elements and the first one (value and bits).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax.numpy as jnp
      >>> jxt.assert_bit_identical({"w": jnp.zeros(2)}, {"w": jnp.zeros(2)})
      >>> jxt.assert_bit_identical(
      ...     {"w": jnp.zeros(2)}, {"w": -jnp.zeros(2)})  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      AssertionError: leaf 'w' of `actual` differs from `expected` in 2 of 2 ...
      >>> import numpy as np
      >>> quiet = np.array([0x7FC00000], np.uint32).view(np.float32)
      >>> payload = np.array([0x7FFFFFFF], np.uint32).view(np.float32)
      >>> jxt.assert_bit_identical({"w": quiet}, {"w": payload})  # a NaN is a NaN
      >>> jxt.assert_bit_identical(
      ...     {"w": quiet}, {"w": payload}, nan_bits=True)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      AssertionError: leaf 'w' of `actual` differs from `expected` in 1 of 1 ...
    """
    a_name, b_name = names
    sa, sb = jax.tree.structure(expected), jax.tree.structure(actual)
    if sa != sb:
        raise AssertionError(
            f"`{b_name}` has tree structure {sb}, `{a_name}` has {sa}."
        )
    paths = leaf_names(expected)
    for name, x, y in zip(
        paths, jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True
    ):
        x, y = concrete(a_name, x), concrete(b_name, y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(
                f"leaf {name!r} of `{b_name}` is {y.dtype}{list(y.shape)}, "
                f"`{a_name}` has {x.dtype}{list(x.shape)}."
            )
        diff = np.any(_leaf_bytes(x) != _leaf_bytes(y), axis=-1)
        if not nan_bits and jnp.issubdtype(x.dtype, jnp.inexact):
            diff &= ~(_isnan(x) & _isnan(y))
        if diff.any():
            i = int(np.flatnonzero(diff)[0])
            index = np.unravel_index(i, x.shape) if x.shape else ()
            raise AssertionError(
                f"leaf {name!r} of `{b_name}` differs from `{a_name}` in "
                f"{int(diff.sum())} of {diff.size} elements; first at index "
                f"{tuple(int(k) for k in index)}: {_fmt(y, i)} vs {_fmt(x, i)}."
            )


def _states(before_state: Any, after_state: Any):
    s0 = scaling_state_of(before_state, "before_state")
    s1 = scaling_state_of(after_state, "after_state")
    return s0, s1


def _advanced(name: str, before: Any, after: Any, by: int) -> None:
    b, a = int(concrete(name, before)), int(concrete(name, after))
    want = min(b + by, _INT32_MAX)
    if a != want:
        raise AssertionError(
            f"`after_state.{name}` is {a}, expected {want} (`before_state.{name}` "
            f"is {b})."
        )


def assert_skipped(
    before_params: Any, before_state: Any, after_params: Any, after_state: Any
) -> None:
    """Asserts one step was skipped and left params and inner state bit-identical.

    Checks, for the :func:`jaxscale.dynamic_scaling` state found in each
    optimizer state: ``last_step_finite`` is false, ``steps`` and
    ``skipped_steps`` advanced by one, ``inner_state`` is bit-identical, and the
    parameters are bit-identical (signed zeros and ``NaN`` payloads included).

    Args:
      before_params: parameters before the step.
      before_state: optimizer state before the step (any state holding one
        ``DynamicScalingState``).
      after_params: parameters after ``optax.apply_updates``.
      after_state: optimizer state after the step.

    Raises:
      AssertionError: naming what changed (a counter, or a leaf by path).
      ValueError: if a state holds no ``DynamicScalingState``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9))
      >>> params = {"w": jnp.array([1.0, -0.0])}
      >>> state = tx.init(params)
      >>> updates, new_state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
      >>> new_params = optax.apply_updates(params, updates)
      >>> jxt.assert_skipped(params, state, new_params, new_state)
    """
    s0, s1 = _states(before_state, after_state)
    if bool(concrete("after_state", s1.last_step_finite)):
        raise AssertionError(
            "the step was applied, not skipped: `after_state.last_step_finite` is "
            "True (every unscaled gradient was finite)."
        )
    _advanced("steps", s0.steps, s1.steps, 1)
    _advanced("skipped_steps", s0.skipped_steps, s1.skipped_steps, 1)
    assert_bit_identical(
        s0.inner_state,
        s1.inner_state,
        names=("before_state.inner_state", "after_state.inner_state"),
    )
    assert_bit_identical(
        before_params, after_params, names=("before_params", "after_params")
    )


def assert_applied(
    before_params: Any, before_state: Any, after_params: Any, after_state: Any
) -> None:
    """Asserts one step was applied and left finite parameters of the same dtypes.

    Checks, for the :func:`jaxscale.dynamic_scaling` state found in each
    optimizer state: ``last_step_finite`` is true, ``steps`` advanced by one,
    ``skipped_steps`` did not, ``consecutive_skips`` is 0; the parameters keep
    their structure, shapes and dtypes; every floating parameter is finite.

    Args:
      before_params: parameters before the step.
      before_state: optimizer state before the step.
      after_params: parameters after ``optax.apply_updates``.
      after_state: optimizer state after the step.

    Raises:
      AssertionError: naming the counter, or the parameter leaf by path.
      ValueError: if a state holds no ``DynamicScalingState``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(2, jnp.float16)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}
      >>> updates, new_state = tx.update(grads, state)
      >>> new_params = optax.apply_updates(params, updates)
      >>> jxt.assert_applied(params, state, new_params, new_state)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      AssertionError: the step was skipped, not applied: ...
    """
    s0, s1 = _states(before_state, after_state)
    if not bool(concrete("after_state", s1.last_step_finite)):
        raise AssertionError(
            "the step was skipped, not applied: `after_state.last_step_finite` is "
            "False."
        )
    _advanced("steps", s0.steps, s1.steps, 1)
    _advanced("skipped_steps", s0.skipped_steps, s1.skipped_steps, 0)
    if int(concrete("after_state", s1.consecutive_skips)) != 0:
        raise AssertionError(
            "`after_state.consecutive_skips` is "
            f"{int(np.asarray(s1.consecutive_skips))}, expected 0."
        )
    sa, sb = jax.tree.structure(before_params), jax.tree.structure(after_params)
    if sa != sb:
        raise AssertionError(
            f"`after_params` has tree structure {sb}, `before_params` has {sa}."
        )
    for name, x, y in zip(
        leaf_names(before_params),
        jax.tree.leaves(before_params),
        jax.tree.leaves(after_params),
        strict=True,
    ):
        x, y = concrete("before_params", x), concrete("after_params", y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(
                f"leaf {name!r} of `after_params` is {y.dtype}{list(y.shape)}, "
                f"`before_params` has {x.dtype}{list(x.shape)}."
            )
        if is_inexact_leaf(y):
            wide = np.complex128 if np.iscomplexobj(y) else np.float64
            bad = ~np.isfinite(y.astype(wide))
            if bad.any():
                i = int(np.flatnonzero(bad.reshape(-1))[0])
                raise AssertionError(
                    f"leaf {name!r} of `after_params` has {int(bad.sum())} "
                    f"non-finite elements, e.g. {y.reshape(-1)[i]!r} at flat "
                    f"index {i}."
                )


def _trajectory(states: Any) -> dict[str, np.ndarray | None]:
    """Per-step arrays (scale, trackers, applied) from states or scales."""

    def is_number(x):
        return isinstance(x, numbers.Real) or (
            isinstance(x, np.ndarray | np.generic | jax.Array) and np.ndim(x) == 0
        )

    def from_one(s):
        applied = None
        if isinstance(s, LossScale):
            ls = loss_scale_of(s)
        else:
            try:
                st = scaling_state_of(s, "states")
            except ValueError:
                st = None
            if st is not None:
                ls, applied = st.loss_scale, st.last_step_finite
            else:
                ls = loss_scale_of(s)
        dyn = isinstance(ls, DynamicLossScale)
        return {
            "loss_scale": ls.loss_scale,
            "growth_tracker": ls.growth_tracker if dyn else None,
            "hysteresis_tracker": ls.hysteresis_tracker if dyn else None,
            "applied": applied,
        }

    if isinstance(states, list):
        if all(is_number(s) for s in states):
            return {"loss_scale": np.asarray(states, np.float32)}
        rows = [from_one(s) for s in states]
        return (
            {
                k: None
                if any(r[k] is None for r in rows)
                else np.stack([concrete("states", r[k]) for r in rows])
                for k in rows[0]
            }
            if rows
            else {"loss_scale": np.zeros((0,), np.float32)}
        )
    if isinstance(states, np.ndarray | jax.Array):
        return {"loss_scale": concrete("states", states).astype(np.float32)}
    one = from_one(states)
    return {k: None if v is None else concrete("states", v) for k, v in one.items()}


def assert_trajectory_matches(states: Any, expected: Sequence[SimStep]) -> None:
    """Asserts a real run followed a simulated trajectory, step by step.

    The scale is compared bit for bit (as float32), then the growth and
    hysteresis trackers (when ``states`` holds a :class:`DynamicLossScale`) and
    whether each step was applied (when it holds a
    :class:`jaxscale.DynamicScalingState`).

    Args:
      states: the run, one entry per step *after* that step: a list of
        optimizer states (or :class:`LossScale` values, or scales as floats); or
        one state whose leaves are stacked along a leading step axis (what
        ``lax.scan`` returns); or a 1-D array of scales.
      expected: the :class:`SimStep` list from :func:`simulate`.

    Raises:
      AssertionError: naming the first step and field that differ.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> import jax, jax.numpy as jnp
      >>> ls = jxs.DynamicLossScale.create(init_scale=4.0, growth_interval=2)
      >>> finite = jnp.array([True, False, True, True])
      >>> _, run = jax.lax.scan(lambda s, f: (s.adjust(f),) * 2, ls, finite)
      >>> jxt.assert_trajectory_matches(run, jxt.simulate(ls, finite.tolist()))
      >>> jxt.assert_trajectory_matches(  # doctest: +ELLIPSIS
      ...     [4.0, 4.0, 8.0, 8.0], jxt.simulate(ls, finite.tolist()))
      Traceback (most recent call last):
      ...
      AssertionError: step 1: loss_scale is 4.0, expected 2.0 ...
    """
    rows = list(expected)
    if not all(isinstance(r, SimStep) for r in rows):
        raise TypeError("`expected` must be a list of SimStep, as simulate returns.")
    got = _trajectory(states)
    n = len(got["loss_scale"])
    if n != len(rows):
        raise AssertionError(f"the run has {n} steps, the expectation {len(rows)}.")
    want = {
        "loss_scale": np.asarray([r.loss_scale for r in rows], np.float32),
        "growth_tracker": np.asarray([r.growth_tracker for r in rows]),
        "hysteresis_tracker": np.asarray([r.hysteresis_tracker for r in rows]),
        "applied": np.asarray([r.applied for r in rows]),
    }
    gs = got["loss_scale"].astype(np.float32).view(np.uint32)
    ws = want["loss_scale"].view(np.uint32)
    for t in range(n):
        if gs[t] != ws[t]:
            raise AssertionError(
                f"step {t}: loss_scale is {float(got['loss_scale'][t])!r}, expected "
                f"{float(want['loss_scale'][t])!r} (bits 0x{int(gs[t]):08x} vs "
                f"0x{int(ws[t]):08x})."
            )
        for key in ("growth_tracker", "hysteresis_tracker", "applied"):
            g = got.get(key)
            if g is not None and g[t].item() != want[key][t].item():
                raise AssertionError(
                    f"step {t}: {key} is {g[t].item()!r}, expected "
                    f"{want[key][t].item()!r}."
                )
