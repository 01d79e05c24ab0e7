"""The data-parallel mean of gradients, sent in a narrow dtype, summed in float32.

``lax.pmean(grads, "data")`` in 16 bits lets the all-reduce round its partial sums
at every hop of a ring, so the error grows with the number of devices, and a sum of
scaled float16 gradients overflows where the mean would not. Here, as in
Megatron-LM's ``reduce_scatter_with_fp32_accumulation`` (the all-to-all form), each
device cuts its flattened gradients into ``n`` chunks and sends chunk ``i`` to
device ``i`` in the wire dtype, with a float32 scale per block where the dtype needs
one. Device ``i`` dequantises the ``n`` copies of its chunk, sums them in float32,
divides by ``n`` and sends the mean back to everyone (an all-gather, in the wire
dtype again). A value is rounded twice, once on the way out and once on the way
back, however many devices there are; the bytes are those of a ring all-reduce in
the wire dtype: ``2 (n - 1) / n`` of the gradient per device.

Block scales are powers of two, computed from each block's amax on its float32
bits: exact, and the same on every backend. A block holding an inf or a NaN gets a
NaN scale, so it arrives as NaN (float8_e4m3fn has no inf) and is never a finite
number; float16 without block scales sends values as they are, so an inf of a
loss-scaled gradient arrives as an inf on every device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from jaxscale._distributed import explain_unbound, gather_invariant
from jaxscale._jax_private import manual_axes, varying_axes
from jaxscale._scope import BLOCK_SCALES_SCOPE, REDUCE_MEAN_SCOPE

__all__ = [
    "ReduceGradientsState",
    "reduce_gradients",
    "reduce_mean",
    "reduce_state_specs",
]

_F32 = np.dtype("float32")
_WIRES = tuple(
    np.dtype(d)
    for d in (
        jnp.float32,
        jnp.bfloat16,
        jnp.float16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
    )
)
_NO_SCALES_OK = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_DEFAULT_BLOCK = 256


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


def _wire(wire_dtype: Any) -> np.dtype:
    try:
        dtype = np.dtype(jnp.dtype(wire_dtype))
    except TypeError:
        raise TypeError(f"`wire_dtype` must be a dtype, got {wire_dtype!r}.") from None
    if dtype not in _WIRES:
        names = ", ".join(d.name for d in _WIRES)
        raise ValueError(f"`wire_dtype` must be one of {names}, got {dtype.name}.")
    return dtype


def _block(block_size: Any, wire: np.dtype) -> int | None:
    """The block size the wire uses: ``None`` for no block scales."""
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int | np.integer)
    ):
        raise TypeError(f"`block_size` must be an int or None, got {block_size!r}.")
    if wire == _F32:
        return None  # float32 travels as it is
    if block_size is None:
        if wire not in _NO_SCALES_OK:
            raise ValueError(
                f"`block_size` must be an int for `wire_dtype` {wire.name} (its "
                "range needs a scale per block; `None` is for float16 or bfloat16, "
                "whose values travel as they are), got None."
            )
        return None
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1 (or None), got {block_size}.")
    return int(block_size)


def _axis(axis_name: Any) -> str:
    if not isinstance(axis_name, str):
        raise TypeError(
            f"`axis_name` must be the name of one mapped axis (a str), got "
            f"{axis_name!r}."
        )
    return axis_name


def _axis_size(axis_name: str, what: str) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise explain_unbound(axis_name, err, what) from None


# --------------------------------------------------------------------------- #
# Block scales: powers of two from the float32 bits of each block's amax
# --------------------------------------------------------------------------- #


def _exponent_and_mantissa(value: float) -> tuple[int, int]:
    bits = int(np.array(value, _F32).view(np.int32))
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


def _scales(blocks: jax.Array, wire: np.dtype) -> jax.Array:
    """``f32[..., nb]``: for each block (the last axis of ``blocks``) the
    smallest power of two ``s`` with ``amax / s <= max(wire)``; 1 for a block of
    zeros, NaN for a block holding an inf or a NaN.

    The bits of ``|x|`` read as int32 are ordered as the values, NaN above inf,
    so their maximum is the amax's bits on any backend, whatever its float
    ``max`` does with NaN.
    """
    key = jnp.max(lax.bitcast_convert_type(jnp.abs(blocks), jnp.int32), axis=-1)
    e_max, m_max = _exponent_and_mantissa(float(jnp.finfo(wire).max))
    biased = key >> 23
    e = biased - (127 + e_max) + ((key & 0x7FFFFF) > m_max).astype(jnp.int32)
    # Below a normal amax (zero, or flushed) any scale fits: keep 1 and 1/s normal.
    e = jnp.where(biased == 0, 0, jnp.clip(e, -126, 126))
    scale = lax.bitcast_convert_type((e + 127) << 23, jnp.float32)
    return jnp.where(biased == 255, np.float32(np.nan), scale)


def _quantize(x: jax.Array, wire: np.dtype, block: int | None) -> tuple[Any, Any]:
    """``x`` (``f32[r, k]``, ``k`` a multiple of ``block``) in ``wire``, and its
    block scales ``f32[r, k // block]`` (``None`` without blocks)."""
    if block is None:
        return x.astype(wire), None
    blocks = x.reshape(x.shape[0], -1, block)
    scale = _scales(blocks, wire)
    inverse = lax.bitcast_convert_type(
        (254 << 23) - lax.bitcast_convert_type(scale, jnp.int32), jnp.float32
    )  # 1 / scale, exact for a power of two; NaN stays NaN below
    inverse = jnp.where(jnp.isnan(scale), scale, inverse)
    return (blocks * inverse[..., None]).astype(wire).reshape(x.shape), scale


def _dequantize(q: jax.Array, scale: Any, block: int | None) -> jax.Array:
    x = q.astype(_F32)
    if scale is None:
        return x
    return (x.reshape(*scale.shape, block) * scale[..., None]).reshape(q.shape)


# --------------------------------------------------------------------------- #
# The transport
# --------------------------------------------------------------------------- #


def _mean_of(
    x: jax.Array,
    axis_name: str,
    n: int,
    wire: np.dtype,
    block: int | None,
    carried: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``f32[n * k]``: the mean over the axis of ``x`` (``f32[n, k]``, row ``i``
    for device ``i``), the same on every device; and ``f32[k]``, what rounding
    this device's chunk of the mean (plus ``carried``) to the wire lost."""
    # The scopes name the collectives in the compiled program's metadata
    # (``jxs.diagnostics.collective_report``: "reduce_mean", its scales).
    with jax.named_scope(REDUCE_MEAN_SCOPE):
        q, scale = _quantize(x, wire, block)
        q = lax.all_to_all(q, axis_name, 0, 0, tiled=True)
        if scale is not None:
            with jax.named_scope(BLOCK_SCALES_SCOPE):
                scale = lax.all_to_all(scale, axis_name, 0, 0, tiled=True)
        mean = jnp.sum(_dequantize(q, scale, block), axis=0) / np.float32(n)
        if carried is not None:
            mean = mean + carried
        q, scale = _quantize(mean[None], wire, block)
        lost = mean - _dequantize(q, scale, block)[0]
        q = gather_invariant(q[0], axis_name)
        if scale is None:
            return q.astype(_F32), lost
        with jax.named_scope(BLOCK_SCALES_SCOPE):
            scale = gather_invariant(scale[0], axis_name)
        return _dequantize(q[None], scale[None], block)[0], lost


class _Flat(NamedTuple):
    """Where each floating leaf lies in the padded float32 vector."""

    treedef: Any
    leaves: list[Any]
    floating: list[bool]
    size: int  # floating elements
    padded: int  # a multiple of n * block


def _flatten(tree: Any, n: int, block: int | None, what: str, axis: str) -> _Flat:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    floating = []
    for path, leaf in zip(paths, leaves, strict=True):
        dtype = np.dtype(getattr(leaf, "dtype", None) or jnp.result_type(leaf))
        if dtype == jax.dtypes.float0:
            floating.append(False)  # the gradient of an integer input: no data
            continue
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{what} averages floating-point leaves only; "
                f"`{jax.tree_util.keystr(path)}` is {dtype}. Take such leaves "
                "out of the tree (or `lax.psum` them yourself)."
            )
        floating.append(True)
    _check_varying(leaves, paths, floating, axis, what)
    size = sum(int(np.size(x)) for x, f in zip(leaves, floating, strict=True) if f)
    unit = n * (block or 1)
    padded = max(unit, -(-size // unit) * unit)
    return _Flat(treedef, leaves, floating, size, padded)


def _check_varying(leaves, paths, floating, axis: str, what: str) -> None:
    """Refuses leaves typed as the same on every device (already reduced)."""
    axes, checked = manual_axes()
    if not checked or axis not in axes:
        return  # no varying types to read (pmap, vmap, check_vma=False)
    for path, leaf, f in zip(paths, leaves, floating, strict=True):
        if f and axis not in varying_axes(jax.typeof(leaf)):
            raise ValueError(
                f"{what}: `{jax.tree_util.keystr(path)}` is already the same on "
                f"every device of axis {axis!r}, so it has been reduced already "
                "(a `lax.pmean`/`psum` before, or JAX's own: under "
                "`shard_map(check_vma=True)` the gradient of a parameter passed "
                "replicated, `P()`, is summed over the axis by autodiff, in its "
                "dtype). Reduce once: differentiate per device, with respect to "
                f"`lax.pcast(params, {axis!r}, to='varying')` (`lax.pvary` before "
                "jax 0.10), or use `check_vma=False`."
            )


def _concat(flat: _Flat) -> jax.Array:
    parts = [
        jnp.ravel(x).astype(_F32)
        for x, f in zip(flat.leaves, flat.floating, strict=True)
        if f
    ]
    parts.append(jnp.zeros(flat.padded - flat.size, _F32))
    return jnp.concatenate(parts)


def _unflatten(flat: _Flat, vector: jax.Array) -> Any:
    out, at = [], 0
    for x, f in zip(flat.leaves, flat.floating, strict=True):
        if not f:
            out.append(x)
            continue
        size = int(np.size(x))
        out.append(vector[at : at + size].reshape(jnp.shape(x)).astype(x.dtype))
        at += size
    return jax.tree_util.tree_unflatten(flat.treedef, out)


def reduce_mean(
    tree: Any,
    axis_name: str,
    *,
    wire_dtype: Any = jnp.float32,
    block_size: int | None = _DEFAULT_BLOCK,
) -> Any:
    """The mean over a mapped axis of every floating leaf, sent in ``wire_dtype``.

    A replacement for ``lax.pmean(grads, axis_name)`` inside ``jax.shard_map``
    (or ``jax.pmap``) whose error does not grow with the number of devices: the
    leaves are flattened into one float32 vector, cut into one chunk per device,
    sent with an all-to-all in ``wire_dtype`` (with a float32 power-of-two scale
    per ``block_size`` values for float8, float16 and bfloat16), summed in
    float32 by the device that owns the chunk, divided by the axis size and
    all-gathered back in ``wire_dtype``. Each value is rounded to ``wire_dtype``
    twice (out and back); the bytes per device are a ring all-reduce's in
    ``wire_dtype``, plus 4 bytes per block for the scales.

    Non-finite values are never lost: a block holding an inf or a NaN arrives as
    NaN; without block scales (``block_size=None``, float16 or bfloat16) values
    travel as they are, so the inf of an overflowed loss-scaled gradient arrives
    as an inf, and a finite value above the wire dtype's range as an inf too.

    Args:
      tree: a pytree of arrays, each device's own (varying over ``axis_name``).
        Leaves of any floating dtype come back in it; ``float0`` leaves (the
        gradients of integer inputs) pass through.
      axis_name: the mapped axis to average over (one name).
      wire_dtype: the dtype on the wire: ``float32`` (exact sum, no scales),
        ``bfloat16``, ``float16``, ``float8_e4m3fn`` or ``float8_e5m2``.
      block_size: values per float32 scale (unused for ``float32``). ``None``
        sends float16 or bfloat16 values unscaled: right for loss-scaled
        gradients, where an overflow must arrive as an inf.

    Returns:
      ``tree`` with each floating leaf replaced by its mean over the axis, in its
      own dtype, the same on every device (typed invariant over the axis).

    Raises:
      TypeError: for an integer or bool leaf, or a ``wire_dtype``,
        ``block_size`` or ``axis_name`` of the wrong type.
      ValueError: for a ``wire_dtype`` not listed above, a ``block_size`` below
        1 (or ``None`` with float8), or leaves already the same on every device
        (reduced already; only where JAX types varying values, in
        ``shard_map(check_vma=True)``).
      NameError: where no mapped axis is named ``axis_name``.

    Examples:
      >>> import jaxscale as jxs, jax, jax.numpy as jnp
      >>> grads = {"w": jnp.arange(8.0).reshape(4, 2)}  # one row per device
      >>> mean = jax.vmap(
      ...     lambda g: jxs.reduce_mean(g, "data", wire_dtype=jnp.float16),
      ...     axis_name="data",
      ... )(grads)
      >>> mean["w"][0]
      Array([3., 4.], dtype=float32)

    References:
      Megatron-LM, ``DistributedDataParallelConfig``'s
      ``reduce_scatter_with_fp32_accumulation`` (NVIDIA/Megatron-LM#1967).
    """
    wire = _wire(wire_dtype)
    block = _block(block_size, wire)
    axis = _axis(axis_name)
    what = "`jxs.reduce_mean`"
    n = _axis_size(axis, what)
    flat = _flatten(tree, n, block, what, axis)
    vector, _ = _mean_of(_concat(flat).reshape(n, -1), axis, n, wire, block)
    return _unflatten(flat, vector)


# --------------------------------------------------------------------------- #
# The optax transformation
# --------------------------------------------------------------------------- #


class ReduceGradientsState(NamedTuple):
    """The state of :func:`reduce_gradients`.

    Attributes:
      residual: ``f32[n, size]`` with error feedback (``None`` without): row
        ``i`` is device ``i``'s quantisation error of its last sent gradients
        (flattened and padded to ``size``), added to its next ones.
      mean_residual: ``f32[n, size // n]`` with error feedback (``None``
        without): row ``i`` is what rounding the mean of chunk ``i``, which
        device ``i`` sums and sends back, lost last time; added to its next mean.
      warmup_count: ``i32[]`` with ``warmup_steps`` (``None`` without): the
        steps with finite averaged gradients so far, counted up to
        ``warmup_steps``; below it the gradients travel in ``warmup_dtype``.

    Each device holds its own residual rows: shard them over the axis,
    ``P(axis_name)``; the count is the same everywhere, ``P()``
    (:func:`reduce_state_specs`).

    Examples:
      >>> import jaxscale as jxs
      >>> jxs.ReduceGradientsState(residual=None, mean_residual=None)
      ReduceGradientsState(residual=None, mean_residual=None, warmup_count=None)
    """

    residual: jax.Array | None
    mean_residual: jax.Array | None
    warmup_count: jax.Array | None = None


def reduce_gradients(
    axis_name: str,
    *,
    wire_dtype: Any = jnp.float32,
    block_size: int | None = _DEFAULT_BLOCK,
    error_feedback: bool = False,
    warmup_steps: int = 0,
    warmup_dtype: Any = jnp.bfloat16,
) -> optax.GradientTransformation:
    """An optax transformation that averages the gradients over a mapped axis:
    :func:`reduce_mean` as the first element of a chain.

    Two placements, both inside ``jax.shard_map`` (or ``jax.pmap``):

    * before :func:`dynamic_scaling`, on the *scaled* gradients:
      ``optax.chain(jxs.reduce_gradients("data", wire_dtype=jnp.float16,
      block_size=None), jxs.dynamic_scaling(optax.adam(1e-3)))``. An overflow
      travels as an inf and reaches every device, so ``dynamic_scaling`` needs
      no ``axis_name`` and makes one decision everywhere.
    * inside it, on unscaled gradients, with block scales:
      ``jxs.dynamic_scaling(optax.chain(jxs.reduce_gradients("data",
      wire_dtype=jnp.float8_e4m3fn), optax.adam(1e-3)), axis_name="data")``.
      ``axis_name`` there agrees on the local gradients' finiteness.

    With ``error_feedback``, each device adds what rounding to the wire dtype
    took from its last gradients to its next ones (``c = g + e``, ``e' = c -
    dequantize(quantize(c))``), and the device that sums a chunk does the same
    with the rounding of the chunk's mean it sends back (the two-sided
    compensation of DoubleSqueeze): the running sum of the averaged gradients
    follows that of the exact means, within one rounding. A step whose averaged
    gradients are not finite leaves both residuals bit-identical. Placed before
    ``dynamic_scaling``, the residuals are in scaled units: a change of the loss
    scale mis-scales one step's residuals by its factor (place it inside to
    avoid that). The residuals hold one float32 per gradient value and device,
    and one per ``n`` values, sharded over the axis: build the state inside
    ``jax.set_mesh(mesh)`` (or inside the mapped function) and pass it with
    :func:`reduce_state_specs`.

    With ``warmup_steps``, the first ``warmup_steps`` steps whose averaged
    gradients are finite send them in ``warmup_dtype`` (bfloat16 by default,
    with the same block scales), and every later step in ``wire_dtype``: early
    in training, when the gradients change fastest, a float8 wire with error
    feedback trails a float32 mean (``docs/multidevice.md`` measures it). The
    switch is a ``lax.cond`` on a step count in the state: one compiled step,
    no retrace and no host round trip; a skipped step (non-finite averaged
    gradients) does not count. Error feedback, if on, compensates whichever
    wire the step used.

    Args:
      axis_name: the mapped axis to average over (one name).
      wire_dtype: as for :func:`reduce_mean`.
      block_size: as for :func:`reduce_mean`.
      error_feedback: keep each device's quantisation error and add it to its
        next gradients (not with a ``float32`` wire, which has none).
      warmup_steps: how many finite steps send in ``warmup_dtype`` before
        ``wire_dtype`` takes over (default 0: none).
      warmup_dtype: the wire of the warm-up, wider than ``wire_dtype``:
        ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`ReduceGradientsState`.

    Raises:
      TypeError, ValueError: as :func:`reduce_mean`, when built (arguments) or
        updated (leaves); ``ValueError`` for error feedback with a float32 wire,
        a negative ``warmup_steps`` or a ``warmup_dtype`` no wider than
        ``wire_dtype``; ``TypeError`` for a ``warmup_steps`` that is not an int.

    Examples:
      >>> import jaxscale as jxs, jax, jax.numpy as jnp, optax
      >>> tx = jxs.reduce_gradients("data", wire_dtype=jnp.float16, block_size=None)
      >>> grads = jnp.arange(8.0).reshape(4, 2)  # one row per device
      >>> updates, _ = jax.vmap(
      ...     lambda g: tx.update(g, tx.init(g)), axis_name="data"
      ... )(grads)
      >>> updates[0]
      Array([3., 4.], dtype=float32)

    References:
      Seide et al., "1-bit stochastic gradient descent and its application to
      data-parallel distributed training of speech DNNs", Interspeech 2014
      (error feedback); Tang et al., "DoubleSqueeze: parallel stochastic gradient
      descent with double-pass error-compensated compression", ICML 2019.
    """
    wire = _wire(wire_dtype)
    block = _block(block_size, wire)
    axis = _axis(axis_name)
    if not isinstance(error_feedback, bool):
        raise TypeError(f"`error_feedback` must be a bool, got {error_feedback!r}.")
    if error_feedback and wire == _F32:
        raise ValueError(
            "`error_feedback` needs a `wire_dtype` narrower than float32 (a float32 "
            "wire rounds nothing to feed back), got error_feedback=True with "
            "float32."
        )
    warmup = _warmup(warmup_steps, warmup_dtype, wire, block)
    what = "`update` of `jxs.reduce_gradients`"

    def init(params):
        count = jnp.zeros((), jnp.int32) if warmup else None
        if not error_feedback:
            return ReduceGradientsState(None, None, count)
        try:  # inside the mapped function: this device's row
            n, rows = lax.axis_size(axis), 1
        except NameError:
            n = rows = _mesh_axis_size(axis)
        size = _flatten(params, n, block, "`init` of `jxs.reduce_gradients`", "").padded
        return ReduceGradientsState(
            residual=jnp.zeros((rows, size), _F32),
            mean_residual=jnp.zeros((rows, size // n), _F32),
            warmup_count=count,
        )

    def send(rows, carried, n, count):
        """The mean of ``rows`` (``f32[n, k]``) and, with ``carried`` (error
        feedback), what this device's rounding lost on the way out and on the
        way back: on the wire of step ``count``."""

        def on(dtype, blocks):
            def transport(rows, carried):
                mean, lost = _mean_of(rows, axis, n, dtype, blocks, carried)
                if carried is None:
                    return mean
                q, scale = _quantize(rows, dtype, blocks)
                return mean, rows - _dequantize(q, scale, blocks), lost

            return transport

        main = on(wire, block)
        if not warmup:
            return main(rows, carried)
        steps, warm, warm_block = warmup
        return lax.cond(count < steps, on(warm, warm_block), main, rows, carried)

    def update(updates, state, params=None):
        del params
        n = _axis_size(axis, what)
        flat = _flatten(updates, n, block, what, axis)
        vector = _concat(flat)
        if warmup and state.warmup_count is None:
            raise ValueError(
                f"{what}: the state has no `warmup_count`, and the transformation "
                f"warms up for {warmup[0]} steps: pass the state `init` of this "
                "transformation built (one made without `warmup_steps` has none)."
            )
        count = state.warmup_count
        if state.residual is None:
            mean = send(vector.reshape(n, -1), None, n, count)
            if warmup:
                state = state._replace(warmup_count=_counted(state, mean, warmup))
            return _unflatten(flat, mean), state
        if state.residual.shape != (1, flat.padded):
            raise ValueError(
                f"{what}: the residual's local shape is {state.residual.shape}, "
                f"expected (1, {flat.padded}): pass the state into `jax.shard_map` "
                f"sharded over {axis!r} (`jxs.reduce_state_specs(opt_state, "
                f"{axis!r})`), built by `init` for these gradients."
            )
        rows = (vector + state.residual[0]).reshape(n, -1)
        mean, error, lost = send(rows, state.mean_residual[0], n, count)
        # One decision on every device: the mean is the same everywhere.
        finite = jnp.all(jnp.isfinite(mean))
        new = ReduceGradientsState(
            residual=jnp.where(finite, error.reshape(1, -1), state.residual),
            mean_residual=jnp.where(finite, lost[None], state.mean_residual),
            warmup_count=_counted(state, mean, warmup) if warmup else None,
        )
        return _unflatten(flat, mean), new

    return optax.GradientTransformation(init, update)


def _warmup(
    steps: Any, dtype: Any, wire: np.dtype, block: int | None
) -> tuple[int, np.dtype, int | None] | None:
    """``(steps, dtype, block)`` of the warm-up wire, or ``None`` for none."""
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer):
        raise TypeError(f"`warmup_steps` must be an int, got {steps!r}.")
    if steps < 0:
        raise ValueError(f"`warmup_steps` must be >= 0, got {steps}.")
    if steps == 0:
        return None  # `warmup_dtype` unused
    try:
        warm = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"`warmup_dtype` must be a dtype, got {dtype!r}.") from None
    wider = [d for d in _WIRES if d.itemsize > wire.itemsize]
    if warm not in wider:
        names = ", ".join(d.name for d in wider) or "none"
        raise ValueError(
            f"`warmup_dtype` must be a wire wider than `wire_dtype` {wire.name} "
            f"({names}), got {warm.name}."
        )
    # Chunks are cut in blocks of the main wire: the warm-up keeps its scales
    # (float32 needs none; float16/bfloat16 take them where the wire has them).
    return int(steps), warm, None if warm == _F32 else block


def _counted(state: ReduceGradientsState, mean: jax.Array, warmup: tuple) -> Any:
    """The warm-up count after a step: one more (up to the warm-up's length)
    where the averaged gradients are finite, else as it was."""
    finite = jnp.all(jnp.isfinite(mean))
    count = state.warmup_count
    return jnp.where(finite, jnp.minimum(count + 1, warmup[0]), count)


def _mesh_axis_size(axis: str) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(getattr(mesh, "shape", None) or {})
    if axis not in shape:
        raise ValueError(
            "`init` of `jxs.reduce_gradients(..., error_feedback=True)` makes one "
            f"residual row per device of axis {axis!r}, and no mesh in scope has "
            "that axis: call `init` inside `with jax.set_mesh(mesh):` (or inside "
            f"the mapped function), got mesh axes {tuple(shape)}."
        )
    return int(shape[axis])


def reduce_state_specs(tree: Any, axis_name: str) -> Any:
    """``PartitionSpec`` s for ``jax.shard_map``'s ``in_specs``/``out_specs`` of
    a state holding :class:`ReduceGradientsState` s: ``P(axis_name)`` for their
    residuals (one row per device), ``P()`` for every other leaf (a warm-up's
    count among them).

    Args:
      tree: an optimizer state (or a train state holding one).
      axis_name: the axis ``reduce_gradients`` averages over.

    Returns:
      A pytree of ``PartitionSpec`` s with the structure of ``tree``.

    Examples:
      >>> import jaxscale as jxs, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> state = (
      ...     jxs.ReduceGradientsState(jnp.zeros((8, 256)), jnp.zeros((8, 32))),
      ...     jnp.ones(()),
      ... )
      >>> jxs.reduce_state_specs(state, "data") == (
      ...     jxs.ReduceGradientsState(P("data"), P("data")), P()
      ... )
      True
    """
    _axis(axis_name)

    def spec(node):
        if isinstance(node, ReduceGradientsState):
            rows = jax.tree.map(lambda _: PartitionSpec(axis_name), node[:2])
            count = jax.tree.map(lambda _: PartitionSpec(), node.warmup_count)
            return ReduceGradientsState(*rows, count)
        return PartitionSpec()

    return jax.tree.map(
        spec, tree, is_leaf=lambda x: isinstance(x, ReduceGradientsState)
    )
