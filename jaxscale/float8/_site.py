"""One float8 matmul site: the ``custom_vjp`` and the trace-time context.

A *site* is one ``dot_general`` equation of the function that
:func:`jaxscale.autocast` runs in float8. Its operands are put in the form
XLA:GPU's GEMM rewriter turns into a cuBLASLt float8 call (two matrices,
``[M, K] x [K, N]``, one contracting and one free dimension each, scalar
scales, output float32 then scaled and cast), by transposes and reshapes that
are ordinary (differentiable) JAX operations; the ``custom_vjp`` sees only the
matrices:

- forward: ``x`` and ``w`` quantised to ``fwd_dtype`` (e4m3) with their scales,
  ``dot(qx, qw) * (sx * sw)`` in float32, cast to the compute dtype;
- backward: the incoming gradient ``g`` quantised to ``bwd_dtype`` (e5m2), then
  ``dx = dot(qg, qw^T) * (sg * sw)`` and ``dw = dot(qx^T, qg) * (sx * sg)``,
  both float8 products, reusing the quantised ``qx`` and ``qw`` saved by the
  forward (half the memory of 16-bit residuals).

Delayed scaling's per-site state (:class:`SiteState`: ``f32[3, H]`` amax
histories and ``f32[3]`` scales, rows: the left operand, the right operand, the
gradient) enters the
``custom_vjp`` as an input. Its *cotangent* carries the site's new history, and
ones in place of the scales as a flag that the site ran (an unused site, or one
in an untaken ``cond`` branch, gets a zero cotangent and keeps its state);
:meth:`DelayedScaling.update` turns the cotangent back into the new state. Inside a
``lax.scan`` the state enters as a per-iteration input broadcast by
:func:`broadcast_max`, whose transpose takes the maximum over iterations
instead of the sum (the amax of a site run ``n`` times is the max of its
``n`` amaxes).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale._accumulate import ACCUMULATING
from jaxscale._jax_private import (
    binding_at,
    dot_dimension_numbers,
    enclosing_trace,
    manual_axes,
)
from jaxscale._scope import Scope
from jaxscale.float8._numerics import poison, saturate

__all__ = [
    "SMALL_DOT",
    "Context",
    "SiteState",
    "broadcast_max",
    "checkpoint_policy",
    "current_context",
    "eligible",
    "evaluating_error",
    "float8_dot",
    "gemm_form",
    "signature",
    "sizes",
    "using_state",
    "weight_grad_operands",
]

_F32 = np.dtype("float32")


class SiteState(NamedTuple):
    """Delayed scaling's state of one site: rows left operand (the activation
    of ``x @ w``), right operand (its weight), gradient."""

    history: jax.Array  # f32[3, H]
    scale: jax.Array  # f32[3]


# --------------------------------------------------------------------------- #
# Trace-time context: which sites exist, and the state they read
# --------------------------------------------------------------------------- #


class Context:
    """The float8 side of :func:`jaxscale.autocast` evaluations: the
    :class:`~jaxscale._autocast.interp.Extension` a recipe's
    :meth:`~jaxscale.float8.Recipe.begin` returns.

    ``recipe`` says how to scale (``None`` while recording sites for
    :func:`jaxscale.float8.init`, until an autocast sets it); ``state`` is
    ``None`` (current scaling, or recording) or the list of :class:`SiteState`
    of a delayed-scaling state, read in site order; ``signatures`` are the
    sites the state was made for and ``seen`` those met so far; ``loops``
    the lengths of the scans being traced, outermost first. ``evaluating``:
    the state is in scope for :func:`jaxscale.float8.apply`, whose sites
    refuse to be differentiated. One context spans every autocast call made
    while it is in scope (a loss that calls the model twice has twice the
    sites).
    """

    def __init__(
        self,
        recipe: Any,
        state: Sequence[SiteState] | None = None,
        signatures: Sequence[str] | None = None,
        *,
        evaluating: bool = False,
    ):
        self.recipe = recipe
        self.state = list(state) if state is not None else None
        self.signatures = tuple(signatures) if signatures is not None else None
        self.evaluating = evaluating
        self.seen: list[str] = []
        self.loops: list[int] = []
        # (M, K, N) of dot_generals left in 16 bits for their size (below
        # min_dim, or slower by the cost model of float8/_choice.py).
        self.declined: list[tuple[int, int, int]] = []
        # The cost model's device figures, resolved at the first candidate; the
        # choice made for the dot_general between its cast and its emission.
        self.device: Any = None
        self.choice: Any = None
        # Scopes in which float8 is off (see :meth:`suspended`).
        self.paused = 0

    @property
    def delayed(self) -> bool:
        """The recipe reads a state (delayed scaling)."""
        return self.recipe is not None and self.recipe.needs_state

    @property
    def threads_state(self) -> bool:
        """Sites read state arrays (delayed scaling, not recording)."""
        return self.state is not None and not self.paused

    # -- the autocast interpreter's extension hooks ---------------------------

    @property
    def inline_calls(self) -> bool:
        """A ``jit`` body is evaluated in place while sites read state arrays
        (tracers of the caller, which a re-traced body could not close over)."""
        return self.threads_state

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No float8 inside (custom-derivative rules written by the user: their
        backward would not see the quantisation)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def opaque(self) -> Any:
        """Delayed state cannot enter a sub-computation as a closure: float8 is
        off there (current scaling works anywhere)."""
        return self.suspended() if self.delayed else contextlib.nullcontext()

    def fuses(self, chain: Any) -> bool:
        """A written-out attention stays unfused: its products are float8's
        to see (as before extensions could let a chain fuse)."""
        return False

    def may_fuse(self, eqns: Any) -> bool:
        """``jax.nn.dot_product_attention`` may run as cuDNN's fused kernel:
        its batched products are no float8 sites."""
        return True

    def skipped(self, eqn: Any) -> None:
        """Never called: no chain is taken whole (:meth:`fuses`)."""

    def manual(self) -> _Manual:
        """A ``shard_map`` body: no state enters it, and it is :meth:`opaque`."""
        return _Manual(self)

    def loop(self, length: int) -> _Loop:
        """A ``scan`` of ``length`` iterations: the state of the sites met from
        here on enters once per iteration (its transpose, the new history, is a
        max over iterations), and each trace of the body meets them afresh."""
        return _Loop(self, length)

    def next_site(self, signature: str) -> SiteState | None:
        """Registers a site; its state (delayed scaling), else ``None``."""
        i = len(self.seen)
        self.seen.append(signature)
        if self.state is None:
            return None
        if self.signatures is not None and (
            i >= len(self.signatures) or self.signatures[i] != signature
        ):
            raise ValueError(_changed(self.signatures, self.seen))
        return self.state[i]

    def finish(self) -> None:
        """Raises if fewer sites were met than the state holds."""
        if self.signatures is not None and len(self.seen) != len(self.signatures):
            raise ValueError(_changed(self.signatures, self.seen))

    def restart_at(self, n: int) -> None:
        """Forget the sites met after the first ``n`` (a body traced again)."""
        del self.seen[n:]


_IN_SCAN = ", in a scan of length "
_IN_SCANS = ", in scans of lengths "


def _changed(expected: Sequence[str], seen: Sequence[str]) -> str:
    i = next(
        (k for k, (a, b) in enumerate(zip(expected, seen, strict=False)) if a != b),
        min(len(expected), len(seen)),
    )
    got = seen[i] if i < len(seen) else "(no more sites)"
    want = expected[i] if i < len(expected) else "(no more sites)"
    return (
        "The float8 state does not fit this function: its structure changed since "
        f"`jxs.float8.init` (the state has {len(expected)} float8 site(s), the "
        f"function {'at least ' if len(seen) > len(expected) else ''}{len(seen)}"
        f" so far; site {i}: state {want!r}, function {got!r}). "
        f"{_why(want, got)}Make a new state with `jxs.float8.init` for the new "
        "function (the amax histories start afresh), or keep the function as it "
        "was when the state was made."
    )


def _why(want: str, got: str) -> str:
    """What a difference in the scan lengths alone means."""
    base_want, base_got = (
        s.split(_IN_SCAN)[0].split(_IN_SCANS)[0] for s in (want, got)
    )
    if base_want != base_got or want == got:
        return ""
    if want == base_want:  # no lengths: a state from before they were recorded?
        return (
            "The state records no scan length for this site, which is inside a "
            "`scan`: if it was made by an earlier jaxscale (which did not record "
            "them), restore its checkpoint into a state made by `jxs.float8.init` "
            "for this function (orbax and `flax.serialization` restore the arrays "
            "and take the sites from the target). "
        )
    if got == base_got:
        return "The site is no longer inside a `scan`. "
    return (
        "The site is inside a `scan` of another length: scanned layers (Flax "
        "`nn.scan`) of another depth are another model, and the one history a "
        "scanned site keeps for all its iterations is not this model's (a `scan` "
        "over a sequence needs the length the state was made with: pad to it). "
    )


# The delayed-scaling context that jxs.float8.value_and_grad, apply and init put
# in scope while they trace the function (trace time only, per thread).
STATE_SCOPE = Scope("float8 state")


def using_state(ctx: Context) -> Any:
    """``ctx`` in scope for the autocast regions traced inside the block."""
    return STATE_SCOPE.push(ctx)


def current_context() -> Context | None:
    """The float8 :class:`Context` in scope, or ``None``."""
    return STATE_SCOPE.current()


class _Manual:
    """:meth:`Context.manual`: a ``shard_map`` body, under :meth:`Context.opaque`."""

    xs: tuple[Any, ...] = ()

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def body(self, extra: Sequence[Any]) -> Any:
        return self.ctx.opaque()


class _Loop:
    """:meth:`Context.loop`: the per-iteration state of one ``scan``."""

    def __init__(self, ctx: Context, length: int):
        self.ctx, self.first, self.length = ctx, len(ctx.seen), length
        threads = ctx.threads_state
        states = tuple(ctx.state[self.first :]) if threads else ()
        self.xs = (ctx.recipe.over_iterations(states, length),) if threads else ()

    @contextlib.contextmanager
    def body(self, extra: Sequence[Any]) -> Iterator[None]:
        ctx = self.ctx
        ctx.restart_at(self.first)  # the body may be traced more than once
        saved = ctx.state
        if extra:
            (mine,) = extra
            ctx.state = [*ctx.state[: self.first], *mine]
        ctx.loops.append(self.length)
        try:
            yield
        finally:
            ctx.loops.pop()
            ctx.state = saved


# --------------------------------------------------------------------------- #
# Which dots, and in which form
# --------------------------------------------------------------------------- #


def sizes(params: Any, lhs_shape: tuple, rhs_shape: tuple) -> tuple[int, ...] | None:
    """``(M, K, N)`` of a ``dot_general`` without batch dimensions, else None."""
    (cx, cw), (bx, bw) = dot_dimension_numbers(params)
    if bx or bw or not cx:
        return None
    k = math.prod(lhs_shape[d] for d in cx)
    m = math.prod(s for d, s in enumerate(lhs_shape) if d not in cx)
    n = math.prod(s for d, s in enumerate(rhs_shape) if d not in cw)
    return m, k, n


def eligible(params: Any, lhs_shape: tuple, rhs_shape: tuple, min_dim: int) -> bool:
    """A ``dot_general`` that runs in float8: no batch dimensions, and the
    contracting size and both free sizes at least ``min_dim``."""
    mkn = sizes(params, lhs_shape, rhs_shape)
    return mkn is not None and min(mkn) >= max(min_dim, 1)


def signature(
    params: Any, lhs_shape: tuple, where: str, loops: Sequence[int] = ()
) -> str:
    """What identifies a site across traces: where it is (the name stack), its
    contracting size (not the batch, which may change between calls) and the
    lengths of the scans around it, outermost first (a scanned stack of layers
    of another depth is another structure)."""
    (cx, _), _ = dot_dimension_numbers(params)
    k = math.prod(lhs_shape[d] for d in cx)
    sig = f"{where or '(top level)'}: dot_general contracting {k}"
    if len(loops) == 1:
        return f"{sig}{_IN_SCAN}{loops[0]}"
    if loops:
        return f"{sig}{_IN_SCANS}{', '.join(map(str, loops))} (outermost first)"
    return sig


def _matrix(x: jax.Array, contract: Sequence[int], contract_last: bool) -> jax.Array:
    free = [d for d in range(x.ndim) if d not in contract]
    order = [*free, *contract] if contract_last else [*contract, *free]
    if order != list(range(x.ndim)):
        x = jnp.transpose(x, order)
    k = math.prod(x.shape[len(free) :] if contract_last else x.shape[: len(contract)])
    return x.reshape((-1, k) if contract_last else (k, -1))


def float8_dot(
    x: jax.Array,
    w: jax.Array,
    dimension_numbers: Any,
    out_dtype: np.dtype,
    recipe: Any,
    site: SiteState | None,
    evaluating: bool = False,
) -> jax.Array:
    """``lax.dot_general(x, w, dimension_numbers)`` as a float8 matmul; with
    ``evaluating``, one whose backward raises (:func:`evaluating_error`)."""
    (cx, cw), _ = dimension_numbers
    x2 = _matrix(x, cx, contract_last=True)
    w2 = _matrix(w, cw, contract_last=False)
    out_shape = [s for d, s in enumerate(x.shape) if d not in cx] + [
        s for d, s in enumerate(w.shape) if d not in cw
    ]
    state = () if site is None else tuple(site)
    key = (np.dtype(out_dtype), np.dtype(x.dtype), np.dtype(w.dtype), recipe)
    key = (*key, evaluating)
    y = _f8_matmul(key, x2, w2, state)
    return y.reshape(out_shape)


def weight_grad_operands(
    x: jax.Array, g: jax.Array, recipe: Any
) -> tuple[jax.Array, jax.Array]:
    """The operands of the weight gradient ``x^T g`` of :func:`float8_dot` with a
    recipe that keeps no state, ``x`` ``[M, K]`` and ``g`` ``[M, N]`` matrices, as
    that product multiplies them: quantised (a tensorwise recipe: ``x`` with its
    forward scale, ``g`` with its own; an axiswise one: both along M) and
    dequantised to float32, so that their product (exact in float32 up to the
    accumulation) is the site's weight gradient."""
    if recipe.needs_state:
        raise ValueError(
            f"{type(recipe).__name__} keeps a state across steps: its scales are "
            "not those of one batch's operands."
        )
    if recipe.axiswise:
        (sx, sg), _ = _scales(recipe, (), [x, g], [0, 2], [0, 0])
    else:
        (sx,), _ = _scales(recipe, (), [x], [0], [1])
        (sg,), _ = _scales(recipe, (), [g], [2], [1])
    qx = saturate(x, sx, recipe.fwd_dtype).astype(_F32) * sx
    qg = saturate(g, sg, recipe.bwd_dtype).astype(_F32) * sg
    return qx, qg


def _scales(
    recipe: Any,
    state: tuple,
    tensors: Sequence[jax.Array],
    roles: Sequence[int],
    axes: Sequence[int],
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Each tensor's scale and amax, by the recipe (:meth:`Recipe.scale`),
    constants to differentiation; a scale is NaN where its tensor holds an inf
    or a NaN (:func:`poison`), so the product is NaN, as a loss-scale check
    needs, while the cast (:func:`saturate`) reads the tensor once."""
    pairs = [
        _scale(recipe, state, t, r, axis)
        for t, r, axis in zip(tensors, roles, axes, strict=True)
    ]
    return (
        [lax.stop_gradient(poison(s, a)) for s, a in pairs],
        [lax.stop_gradient(a) for _, a in pairs],
    )


def _scale(recipe: Any, state: tuple, t: jax.Array, role: int, axis: int) -> tuple:
    """A tensorwise recipe's scale of ``t``; an axiswise one's along ``t``'s
    contracting ``axis``, which its :meth:`~Recipe.scale` sees last, shaped
    to broadcast against ``t`` (size 1 along ``axis``)."""
    if not recipe.axiswise:
        return recipe.scale(t, role, state)
    s, a = recipe.scale(jnp.moveaxis(t, axis, -1), role, state)
    return jnp.moveaxis(s, -1, axis), jnp.moveaxis(a, -1, axis)


# XLA:GPU gives a dot whose ``(M + N) * K`` is below its
# ``xla_gpu_gemm_rewrite_size_threshold`` (100 by default) to neither cuBLASLt nor
# Triton but to its loop emitter, which widens float8 operands to float16 and
# multiplies them there: 448 * 448 (two e4m3 operands at the top of their range,
# as a per-tensor scale puts them) is inf in float16. Dots that small gain nothing
# from float8, so below five times that threshold their operands are widened to
# float32 first (exact: every float8 value, and the product of two, is a
# float32). Larger dots keep the ``dot(f8, f8)`` form that XLA:GPU rewrites to a
# float8 cuBLASLt GEMM.
SMALL_DOT = 512

# The name of a site's quantised operands, scales and amaxes (what its backward
# reads) for ``jax.checkpoint`` policies: :func:`checkpoint_policy` saves them.
OPERAND_NAME = "jaxscale_float8_operand"


def checkpoint_policy(policy: Any = None) -> Any:
    """A ``jax.checkpoint`` policy that also saves what float8 sites' backward
    reads: their float8 operands, scales and amaxes.

    Under ``jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)``
    a float8 site's product is saved, but its operands are quantised again in
    the backward (an amax and a cast of each, read from their 16-bit values);
    with this policy they are saved instead, in float8 (half the bytes of a
    16-bit copy), and the backward recomputes nothing of the site.

    Args:
      policy: the policy to extend (a ``jax.checkpoint_policies`` member or
        your own); ``None`` for ``jax.checkpoint_policies.dots_saveable``.

    Returns:
      A policy for ``jax.checkpoint``, ``flax.linen.remat`` or
      ``equinox.filter_checkpoint``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> f = jxs.autocast(
      ...     lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.bfloat16,
      ...     float8=jxs.float8.CurrentScaling(min_dim=0))
      >>> g = jax.checkpoint(f, policy=jxs.float8.checkpoint_policy())
      >>> jax.grad(g)(jnp.ones((64, 64)), jnp.ones((32, 64))).dtype
      dtype('float32')
    """
    if policy is None:
        policy = jax.checkpoint_policies.dots_saveable
    if not callable(policy):
        raise TypeError(
            "`policy` must be a jax.checkpoint policy (a callable such as "
            f"`jax.checkpoint_policies.dots_saveable`) or None, got {policy!r}."
        )
    names = jax.checkpoint_policies.save_only_these_names(OPERAND_NAME)
    return jax.checkpoint_policies.save_from_both_policies(policy, names)


def gemm_form(m: int, k: int, n: int) -> str:
    """``"float8"`` (``dot(f8, f8)``) or ``"float32"`` (operands widened first)
    for a float8 product of sizes ``m``, ``k``, ``n``."""
    return "float32" if (m + n) * k < SMALL_DOT else "float8"


def _explicit_sharding(like: jax.Array) -> Any:
    """``like``'s sharding where its mesh has an explicit axis (sharding in
    types: ``jax.make_mesh``'s default from jax 0.10), else ``None``."""
    sharding = getattr(jax.typeof(like), "sharding", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return sharding if jax.sharding.AxisType.Explicit in types else None


def _gemm(a, b, contract: tuple, scale: jax.Array, dtype, like: Any = None):
    """``a`` times ``b`` over ``contract`` in float32, times ``scale``, in
    ``dtype``; sharded as ``like`` (a gradient as its primal) where the mesh
    is explicit: a weight gradient contracts the batch, sharded on both sides,
    which JAX refuses to resolve on its own."""
    (ca,), (cb,) = contract
    k = a.shape[ca]
    if gemm_form(a.size // k, k, b.size // k) == "float32":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    out = None if like is None else _explicit_sharding(like)
    y = lax.dot_general(
        a, b, (contract, ((), ())), preferred_element_type=jnp.float32, out_sharding=out
    )
    return (y * scale).astype(dtype)


def evaluating_error() -> str:
    """The error of a site's backward under :func:`jaxscale.float8.apply`: its
    new amaxes would be lost. The first way out is the one that fits: inside
    ``jxs.accumulate_value_and_grad``, its float8 counterpart."""
    one = "`jxs.float8.value_and_grad(f, state)`"
    acc = "`jxs.float8.accumulate_value_and_grad(f, state, num_microbatches=k)`"
    if ACCUMULATING.current() is not None:
        train = (
            f"{acc} in place of `jxs.accumulate_value_and_grad(jxs.float8.apply(...))`"
        )
        train += f" (without accumulation: {one})"
    else:
        train = f"{one} (accumulating gradients over micro-batches: {acc})"
    return (
        "`jxs.float8.apply(f, state)` is for evaluation (it reads the state and "
        "never updates it), and its function is being differentiated: the amax "
        f"histories of this step would be dropped silently. Train through {train}, "
        "which returns the new state (discard it to differentiate with the state "
        "held fixed)."
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _f8_matmul(key: tuple, x: jax.Array, w: jax.Array, state: tuple) -> jax.Array:
    return _fwd(key, x, w, state)[0]


def _fwd(key, x, w, state):
    out_dtype, _, _, recipe, _ = key
    # What the backward reads is named for checkpoint policies (OPERAND_NAME).
    # The float8 operands cross as their bits: a ``jax.checkpoint`` that saves
    # a value passes it through ``reduce_precision`` with its dtype's exponent
    # and mantissa bits, which for float8_e4m3fn (no infinity) turns every
    # value from 256 to 448 into inf.
    # A weight that jxs.accumulate_value_and_grad's loop closes over is the
    # same in every micro-batch: its scale and cast are computed outside the
    # loop, once per accumulation window (XLA:GPU does not hoist them).
    home = _loop_constant(recipe, state, w)
    with binding_at(home):
        (sw,), (aw,) = _scales(recipe, state, [w], [1], [0])
        bw = lax.bitcast_convert_type(saturate(w, sw, recipe.fwd_dtype), jnp.uint8)
    # An axiswise recipe's backward quantises x and w again along its own
    # contractions: it keeps them as they came (their own dtype; a loop
    # constant as it is, for the backward to quantise outside the loop too).
    if recipe.axiswise:
        x, w = _name(x), (w if home is not None else _name(w))
    (sx,), (ax,) = _scales(recipe, state, [x], [0], [1])
    sx, sw, ax, aw = map(_name, (sx, sw, ax, aw))
    rx = _name(lax.bitcast_convert_type(saturate(x, sx, recipe.fwd_dtype), jnp.uint8))
    rw = _name(bw)
    qx, qw = (lax.bitcast_convert_type(r, recipe.fwd_dtype) for r in (rx, rw))
    y = _gemm(qx, qw, ((1,), (0,)), sx * sw, out_dtype)
    if recipe.axiswise:
        return y, (x, w, state)
    return y, (rx, rw, sx, sw, ax, aw, state)


def _loop_constant(recipe: Any, state: tuple, w: Any) -> Any:
    """The trace a weight lives in when it is a constant of the micro-batch
    loop of ``jxs.accumulate_value_and_grad`` (a value its body closes over),
    else ``None``. Not for a recipe with state (the scale depends on the
    loop's state) nor inside ``shard_map`` (the amax is reduced over the
    mesh axes in scope)."""
    if ACCUMULATING.current() is None or recipe.needs_state or manual_axes()[0]:
        return None
    return enclosing_trace(w)


def _name(x: jax.Array) -> jax.Array:
    return checkpoint_name(x, OPERAND_NAME)


def _bwd(key, res, g):
    _, x_dtype, w_dtype, recipe, evaluating = key
    if evaluating:
        raise ValueError(evaluating_error())
    if recipe.axiswise:
        return _bwd_axiswise(key, res, g)
    rx, rw, sx, sw, ax, aw, state = res
    qx, qw = (lax.bitcast_convert_type(r, recipe.fwd_dtype) for r in (rx, rw))
    (sg,), (ag,) = _scales(recipe, state, [g], [2], [1])
    qg = saturate(g, sg, recipe.bwd_dtype)
    dx = _gemm(qg, qw, ((1,), (1,)), sg * sw, x_dtype, like=rx)  # g w^T
    dw = _gemm(qx, qg, ((0,), (0,)), sx * sg, w_dtype, like=rw)  # x^T g
    return dx, dw, recipe.record(state, (ax, aw, ag))


def _bwd_axiswise(key, res, g):
    """The backward of an axiswise recipe: each product quantises its operands
    along its own contracting axis (``dx = g w^T`` along N, ``dw = x^T g``
    along M), so x and w are quantised again, and g twice."""
    _, x_dtype, w_dtype, recipe, _ = key
    x, w, state = res
    with binding_at(_loop_constant(recipe, state, w)):
        (sw,), _ = _scales(recipe, state, [w], [1], [1])
        qw = saturate(w, sw, recipe.fwd_dtype)
    (sg,), _ = _scales(recipe, state, [g], [2], [1])
    qg = saturate(g, sg, recipe.bwd_dtype)
    dx = _gemm(qg, qw, ((1,), (1,)), sg * sw.T, x_dtype, like=x)  # [M,1] * [1,K]
    (sx, sg), _ = _scales(recipe, state, [x, g], [0, 2], [0, 0])
    qx, qg = saturate(x, sx, recipe.fwd_dtype), saturate(g, sg, recipe.bwd_dtype)
    dw = _gemm(qx, qg, ((0,), (0,)), sx.T * sg, w_dtype, like=w)  # [K,1] * [1,N]
    return dx, dw, recipe.record(state, ())


_f8_matmul.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast_max(tree: Any, n: int) -> Any:
    """``tree`` stacked ``n`` times along a new leading axis; its transpose is
    the maximum over that axis (not the sum)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def _bmax_fwd(tree, n):
    return broadcast_max(tree, n), None


def _bmax_bwd(n, _, ct):
    return (jax.tree.map(lambda c: jnp.max(c, axis=0), ct),)


broadcast_max.defvjp(_bmax_fwd, _bmax_bwd)
