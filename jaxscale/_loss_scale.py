"""Loss-scale state: frozen, registered pytrees with static config.

The array leaves are the scale (``f32[]``) and the counters (``i32[]``); every
hyper-parameter is a static field declared once through dataclass field metadata,
so it survives ``jit``, ``vmap``, ``lax.scan`` and (de)serialisation unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from typing import Any, final

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._args import check_int
from jaxscale._tree import compute_dtype, is_inexact_leaf, map_parts

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
]

_F32 = np.finfo(np.float32)
#: Smallest normal float32 (2**-126): the default floor of the scale.
DEFAULT_MIN_SCALE = float(_F32.tiny)
#: Largest finite float32 (about 3.4e38): the default ceiling of the scale.
DEFAULT_MAX_SCALE = float(_F32.max)
# Above this scale 1/scale is a float32 subnormal, which XLA flushes to zero.
_SPLIT_ABOVE = 2.0**126
_SPLIT_BY = 2.0**-64


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata={"static": True}, **kwargs)


# --------------------------------------------------------------------------- #
# Validation helpers (run eagerly in ``create``; never on traced values).
# --------------------------------------------------------------------------- #


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, np.ndarray | jax.Array) and np.ndim(value) == 0:
            if isinstance(value, jax.core.Tracer):
                raise TypeError(
                    f"`{name}` must be a concrete number, got a traced value. Build "
                    "loss scales outside `jax.jit` (configuration is static)."
                )
            kind = np.asarray(value).dtype.kind
            if kind not in "fiu":
                raise TypeError(f"`{name}` must be a real number, got {value!r}.")
            return float(value)
        raise TypeError(f"`{name}` must be a real number, got {value!r}.")
    return float(value)


def _as_f32(name: str, value: Any) -> float:
    """Rounds to float32 (what the state stores) and checks the result is finite."""
    x = _real(name, value)
    if not math.isfinite(x):
        raise ValueError(f"`{name}` must be finite, got {value!r}.")
    with np.errstate(over="ignore"):
        y = float(np.float32(x))
    if not math.isfinite(y):
        raise ValueError(
            f"`{name}` must be representable as a finite float32 (at most "
            f"{DEFAULT_MAX_SCALE:.7g}), got {value!r}."
        )
    return y


def _check_scale_bounds(
    init: float, min_scale: float, max_scale: float, given_min: Any
) -> None:
    if min_scale < DEFAULT_MIN_SCALE:
        raise ValueError(
            f"`min_scale` must be >= {DEFAULT_MIN_SCALE!r} (2**-126, the smallest "
            "normal float32: XLA:CPU flushes a subnormal scale to 0, and below "
            f"2**-128 1/scale overflows to inf), got {given_min!r}."
        )
    if min_scale > max_scale:
        raise ValueError(
            f"`min_scale` must be <= `max_scale`, got min_scale={min_scale!r} > "
            f"max_scale={max_scale!r}."
        )
    if not min_scale <= init <= max_scale:
        raise ValueError(
            f"`init_scale` must lie in [min_scale, max_scale] = [{min_scale!r}, "
            f"{max_scale!r}], got {init!r}."
        )


def _as_bool_scalar(name: str, value: jax.typing.ArrayLike) -> jax.Array:
    x = jnp.asarray(value)
    if x.dtype != jnp.bool_ or x.shape != ():
        raise TypeError(
            f"`{name}` must be a boolean scalar (bool[]), e.g. from "
            f"`jxs.all_finite(grads)`, got {x.dtype}{list(x.shape)}."
        )
    return x


# --------------------------------------------------------------------------- #
# Leaf arithmetic shared by every scale kind.
# --------------------------------------------------------------------------- #


def scale_tree(tree: Any, scale: jax.Array) -> Any:
    def part(x):
        c = compute_dtype(x.dtype)
        return (x.astype(c) * scale.astype(c)).astype(x.dtype)

    def leaf(x):
        return map_parts(part, jnp.asarray(x)) if is_inexact_leaf(x) else x

    return jax.tree.map(leaf, tree)


def reciprocal_parts(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits ``1/scale`` into two float32 factors that are never subnormal.

    For ``scale <= 2**126`` this is ``(1/scale, 1)``, so ``x * hi * lo`` equals
    torch's ``x * (1/scale)`` bit for bit wherever the product is a normal
    (non-subnormal) number (XLA:CPU flushes subnormal results to zero, torch keeps
    them). Above ``2**126``, ``1/scale`` is a
    float32 subnormal that XLA flushes to zero (every gradient would become 0);
    there the power of two ``2**-64`` is split off and applied separately.
    """
    big = scale > _SPLIT_ABOVE
    lo = jnp.where(big, jnp.float32(_SPLIT_BY), jnp.float32(1.0))
    hi = jnp.float32(1.0) / (scale * lo)
    return hi, lo


def unscale_leaf(x: Any, hi: jax.Array, lo: jax.Array) -> Any:
    """Multiplies one floating leaf by ``hi * lo`` in its compute dtype (a
    complex leaf: each of its real and imaginary parts, keeping its dtype)."""
    if not is_inexact_leaf(x):
        return x

    def part(x):
        c = compute_dtype(x.dtype)
        return (x.astype(c) * hi.astype(c) * lo.astype(c)).astype(x.dtype)

    return map_parts(part, jnp.asarray(x))


# --------------------------------------------------------------------------- #
# The loss-scale kinds.
# --------------------------------------------------------------------------- #


class LossScale(abc.ABC):
    """Abstract base of every loss-scale state.

    A loss scale is an immutable pytree. Its array leaves (the scale and any
    counters) live on device and change from step to step; its configuration is
    static (part of the tree structure), so changing the *value* of the scale never
    retraces a jitted function. New states come from :meth:`adjust` or
    :func:`dataclasses.replace`.

    Subclasses: :class:`NoOpLossScale`, :class:`StaticLossScale`,
    :class:`DynamicLossScale`.

    Examples:
      >>> import jaxscale as jxs
      >>> isinstance(jxs.DynamicLossScale.create(), jxs.LossScale)
      True
    """

    #: ``f32[]``, the current scale (a field or property of every subclass).
    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating leaf of ``tree`` by the loss scale.

        Each floating leaf is multiplied in float32 (float64 for f64 leaves) and
        cast back to its own dtype, so dtypes are preserved: a float16 loss stays
        float16 (and may overflow to ``inf``, which the next step detects).
        A complex leaf is multiplied part by part (its real and its imaginary
        part) and stays complex. Integer, boolean and ``None`` leaves pass
        through untouched.

        Args:
          tree: a pytree, typically the scalar loss.

        Returns:
          A pytree of the same structure and dtypes.

        Examples:
          >>> import jaxscale as jxs
          >>> import jax.numpy as jnp
          >>> jxs.StaticLossScale.create(8.0).scale(jnp.float32(0.5))
          Array(4., dtype=float32)
        """
        return scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        """Divides every floating leaf of ``tree`` by the loss scale.

        Output dtype rule: each floating leaf is multiplied by ``1/scale`` in
        float32 (float64 for f64 leaves) and cast back to its own dtype, so an f16
        gradient comes back f16 and can still underflow there; keep master
        parameters in float32 to get float32 gradients. For scales up to ``2**126``
        the result equals torch's ``grad * (1/scale)`` bit for bit for normal
        (non-subnormal) results; a subnormal result is flushed to zero by XLA:CPU
        (torch keeps it). Above ``2**126`` the reciprocal is split into two normal
        factors, so the result stays within one ulp of ``grad / scale`` where a
        plain ``grad * (1/scale)`` would be flushed to zero by XLA. A complex
        leaf (complex64, or complex128 under x64) is unscaled part by part, its
        real and imaginary parts by the same real factor, and keeps its dtype.
        Integer, boolean and ``None`` leaves pass through untouched.

        Args:
          tree: a pytree, typically gradients of the scaled loss.

        Returns:
          A pytree of the same structure and dtypes.

        Examples:
          >>> import jaxscale as jxs
          >>> import jax.numpy as jnp
          >>> jxs.StaticLossScale.create(8.0).unscale({"w": jnp.array([4.0, 16.0])})
          {'w': Array([0.5, 2. ], dtype=float32)}
          >>> z = jnp.array([4 - 16j], jnp.complex64)
          >>> jxs.StaticLossScale.create(8.0).unscale(z)
          Array([0.5-2.j], dtype=complex64)
        """
        hi, lo = reciprocal_parts(self.loss_scale)
        return jax.tree.map(lambda x: unscale_leaf(x, hi, lo), tree)

    @abc.abstractmethod
    def adjust(self, grads_finite: jax.typing.ArrayLike) -> LossScale:
        """Returns the state for the next step, given whether this step's
        unscaled gradients were all finite (``bool[]``)."""

    #: The smallest scale :meth:`adjust` can reach, or ``None`` for a scale that
    #: never changes (static, no-op). ``jxs.diagnostics.monitor`` reads it.
    floor: float | None = None

    def at_floor(self) -> jax.Array:
        """``bool[]``: whether the scale sits at its :attr:`floor` (always false
        for a scale without one).

        Examples:
          >>> import jaxscale as jxs
          >>> ls = jxs.DynamicLossScale.create(init_scale=2.0, min_scale=1.0)
          >>> bool(ls.at_floor()), bool(ls.adjust(False).at_floor())
          (False, True)
        """
        if self.floor is None:
            return jnp.zeros((), jnp.bool_)
        return self.loss_scale <= jnp.float32(self.floor)


@final
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """A loss scale of exactly 1 that never changes: scaling is the identity.

    Use it for bfloat16 or float32 training, where gradients do not underflow, to
    keep the same train step (the transformation still skips non-finite steps).
    It has no array leaves.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> ls = jxs.NoOpLossScale()
      >>> ls.loss_scale
      Array(1., dtype=float32)
      >>> ls.unscale(jnp.float32(3.0))
      Array(3., dtype=float32)
      >>> ls.adjust(jnp.bool_(False)) == ls
      True
    """

    @property
    def loss_scale(self) -> jax.Array:
        """``f32[]`` one."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        """Returns ``tree`` unchanged.

        Examples:
          >>> import jaxscale as jxs
          >>> jxs.NoOpLossScale().scale(2.0)
          2.0
        """
        return tree

    def unscale(self, tree: Any) -> Any:
        """Returns ``tree`` unchanged.

        Examples:
          >>> import jaxscale as jxs
          >>> jxs.NoOpLossScale().unscale(2.0)
          2.0
        """
        return tree

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> NoOpLossScale:
        """Returns ``self``; validates ``grads_finite``.

        Examples:
          >>> import jaxscale as jxs
          >>> jxs.NoOpLossScale().adjust(True)
          NoOpLossScale()
        """
        _as_bool_scalar("grads_finite", grads_finite)
        return self


@final
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    Attributes:
      loss_scale: ``f32[]``, the scale.

    Examples:
      >>> import jaxscale as jxs
      >>> ls = jxs.StaticLossScale.create(1024.0)
      >>> ls.loss_scale
      Array(1024., dtype=float32)
      >>> ls.adjust(False).loss_scale
      Array(1024., dtype=float32)
    """

    loss_scale: jax.Array

    @classmethod
    def create(cls, scale: float = 2.0**15) -> StaticLossScale:
        """Builds a validated static loss scale.

        Args:
          scale: the scale; a finite float32 in ``[2**-126, float32 max]``.

        Returns:
          A new :class:`StaticLossScale` with a fresh ``f32[]`` leaf.

        Raises:
          TypeError: if ``scale`` is not a real number.
          ValueError: if ``scale`` is not finite or outside the range above.

        Examples:
          >>> import jaxscale as jxs
          >>> jxs.StaticLossScale.create(128).loss_scale
          Array(128., dtype=float32)
        """
        value = _as_f32("scale", scale)
        if not DEFAULT_MIN_SCALE <= value:
            raise ValueError(
                f"`scale` must be >= {DEFAULT_MIN_SCALE!r} (the smallest normal "
                f"float32), got {scale!r}."
            )
        return cls(loss_scale=jnp.asarray(value, jnp.float32))

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> StaticLossScale:
        """Returns ``self``: a static scale never changes.

        Examples:
          >>> import jaxscale as jxs
          >>> ls = jxs.StaticLossScale.create(4.0)
          >>> ls.adjust(False) is ls
          True
        """
        _as_bool_scalar("grads_finite", grads_finite)
        return self


@final
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """A loss scale that backs off on overflow and grows after a run of good steps.

    Update rule of :meth:`adjust`, for ``finite`` = "every unscaled gradient of
    this step is finite"::

        if finite:
            hysteresis_tracker = hysteresis             # budget refills
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                if loss_scale * growth_factor <= max_scale:   # inf never is
                    loss_scale *= growth_factor
        else:                                           # the step is skipped
            growth_tracker = 0
            if hysteresis_tracker > 1:
                hysteresis_tracker -= 1                 # tolerated, no back-off
            else:
                loss_scale = max(loss_scale * backoff_factor, min_scale)

    With ``hysteresis=1`` and neither bound reached this is exactly the rule of
    ``torch.amp.GradScaler.update`` (``_amp_update_scale_``): growth on the
    ``growth_interval``-th consecutive finite step, a growth that would overflow
    float32 is dropped while the tracker still resets, every overflow halves.
    The product is rounded to float32 once; torch forms it in float64 from the
    *exact* Python factor, so the two agree bit for bit whenever the factors are
    float32 numbers (2, 3, 1.5, 0.5, 0.25, ...) and may differ by one ulp of the
    scale for factors such as 1.1 or 0.3 that float32 cannot hold.

    **Hysteresis** (``hysteresis=n``, from DeepSpeed and Megatron-LM): the first
    ``n - 1`` *consecutive* overflows skip the step without backing off; the
    ``n``-th and every further consecutive one back off. The budget refills on
    every finite step (DeepSpeed's ``consecutive_hysteresis=True``), not only on
    growth (Megatron-LM): an isolated overflow spike every few hundred steps is
    then always tolerated, rather than only until the budget has been spent once
    in a growth window of thousands of steps, so the rule depends only on the
    current overflow streak and is easy to reason about.

    **Bounds** (safer than torch, pytorch#99640): the scale never goes below
    ``min_scale`` (default ``2**-126``, the smallest normal float32, so ``1/scale``
    is finite) nor above ``max_scale`` (default the largest finite float32), so it
    is never 0, subnormal or inf. Both are static fields and survive ``jit``.

    Attributes:
      loss_scale: ``f32[]``, the current scale.
      growth_tracker: ``i32[]``, consecutive finite steps since the last change.
      hysteresis_tracker: ``i32[]``, overflows still tolerated (at least 1).
      growth_factor: static; multiplier on growth, > 1.
      backoff_factor: static; multiplier on overflow, in (0, 1).
      growth_interval: static; finite steps between growths, >= 1.
      hysteresis: static; consecutive overflows before backing off, >= 1.
      min_scale: static; the floor.
      max_scale: static; the ceiling.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> ls = jxs.DynamicLossScale.create(init_scale=2.0**15, growth_interval=2)
      >>> ls = ls.adjust(jnp.bool_(False))   # overflow: back off
      >>> ls.loss_scale
      Array(16384., dtype=float32)
      >>> ls = ls.adjust(True).adjust(True)  # two finite steps: grow
      >>> ls.loss_scale
      Array(32768., dtype=float32)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018.
      ``torch.amp.GradScaler`` and ``_amp_update_scale_`` (PyTorch).
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    growth_factor: float = _static(default=2.0)
    backoff_factor: float = _static(default=0.5)
    growth_interval: int = _static(default=2000)
    hysteresis: int = _static(default=1)
    min_scale: float = _static(default=DEFAULT_MIN_SCALE)
    max_scale: float = _static(default=DEFAULT_MAX_SCALE)

    @classmethod
    def create(
        cls,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = DEFAULT_MIN_SCALE,
        max_scale: float = DEFAULT_MAX_SCALE,
    ) -> DynamicLossScale:
        """Builds a validated dynamic loss scale (defaults as torch's GradScaler).

        Every argument is checked here, eagerly; the constructor itself does not
        validate (it also runs when JAX rebuilds the pytree). Floats are rounded
        to float32, the precision the state keeps.

        Args:
          init_scale: the initial scale, finite, in ``[min_scale, max_scale]``.
          growth_factor: multiplier on growth, finite and > 1.
          backoff_factor: multiplier on overflow, in (0, 1).
          growth_interval: consecutive finite steps before a growth, >= 1.
          hysteresis: consecutive overflows before the scale backs off, >= 1
            (1 is torch's rule).
          min_scale: the floor, >= ``2**-126``.
          max_scale: the ceiling, a float32 >= ``min_scale``; ``float("inf")``
            means no ceiling (the largest finite float32, the default).

        Returns:
          A new :class:`DynamicLossScale` whose leaves are fresh device arrays.

        Raises:
          TypeError: if an argument has the wrong type (e.g. a float interval).
          ValueError: if an argument breaks the rule given above.

        Examples:
          >>> import jaxscale as jxs
          >>> ls = jxs.DynamicLossScale.create(init_scale=1024, hysteresis=2)
          >>> ls.loss_scale, ls.hysteresis
          (Array(1024., dtype=float32), 2)
        """
        init = _as_f32("init_scale", init_scale)
        if init <= 0:
            raise ValueError(f"`init_scale` must be > 0, got {init_scale!r}.")
        gf = _as_f32("growth_factor", growth_factor)
        if not gf > 1.0:
            raise ValueError(
                f"`growth_factor` must be > 1 (in float32), got {growth_factor!r}."
            )
        bf = _as_f32("backoff_factor", backoff_factor)
        if not 0.0 < bf < 1.0:
            raise ValueError(
                f"`backoff_factor` must be in (0, 1) (in float32), got "
                f"{backoff_factor!r}."
            )
        interval = check_int("growth_interval", growth_interval)
        hyst = check_int("hysteresis", hysteresis)
        lo = _as_f32("min_scale", min_scale)
        # ``inf`` is how torch users say "no ceiling": the largest finite
        # float32, which is the ceiling anyway (a growth to inf is dropped).
        if _real("max_scale", max_scale) == math.inf:
            max_scale = DEFAULT_MAX_SCALE
        hi = _as_f32("max_scale", max_scale)
        _check_scale_bounds(init, lo, hi, min_scale)
        return cls(
            loss_scale=jnp.asarray(init, jnp.float32),
            growth_tracker=jnp.zeros((), jnp.int32),
            hysteresis_tracker=jnp.asarray(hyst, jnp.int32),
            growth_factor=gf,
            backoff_factor=bf,
            growth_interval=interval,
            hysteresis=hyst,
            min_scale=lo,
            max_scale=hi,
        )

    @property
    def floor(self) -> float:  # type: ignore[override]
        """``min_scale``: backing off never goes below it."""
        return self.min_scale

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
        """Returns the next state after a step (see the class docstring's rule).

        Branch-free (``jnp.where`` only): no host synchronisation, same shapes and
        dtypes in and out, so it runs inside ``jit`` and ``lax.scan``.

        Args:
          grads_finite: ``bool[]``, whether every unscaled gradient was finite.

        Returns:
          The new :class:`DynamicLossScale`.

        Raises:
          TypeError: if ``grads_finite`` is not a boolean scalar.

        Examples:
          >>> import jaxscale as jxs
          >>> ls = jxs.DynamicLossScale.create(init_scale=8.0, hysteresis=2)
          >>> ls.adjust(False).loss_scale  # first overflow tolerated
          Array(8., dtype=float32)
          >>> ls.adjust(False).adjust(False).loss_scale
          Array(4., dtype=float32)
        """
        finite = _as_bool_scalar("grads_finite", grads_finite)
        scale = self.loss_scale
        tracker = self.growth_tracker + 1
        # ``>=`` equals torch's ``==`` on any state this class produces.
        at_interval = tracker >= self.growth_interval
        grown = scale * jnp.float32(self.growth_factor)
        grow = finite & at_interval & (grown <= jnp.float32(self.max_scale))
        back_off = ~finite & (self.hysteresis_tracker <= 1)
        backed_off = jnp.maximum(
            scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_scale)
        )
        new_scale = jnp.where(grow, grown, jnp.where(back_off, backed_off, scale))
        new_tracker = jnp.where(finite & ~at_interval, tracker, 0)
        new_hysteresis = jnp.where(
            finite,
            jnp.int32(self.hysteresis),
            jnp.maximum(self.hysteresis_tracker - 1, 1),
        )
        return dataclasses.replace(
            self,
            loss_scale=new_scale.astype(jnp.float32),
            growth_tracker=new_tracker.astype(jnp.int32),
            hysteresis_tracker=new_hysteresis.astype(jnp.int32),
        )
