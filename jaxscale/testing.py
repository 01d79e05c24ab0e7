"""Tools to unit-test your own mixed-precision train step.

Import it as its own module (``import jaxscale`` does not load it)::

    import jaxscale.testing as jxt

* :func:`simulate`: a pure-Python reference of loss-scale trajectories, under
  jaxscale's rule, torch's ``GradScaler`` or Megatron-LM's
  ``DynamicGradScaler``, for a sequence of finite / non-finite steps.
* :func:`inject_nonfinite` and :func:`nonfinite_at`: put ``inf`` or ``NaN`` into
  chosen gradient leaves at chosen steps, inside ``jit``, without a host sync.
* :func:`assert_skipped`, :func:`assert_applied`,
  :func:`assert_trajectory_matches`, :func:`assert_bit_identical`: assertions
  whose messages name the offending leaf and step.

Only ``jax``, ``numpy`` and ``optax`` are needed (no test framework).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale._diagnostics import _scaling_state_of
from jaxscale._hooks import leaf_names, path_name
from jaxscale._loss_scale import DynamicLossScale, LossScale
from jaxscale._transform import loss_scale_of
from jaxscale._tree import is_float_leaf

__all__ = [
    "NonfiniteAtState",
    "SimStep",
    "assert_applied",
    "assert_bit_identical",
    "assert_skipped",
    "assert_trajectory_matches",
    "inject_nonfinite",
    "nonfinite_at",
    "simulate",
]

_F32 = np.float32
_INT32_MAX = int(np.iinfo(np.int32).max)
RULES = ("jaxscale", "megatron", "torch")

# --------------------------------------------------------------------------- #
# Reference simulator
# --------------------------------------------------------------------------- #


class SimStep(NamedTuple):
    """The loss-scale state after one simulated step (see :func:`simulate`).

    Attributes:
      loss_scale: the scale for the next step, a float32 value as a ``float``.
      growth_tracker: consecutive finite steps since the last change.
      hysteresis_tracker: overflows still tolerated (always 1 under torch's rule;
        Megatron-LM's goes to 0 and below while it keeps backing off).
      applied: whether this step's update was applied (the step was finite).

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> jxt.simulate(jxs.DynamicLossScale.create(init_scale=4.0), [False])
      [SimStep(loss_scale=2.0, growth_tracker=0, hysteresis_tracker=1, applied=False)]
    """

    loss_scale: float
    growth_tracker: int
    hysteresis_tracker: int
    applied: bool


def _bools(name: str, values: Any) -> list[bool]:
    if isinstance(values, str) or not isinstance(values, Iterable | np.ndarray):
        raise TypeError(f"`{name}` must be a sequence of booleans, got {values!r}.")
    out = []
    for i, v in enumerate(np.asarray(values).reshape(-1).tolist()):
        if not isinstance(v, bool):
            raise TypeError(
                f"`{name}` must be a sequence of booleans, got {v!r} at index {i}."
            )
        out.append(v)
    return out


def _concrete(name: str, x: Any) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"`{name}` must hold concrete values, got a traced value: call this "
            "outside `jax.jit`."
        )
    return np.asarray(x)


def simulate(
    loss_scale: DynamicLossScale, finite: Sequence[bool], *, rule: str = "jaxscale"
) -> list[SimStep]:
    """Replays a dynamic loss scale over a sequence of finite / non-finite steps.

    A plain-Python statement of each update rule, in float32 arithmetic (via
    numpy), to compare a real run against. It starts from the leaves and the
    static configuration of ``loss_scale``. Rules:

    * ``"jaxscale"``: :meth:`DynamicLossScale.adjust` exactly: the hysteresis
      budget refills on every finite step, the scale stays in
      ``[min_scale, max_scale]``, a growth above ``max_scale`` is dropped.
    * ``"torch"``: ``torch.amp.GradScaler.update`` (``_amp_update_scale_``)
      exactly: products in float64 rounded to float32, a growth to ``inf`` is
      dropped, and there is **no floor**: the scale can become subnormal and
      then 0 (pytorch#99640). ``min_scale`` and ``max_scale`` are ignored;
      ``hysteresis`` must be 1.
    * ``"megatron"``: Megatron-LM's ``DynamicGradScaler.update`` exactly: the
      hysteresis budget refills only when the scale grows (and the tracker goes
      on counting down below 1 while overflows continue), the floor is
      ``min_scale``, and there is no ceiling (``max_scale`` is ignored; the
      scale can grow to ``inf``).

    Args:
      loss_scale: the initial :class:`jaxscale.DynamicLossScale` (concrete).
      finite: one boolean per step: whether that step's gradients were finite.
      rule: ``"jaxscale"``, ``"torch"`` or ``"megatron"``.

    Returns:
      One :class:`SimStep` per step: the state *after* that step.

    Raises:
      TypeError: if ``loss_scale`` is not a concrete ``DynamicLossScale`` or
        ``finite`` not a sequence of booleans.
      ValueError: if ``rule`` is unknown, or ``rule="torch"`` with
        ``hysteresis != 1``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jaxscale.testing as jxt
      >>> ls = jxs.DynamicLossScale.create(init_scale=8.0, growth_interval=2)
      >>> [s.loss_scale for s in jxt.simulate(ls, [False, True, True, False])]
      [4.0, 4.0, 8.0, 4.0]
      >>> low = jxs.DynamicLossScale.create(init_scale=2.0**-126)
      >>> jxt.simulate(low, [False] * 24)[-1].loss_scale  # stays at the floor
      1.1754943508222875e-38
      >>> jxt.simulate(low, [False] * 24, rule="torch")[-1].loss_scale
      0.0
    """
    if not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            "`loss_scale` must be a jxs.DynamicLossScale (e.g. "
            f"jxs.DynamicLossScale.create()), got {type(loss_scale).__name__}."
        )
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {RULES}, got {rule!r}.")
    if rule == "torch" and loss_scale.hysteresis != 1:
        raise ValueError(
            "`loss_scale` must have hysteresis=1 for rule='torch' "
            "(torch.amp.GradScaler has no hysteresis), got "
            f"hysteresis={loss_scale.hysteresis}."
        )
    seq = _bools("finite", finite)
    scale = _F32(_concrete("loss_scale", loss_scale.loss_scale))
    growth = int(_concrete("loss_scale", loss_scale.growth_tracker))
    budget = int(_concrete("loss_scale", loss_scale.hysteresis_tracker))
    step = {
        "jaxscale": _step_jaxscale,
        "torch": _step_torch,
        "megatron": _step_megatron,
    }
    fn = functools.partial(step[rule], loss_scale)
    out = []
    with np.errstate(over="ignore", under="ignore"):
        for ok in seq:
            scale, growth, budget = fn(scale, growth, budget, ok)
            out.append(SimStep(float(scale), growth, budget, ok))
    return out


def _step_jaxscale(c: DynamicLossScale, scale, growth, budget, finite):
    if finite:
        budget = c.hysteresis
        growth += 1
        if growth >= c.growth_interval:
            growth = 0
            grown = _F32(scale * _F32(c.growth_factor))
            if grown <= _F32(c.max_scale):
                scale = grown
    else:
        growth = 0
        if budget > 1:
            budget -= 1
        else:
            scale = max(_F32(scale * _F32(c.backoff_factor)), _F32(c.min_scale))
    return scale, growth, budget


def _step_torch(c: DynamicLossScale, scale, growth, budget, finite):
    # aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp: float * double factor.
    if finite:
        growth += 1
        if growth == c.growth_interval:
            grown = _F32(np.float64(scale) * np.float64(c.growth_factor))
            if math.isfinite(grown):
                scale = grown
            growth = 0
    else:
        scale = _F32(np.float64(scale) * np.float64(c.backoff_factor))
        growth = 0
    return scale, growth, 1


def _step_megatron(c: DynamicLossScale, scale, growth, budget, finite):
    # megatron/core/optimizer/grad_scaler.py: float32 tensors throughout.
    if finite:
        growth += 1
        if growth == c.growth_interval:
            growth = 0
            budget = c.hysteresis
            scale = _F32(scale * _F32(c.growth_factor))
    else:
        growth = 0
        budget -= 1
        if budget <= 0:
            scale = max(_F32(scale * _F32(c.backoff_factor)), _F32(c.min_scale))
    return scale, growth, budget


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
    leaf's dtype: a finite ``1e30`` becomes ``inf`` in float16). Other leaves,
    and every leaf at other steps, are returned unchanged.

    Args:
      tree: a pytree, typically the (scaled) gradients.
      step: an integer scalar, the current step.
      at_steps: the steps (ints >= 0) at which to inject.
      paths: which floating leaves: ``None`` for all; a substring of the path
        name (``"dense/kernel"``, ``"layers/0"``); a sequence of substrings
        (any matches); or a predicate ``f(name) -> bool``. Names are key paths
        joined by ``/``, as :func:`jaxscale.nonfinite_paths` reports them.
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
        if not is_float_leaf(x) or not select(path_name(path)):
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
            if is_float_leaf(x)
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
      >>> int(jxs.summary(state)["skipped_steps"])
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
        step = jnp.where(state.step < _INT32_MAX, state.step + 1, state.step)
        return out, NonfiniteAtState(step=step)

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- #
# Assertions
# --------------------------------------------------------------------------- #


def _leaf_bytes(x: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    return flat.view(np.uint8).reshape(flat.shape + (x.dtype.itemsize,))


def _fmt(x: np.ndarray, i: int) -> str:
    v = x.reshape(-1)[i].item()
    raw = _leaf_bytes(x)[i][::-1].tobytes().hex()  # little-endian to readable
    return f"{v!r} (0x{raw})"


def assert_bit_identical(
    expected: Any, actual: Any, *, names: tuple[str, str] = ("expected", "actual")
) -> None:
    """Asserts two pytrees are equal bit for bit, leaf by leaf.

    Compares the raw bytes of every leaf, so ``-0.0`` differs from ``0.0`` and
    two ``NaN`` with different payloads differ, while equal ``NaN`` bits match.
    Structure, shapes and dtypes must match too.

    Args:
      expected: a pytree of arrays.
      actual: a pytree of arrays.
      names: how the two trees are called in the message.

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
        x, y = _concrete(a_name, x), _concrete(b_name, y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(
                f"leaf {name!r} of `{b_name}` is {y.dtype}{list(y.shape)}, "
                f"`{a_name}` has {x.dtype}{list(x.shape)}."
            )
        diff = np.any(_leaf_bytes(x) != _leaf_bytes(y), axis=-1)
        if diff.any():
            i = int(np.flatnonzero(diff)[0])
            index = np.unravel_index(i, x.shape) if x.shape else ()
            raise AssertionError(
                f"leaf {name!r} of `{b_name}` differs from `{a_name}` in "
                f"{int(diff.sum())} of {diff.size} elements; first at index "
                f"{tuple(int(k) for k in index)}: {_fmt(y, i)} vs {_fmt(x, i)}."
            )


def _states(before_state: Any, after_state: Any):
    s0 = _scaling_state_of(before_state, "before_state")
    s1 = _scaling_state_of(after_state, "after_state")
    return s0, s1


def _advanced(name: str, before: Any, after: Any, by: int) -> None:
    b, a = int(_concrete(name, before)), int(_concrete(name, after))
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
    if bool(_concrete("after_state", s1.last_step_finite)):
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
    if not bool(_concrete("after_state", s1.last_step_finite)):
        raise AssertionError(
            "the step was skipped, not applied: `after_state.last_step_finite` is "
            "False."
        )
    _advanced("steps", s0.steps, s1.steps, 1)
    _advanced("skipped_steps", s0.skipped_steps, s1.skipped_steps, 0)
    if int(_concrete("after_state", s1.consecutive_skips)) != 0:
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
        x, y = _concrete("before_params", x), _concrete("after_params", y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(
                f"leaf {name!r} of `after_params` is {y.dtype}{list(y.shape)}, "
                f"`before_params` has {x.dtype}{list(x.shape)}."
            )
        if is_float_leaf(y):
            bad = ~np.isfinite(y.astype(np.float64))
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
                st = _scaling_state_of(s, "states")
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
                else np.stack([_concrete("states", r[k]) for r in rows])
                for k in rows[0]
            }
            if rows
            else {"loss_scale": np.zeros((0,), np.float32)}
        )
    if isinstance(states, np.ndarray | jax.Array):
        return {"loss_scale": _concrete("states", states).astype(np.float32)}
    one = from_one(states)
    return {k: None if v is None else _concrete("states", v) for k, v in one.items()}


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
