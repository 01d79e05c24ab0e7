"""The per-primitive dtype rules of :func:`jaxscale.autocast`: the public table.

Every first-order JAX primitive that takes floating operands is in one of five
classes (:class:`AutocastRule`); a primitive that is not in the table runs at the
dtypes it was traced with. The classes follow torch's autocast lists for CUDA
(``aten/src/ATen/autocast_mode.cpp``), translated from torch's ops to the JAX
primitives they lower to; ``docs/autocast.md`` lists the table op by op with the
decisions that differ from torch's CUDA and CPU lists, and why.

Higher-order primitives (``jit``, ``scan``, ``while``, ``cond``, ``checkpoint``,
``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``, ``closed_call``) are not
in the table: the interpreter recurses into them. The only rule they accept as an
override is ``"traced"`` (run the whole sub-computation as traced).
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Any

from jaxscale._jax_private import HIGHER_ORDER_NAMES

__all__ = [
    "AutocastRule",
    "HIGHER_ORDER",
    "Slot",
    "UNLISTED",
    "autocast_rules",
    "resolve_rules",
]


class AutocastRule(enum.StrEnum):
    """The dtype rule classes of :func:`jaxscale.autocast`, one per primitive.

    The members are strings, so ``rules={"exp": "keep"}`` and
    ``rules={"exp": jxs.AutocastRule.KEEP}`` mean the same. In the descriptions,
    *castable* values are those of dtype float16, bfloat16 or float32; float64
    (under x64), the float8 types, integers, booleans, complex numbers and PRNG
    keys are never cast, as in torch.

    - ``LOWER`` (``"lower"``): castable operands are cast to the autocast
      ``dtype``, and so is the output (``preferred_element_type`` is reset to
      ``dtype`` where it was the operands' dtype). The backward pass of the op then
      runs in ``dtype`` too. ``dot_general``, ``conv_general_dilated``,
      ``ragged_dot_general``: torch's ``lower_precision_fp`` list.
    - ``FLOAT32`` (``"float32"``): castable operands are cast to float32 and the
      output is float32: ``exp``, ``log``, ``pow``, ``square``, ``rsqrt``,
      special functions, sums and products (``reduce_sum``, ``cumsum``, ...),
      linear algebra and FFTs: torch's ``fp32`` lists.
    - ``PROMOTE`` (``"promote"``): for primitives whose floating operands must share
      a dtype (``max``, ``select_n``, ``concatenate``, ``scatter``, ...):
      when autocast has made them differ, all are cast to the widest of them
      (float16 with bfloat16 gives float32). As in torch's type promotion, a scalar
      operand (rank 0, a Python number, or an array broadcast from one, such as
      ``jnp.zeros(shape)``) only decides the dtype when every operand is a scalar:
      ``x16 * 2.0`` stays float16.
    - ``BIAS`` (``"bias"``): ``add``, ``sub``, ``mul``, ``div``. ``PROMOTE``,
      except in two cases that keep activations in ``dtype``. The bias: the
      output of a ``LOWER`` op (possibly reshaped) plus or minus a float32
      parameter broadcast from a vector or a scalar runs in ``dtype``, as torch's
      ``linear`` and ``conv`` include their bias. Normalisation: a full-size
      activation in ``dtype`` combined with a float32 value broadcast from fewer
      elements that is a statistic (computed by reductions, from parameters and
      scalars only, not through ``log``/``exp``), a parameter or a constant is
      cast to ``dtype`` (saturating at its finite range) and the op runs in
      ``dtype``, so the activation stays in ``dtype`` as torch's ``batch_norm``
      and Flax's ``dtype=float16`` give. ``x @ w + y`` with a
      full-shape float32 ``y`` is float32, as in torch.
    - ``KEEP`` (``"keep"``): run at the operands' current dtypes, nothing cast:
      unary elementwise ops (``tanh``, ``logistic``, ``sqrt``, ...), integer
      powers ``x ** n`` for ``n >= 3`` (products; ``x ** 2`` and negative powers
      run in float32, as torch's ``pow``), shape ops,
      ``reduce_max``, ``sort``, collectives. An explicit ``convert_element_type`` in
      the function is kept as written; one that was a no-op when traced (a
      weak-type change) stays a no-op.
    - ``LOOKUP`` (``"lookup"``): ``gather``. ``KEEP``, except that rows gathered
      from a wider castable parameter table (an input or constant of the
      function of rank >= 2, by an index array: an embedding lookup) are rounded
      to ``dtype`` after the gather (the table itself is never cast), as Flax's
      ``nn.Embed(dtype=float16)`` gives; so the residual stream of a transformer
      starts in ``dtype``. torch's ``embedding`` returns float32.
    - ``FLOAT8`` (``"float8"``): ``dot_general`` under
      ``jxs.autocast(..., float8=recipe)``: a matmul without batch dimensions
      whose sizes reach the recipe's ``min_dim`` runs as a float8 matmul with
      per-tensor scales (operands in float8_e4m3fn, the gradient in
      float8_e5m2, output in ``dtype``; ``docs/float8.md``); any other
      ``dot_general`` is ``LOWER``. Only valid together with ``float8=`` (or
      ``plan=``): it names the rule object passed in, which runs in autocast's
      plug-in slot.
    - ``WIDE`` (``"wide"``): ``LOWER``, except that a ``dot_general`` whose
      result the function widens to float32 anyway (attention scores on their
      way to a softmax) accumulates and comes out in float32, in float16 and
      bfloat16 alike: scores finite up to float32's range, at twice the memory
      of 16-bit scores on a GPU. Under ``LOWER`` only a float16 product followed
      by a scalar scale is widened, and only until the scale has been applied
      (``docs/autocast.md``, attention). Opt in with
      ``rules={"dot_general": "wide"}``.
    - ``TRACED`` (``"traced"``): castable operands are cast back to the dtypes they
      had when the function was traced, so the primitive runs exactly as written.
      Primitives missing from the table get this rule, so do regions under
      ``jxs.autocast(f, enabled=False)``.

    Examples:
      >>> import jaxscale as jxs
      >>> jxs.AutocastRule("float32") is jxs.AutocastRule.FLOAT32
      True
      >>> str(jxs.AutocastRule.LOWER)
      'lower'
    """

    LOWER = "lower"
    FLOAT32 = "float32"
    PROMOTE = "promote"
    BIAS = "bias"
    KEEP = "keep"
    LOOKUP = "lookup"
    TRACED = "traced"
    FLOAT8 = "float8"
    WIDE = "wide"


class Slot(enum.StrEnum):
    """Table entries that are not rules a user names: where a rule object passed
    in to :func:`jaxscale.autocast` runs.

    ``PLUGIN``: the :class:`~jaxscale._autocast.classes.PluginRule` of
    ``float8=`` (a float8 recipe) or of ``plan=`` (a precision plan's sites);
    ``dot_general`` takes it, and so does every primitive ``rules`` gives the
    ``"float8"`` rule or the rule object itself.
    """

    PLUGIN = "plugin"


_LOWER = ("conv_general_dilated", "dot_general", "ragged_dot_general")

_FLOAT32 = (
    # Exponentials, logarithms, powers (torch CUDA: exp, expm1, log, log10, log2,
    # log1p, pow, reciprocal, rsqrt). ``square`` is torch's pow; ``integer_pow``
    # is "keep" (a product: x ** 3 is x * x * x) except for ``x ** 2`` (a square)
    # and negative exponents (reciprocals), which the interpreter runs in float32.
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "log2",  # a primitive from jax 0.12 (log before)
    "pow",
    "rsqrt",
    "square",
    # Trigonometric and hyperbolic functions of torch's CUDA fp32 list.
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    # Special functions (torch CUDA: erfinv; the others are series and asymptotic
    # expansions with float32 constants). Not erf and erfc: they are GELU's.
    "bessel_i0e",
    "bessel_i1e",
    "digamma",
    "erf_inv",
    "igamma",
    "igamma_grad_a",
    "igammac",
    "lgamma",
    "polygamma",
    "polynomial",  # jnp.polyval from jax 0.12: a power series, as torch's pow
    "random_gamma",
    "random_gamma_grad",
    "regularized_incomplete_beta",
    "zeta",
    # Sums and products (torch CUDA: sum, prod, cumsum, cumprod, logsumexp).
    "cumlogsumexp",
    "cumprod",
    "cumsum",
    "reduce_prod",
    "reduce_sum",
    # Linear algebra and FFTs (torch: linalg_*, fft_*, cholesky, ...).
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "eigh_jacobi",
    "fft",
    "geqp3",
    "geqrf",
    "hessenberg",
    "householder_product",
    "lu",
    "ormqr",
    "qr",
    "schur",
    "svd",
    "symmetric_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
)

_PROMOTE = (
    "add_any",
    "atan2",
    "clamp",
    "complex",
    "concatenate",
    "dynamic_update_slice",
    "eq",
    "eq_to",
    "ge",
    "gt",
    "le",
    "le_to",
    "lt",
    "lt_to",
    "max",
    "min",
    "ne",
    "nextafter",
    "pad",
    "rem",
    "scatter",
    "scatter-add",
    "scatter-max",
    "scatter-min",
    "scatter-mul",
    "scatter-sub",
    "select_and_gather_add",
    "select_and_scatter_add",
    "select_n",
    "stack",
)

_BIAS = ("add", "div", "mul", "sub")

_LOOKUP = ("gather",)

_KEEP = (
    # Unary elementwise ops that torch runs in the input's dtype.
    "abs",
    "acosh",
    "asinh",
    "atan",
    "atanh",
    "cbrt",
    "ceil",
    "conj",
    "cos",
    "erf",
    "erfc",
    "floor",
    "imag",
    "integer_pow",
    "is_finite",
    "logistic",
    "neg",
    "one_minus_square",  # jax 0.12: 1 - y * y, tanh's derivative
    "real",
    "reduce_precision",
    "round",
    "sign",
    "sin",
    "sqrt",
    "tanh",
    # Casts, shapes and data movement.
    "broadcast_in_dim",
    "convert_element_type",
    "copy",
    "dynamic_slice",
    "reshape",
    "rev",
    "slice",
    "split",
    "squeeze",
    "tile",
    "transpose",
    "unstack",
    "zeros_like",
    # Exact reductions, sorting, selection.
    "argmax",
    "argmin",
    "approx_top_k",
    "cummax",
    "cummin",
    "reduce_max",
    "reduce_min",
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window_sum",
    "sort",
    "top_k",
    # Scaled float8/float4 products (lax.scaled_dot): their operands are already
    # narrow, with their own scales; nothing to cast.
    "scaled_dot",
    # Identity-like ops, sharding and collectives: the values' dtypes pass through.
    "all_gather",
    "all_gather_done",
    "all_gather_invariant",
    "all_gather_reduced",
    "all_gather_reduced_start",
    "all_gather_start",
    "all_to_all",
    "all_to_all_done",
    "all_to_all_start",
    "debug_callback",
    "device_put",
    "layout_constraint",
    "name",  # jax.ad_checkpoint.checkpoint_name
    "optimization_barrier",
    "pbroadcast",
    "pbroadcast_done",
    "pbroadcast_dynamic",
    "pbroadcast_start",
    "pgather",
    "pmax",
    "pmin",
    "ppermute",
    "ppermute_done",
    "ppermute_start",
    "precv",
    "preduced",
    "psend",
    "psum",
    "psum_done",
    "psum_invariant",
    "psum_invariant_start",
    "psum_start",
    "pvary",
    "ragged_all_to_all",
    "reduce_scatter",
    "reduce_scatter_done",
    "reduce_scatter_start",
    "reshard",
    "sharding_constraint",
    "stop_gradient",
    "unreduced_pmax",
    "unreduced_pmin",
    "unreduced_psum",
    "unreduced_psum_start",
    "unreduced_reduce_scatter",
    "unreduced_reduce_scatter_start",
    "vary_unreduced_cast",
    "vary_unreduced_cast_p",  # its name in jax 0.10
)

# Run as traced on purpose: bit-level reinterpretation, user callbacks (they get the
# dtypes they were written for), and reductions with a user-written body.
_TRACED = (
    "bitcast_convert_type",
    "get",  # a mutable array's read and write: the value keeps the ref's dtype
    "swap",
    "io_callback",
    "pure_callback",
    "reduce",
    "reduce_window",
    "select_and_scatter",
)

# First-order primitives of jax (0.7 to 0.12) deliberately not in the table, each
# with why: they run at their inputs' dtypes (``"promote"`` if autocast made
# those differ). A test fails on a primitive of the installed jax that is neither
# here nor in the table, so a new one is a decision, not a silent default.
_NO_FLOATING_OPERAND = "no floating operand: nothing to cast"
_AT_THEIR_DTYPE = "creates values at the dtype it was traced with"
_HIGHER_ORDER_REWRITE = (
    "higher-order without a handler: rewritten without knowing its schema, or "
    "run as traced with an AutocastWarning"
)
_INTERNAL = "internal to a JAX transformation or to extended dtypes"
UNLISTED: Mapping[str, str] = types.MappingProxyType(
    {
        **dict.fromkeys(
            (
                "after_all",
                "and",
                "axis_index",
                "clz",
                "create_token",
                "iota",
                "iota_2x32_shape",
                "lu_pivots_to_permutation",
                "mulhi",
                "not",
                "or",
                "platform_index",
                "population_count",
                "random_bits",
                "random_clone",
                "random_fold_in",
                "random_seed",
                "random_split",
                "random_unwrap",
                "random_wrap",
                "reduce_and",
                "reduce_or",
                "reduce_xor",
                "rng_bit_generator",
                "shift_left",
                "shift_right_arithmetic",
                "shift_right_logical",
                "threefry2x32",
                "xor",
            ),
            _NO_FLOATING_OPERAND,
        ),
        **dict.fromkeys(("empty", "empty2", "rng_uniform"), _AT_THEIR_DTYPE),
        **dict.fromkeys(
            (
                "composite",
                "custom_lin",
                "custom_linear_solve",
                "eval_jaxpr",
                "for",
                "program_order",  # jax 0.11's jax.experimental.overlap
                "xla_pmap",
            ),
            _HIGHER_ORDER_REWRITE,
        ),
        **dict.fromkeys(
            (
                "bias_bwd",
                "bias_fwd",
                "dce_sink",
                "from_edtype",
                "stage",
                "tie",
                "to_edtype",
            ),
            _INTERNAL,
        ),
    }
)

_DEFAULT: Mapping[str, AutocastRule] = types.MappingProxyType(
    {
        **dict.fromkeys(_LOWER, AutocastRule.LOWER),
        **dict.fromkeys(_FLOAT32, AutocastRule.FLOAT32),
        **dict.fromkeys(_PROMOTE, AutocastRule.PROMOTE),
        **dict.fromkeys(_BIAS, AutocastRule.BIAS),
        **dict.fromkeys(_LOOKUP, AutocastRule.LOOKUP),
        **dict.fromkeys(_KEEP, AutocastRule.KEEP),
        **dict.fromkeys(_TRACED, AutocastRule.TRACED),
    }
)

# Higher-order primitives the interpreter recurses into, each with the construct
# it is (the key of its handler in ``jaxscale._autocast.hop.HANDLERS``): every
# name they have had from jax 0.7 to 0.12 ("pjit" is jit's older name,
# "checkpoint" and "remat2" are jax.checkpoint's, "core_call" and "eval_jaxpr"
# closed_call's older and newer ones) and the live primitives' names. Version
# facts, so they come from the adapter.
HIGHER_ORDER: Mapping[str, str] = types.MappingProxyType(dict(HIGHER_ORDER_NAMES))

_ACCEPTED = ", ".join(f"'{r.value}'" for r in AutocastRule)


def _rule_of(key: str, value: Any) -> AutocastRule:
    try:
        rule = AutocastRule(value)
    except ValueError:
        raise ValueError(
            f"`rules[{key!r}]` must be one of {_ACCEPTED} (or a "
            f"`jxs.AutocastRule`), got {value!r}."
        ) from None
    if key in HIGHER_ORDER and rule is not AutocastRule.TRACED:
        raise ValueError(
            f"`rules[{key!r}]`: `{key}` is a higher-order primitive; autocast "
            f"recurses into it, and the only override it accepts is 'traced' (run "
            f"it as traced), got {value!r}."
        )
    return rule


def resolve_rules(rules: Mapping[Any, Any] | None) -> dict[str, AutocastRule]:
    """The default table with ``rules`` (validated) laid over it."""
    table = dict(_DEFAULT)
    if rules is None:
        return table
    if not isinstance(rules, Mapping):
        hint = ""
        if isinstance(rules, type | str) or hasattr(rules, "itemsize"):
            hint = " (the table takes no dtype: it is the same for every dtype)"
        raise TypeError(
            "`rules` must be a mapping from primitive names (or primitives) to "
            f"rule names, such as {{'exp': 'keep'}}, got {type(rules).__name__}"
            f"{hint}."
        )
    for key, value in rules.items():
        name = key if isinstance(key, str) else getattr(key, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                "`rules` keys must be primitive names such as 'exp' or primitives "
                f"such as `jax.lax.exp_p`, got {key!r}."
            )
        table[name] = _rule_of(name, value)
    return table


def autocast_rules(
    rules: Mapping[Any, Any] | None = None,
) -> Mapping[str, AutocastRule]:
    """The table :func:`autocast` uses: primitive name to :class:`AutocastRule`.

    The table is the same for float16 and bfloat16, as torch's lists are. A
    primitive that is not in it (including one you define) runs at the dtypes it
    was traced with (``"traced"``); higher-order primitives (``jit``, ``scan``,
    ``while``, ``cond``, ``checkpoint``, custom derivatives, ``shard_map``) are not
    in it: autocast recurses into them. ``docs/autocast.md`` compares the table
    with torch's CUDA and CPU lists op by op.

    Args:
      rules: overrides, as passed to :func:`autocast`: primitive names (or
        primitives) to rule names (or :class:`AutocastRule` members). They are
        validated as :func:`autocast` does.

    Returns:
      A read-only mapping, sorted by primitive name.

    Raises:
      ValueError: for an unknown rule name, or a rule other than ``"traced"`` for
        a higher-order primitive.
      TypeError: if ``rules`` is not a mapping, or a key is neither a name nor a
        primitive.

    Examples:
      >>> import jaxscale as jxs
      >>> table = jxs.autocast_rules()
      >>> [str(table[name]) for name in ("dot_general", "exp", "add", "tanh")]
      ['lower', 'float32', 'bias', 'keep']
      >>> jxs.autocast_rules({"exp": "keep"})["exp"]
      <AutocastRule.KEEP: 'keep'>
    """
    table = resolve_rules(rules)
    return types.MappingProxyType(dict(sorted(table.items())))
