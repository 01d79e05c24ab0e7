"""The one adapter between jaxscale and JAX's private API and version differences.

Every ``jax._src`` import of the package and every shim over a difference
between JAX versions is here, so that a JAX upgrade touches one file. This is
the ground floor: it imports only JAX, NumPy and the standard library, nothing
of jaxscale. The touchpoints, and why each is needed:

- :func:`trace` (``jax._src.api_util``, ``linear_util``,
  ``interpreters.partial_eval``): trace a function to a ``ClosedJaxpr`` at
  abstract values that keep their shardings and varying manual axes
  (``jax.make_jaxpr`` takes ``ShapeDtypeStruct``-like arguments and loses
  them). The autocast handlers re-trace loop bodies, branches and ``jit``
  bodies at new dtypes with it.
- :func:`bind` (``Primitive.get_bind_params``, which returned
  ``(subfuns, params)`` in older JAX): bind a primitive with the parameters of
  a jaxpr equation, as ``jax.core.eval_jaxpr`` does.
- :func:`eqn_context` (``jax._src.source_info_util``): emit an equation's
  replacement under its name stack and traceback, so profiles and errors point
  at the user's code.
- :func:`user_frame` and :func:`name_stack_text` (``source_info_util``, whose
  ``user_frame`` took the ``SourceInfo`` in older JAX): where an equation comes
  from, for :func:`jaxscale.autocast_report`.
- :func:`instantiate_zeros` (``jax._src.ad_util``, ``interpreters.ad``): a
  ``custom_vjp`` backward may return symbolic zero cotangents, which a traced
  jaxpr cannot hold.
- :func:`ct_aval` (``to_ct_aval``, ``to_tangent_aval`` before it): the
  cotangent type of a ``custom_vjp`` output.
- :func:`custom_jvp_rule` (``jvp_jaxpr_fun``, ``jvp_jaxpr_thunk`` before it):
  the JVP rule of a ``custom_jvp_call`` equation.
- :data:`shard_map` (``jax.shard_map``, absent before JAX 0.7): ``None`` where
  missing, and autocast runs a ``shard_map`` as traced.
- :func:`convert_weak` (``jax._src.lax.lax._convert_element_type``): give a
  value a weak type back (``lax.convert_element_type`` cannot), so an output
  keeps the weak type its function gave it and a jitted step does not retrace.
- :func:`mark_varying` (``lax.pcast(..., to="varying")``, ``lax.pvary``
  before JAX 0.10): mark a value as varying over ``shard_map`` axes.
- :func:`varying_axes` (``aval.manual_axis_type.varying`` from JAX 0.10,
  ``aval.vma`` before): the ``shard_map`` axes a value varies over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax._src import ad_util, api_util, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax.extend import core as jcore

__all__ = [
    "bind",
    "convert_weak",
    "ct_aval",
    "custom_jvp_rule",
    "eqn_context",
    "instantiate_zeros",
    "mark_varying",
    "name_stack_text",
    "shard_map",
    "trace",
    "user_frame",
    "varying_axes",
]


def trace(fn: Callable[..., Sequence[Any]], avals: Sequence[Any]) -> Any:
    """``fn`` traced to a ``ClosedJaxpr`` at abstract values ``avals`` (which keep
    their shardings and varying manual axes, unlike ``ShapeDtypeStruct``)."""
    debug = api_util.debug_info("jaxscale.autocast", fn, tuple(avals), {})
    traced = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=debug), list(avals))
    return jcore.ClosedJaxpr(traced[0], traced[2])  # (jaxpr, out_avals, consts, ...)


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


def instantiate_zeros(ct: Any) -> Any:
    """A cotangent, a symbolic zero made an array of zeros."""
    return ad.instantiate_zeros(ct) if isinstance(ct, ad_util.Zero) else ct


def ct_aval(aval: Any) -> Any:
    """The abstract value of the cotangent of a value of type ``aval``."""
    to_ct = getattr(aval, "to_ct_aval", None) or aval.to_tangent_aval
    return to_ct()


def custom_jvp_rule(params: Mapping[str, Any]) -> Any:
    """The JVP rule (a ``lu.WrappedFun`` giving ``(jaxpr, consts, out_zeros)``) of a
    ``custom_jvp_call`` equation's parameters, or ``None``."""
    return params.get("jvp_jaxpr_fun", params.get("jvp_jaxpr_thunk"))


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
