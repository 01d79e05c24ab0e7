"""Host-side checks (and optional repairs) of a restored jaxscale state.

Runs on concrete values, once, on the restore path: never inside the train step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import _nnx
from jaxscale._find import (
    RESTORED_WITHOUT_TARGET,
    looks_restored_without_target,
    scaling_states,
)
from jaxscale._loss_scale import (
    DEFAULT_MAX_SCALE,
    DEFAULT_MIN_SCALE,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxscale._state import DynamicScalingState, LeafFlags

__all__ = ["validate_state"]

_I32 = np.iinfo(np.int32)
_COUNTERS = ("steps", "skipped_steps", "consecutive_skips")


class _Checker:
    """Checks leaves one by one; raises, or records a repair and returns it."""

    def __init__(self, prefix: str, repair: bool, note: str = ""):
        self.prefix = prefix
        self.repair = repair
        self.note = note
        self.repairs: list[str] = []

    def name(self, field: str) -> str:
        return f"{self.prefix}{field}"

    def fail(self, field: str, rule: str, value: Any, *, fixable: bool = True) -> None:
        hint = (
            " Pass `repair=True` to fix it as documented in `jxs.validate_state`."
            if fixable
            else ""
        )
        got = value if isinstance(value, str) else repr(value)
        raise ValueError(
            f"`{self.name(field)}` must be {rule}, got {got}.{hint}{self.note}"
        )

    def fix(self, field: str, rule: str, old: Any, new: Any) -> Any:
        if not self.repair:
            self.fail(field, rule, old)
        shown = [x if isinstance(x, str) else repr(x) for x in (old, new)]
        self.repairs.append(
            f"`{self.name(field)}` {shown[0]} -> {shown[1]} (must be {rule})"
        )
        return new

    def scalar(self, field: str, value: Any, dtype: Any) -> tuple[Any, bool]:
        """Checks a leaf's shape and dtype; returns ``(python_value, was_cast)``."""
        if isinstance(value, jax.core.Tracer):
            raise TypeError(
                "`jxs.validate_state` checks concrete values on the host; call it "
                f"outside `jax.jit` (after restoring), got a tracer for "
                f"`{self.name(field)}`."
            )
        if not hasattr(value, "dtype") and not isinstance(value, bool | int | float):
            name = np.dtype(dtype).name
            raise ValueError(
                f"`{self.name(field)}` must be {'an' if name[0] in 'aeiou' else 'a'} "
                f"{name}[] array, got {type(value).__name__}."
            )
        arr = np.asarray(value)
        want = np.dtype(dtype)
        if arr.shape != ():
            raise ValueError(
                f"`{self.name(field)}` must be a scalar ({want.name}[]), got shape "
                f"{arr.shape} ({arr.dtype.name}{list(arr.shape)}). A batched state "
                "(e.g. from `vmap`) must be validated one element at a time."
            )
        x = arr.item()
        cast = arr.dtype != want
        if cast:
            kind = want.kind
            ok = (
                (kind == "f" and _is_real(arr.dtype))
                or (kind == "i" and _integral(x) and _I32.min <= x <= _I32.max)
                or (kind == "b" and x in (0, 1))
            )
            rule = f"{want.name}[]"
            if not ok:
                self.fail(field, rule, f"{arr.dtype.name}[] {x!r}", fixable=False)
            self.fix(field, rule, f"{arr.dtype.name}[] {x!r}", f"{want.name}[]")
        if want.kind == "f":
            return float(x), cast
        if want.kind == "b":
            return bool(x), cast
        return int(x), cast


def _is_real(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def _integral(x: Any) -> bool:
    return isinstance(x, bool | int) or (
        isinstance(x, float) and math.isfinite(x) and x == int(x)
    )


def _check_scale(
    c: _Checker, field: str, value: Any, lo: float, hi: float
) -> tuple[float, bool]:
    """Checks a scale leaf; returns ``(value, changed)``."""
    # Checked before rounding to float32, so that a positive float64 that
    # underflows (or overflows) float32 is clamped, not mistaken for 0 (or inf).
    x, changed = c.scalar(field, value, np.float32)
    if math.isnan(x) or x <= 0:
        c.fail(
            field,
            "finite and > 0 (NaN, zero and negative scales carry no magnitude and "
            "are never repaired: rebuild the loss scale with "
            "`jxs.DynamicLossScale.create(init_scale=...)`)",
            x,
            fixable=False,
        )
    if not lo <= x <= hi:
        rule = f"in [min_scale, max_scale] = [{lo!r}, {hi!r}]"
        if x < DEFAULT_MIN_SCALE:
            rule += " (a subnormal scale makes 1/scale overflow to inf)"
        elif math.isinf(x):
            rule = f"finite and {rule}"
        x = c.fix(field, rule, x, min(max(x, lo), hi))
        changed = True
    return float(np.float32(x)), changed


def _check_int(
    c: _Checker, field: str, value: Any, lo: int, hi: int, rule: str
) -> tuple[int, bool]:
    x, changed = c.scalar(field, value, np.int32)
    if not lo <= x <= hi:
        x = c.fix(field, rule, x, min(max(x, lo), hi))
        changed = True
    return int(x), changed  # exact: an int32 does not round-trip through float32


def _validate_loss_scale(ls: Any, c: _Checker) -> Any:
    if isinstance(ls, NoOpLossScale):
        return ls
    if isinstance(ls, StaticLossScale):
        x, changed = _check_scale(
            c, "loss_scale", ls.loss_scale, DEFAULT_MIN_SCALE, DEFAULT_MAX_SCALE
        )
        if not changed:
            return ls
        return StaticLossScale(loss_scale=jnp.asarray(x, jnp.float32))
    if isinstance(ls, DynamicLossScale):
        x, s_changed = _check_scale(
            c, "loss_scale", ls.loss_scale, ls.min_scale, ls.max_scale
        )
        t, t_changed = _check_int(
            c,
            "growth_tracker",
            ls.growth_tracker,
            0,
            ls.growth_interval - 1,
            f"in [0, growth_interval) = [0, {ls.growth_interval})",
        )
        h, h_changed = _check_int(
            c,
            "hysteresis_tracker",
            ls.hysteresis_tracker,
            1,
            ls.hysteresis,
            f"in [1, hysteresis] = [1, {ls.hysteresis}]",
        )
        if not (s_changed or t_changed or h_changed):
            return ls
        return dataclasses.replace(
            ls,
            loss_scale=jnp.asarray(x, jnp.float32) if s_changed else ls.loss_scale,
            growth_tracker=jnp.asarray(t, jnp.int32)
            if t_changed
            else ls.growth_tracker,
            hysteresis_tracker=(
                jnp.asarray(h, jnp.int32) if h_changed else ls.hysteresis_tracker
            ),
        )
    raise TypeError(
        f"`{c.name('')[:-1] or 'state'}` must be a jxs.LossScale with a known "
        f"validation rule (DynamicLossScale, StaticLossScale, NoOpLossScale), got "
        f"{type(ls).__name__}."
    )


def _validate_scaling_state(state: DynamicScalingState, c: _Checker) -> Any:
    prefix = c.prefix
    c.prefix = f"{prefix}loss_scale."
    if not isinstance(state.loss_scale, LossScale):
        raise TypeError(
            f"`{prefix}loss_scale` must be a jxs.LossScale, got "
            f"{type(state.loss_scale).__name__}."
        )
    new_ls = _validate_loss_scale(state.loss_scale, c)
    c.prefix = prefix
    updates: dict[str, Any] = {}
    if new_ls is not state.loss_scale:
        updates["loss_scale"] = new_ls
    upper, upper_name = int(_I32.max), None
    for field in _COUNTERS:
        rule = f"in [0, {upper_name}] = [0, {upper}]" if upper_name else ">= 0"
        x, changed = _check_int(c, field, getattr(state, field), 0, upper, rule)
        if changed:
            updates[field] = jnp.asarray(x, jnp.int32)
        upper, upper_name = x, field
    updates.update(_check_flags(c, state.nonfinite_leaves))
    return state._replace(**updates) if updates else state


def _check_flags(c: _Checker, flags: Any) -> dict[str, Any]:
    """``nonfinite_leaves``: :class:`LeafFlags`, one ``bool[n]`` array. (Other
    layouts, 0.1.0's, are converted by ``jxs.upgrade_checkpoint`` on restore.)"""
    if not isinstance(flags, LeafFlags):
        c.fail(
            "nonfinite_leaves",
            "a LeafFlags (restore a jaxscale 0.1.0 or 0.2.0 checkpoint with "
            "`jxs.upgrade_checkpoint`)",
            type(flags).__name__,
            fixable=False,
        )
    value = flags.flags
    if value is None:  # no gradient leaves
        return {}
    if isinstance(value, jax.core.Tracer):
        c.scalar("nonfinite_leaves.flags", value, np.bool_)  # raises
    arr = np.asarray(value)
    want = (len(flags.names),)
    if arr.shape != want:
        c.fail(
            "nonfinite_leaves.flags",
            f"bool{list(want)} (one flag per gradient leaf)",
            f"{arr.dtype.name}{list(arr.shape)}",
            fixable=False,
        )
    if arr.dtype == np.bool_:
        return {}
    fixed = np.zeros(want, np.bool_)
    if arr.dtype.kind in "biu" and ((arr == 0) | (arr == 1)).all():
        fixed = arr.astype(np.bool_)
    c.fix("nonfinite_leaves.flags", "bool", arr.dtype.name, "bool")
    return {"nonfinite_leaves": LeafFlags(jnp.asarray(fixed), flags.names)}


def _is_ours(x: Any) -> bool:
    return isinstance(x, LossScale | DynamicScalingState)


_STATE_NOTE = (
    " (An nnx.State has no loss-scale configuration, which `nnx.split` puts in "
    "the GraphDef: ranges that depend on it are checked against the widest one "
    "allowed; validate `nnx.merge(graphdef, state)` for the full check.)"
)


def validate_state(state: Any, *, repair: bool = False) -> Any:
    """Checks a restored jaxscale state against its configuration, on the host.

    Run it once after restoring a checkpoint (orbax, ``flax.serialization``, a
    converted torch state), outside ``jit``: it reads the concrete values. It
    finds every :class:`DynamicScalingState` and :class:`LossScale` in ``state``
    (which may be the state itself, an ``optax.chain`` state, a Flax
    ``TrainState``...) and checks, naming the field, the rule and the value in a
    ``ValueError``:

    * shapes and dtypes: every leaf a scalar; ``loss_scale`` ``f32[]``; trackers
      and counters ``i32[]``; the per-leaf flags ``bool[n]`` (a float64 scale or
      an int64 tracker from a foreign checkpoint is rejected);
    * ``loss_scale``: finite, > 0, and in ``[min_scale, max_scale]`` (so never 0,
      subnormal or inf; :class:`StaticLossScale`: in ``[2**-126, float32 max]``);
    * ``growth_tracker`` in ``[0, growth_interval)``; ``hysteresis_tracker`` in
      ``[1, hysteresis]`` (a checkpoint written under another configuration can
      break these: the configuration comes from your code, the values from the
      checkpoint);
    * counters: ``0 <= consecutive_skips <= skipped_steps <= steps``, and
      ``nonfinite_leaves`` one ``bool`` flag per gradient leaf.

    With ``repair=True`` these documented repairs are made instead, each reported
    in one ``UserWarning``:

    * a dtype is cast (to ``float32``; to ``int32`` / ``bool`` only if the value
      is integral and fits);
    * a positive scale outside the bounds (a subnormal, ``inf``) is clamped into
      ``[min_scale, max_scale]``;
    * ``growth_tracker`` is clamped into ``[0, growth_interval - 1]``: a tracker
      at or beyond the interval grows the scale on the next finite step, which is
      what :meth:`DynamicLossScale.adjust` does with it anyway;
    * ``hysteresis_tracker`` and the counters are clamped into their ranges;
      integral flags (0 or 1) are cast to ``bool``.

    Never repaired (a ``ValueError`` even with ``repair=True``): a NaN, zero or
    negative scale, a non-scalar leaf, and a value that does not fit its dtype.
    The inner optimizer's state and the parameters are not inspected: check
    parameters with :func:`all_finite`.

    Flax NNX: an ``nnx.Optimizer``, its ``opt_state`` and an ``nnx.State``
    (from ``nnx.split``, or restored by orbax in a functional loop) are
    mutable, and are checked and repaired **in place**, as NNX updates
    everything: the repaired values are written into their variables (any
    jaxscale state held in NNX variables is), and ``state`` itself is returned. An
    ``nnx.State`` has no loss-scale configuration (``nnx.split`` puts it in the
    GraphDef), so the ranges that depend on it are checked against the widest
    configuration allowed (scale in ``[2**-126, float32 max]``, trackers
    ``>= 0`` and ``>= 1``); everything else is checked as above. Validate the
    merged optimizer for the full check.

    Args:
      state: a pytree holding jaxscale state, with concrete (not traced) leaves,
        an ``nnx.Optimizer`` or an ``nnx.State``.
      repair: whether to repair instead of raising, as listed above.

    Returns:
      ``state`` itself when it is valid or held in NNX variables (repaired in
      place); otherwise (with ``repair=True``) a copy in which only the
      repaired leaves are replaced (by fresh device arrays).

    Raises:
      ValueError: if a check fails (with ``repair=False``), or a value cannot be
        repaired, or ``state`` holds no jaxscale state.
      TypeError: if a leaf is a tracer (called inside ``jit``).

    Examples:
      >>> import jaxscale as jxs
      >>> import dataclasses, jax.numpy as jnp, optax
      >>> tx = jxs.dynamic_scaling(
      ...     optax.sgd(0.1), jxs.DynamicLossScale.create(growth_interval=100))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> jxs.validate_state(state) is state
      True
      >>> bad = state._replace(loss_scale=dataclasses.replace(
      ...     state.loss_scale, growth_tracker=jnp.int32(150)))
      >>> jxs.validate_state(bad)
      Traceback (most recent call last):
        ...
      ValueError: `loss_scale.growth_tracker` must be in [0, growth_interval) = [0, 100), got 150. Pass `repair=True` to fix it as documented in `jxs.validate_state`.
    """  # noqa: E501
    found = 0
    repairs: list[str] = []

    def check(path: Any, node: Any, note: str = "", in_place: bool = False) -> Any:
        nonlocal found
        if not _is_ours(node):
            return node
        found += 1
        prefix = jax.tree_util.keystr(path)
        prefix = f"{prefix.lstrip('.')}." if prefix else ""
        c = _Checker(prefix, repair, note)
        validate = (
            _validate_scaling_state
            if isinstance(node, DynamicScalingState)
            else _validate_loss_scale
        )
        held = jax.tree.leaves(node, is_leaf=_nnx.is_variable)
        if in_place or any(map(_nnx.is_variable, held)):  # NNX: repaired in place
            old = jax.tree.map(_nnx.unwrap, node, is_leaf=_nnx.is_variable)
            _nnx.write_back(node, old, validate(old, c))
            out = node
        else:
            out = validate(node, c)
        repairs.extend(c.repairs)
        return out

    if _nnx.is_state(state):
        for path, node in scaling_states(state):
            check(path, node, _STATE_NOTE, in_place=True)
        out = state
    elif _nnx.is_object(state):  # an nnx.Optimizer: its variables, in place
        key = jax.tree_util.GetAttrKey("opt_state")
        for path, node in scaling_states(state):
            check((key, *path), node)
        out = state
    elif _is_ours(state):
        out = check((), state)
    else:
        out = jax.tree_util.tree_map_with_path(check, state, is_leaf=_is_ours)
    if not found and looks_restored_without_target(state):
        raise ValueError(f"`state` {RESTORED_WITHOUT_TARGET}")
    if not found:
        hint = (
            " An nnx.State of the model alone holds no optimizer state: pass the "
            "state of `nnx.split((model, optimizer))` or the `nnx.Optimizer`."
            if _nnx.is_state(state)
            else ""
        )
        raise ValueError(
            "`state` contains no jaxscale state (a jxs.DynamicScalingState or "
            f"jxs.LossScale), got {type(state).__name__}. Pass the optimizer state "
            f"built by `jxs.dynamic_scaling`.{hint}"
        )
    if repairs:
        warnings.warn(
            "jxs.validate_state repaired: " + "; ".join(repairs) + ".",
            UserWarning,
            stacklevel=2,
        )
    return out
