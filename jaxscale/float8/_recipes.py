"""The float8 recipes: rule classes for ``dot_general`` that plug into
:func:`jaxscale.autocast`.

A recipe is a :class:`~jaxscale._autocast.classes.PluginRule`: ``autocast(f,
float8=r)`` is shorthand for ``autocast(f, rules={"dot_general": r})``. The
base, :class:`Recipe`, decides which ``dot_general`` equations are float8
*sites* and emits them (:func:`jaxscale.float8._site.float8_dot`); each
recipe class carries the rest of its behaviour, one class per recipe (as
Transformer Engine's ``*QuantizeConfig`` classes): how a tensor's scale is
chosen (:meth:`Recipe.scale`), whether a state is read (``needs_state``), what
the backward records in it (:meth:`Recipe.record`), how a loop's iterations
combine (:meth:`Recipe.over_iterations`) and where the state of one autocast
evaluation comes from (:meth:`Recipe.begin`).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._accumulate import ACCUMULATING
from jaxscale._autocast.classes import RULE_CLASSES, PluginRule
from jaxscale._autocast.interp import AutocastWarning
from jaxscale._autocast.rules import AutocastRule
from jaxscale._autocast.values import dtype_of, is_castable
from jaxscale._jax_private import dot_dimension_numbers
from jaxscale.float8._choice import (
    Choice,
    check_device_kind,
    check_sites,
    choose,
    target_device,
)
from jaxscale.float8._numerics import E4M3, E5M2, amax, scale_from_amax
from jaxscale.float8._select import check_select
from jaxscale.float8._site import (
    Context,
    SiteState,
    broadcast_max,
    current_context,
    float8_dot,
    signature,
    sizes,
)

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "Recipe",
]

_F32 = np.dtype("float32")
_FLOAT8 = MappingProxyType({"float8_e4m3fn": E4M3, "float8_e5m2": E5M2})
_LOWER = RULE_CLASSES[AutocastRule.LOWER]


def _float8_dtype(value: Any, name: str) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError:
        dt = None
    if dt is None or dt.name not in _FLOAT8:
        raise ValueError(
            f"`{name}` must be float8_e4m3fn or float8_e5m2 (as "
            "`jnp.float8_e4m3fn`, or its name), got "
            f"{value!r}."
        )
    return dt


def _min_dim(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"`min_dim` must be None (the cost model chooses) or an int >= 0 (the "
            f"smallest contracting and output dimension a float8 matmul may "
            f"have), got {type(value).__name__} {value!r}."
        )
    if value < 0:
        raise ValueError(f"`min_dim` must be >= 0, got {value}.")
    return int(value)


def _margin(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"`margin` must be a number, got {type(value).__name__}.")
    if not np.isfinite(value) or abs(value) > 64:
        raise ValueError(
            f"`margin` must be a finite exponent in [-64, 64] (scales are "
            f"multiplied by 2**margin), got {value}."
        )
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe(PluginRule):
    """The base of the float8 recipes: a rule class for ``dot_general``.

    Under ``jxs.autocast(f, dtype, float8=recipe)``, a ``dot_general`` without
    batch dimensions is a *candidate*, and a float8 *site* if the recipe
    chooses it: by the first of ``sites``' patterns found in its name stack;
    else by ``select``, if it has an opinion; else, with an integer
    ``min_dim``, if its contracting size and both free sizes reach it; else
    (``min_dim=None``, the default) if the cost model predicts its float8
    products, quantisation included, faster than 16-bit ones on the device
    kind (``docs/float8.md``: "Which matmuls run in float8"). Each of these is
    a *selector*, ``(site, shape) -> Format | None``, asked in that order. A
    site's operands are quantised to ``fwd_dtype`` with one scale each, its
    incoming gradient to ``bwd_dtype``, and its three products run on float8
    operands; any other ``dot_general`` runs in ``dtype`` (the
    ``"lower"`` rule). The operands are not cast first: each is quantised from
    its own dtype.

    A recipe is one subclass (frozen dataclass fields are its configuration)
    that defines :meth:`scale`, and, if it keeps state across steps,
    ``needs_state = True`` with :meth:`record`, :meth:`begin` and
    :meth:`over_iterations`. :class:`CurrentScaling` and
    :class:`DelayedScaling` are the two shipped.

    Args:
      fwd_dtype: the float8 dtype of the forward operands (float8_e4m3fn).
      bwd_dtype: the float8 dtype of the gradient in the backward (float8_e5m2).
      margin: scales are multiplied by ``2**margin`` (headroom: a positive
        margin leaves room for values larger than the amax).
      min_dim: ``None`` (the cost model chooses per matmul from its shape,
        operand dtypes and the device kind), or an int: a matmul runs in float8
        if its contracting size and both output sizes are at least this (0 puts
        every candidate in float8).
      sites: per-site choices that come first: a dict (or a tuple of pairs) of
        regular expressions searched (``re.search``) in the candidate's name
        stack (Flax module paths such as ``"GPT/Block_0/mlp_up"``,
        ``jax.named_scope`` names; ``""`` at the top level) to ``True`` (float8)
        or ``False`` (16 bits); the first that matches decides. A product with
        batch dimensions never runs in float8.
      device_kind: the device kind whose figures the cost model uses (as
        ``jax.devices()[0].device_kind``, e.g. ``"NVIDIA H200"``); ``None``:
        the kind the traced step is for, resolved once per autocast call from
        the devices of the first candidate's operands (arguments placed on a
        mesh, or ``ShapeDtypeStruct`` arguments with a sharding on a deviceless
        topology), else the mesh in context (``jax.set_mesh``), else JAX's
        default device. A kind the model has no figures for (the CPU) takes
        the H100 SXM's with an :class:`~jaxscale.AutocastWarning`.
      select: ``None``, or your per-site selector, asked after ``sites`` and
        before ``min_dim`` and the cost model: a callable ``select(site,
        shape)`` of a candidate's name stack (as ``sites`` sees it) and its
        ``(m, k, n)`` that returns ``True`` or the recipe's float8
        :class:`~jaxscale.precision.Format` (float8), ``False`` or
        ``Format.HALF`` (16 bits), or ``None`` (no opinion: ``min_dim`` or the
        cost model decides). A precision plan's :meth:`Plan.select
        <jaxscale.precision.Plan.select>` is one; so is a torchao-style
        ``module_filter_fn``. Called at trace time, once per candidate.

    Examples:
      A recipe of your own: scales that are powers of two (exact to apply).

      >>> import jaxscale as jxs
      >>> import dataclasses, jax.numpy as jnp
      >>> @dataclasses.dataclass(frozen=True)
      ... class PowerOfTwo(jxs.float8.Recipe):
      ...     def scale(self, x, role, state):
      ...         a = jnp.max(jnp.abs(x)).astype(jnp.float32)
      ...         top = float(jnp.finfo(self.dtype_of(role)).max)
      ...         s = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(a, 1e-30) / top)))
      ...         return s, a
      >>> f = jxs.autocast(lambda w, x: x @ w, jnp.bfloat16,
      ...                  float8=PowerOfTwo(min_dim=0))
      >>> y = f(jnp.ones((16, 16)), jnp.ones((8, 16)))
      >>> y.dtype, float(y[0, 0])
      (dtype('float32'), 16.0)
    """

    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    margin: float = 0.0
    min_dim: int | None = None
    sites: Any = ()
    device_kind: str | None = None
    select: Any = None

    # Whether sites read a state threaded through the train step.
    needs_state: ClassVar[bool] = False
    # Whether scales are per row along each product's contraction (scale()
    # then sees the contracting axis last and returns scales of size 1 there).
    axiswise: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.axiswise and self.needs_state:
            raise TypeError(
                f"{type(self).__name__}: an axiswise recipe (`axiswise = True`) "
                "keeps no state across steps (`needs_state` must be False)."
            )
        fwd = _float8_dtype(self.fwd_dtype, "fwd_dtype")
        bwd = _float8_dtype(self.bwd_dtype, "bwd_dtype")
        if fwd == E5M2:
            raise ValueError(
                "`fwd_dtype` must be float8_e4m3fn, got float8_e5m2: the forward "
                "product would multiply two e5m2 operands, which XLA:GPU never "
                "turns into a float8 GEMM (and Transformer Engine has no such "
                "format). float8_e5m2 is for the gradient (`bwd_dtype`)."
            )
        for name, value in (
            ("fwd_dtype", fwd),
            ("bwd_dtype", bwd),
            ("margin", _margin(self.margin)),
            ("min_dim", _min_dim(self.min_dim)),
            ("sites", check_sites(self.sites)),
            ("device_kind", check_device_kind(self.device_kind)),
            ("select", check_select(self.select)),
        ):
            object.__setattr__(self, name, value)

    # -- numerics: what each recipe defines ----------------------------------

    def dtype_of(self, role: int) -> np.dtype:
        """The float8 dtype of a tensor of ``role``: 0 the left operand (the
        activation of ``x @ w``), 1 the right operand (its weight), 2 the
        incoming gradient."""
        return self.bwd_dtype if role == 2 else self.fwd_dtype

    def scale(self, x: jax.Array, role: int, state: tuple) -> tuple[Any, Any]:
        """``(scale, amax)`` of tensor ``x`` of ``role`` (see :meth:`dtype_of`),
        both ``f32[]``: ``x`` is quantised as ``x / scale``. ``state`` is the
        site's state (``()`` when the recipe keeps none). Called at trace time,
        inside the site's ``custom_vjp``; the results are constants to
        differentiation. For a recipe with ``axiswise = True``, ``x``'s last
        axis is the one the product contracts, and both results have ``x``'s
        shape with size 1 there (one scale per row)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no `scale(x, role, state)`: a "
            "float8 recipe says how each tensor's scale is chosen."
        )

    def record(self, state: tuple, amaxes: Sequence[Any]) -> tuple:
        """The cotangent of the site's state, from the backward: the step's
        ``amaxes`` (left, right, gradient) for a recipe that keeps state;
        ``()`` for one that does not."""
        return ()

    def over_iterations(self, states: tuple, length: int) -> Any:
        """The state a ``scan`` body of ``length`` iterations reads, per
        iteration; its transpose combines the iterations' new states (the
        maximum: the amax of a site run ``n`` times is the max of its ``n``
        amaxes)."""
        return broadcast_max(states, length)

    # -- the autocast rule: which dot_generals are sites, and their emission --

    def check(self, dtype: np.dtype) -> None:
        if dtype == _F32:
            raise ValueError(
                "`float8` needs a 16-bit compute `dtype` (bfloat16 or float16): "
                "the float8 products return it and everything else runs in it; "
                f"float32 switches autocast off. Got dtype float32 with "
                f"float8={self!r}."
            )

    def begin(self) -> Context:
        """The trace-time context of one autocast evaluation: its own sites."""
        return Context(self)

    def _choose(self, it: Any, eqn: Any, vals: list[Any]) -> Choice | None:
        """Whether a ``dot_general`` runs in float8, and why (:func:`choose`);
        ``None`` for an equation that is no candidate, unless a pattern asked
        for float8 there."""
        ctx = it.extension
        if (
            ctx is None
            or ctx.paused
            or eqn.primitive.name != "dot_general"
            or len(vals) != 2
            or not all(is_castable(dtype_of(v)) for v in vals)
        ):
            return None
        where = str(eqn.source_info.name_stack)
        mkn = sizes(eqn.params, np.shape(vals[0]), np.shape(vals[1]))
        if mkn is None:  # batch dimensions: 16 bits, said where it was asked for
            asked = next((p for p, f in self.sites if f and re.search(p, where)), None)
            why = f"16 bits: pattern '{asked}' asks for float8, but the product "
            why += "has batch dimensions (a float8 GEMM takes none)"
            return None if asked is None else Choice(False, why, "pattern")
        if min(mkn) < 1:
            return None

        def device() -> Any:
            if ctx.device is None:
                ctx.device = target_device(self.device_kind, vals)
            return ctx.device

        nbytes = tuple(np.dtype(dtype_of(v)).itemsize for v in vals)
        return choose(self, where, mkn, nbytes, device, it.dtype.name)

    def _chosen(self, it: Any, eqn: Any, vals: list[Any]) -> Choice | None:
        """The choice :meth:`cast_operands` made for ``eqn`` (after it, the
        operands of a product left in 16 bits are cast)."""
        ctx = it.extension
        if ctx is not None and ctx.choice is not None and ctx.choice[0] is eqn:
            return ctx.choice[1]
        return self._choose(it, eqn, vals)

    def cast_operands(self, it, eqn, vals, infos, traced):
        choice = self._choose(it, eqn, vals)
        if it.extension is not None:
            it.extension.choice = (eqn, choice)
        if choice is not None and choice.float8:
            return vals, None
        return _LOWER.cast_operands(it, eqn, vals, infos, traced)

    def adjust_params(self, it, eqn, vals, traced):
        choice = self._chosen(it, eqn, vals)
        if choice is not None and choice.float8:
            return super().adjust_params(it, eqn, vals, traced)
        return _LOWER.adjust_params(it, eqn, vals, traced)

    def emit(self, it, eqn, params, vals):
        """A site as a float8 product; any other ``dot_general`` exactly as
        16-bit autocast runs it (the ``"lower"`` rule)."""
        ctx = it.extension
        choice = self._chosen(it, eqn, vals)
        if choice is None or not choice.float8:
            if choice is not None:
                it.note(f"float8 declined: {choice.why}")
                if choice.by in ("min_dim", "model"):  # its size: warn if all are
                    ctx.declined.append(
                        sizes(params, np.shape(vals[0]), np.shape(vals[1]))
                    )
            return _LOWER.emit(it, eqn, params, vals)
        where = str(eqn.source_info.name_stack)
        site = ctx.next_site(signature(params, np.shape(vals[0]), where, ctx.loops))
        it.note(
            f"float8 site {len(ctx.seen) - 1}: operands {self.fwd_dtype.name}, "
            f"gradient {self.bwd_dtype.name}, "
            f"{'delayed' if site is not None else self._kind()} scaling; {choice.why}"
        )
        dims = dot_dimension_numbers(params)
        x, w = vals
        return [float8_dot(x, w, dims, it.dtype, self, site, ctx.evaluating)]

    def out_infos(self, it, eqn, infos, outs):
        return _LOWER.out_infos(it, eqn, infos, outs)

    def _kind(self) -> str:
        return "rowwise" if self.axiswise else "current"


@dataclasses.dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Float8 with current (just-in-time) per-tensor scaling: stateless.

    Each float8 matmul scales every operand by its own amax *in this step*:
    the activation and the weight before the forward product
    (``fwd_dtype``, float8_e4m3fn by default), the incoming gradient before
    the two backward products (``bwd_dtype``, float8_e5m2). Nothing is kept
    between steps, so the train step needs no extra state; each scale costs a
    reduction over its tensor. This is torchao's default ("tensorwise"
    scaling) and the default of :func:`jaxscale.autocast`'s ``float8=``.

    Args:
      fwd_dtype: as :class:`Recipe` (float8_e4m3fn).
      bwd_dtype: as :class:`Recipe` (float8_e5m2).
      margin: as :class:`Recipe`.
      min_dim: as :class:`Recipe` (``None``: the cost model chooses).
      sites: as :class:`Recipe`.
      device_kind: as :class:`Recipe`.
      select: as :class:`Recipe`.

    Examples:
      >>> import jaxscale as jxs
      >>> recipe = jxs.float8.CurrentScaling(min_dim=0)
      >>> recipe.fwd_dtype, recipe.bwd_dtype
      (dtype(float8_e4m3fn), dtype(float8_e5m2))

      By default the cost model chooses; patterns of the name stack come first:

      >>> recipe = jxs.float8.CurrentScaling(sites={"head": False, "mlp": True})
      >>> recipe.min_dim, recipe.sites
      (None, (('head', False), ('mlp', True)))

      A selector of your own, torchao's ``module_filter_fn`` in effect (``None``:
      the cost model decides):

      >>> import jax.numpy as jnp
      >>> def select(site, shape):
      ...     return False if "head" in site else None
      >>> recipe = jxs.float8.CurrentScaling(select=select, min_dim=0)
      >>> def f(w, x):
      ...     return x @ w
      >>> g = jxs.autocast(f, jnp.bfloat16, float8=recipe)
      >>> g(jnp.ones((16, 16)), jnp.ones((8, 16))).dtype
      dtype('float32')
    """

    names = (True, "current")

    def scale(self, x, role, state):
        a = amax(x)
        return scale_from_amax(a, self.dtype_of(role), self.margin), a

    def end(self, extension: Context) -> None:
        """Warns when no matmul ran in float8 because of its size (below
        ``min_dim``, or predicted slower by the cost model)."""
        ctx = extension
        if ctx.seen or not ctx.declined:
            return
        m, k, n = max(ctx.declined, key=min)
        if self.min_dim is not None:
            why = (
                f"have a size below the recipe's `min_dim` ({self.min_dim}; the "
                f"largest is M={m}, K={k}, N={n})"
            )
        else:
            name = ctx.device[1] if ctx.device is not None else "this device"
            why = (
                f"are predicted slower in float8 than in 16 bits on {name} by the "
                f"cost model (the largest is M={m}, K={k}, N={n})"
            )
        warnings.warn(
            f"jxs.autocast(float8=...): nothing runs in float8: all "
            f"{len(ctx.declined)} matmul(s) without batch dimensions {why}, so "
            "they run in 16 bits (docs/float8.md: which matmuls run in float8). "
            "Pass `float8=jxs.float8.CurrentScaling(min_dim=0)` to use float8 "
            "anyway, or `sites={pattern: True}` for some of them.",
            AutocastWarning,
            stacklevel=3,
        )


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(CurrentScaling):
    """Float8 with current scaling per row: one scale for each row of an
    operand along the product's contraction (torchao's "rowwise").

    For ``y = x @ w`` (``x`` of M×K, ``w`` of K×N) each of x's M rows and each
    of w's N columns has its own scale, the amax of its K values, and the
    product is ``(qx @ qw) * sx * sw`` (the scales factor out of the sum over
    K). A value far larger than the rest of its tensor then costs only its own
    row the precision that tensorwise scaling takes from the whole tensor.
    The backward quantises again along its own contractions (``dx = g w^T``
    along N, ``dw = x^T g`` along M), so a site keeps x and w in their own
    dtype for it, not in float8, and quantises four more tensors than
    :class:`CurrentScaling` (eight in all against three). On XLA:GPU the
    cuBLASLt float8 GEMM takes scalar scales only: the per-row scales are
    applied to its output, an extra pass. Stateless, as :class:`CurrentScaling`;
    the cost model's figures are :class:`CurrentScaling`'s (``min_dim`` or
    ``sites`` to choose otherwise). Inside ``shard_map`` each device scales its
    own rows (their amaxes are not reduced over the mesh).

    Args:
      fwd_dtype: as :class:`Recipe` (float8_e4m3fn).
      bwd_dtype: as :class:`Recipe` (float8_e5m2).
      margin: as :class:`Recipe`.
      min_dim: as :class:`Recipe` (``None``: the cost model chooses).
      sites: as :class:`Recipe`.
      device_kind: as :class:`Recipe`.
      select: as :class:`Recipe`.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> x = jnp.array([[1.0, 2.0], [1000.0, 3.0]])  # rows far apart
      >>> w = jnp.array([[0.1, 0.2], [0.3, 0.4]])
      >>> f = jxs.autocast(lambda x, w: x @ w, jnp.bfloat16,
      ...                  float8=jxs.float8.RowwiseScaling(min_dim=0))
      >>> [round(float(v), 2) for v in f(x, w)[0]]  # tensorwise: [0.66, 0.98]
      [0.7, 1.0]
    """

    names = ("rowwise",)
    axiswise: ClassVar[bool] = True

    def scale(self, x, role, state):
        a = amax(x, axis=-1)
        return scale_from_amax(a, self.dtype_of(role), self.margin), a


DELAYED_DEPRECATION = (
    "jxs.float8.DelayedScaling (float8='delayed') is deprecated and will be "
    "removed in 0.4.0: measured against jxs.float8.CurrentScaling it was no "
    "faster on an H200 (GPT-2-small 1.288 vs 1.279 of the bfloat16 step, one "
    "d 4096 site 0.875 vs 0.871), compiled up to 7 times slower (13 to 27 s vs "
    "2 to 4 s at d >= 2048), added twice the kernels per matmul, and trained "
    "as close to bfloat16 within the seeds' noise (0.005 nats closer on "
    "average, from 0.019 closer to 0.002 further per seed). Use "
    "float8=True (jxs.float8.CurrentScaling), or float8='rowwise' for accuracy; "
    "both need no state: drop jxs.float8.init and call jxs.value_and_grad or "
    "jax.value_and_grad instead of jxs.float8.value_and_grad. The evidence is "
    "in docs/float8.md, 'Delayed scaling is deprecated'."
)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Float8 with delayed scaling: scales from an amax history (Transformer
    Engine's recipe). **Deprecated** (removed in 0.4.0): constructing one
    warns with a :class:`DeprecationWarning`; use :class:`CurrentScaling`.

    Measured against current scaling, delayed scaling was no faster (on one
    H200: GPT-2-small with every dense layer in float8 1.288 against 1.279 of
    the bfloat16 step; one d 4096 site 0.875 against 0.871), compiled 4 to 7
    times slower at d >= 2048 (13.1 to 26.8 s against 2.1 to 3.6 s), added
    twice the kernels per site (XLA:GPU for an H200: 17 against 9), and
    trained as close to bfloat16 within the seeds' noise: on the char
    transformer over three seeds, +0.0214 against +0.0242 nats at width 64
    and +0.0021 against +0.0087 at width 256 (:class:`RowwiseScaling`,
    stateless: +0.0222 and +0.0033), per seed from 0.019 closer to 0.002
    further (``docs/float8.md``, "Delayed scaling is deprecated"). torchao
    removed its delayed scaling for the same reasons.

    Each float8 matmul (a *site*) keeps, per operand (the left operand: the
    activation of ``x @ w``; the right: the weight; the gradient), the amaxes
    of the last ``history_len`` steps and a scale. A
    step quantises with the scales the state holds, records its own amaxes,
    and the new scale is ``max(history) / finfo.max * 2**margin`` (Transformer
    Engine's ``amax_compute_algo="max"``). The state is a pytree
    (:class:`Float8State`) made by :func:`jaxscale.float8.init` and threaded
    through the train step by :func:`jaxscale.float8.value_and_grad` (or
    :func:`jaxscale.float8.accumulate_value_and_grad`, one update per
    accumulation window).

    Args:
      history_len: steps of amax history per operand (Transformer Engine: 1024).
      fwd_dtype: as :class:`CurrentScaling`.
      bwd_dtype: as :class:`CurrentScaling`.
      margin: as :class:`CurrentScaling`.
      min_dim: as :class:`CurrentScaling`.
      sites: as :class:`CurrentScaling`.
      device_kind: as :class:`CurrentScaling`.
      select: as :class:`CurrentScaling`.

    Examples:
      >>> import jaxscale as jxs
      >>> jxs.float8.DelayedScaling(history_len=16).history_len
      16
    """

    history_len: int = 1024

    names = ("delayed",)
    needs_state: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        # stacklevel 3: the caller of the dataclass's __init__.
        warnings.warn(DELAYED_DEPRECATION, DeprecationWarning, stacklevel=3)
        h = self.history_len
        if isinstance(h, bool) or not isinstance(h, int | np.integer) or h < 1:
            raise ValueError(f"`history_len` must be an int >= 1, got {h!r}.")
        object.__setattr__(self, "history_len", int(h))

    def scale(self, x, role, state):
        """From the state; from the amax (as :class:`CurrentScaling`) while the
        site's history holds no finite step (the first, or a float16 run whose
        first steps overflowed), or no state is read (``jxs.float8.init``
        recording the sites)."""
        a = amax(x)
        now = scale_from_amax(a, self.dtype_of(role), self.margin)
        if not state:
            return now, a
        history, scale = state
        h = history[role]
        fresh = jnp.max(jnp.where(jnp.isfinite(h), h, 0.0)) <= 0
        return jnp.where(fresh, now, scale[role]), a

    def record(self, state, amaxes):
        """The new history (this step's amaxes first), and ones in place of the
        scales: the flag that the site ran (:meth:`update`)."""
        if not state:
            return ()
        history, scale = state
        new = jnp.roll(history, 1, axis=1).at[:, 0].set(jnp.stack(list(amaxes)))
        return new, jnp.ones_like(scale)

    def update(self, old: SiteState, ct: Any) -> SiteState:
        """A site's new state from the cotangent its ``custom_vjp`` gave its
        state (:meth:`record`); the old state where the site did not run."""
        ct_history, ran = ct
        ran = ran[0] > 0
        history = jnp.where(ran, ct_history, old.history)
        finite = jnp.where(jnp.isfinite(history), history, 0.0)
        peak = jnp.max(finite, axis=1)
        scale = jnp.stack(
            [
                scale_from_amax(peak[r], self.dtype_of(r), self.margin, old.scale[r])
                for r in range(3)
            ]
        )
        return SiteState(history, jnp.where(ran, scale, old.scale))

    def begin(self) -> Context:
        """The context that :func:`jaxscale.float8.value_and_grad`,
        :func:`~jaxscale.float8.apply` or :func:`~jaxscale.float8.init` has
        put in scope (its state, its sites)."""
        scope = current_context()
        if scope is None:
            train = (
                "`jxs.float8.accumulate_value_and_grad(f, state, "
                "num_microbatches=k)(*args)` in place of "
                "`jxs.accumulate_value_and_grad` (training with gradient "
                "accumulation: returns the new state)"
                if ACCUMULATING.current() is not None
                else "`jxs.float8.value_and_grad(f, state)(*args)` (training: "
                "returns the new state)"
            )
            raise ValueError(
                "`float8`: delayed scaling reads and updates a state of amax "
                "histories, and none is in scope. Make one with "
                "`state = jxs.float8.init(f, *args)` and call the function "
                f"through {train} or `jxs.float8.apply(f, state)(*args)` "
                "(evaluation). Or use `float8=True` (current scaling: no state)."
            )
        if scope.recipe is None:  # recording for init
            scope.recipe = self
        elif scope.recipe != self:
            raise ValueError(
                f"`float8`: this autocast's recipe {self!r} is not the one the "
                f"state in scope was made for ({scope.recipe!r}). Make the state "
                "with `jxs.float8.init` from the same function."
            )
        return scope

    def for_report(self) -> CurrentScaling:
        """Current scaling with the same fields (a report has no state)."""
        fields = dataclasses.fields(Recipe)
        return CurrentScaling(**{f.name: getattr(self, f.name) for f in fields})
