"""The one adapter between jaxscale and JAX: private API, equation schemas and
version differences.

Every ``jax._src`` import of the package, every read of a jaxpr equation's
parameters and every shim over a difference between JAX versions is here, so
that a JAX upgrade touches one file (a test fails on ``eqn.params[...]``,
``.params.get(`` or ``jax._src`` anywhere else). The rest of the package asks
this module structural questions: which construct a higher-order primitive is
(:func:`construct_of`, by primitive object, so that a rename such as
``closed_call`` -> ``eval_jaxpr`` follows), a scan's consts/carry/xs split
(:func:`scan_parts`), a ``custom_vjp``'s forward and backward results
(:class:`CustomVjpParts`), a jaxpr's inputs (:func:`close`), ``shard_map``'s axes
(:func:`shard_map_parts`), the sub-jaxprs of an equation it knows nothing about
(:func:`subjaxprs`, for the schema-free rewrite). Each accessor returns ``None``
when the equation's parameters are not ones it understands.

The version differences it absorbs (jax 0.7.0 to 0.12.0.1):

- ``scan``: ``num_consts``/``num_carry`` until 0.10, a FlatTree ``ft_in``
  (``unpack()`` gives consts, carry and xs) from 0.11 (jax-ml/jax#39005); the
  counts are also derived from the types when neither is there.
- ``custom_vjp``: the backward returns ``(cotangents, logs)`` from 0.11.1
  (#39646), a list before.
- Open jaxprs (a ``custom_vjp`` forward, a ``custom_jvp`` rule) carry their
  constants as ``constvars`` until 0.11.0 and as leading ``invars`` from 0.11.1
  (#39323); ``ClosedJaxpr`` is an alias of ``Jaxpr`` from 0.11.
- ``closed_call``/``core_call`` are one primitive named ``eval_jaxpr`` from
  0.11.1 (#39593).
- ``shard_map``'s manual axes are ``manual_axes`` until 0.10.1 and
  ``newly_manual_axes`` from 0.10.2.
- ``Primitive.get_bind_params`` returned ``(subfuns, params)`` before 0.8;
  ``source_info_util.user_frame`` took the ``SourceInfo``; the cotangent type
  was ``to_tangent_aval``; a ``custom_jvp``'s rule was ``jvp_jaxpr_thunk``;
  ``lax.pcast`` was ``lax.pvary`` and a value's varying axes ``aval.vma``
  before 0.10.
- The manual axes in scope (:func:`manual_axes`): the abstract mesh's
  ``manual_axes``, and whether ``shard_map`` checks them
  (``config._check_vma``, a private flag in every version from 0.7.0).
- A value closed over from an enclosing trace (:func:`enclosing_trace`,
  :func:`binding_at`): a tracer's ``_trace``, the trace in progress
  ``core.trace_ctx.trace`` and ``core.set_current_trace``, the same from 0.7.0
  to 0.12.

This is the ground floor: it imports only JAX and the standard library,
nothing of jaxscale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax import lax
from jax._src import ad_util, api_util, config, source_info_util
from jax._src import core as _core
from jax._src import linear_util as lu
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax.extend import core as jcore

__all__ = [
    "CustomJvpParts", "CustomVjpParts", "HIGHER_ORDER_NAMES", "RematParts",
    "ScanParts", "ShardMapParts", "WhileParts", "bind", "binding_at",
    "branch_platforms", "broadcast_dimensions", "call_body", "call_like_body",
    "close", "combiner", "cond_branches", "construct_of", "conv_dimension_numbers",
    "convert_target",
    "convert_weak", "ct_aval", "custom_jvp_parts", "custom_vjp_parts",
    "dot_dimension_numbers", "dot_precision", "enclosing_trace", "eqn_context",
    "integer_pow_exponent", "jit_body", "jit_name", "manual_axes", "mark_varying",
    "name_stack_text", "opaque_functions", "preferred_element_type", "rebind",
    "reduction_axes", "remat_parts", "replace_subjaxprs", "scan_parts", "shard_map",
    "shard_map_parts", "subjaxprs", "trace", "user_frame", "varying_axes",
    "while_parts", "with_combiner", "with_preferred_element_type",
]  # fmt: skip

# --------------------------------------------------------------------------- #
# Tracing and binding
# --------------------------------------------------------------------------- #


def trace(fn: Callable[..., Sequence[Any]], avals: Sequence[Any]) -> Any:
    """``fn`` traced to a closed jaxpr at abstract values ``avals`` (which keep
    their shardings and varying manual axes, unlike ``ShapeDtypeStruct``)."""
    debug = api_util.debug_info("jaxscale.autocast", fn, tuple(avals), {})
    traced = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=debug), list(avals))
    return jcore.ClosedJaxpr(traced[0], traced[2])  # (jaxpr, out_avals, consts, ...)


def close(jaxpr: Any, consts: Sequence[Any] = ()) -> Any:
    """``jaxpr`` (open or closed) as a closed jaxpr whose inputs are exactly its
    arguments, ``consts`` attached to the constant inputs: ``constvars`` before
    JAX 0.11.1, the leading ``invars`` from then on (#39323)."""
    consts = list(consts)
    if not consts:
        if isinstance(jaxpr, jcore.ClosedJaxpr):
            return jaxpr
        return jcore.ClosedJaxpr(jaxpr, [])
    if len(jaxpr.constvars) == len(consts):
        return jcore.ClosedJaxpr(getattr(jaxpr, "jaxpr", jaxpr), consts)
    if not jaxpr.constvars and hasattr(jaxpr, "with_consts"):
        return jaxpr.with_consts(consts)  # jax >= 0.11.1: consts lead invars
    raise TypeError(
        f"jaxpr with {len(jaxpr.constvars)} constant inputs given {len(consts)} "
        "constants: a JAX version jaxscale does not know."
    )


def bind(primitive: Any, params: Mapping[str, Any], vals: Sequence[Any]) -> list[Any]:
    """Bind ``primitive`` on ``vals`` with the parameters of a jaxpr equation, as
    ``jax.core.eval_jaxpr`` does; always a list of outputs."""
    params = primitive.get_bind_params(params)
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
        out = primitive.bind(*subfuns, *vals, **params)
    else:
        out = primitive.bind(*vals, **params)
    return list(out) if primitive.multiple_results else [out]


def rebind(eqn: Any, vals: Sequence[Any], **replace: Any) -> list[Any]:
    """``eqn``'s primitive bound on ``vals`` with its parameters, some replaced
    (``branches=``, ``jaxpr=``): every other parameter is kept as traced."""
    return bind(eqn.primitive, {**eqn.params, **replace}, vals)


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """Emit under ``eqn``'s name stack and traceback (as ``jax.core.eval_jaxpr``
    does), so profiles and errors point at the user's code."""
    names = source_info_util.current_name_stack() + eqn.source_info.name_stack
    ctx = getattr(eqn.ctx, "manager", None) or contextlib.nullcontext()
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=names):
        with ctx:
            yield


def user_frame(eqn: Any) -> Any:
    """The innermost frame outside JAX that created ``eqn`` (``file_name``,
    ``start_line``), or ``None``."""
    try:
        return source_info_util.user_frame(eqn.source_info.traceback)
    except (AttributeError, TypeError):  # older jax: takes the SourceInfo
        return source_info_util.user_frame(eqn.source_info)


def name_stack_text(entries: Sequence[Any]) -> str:
    """Name-stack entries as JAX prints them (``jvp(CNN)/Conv_0``); ``""`` if
    none of them is a scope (only transformations)."""
    if not any(isinstance(s, source_info_util.Scope) for s in entries):
        return ""
    return str(source_info_util.NameStack(stack=tuple(entries)))


# --------------------------------------------------------------------------- #
# Higher-order primitives: which construct each is
# --------------------------------------------------------------------------- #

_P = jcore.primitives


def _remat_primitive() -> Any:
    p = getattr(_P, "remat_p", None)
    if p is None:  # jax < 0.8: not in jax.extend
        from jax._src import ad_checkpoint

        p = ad_checkpoint.remat_p
    return p


def _shard_map_primitive() -> Any:
    from jax._src import shard_map as sm

    return sm.shard_map_p


# Primitive object -> construct (by identity: a renamed primitive follows).
_BY_PRIMITIVE: dict[int, tuple[Any, str]] = {
    id(p): (p, c)
    for p, c in [
        (_P.call_p, "call"),
        (_P.closed_call_p, "call"),
        (_P.cond_p, "cond"),
        (_P.custom_jvp_call_p, "custom_jvp"),
        (_P.custom_vjp_call_p, "custom_vjp"),
        (_P.jit_p, "jit"),
        (_remat_primitive(), "remat"),
        (_P.scan_p, "scan"),
        (_shard_map_primitive(), "shard_map"),
        (_P.while_p, "while"),
    ]
}

# Every name a higher-order primitive jaxscale understands has had from JAX 0.7
# to 0.12 (``rules=`` keys), with the construct it is; the live primitives'
# names are added, so a rename is a name here too.
HIGHER_ORDER_NAMES: Mapping[str, str] = {
    "checkpoint": "remat",
    "closed_call": "call",
    "cond": "cond",
    "core_call": "call",
    "custom_jvp_call": "custom_jvp",
    "custom_vjp_call": "custom_vjp",
    "eval_jaxpr": "call",
    "jit": "jit",
    "pjit": "jit",
    "remat2": "remat",
    "scan": "scan",
    "shard_map": "shard_map",
    "while": "while",
    **{p.name: c for p, c in _BY_PRIMITIVE.values()},
}


def construct_of(primitive: Any) -> str | None:
    """The construct (``"scan"``, ``"call"``, ...) a higher-order primitive is,
    by primitive object (a renamed primitive follows, and a user's primitive
    named like one is not one); ``None`` for any other."""
    hit = _BY_PRIMITIVE.get(id(primitive))
    return hit[1] if hit is not None and hit[0] is primitive else None


def _has(params: Mapping[str, Any], *keys: str) -> bool:
    return all(k in params for k in keys)


# --------------------------------------------------------------------------- #
# Structural facts of each construct (None: parameters not understood)
# --------------------------------------------------------------------------- #


def jit_name(eqn: Any) -> str:
    """The name of a ``jit`` equation (its function's ``__name__``), or ``""``."""
    return str(eqn.params.get("name", ""))


def jit_body(eqn: Any) -> Any:
    """The closed jaxpr of a ``jit`` equation (re-bound with ``jaxpr=``)."""
    body = eqn.params.get("jaxpr")
    return None if body is None else close(body)


def call_body(eqn: Any) -> Any:
    """The closed jaxpr a call-like equation (``closed_call``, ``core_call``,
    ``eval_jaxpr``) evaluates."""
    p = eqn.params
    body = p.get("call_jaxpr", p.get("jaxpr"))
    return close(body) if _is_jaxpr(body) else None


class RematParts(NamedTuple):
    """A ``checkpoint`` (remat) equation: its body and ``jax.checkpoint``'s
    arguments."""

    body: Any
    prevent_cse: bool
    policy: Any


def remat_parts(eqn: Any) -> RematParts | None:
    p = eqn.params
    if not _has(p, "jaxpr", "prevent_cse", "policy"):
        return None
    return RematParts(close(p["jaxpr"]), p["prevent_cse"], p["policy"])


class ScanParts(NamedTuple):
    """A ``scan`` equation: ``body`` maps (consts, carry, x) to (carry, y); its
    operands are ``num_consts`` consts, ``num_carry`` carries, then the xs."""

    body: Any
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def _scan_split_from_types(eqn: Any, body: Any, length: int) -> tuple[int, int] | None:
    """(consts, carry) counts that the types admit, if exactly one split does:
    consts and carries have the body's input types, carries its first output
    types, xs and ys a leading axis of ``length``."""
    ins, outs = body.in_avals, body.out_avals
    ops = [v.aval for v in eqn.invars]
    res = [v.aval for v in eqn.outvars]
    n = len(ops)

    def same(a: Any, b: Any) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype

    def stacked(a: Any, b: Any) -> bool:
        return a.shape == (length, *b.shape) and a.dtype == b.dtype

    found = []
    for nc in range(n + 1):
        for nk in range(n - nc + 1):
            if nk > len(outs) or len(res) != len(outs):
                continue
            if (
                all(same(ops[i], ins[i]) for i in range(nc + nk))
                and all(same(ins[nc + j], outs[j]) for j in range(nk))
                and all(stacked(ops[i], ins[i]) for i in range(nc + nk, n))
                and all(stacked(res[j], outs[j]) for j in range(nk, len(outs)))
            ):
                found.append((nc, nk))
    return found[0] if len(found) == 1 else None


def scan_parts(eqn: Any) -> ScanParts | None:
    p = eqn.params
    if not _has(p, "jaxpr", "length", "reverse"):
        return None
    body, length = close(p["jaxpr"]), p["length"]
    split: tuple[int, int] | None = None
    if _has(p, "num_consts", "num_carry"):  # jax < 0.11
        split = (p["num_consts"], p["num_carry"])
    elif hasattr(p.get("ft_in"), "unpack"):  # jax >= 0.11: FlatTree parts
        try:
            consts, carry, _ = p["ft_in"].unpack()
            split = (len(consts), len(carry))
        except (AssertionError, TypeError, ValueError):
            split = None
    if split is None:
        split = _scan_split_from_types(eqn, body, length)
    if split is None or len(body.in_avals) != len(eqn.invars):
        return None
    return ScanParts(body, *split, length, p["reverse"], p.get("unroll", 1))


class WhileParts(NamedTuple):
    """A ``while`` equation: ``cond``'s and ``body``'s consts lead its operands."""

    cond: Any
    body: Any
    cond_nconsts: int
    body_nconsts: int


def while_parts(eqn: Any) -> WhileParts | None:
    p = eqn.params
    if not _has(p, "cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"):
        return None
    return WhileParts(
        close(p["cond_jaxpr"]),
        close(p["body_jaxpr"]),
        p["cond_nconsts"],
        p["body_nconsts"],
    )


def cond_branches(eqn: Any) -> tuple[Any, ...] | None:
    """The closed branches of a ``cond`` equation (operands: the index, then the
    branches' arguments); re-bound with ``rebind(eqn, vals, branches=...)``."""
    branches = eqn.params.get("branches")
    return None if branches is None else tuple(close(b) for b in branches)


def branch_platforms(eqn: Any) -> tuple[Any, ...] | None:
    """The platforms of each branch of a ``cond`` made by
    ``lax.platform_dependent`` (``(("cuda",), None)``: ``None`` the default),
    of which lowering keeps one; ``None`` for any other ``cond``."""
    return eqn.params.get("branches_platforms")


class CustomJvpParts(NamedTuple):
    """A ``custom_jvp_call``: ``call`` the primal (consts first), ``rule(n)``
    the JVP rule for ``n`` primals as a closed jaxpr of (primals, tangents) and
    which output tangents are symbolic zeros."""

    call: Any
    num_consts: int
    rule: Callable[[int], tuple[Any, list[bool]]]


def custom_jvp_parts(eqn: Any) -> CustomJvpParts | None:
    p = eqn.params
    fun = p.get("jvp_jaxpr_fun", p.get("jvp_jaxpr_thunk"))
    if fun is None or not _has(p, "call_jaxpr", "num_consts"):
        return None

    def rule(n: int) -> tuple[Any, list[bool]]:
        jaxpr, consts, out_zeros = fun.call_wrapped(*[False] * n)
        return close(jaxpr, consts), list(out_zeros)

    return CustomJvpParts(close(p["call_jaxpr"]), p["num_consts"], rule)


class CustomVjpParts(NamedTuple):
    """A ``custom_vjp_call``: ``call`` the primal (consts first);
    ``forward(n)`` the forward rule for ``n`` primals as a closed jaxpr giving
    (its own residuals, primal outputs); ``residuals()``, after ``forward``, the
    number of primal outputs and, per residual, the index of the input it is
    (or ``None`` for one of the forward's own); ``backward(args)`` the
    cotangents of the primals (no symbolic zeros), from (residuals, output
    cotangents)."""

    call: Any
    num_consts: int
    forward: Callable[[int], Any]
    residuals: Callable[[], tuple[int, list[int | None]]]
    backward: Callable[[Sequence[Any]], list[Any]]


def custom_vjp_parts(eqn: Any) -> CustomVjpParts | None:
    p = eqn.params
    keys = ("call_jaxpr", "num_consts", "fwd_jaxpr_thunk", "bwd", "out_trees")
    if not _has(p, *keys):
        return None
    fwd, bwd, out_trees = p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]

    def forward(n: int) -> Any:
        jaxpr, consts = fwd.call_wrapped(*[True] * n)
        return close(jaxpr, consts)

    def residuals() -> tuple[int, list[int | None]]:
        out_tree, _, forwards = out_trees()
        return out_tree.num_leaves, list(forwards)

    def backward(args: Sequence[Any]) -> list[Any]:
        cts = bwd.call_wrapped(*args)
        if isinstance(cts, tuple) and len(cts) == 2 and isinstance(cts[0], list):
            cts = cts[0]  # jax >= 0.11.1: (cotangents, logs)
        return [_instantiate_zeros(c) for c in cts]

    return CustomVjpParts(
        close(p["call_jaxpr"]), p["num_consts"], forward, residuals, backward
    )


def call_like_body(eqn: Any) -> Any:
    """The closed body of a call-like equation (``jit``, a call,
    ``checkpoint``, a custom derivative's function), whose inputs and outputs
    are the equation's, one to one; ``None`` for any other."""
    construct = construct_of(eqn.primitive)
    if construct == "jit":
        return jit_body(eqn)
    if construct == "call":
        return call_body(eqn)
    parts = {
        "remat": remat_parts,
        "custom_jvp": custom_jvp_parts,
        "custom_vjp": custom_vjp_parts,
    }.get(construct, lambda _: None)(eqn)
    if parts is None:
        return None
    return parts.body if construct == "remat" else parts.call


class ShardMapParts(NamedTuple):
    """A ``shard_map`` equation, as ``jax.shard_map``'s arguments
    (``axes`` is its ``axis_names``)."""

    body: Any
    mesh: Any
    in_specs: tuple[Any, ...]
    out_specs: tuple[Any, ...]
    check_vma: bool
    axes: Any


def shard_map_parts(eqn: Any) -> ShardMapParts | None:
    p = eqn.params
    if not _has(p, "jaxpr", "mesh", "in_specs", "out_specs", "check_vma"):
        return None
    axes = p.get("newly_manual_axes", p.get("manual_axes"))  # >= 0.10.2, before
    if axes is None:
        return None
    return ShardMapParts(
        close(p["jaxpr"]),
        p["mesh"],
        tuple(p["in_specs"]),
        tuple(p["out_specs"]),
        p["check_vma"],
        axes,
    )


# --------------------------------------------------------------------------- #
# Any other higher-order primitive: its sub-jaxprs, schema-free
# --------------------------------------------------------------------------- #

SubJaxpr = tuple[str, int | None, Any]  # (parameter, index in a tuple or None, jaxpr)


def _is_jaxpr(v: Any) -> bool:
    return isinstance(v, jcore.Jaxpr | jcore.ClosedJaxpr)


def subjaxprs(eqn: Any) -> list[SubJaxpr]:
    """Every jaxpr among ``eqn``'s parameters (directly, or in a tuple or
    list), closed, with where it was."""
    found: list[SubJaxpr] = []
    for key, value in eqn.params.items():
        if _is_jaxpr(value):
            found.append((key, None, close(value)))
        elif isinstance(value, tuple | list):
            found += [(key, i, close(v)) for i, v in enumerate(value) if _is_jaxpr(v)]
    return found


def opaque_functions(eqn: Any) -> list[str]:
    """The parameters of ``eqn`` that are functions staged out of sight (a
    ``lu.WrappedFun`` or a callable that traces later): not rewritable."""
    return [
        k
        for k, v in eqn.params.items()
        if hasattr(v, "call_wrapped") or (callable(v) and not _is_jaxpr(v))
    ]


def _like(old: Any, new: Any) -> Any:
    """``new`` (closed) in the form of ``old``: open if ``old`` was open;
    ``None`` if ``new`` closes over constants ``old`` had no place for."""
    old_consts = getattr(old, "consts", None)
    if isinstance(old, jcore.ClosedJaxpr) and old_consts:
        return new
    if new.consts:
        return None  # the primitive's schema has no place for new constants
    return new if isinstance(old, jcore.ClosedJaxpr) else new.jaxpr


def replace_subjaxprs(
    eqn: Any, new: Mapping[tuple[str, int | None], Any]
) -> dict[str, Any] | None:
    """``eqn``'s parameters with the sub-jaxprs at ``new``'s places replaced,
    each in its original form (open or closed); ``None`` if one cannot be."""
    params = dict(eqn.params)
    for (key, index), closed in new.items():
        if index is None:
            params[key] = _like(params[key], closed)
            if params[key] is None:
                return None
        else:
            items = list(params[key])
            items[index] = _like(items[index], closed)
            if items[index] is None:
                return None
            kind = type(params[key])
            # A named tuple (custom_linear_solve's jaxprs) takes its fields.
            params[key] = kind(*items) if hasattr(kind, "_fields") else kind(items)
    return params


# --------------------------------------------------------------------------- #
# First-order parameters
# --------------------------------------------------------------------------- #


def broadcast_dimensions(eqn: Any) -> tuple[int, ...]:
    """Where a ``broadcast_in_dim`` puts each axis of its operand."""
    return tuple(int(a) for a in eqn.params["broadcast_dimensions"])


def reduction_axes(eqn: Any) -> tuple[int, ...]:
    """The ``axes`` of a reduction (``reduce_max``, ``reduce_sum``...), as ints."""
    return tuple(int(a) for a in eqn.params.get("axes", ()))


def dot_dimension_numbers(params: Mapping[str, Any]) -> Any:
    """``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` of a
    ``dot_general``."""
    return params["dimension_numbers"]


def conv_dimension_numbers(params: Mapping[str, Any]) -> Any:
    """``(lhs_spec, rhs_spec, out_spec)`` of a ``conv_general_dilated``: each
    the axes of batch (or output features), features, then spatial."""
    return tuple(params["dimension_numbers"])


def preferred_element_type(params: Mapping[str, Any]) -> Any:
    """A dot's or convolution's ``preferred_element_type`` (or ``None``)."""
    return params.get("preferred_element_type")


def dot_precision(params: Mapping[str, Any]) -> Any:
    """A dot's ``precision``: ``None``, ``lax.Precision`` values or a
    ``lax.DotAlgorithmPreset`` (``F16_F16_F32``...)."""
    return params.get("precision")


def with_preferred_element_type(params: Mapping[str, Any], dtype: Any) -> dict:
    return dict(params, preferred_element_type=dtype)


def integer_pow_exponent(params: Mapping[str, Any]) -> int:
    return params["y"]


def convert_target(params: Mapping[str, Any]) -> Any:
    """The dtype a ``convert_element_type`` converts to."""
    return params["new_dtype"]


def combiner(params: Mapping[str, Any]) -> Any:
    """A scatter's combiner as a closed jaxpr, or ``None``."""
    update, consts = params.get("update_jaxpr"), params.get("update_consts", ())
    return None if update is None else jcore.ClosedJaxpr(update, list(consts))


def with_combiner(params: Mapping[str, Any], closed: Any) -> dict:
    return dict(params, update_jaxpr=closed.jaxpr, update_consts=tuple(closed.consts))


# --------------------------------------------------------------------------- #
# Autodiff, sharding and dtype shims
# --------------------------------------------------------------------------- #


def _instantiate_zeros(ct: Any) -> Any:
    """A cotangent, a symbolic zero made an array of zeros."""
    return ad.instantiate_zeros(ct) if isinstance(ct, ad_util.Zero) else ct


def ct_aval(aval: Any) -> Any:
    """The abstract value of the cotangent of a value of type ``aval``."""
    to_ct = getattr(aval, "to_ct_aval", None) or aval.to_tangent_aval
    return to_ct()


# ``jax.shard_map``, or ``None`` before JAX 0.7 (``jax.experimental.shard_map``).
shard_map: Callable[..., Any] | None = getattr(jax, "shard_map", None)


def convert_weak(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` with a weak type, as a Python scalar's."""
    return lax_internal._convert_element_type(x, dtype, weak_type=True)


def mark_varying(x: Any, axes: tuple[str, ...]) -> Any:
    """``x`` marked as varying over the ``shard_map`` axes ``axes``."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # jax < 0.10


def varying_axes(aval: Any) -> tuple[str, ...]:
    """The ``shard_map`` axes along which a value (or its type) varies."""
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    axes = manual.varying if manual is not None else getattr(aval, "vma", ())
    return tuple(sorted(axes or ()))


def manual_axes() -> tuple[tuple[str, ...], bool]:
    """The manual (``shard_map``) mesh axes of the trace in progress, sorted,
    and whether their varying types are checked (``check_vma``): ``((),
    False)`` outside ``shard_map``."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(sorted(getattr(mesh, "manual_axes", ()) or ()))
    checked = getattr(config, "_check_vma", None)
    return axes, bool(axes and checked is not None and checked.value)


def enclosing_trace(x: Any) -> Any:
    """The trace ``x`` belongs to, when ``x`` is a tracer of a trace other
    than the one in progress (a value a loop body closes over, say); else
    ``None``."""
    trace = getattr(x, "_trace", None)
    if not isinstance(x, _core.Tracer) or trace is None:
        return None
    return None if trace is _core.trace_ctx.trace else trace


@contextlib.contextmanager
def binding_at(trace: Any) -> Iterator[None]:
    """Operations run inside bind at ``trace`` (``None``: where they would):
    computed there, outside the loop body being traced, and closed over."""
    if trace is None:
        yield
        return
    with _core.set_current_trace(trace):
        yield
