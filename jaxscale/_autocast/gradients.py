"""Weight gradients that leave their matmul in float32 (``gradient_dtype``).

Under ``jit`` with sharded arrays XLA's partitioner inserts the reduction of a
weight gradient across devices on the partial sums of its product, before any
cast that follows. In ``jax.grad(jxs.autocast(loss))`` that product is the
transpose of a 16-bit matmul, so the gradient of a float32 parameter would be
all-reduced (data parallel) or reduce-scattered (FSDP) in 16 bits and only then
widened. :func:`wide_product`, autocast's one widened product, binds the forward
product as before (16-bit operands; a 16-bit result, or a float32 one where
autocast widens it) with a derivative whose weight term takes the float32
tangent, so its transpose, the weight-gradient product, multiplies the 16-bit
cotangent by the 16-bit activation and accumulates and returns float32: the
reduction the partitioner inserts is float32, as torch DDP's of an fp32
parameter's gradient.

On CUDA the term carries the ``F16_F16_F32``/``BF16_BF16_F32`` dot algorithm, so
XLA:GPU runs that product on 16-bit operands with a float32 result (the tangent,
a float32 widening of a 16-bit cotangent, is narrowed back exactly); elsewhere
(XLA:CPU rejects the algorithms) it is the same product with mixed operands,
which XLA:CPU computes in float32 anyway, and so is a matrix-vector product on
CUDA (XLA:GPU rejects the algorithms there). ``lax.platform_dependent`` picks at
lowering time, so a step compiled for a GPU from a CPU host gets the GPU form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxscale._autocast.values import cast, dtype_of
from jaxscale._jax_private import (
    bind,
    dot_dimension_numbers,
    preferred_element_type,
    with_preferred_element_type,
)
from jaxscale._policy import parse_float_dtype

__all__ = [
    "DOT_ALGORITHMS",
    "WIDE_ELEMENTWISE",
    "WIDE_PRODUCTS",
    "gradient_policy",
    "wide_elementwise",
    "wide_product",
]

_F32 = np.dtype("float32")
# The dot algorithm of a weight-gradient product on CUDA, per 16-bit dtype: it
# rounds both operands to that dtype and accumulates in float32.
DOT_ALGORITHMS = MappingProxyType(
    {
        np.dtype("float16"): lax.DotAlgorithmPreset.F16_F16_F32,
        np.dtype(jax.numpy.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32,
    }
)


# The products whose float32 operand's gradient is widened: a matmul's weight,
# a convolution's kernel (or, in a transposed convolution written with the
# parameter on the left, whichever operand is the float32 input).
WIDE_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def wide_product(
    primitive: Any,
    params: Mapping[str, Any],
    *vals: Any,
    sources: Sequence[Any | None] | None = None,
) -> Any:
    """``bind(primitive, params, vals)``: the one widened product of autocast.

    ``primitive`` is a ``dot_general`` or a ``conv_general_dilated`` (or any
    product bound on 16-bit ``vals``); two things may be widened, each at its
    caller's choice:

    - the result: if ``params`` ask for a float32 result from 16-bit operands
      (the widening rule's product, a scale taken in float32 before the
      rounding, a plan's ``HALF_WIDE`` site), the product accumulates and
      returns float32, and its derivative is the 16-bit product's, widened:
      the backward rounds the result's cotangent to the operands' dtype once
      and runs in it, as for a matmul whose float32 result comes from a cast;
    - a weight gradient: the cotangent of each float32 ``sources[i]``
      (``vals[i]`` is its 16-bit cast; ``None`` where it is not one: the
      inputs whose ``gradient_dtype`` is float32) comes out of its product in
      float32 (:func:`_wide_term`), so the reduction across devices that the
      partitioner inserts on it is float32.

    The two compose: a widened result's weight gradient follows
    ``gradient_dtype`` as any other product's."""
    low = [dtype_of(v) for v in vals]
    sources = [None] * len(vals) if sources is None else list(sources)
    primals = [v if s is None else s for v, s in zip(vals, sources, strict=True)]
    out_dtype = np.dtype(preferred_element_type(params) or low[0])
    # A widened result: the derivative is the product in the operands' dtype.
    widened = out_dtype == _F32 and low[0] != _F32
    t_params = with_preferred_element_type(params, low[0]) if widened else params
    t_dtype = low[0] if widened else out_dtype

    def narrowed(ops: Sequence[Any]) -> list[Any]:
        return [cast(o, d) for o, d in zip(ops, low, strict=True)]

    @jax.custom_jvp
    def product(*ops: Any) -> Any:
        return bind(primitive, params, narrowed(ops))[0]

    def jvp(ops: tuple, tangents: tuple) -> tuple[Any, Any]:
        narrow = narrowed(ops)
        terms = []
        for i, t in enumerate(tangents):
            if isinstance(t, SymbolicZero):
                continue
            args = [*narrow[:i], t, *narrow[i + 1 :]]
            if sources[i] is None:
                term = bind(primitive, t_params, args)[0]
            else:
                term = _wide_term(primitive, t_params, args, low[i])
            terms.append(cast(term, t_dtype))
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        return product(*ops), cast(total, out_dtype)

    product.defjvp(jvp, symbolic_zeros=True)
    return product(*primals)


def _wide_term(
    primitive: Any, params: Mapping[str, Any], args: list[Any], low: np.dtype
) -> Any:
    """The product with a float32 tangent among ``args`` (the others in
    ``low``), accumulated and returned in float32: on CUDA with the 16-bit dot
    algorithm (the tangent narrowed exactly, since its cotangent is 16-bit). A
    convolution takes one dtype for both operands: see :func:`_wide_conv`."""
    wide = with_preferred_element_type(params, _F32)
    if primitive.name == "conv_general_dilated":
        return _wide_conv(primitive, wide, args)
    algorithm = DOT_ALGORITHMS.get(np.dtype(low))
    if algorithm is None or not _matrix_matrix(params, args):
        return bind(primitive, wide, args)[0]
    on_gpu = dict(wide, precision=algorithm)  # a dot algorithm is a precision
    # Both operands float32 (exact widenings) for the algorithm, which rounds
    # them back to ``low``: JAX lowers a bf16 algorithm on mixed operands
    # through a dtype promotion that strict promotion refuses.
    return lax.platform_dependent(
        *args,
        cuda=lambda *a: bind(primitive, on_gpu, [cast(x, _F32) for x in a])[0],
        default=lambda *a: bind(primitive, wide, a)[0],
    )


def _wide_conv(primitive: Any, wide: Mapping[str, Any], args: list[Any]) -> Any:
    """A convolution's float32 term: both operands widened (exactly) and the
    result float32, so its transpose, the kernel's gradient, is a float32
    convolution of the widened activation and cotangent whose partial sums
    the partitioner reduces in float32. XLA:CPU computes a 16-bit convolution
    in float32 anyway; XLA:GPU (cuDNN) has no 16-bit convolution with a
    float32 result and runs this one on float32 copies of its operands.
    Rematerialised, so the backward widens the 16-bit activation it keeps
    rather than keeping a float32 copy from the forward."""

    def term(*a: Any) -> Any:
        return bind(primitive, wide, [cast(x, _F32) for x in a])[0]

    return jax.checkpoint(term)(*args)


def _matrix_matrix(params: Mapping[str, Any], args: Sequence[Any]) -> bool:
    """Whether the product and its transposes are matrix-matrix products: its
    contracted size and each operand's free size above 1. XLA:GPU runs a
    matrix-vector product (a width-1 output layer's weight gradient) as a
    reduction and rejects a dot algorithm there ("Unsupported dot precision
    algorithm", jax 0.10 and 0.11); such a product is cheap in float32."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dot_dimension_numbers(params)

    def size(shape: tuple[int, ...], keep: Any) -> int:
        return int(np.prod([d for i, d in enumerate(shape) if keep(i)], dtype=np.int64))

    lhs, rhs = np.shape(args[0]), np.shape(args[1])
    contracted = size(lhs, lambda i: i in lhs_contract)
    lhs_free = size(lhs, lambda i: i not in (*lhs_contract, *lhs_batch))
    rhs_free = size(rhs, lambda i: i not in (*rhs_contract, *rhs_batch))
    return min(contracted, lhs_free, rhs_free) > 1


def gradient_policy(gradient_dtype: Any, dtype: np.dtype) -> Callable[[str], bool]:
    """``autocast``'s ``gradient_dtype`` checked: a function of an input's path
    (``"[0]['params']['w']"``) that says whether its gradient leaves a matmul in
    float32 (``True``) or in ``dtype``, the autocast dtype."""
    if callable(gradient_dtype) and not isinstance(gradient_dtype, type):

        def wide(path: str) -> bool:
            return _is_wide(gradient_dtype(path), dtype, path)

        return wide
    fixed = _is_wide(gradient_dtype, dtype, None)
    return lambda path: fixed


def _is_wide(value: Any, dtype: np.dtype, path: str | None) -> bool:
    where = "" if path is None else f" for the input at {path}"
    if value is None:
        return True
    try:
        dt = parse_float_dtype(value, "gradient_dtype")
    except (TypeError, ValueError):
        dt = None
    if dt == _F32:
        return True
    if dt is not None and (dt == dtype or dtype == _F32 and dt in DOT_ALGORITHMS):
        return False
    raise ValueError(
        f"`gradient_dtype` must be float32 (the default: a float32 input's "
        f"gradient leaves its matmuls, and crosses devices, in float32), the "
        f"autocast dtype ({dtype.name}: half the bytes, rounded once per "
        f"product and summed in {dtype.name} across devices), None (the "
        "default) or a function of an input's path returning one of them; got "
        f"{value!r}{where}."
    )


# The elementwise operations whose broadcast parameter's (or, in a norm,
# statistic's) gradient is widened.
WIDE_ELEMENTWISE = frozenset({"add", "sub", "mul", "div"})


def wide_elementwise(
    primitive: Any, params: Mapping[str, Any], vals: Sequence[Any], source: Any, i: int
) -> Any:
    """``bind(primitive, params, vals)`` (``add``, ``sub``, ``mul`` or ``div``
    that broadcasts ``vals[i]``, the 16-bit cast of the float32 ``source``: a
    bias, a norm's scale or statistic), differentiated so that ``source``'s
    cotangent is summed
    over the broadcast axes in float32: its tangent is broadcast before the
    cast, so the transpose widens the cotangent first (XLA fuses the widening
    into the sum) and a partial sum across devices is reduced in float32. The
    other operand's term is the plain one, so the backward keeps no
    full-size copy of the parameter."""
    low = dtype_of(vals[i])
    j = 1 - i
    like = vals[j]
    shape = np.shape(like)

    def order(x: Any, y: Any) -> list[Any]:
        """``x`` in slot ``i``, ``y`` in the other."""
        return [x, y] if i == 0 else [y, x]

    @jax.custom_jvp
    def op(p: Any, other: Any) -> Any:
        return bind(primitive, params, order(cast(p, low), other))[0]

    def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        (p, other), (dp, dother) = primals, tangents

        # Broadcast by adding zeros laid out as the activation: a plain
        # broadcast is replicated under explicit sharding, so its transpose
        # would gather the activation's cotangent.
        def spread(d: Any) -> Any:
            part = d.reshape((1,) * (len(shape) - np.ndim(d)) + np.shape(d))
            zeros = lax.stop_gradient(jax.numpy.zeros_like(like, dtype=_F32))
            return cast(part + zeros, low)

        if primitive.name == "div":
            out = op(p, other)
            if i == 1:  # x / p: dx / p - out * (dp / p), dp / p in float32
                t = bind(primitive, params, [dother, cast(p, low)])[0]
                return out, t - out * spread(dp / p)
            # p / x: (dp - out * dx) / x
            return out, bind(primitive, params, [spread(dp) - out * dother, other])[0]
        wide = spread(dp)
        if primitive.name == "mul":
            t = bind(primitive, params, order(cast(p, low), dother))[0]
            t = t + bind(primitive, params, order(wide, other))[0]
        else:  # add, sub: linear in both operands
            t = bind(primitive, params, order(wide, dother))[0]
        return op(p, other), t

    op.defjvp(jvp)
    return op(source, like)
