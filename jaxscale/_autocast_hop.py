"""Higher-order primitives under :func:`jaxscale.autocast`.

Each handler evaluates the sub-computations of one higher-order primitive with the
interpreter and binds it again, keeping its semantics:

- ``jit`` is re-bound with its jaxpr re-traced at the new dtypes (shardings,
  donation and the name are kept); ``closed_call`` is inlined.
- ``scan`` and ``while`` go through ``lax.scan`` / ``lax.while_loop``. A loop carry
  keeps the dtype it was traced with, or the incoming value's dtype if that is
  wider: the carry is cast to it on the way in and after every iteration.
- ``cond`` goes through ``lax.switch``; each output takes the widest dtype any
  branch gives it.
- ``checkpoint`` (remat) goes through ``jax.checkpoint`` with the same policy.
- ``custom_jvp_call`` and ``custom_vjp_call`` are rebuilt as ``jax.custom_jvp`` /
  ``jax.custom_vjp`` functions whose primal, JVP, forward and backward are the
  original rules' jaxprs evaluated by the interpreter: the custom derivatives are
  kept, and the backward runs in the dtypes its forward used.
- ``shard_map`` goes through ``jax.shard_map`` with the same mesh and specs.

``HANDLERS`` is derived from :data:`jaxscale._autocast_rules.HIGHER_ORDER`, the
one list of higher-order primitive names, through the construct each name is.
A handler returns ``None`` when the equation's parameters are not the ones it
knows (another jax version); the interpreter then runs the primitive as traced,
with an :class:`~jaxscale.AutocastWarning`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jaxscale._autocast_interp import Interpreter
from jaxscale._autocast_rules import HIGHER_ORDER
from jaxscale._autocast_values import (
    Info,
    cast,
    dtype_of,
    fresh_info,
    is_castable,
    size_of,
    widest,
)
from jaxscale._float8_site import broadcast_max, suspended
from jaxscale._jax_private import (
    ct_aval,
    custom_jvp_rule,
    instantiate_zeros,
    shard_map,
    trace,
)

__all__ = ["BY_CONSTRUCT", "HANDLERS"]

Result = tuple[list[Any], list[Info]] | None


def _has(params: Any, *keys: str) -> bool:
    return all(k in params for k in keys)


def _default_infos(outs: Sequence[Any]) -> list[Info]:
    return [fresh_info(o) for o in outs]


def _retrace(
    it: Interpreter, closed: Any, vals: Sequence[Any], infos: Sequence[Info]
) -> tuple[Any, list[Info]]:
    """``closed`` evaluated by ``it`` on values like ``vals``, as a new jaxpr."""
    box: list[list[Info]] = []

    def fn(*xs: Any) -> list[Any]:
        outs, out_infos = it.eval_closed(closed, xs, infos)
        box.append(out_infos)
        return outs

    return trace(fn, [jax.typeof(v) for v in vals]), box[-1]


def _carry_dtypes(traced: Sequence[Any], init: Sequence[Any]) -> list[np.dtype]:
    """A carry keeps its traced dtype, or the incoming dtype if that is wider."""
    out = []
    for aval, v in zip(traced, init, strict=True):
        t, d = aval.dtype, dtype_of(v)
        out.append(widest([t, d]) if is_castable(t) and is_castable(d) else d)
    return out


def _threads_state(it: Interpreter) -> bool:
    """Float8 sites read delayed-scaling state arrays (tracers of the caller)."""
    return it.float8 is not None and it.float8.threads_state


def _jit(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    if not _has(eqn.params, "jaxpr"):
        return None
    if _threads_state(it):  # inlined: its float8 sites read the caller's state
        return it.eval_closed(eqn.params["jaxpr"], vals, infos)
    new, out_infos = _retrace(it, eqn.params["jaxpr"], vals, infos)
    outs = eqn.primitive.bind(*vals, **dict(eqn.params, jaxpr=new))
    return list(outs), out_infos


def _closed_call(
    it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]
) -> Result:
    call = eqn.params.get("call_jaxpr")
    if isinstance(call, jcore.ClosedJaxpr):
        return it.eval_closed(call, vals, infos)
    if isinstance(call, jcore.Jaxpr):
        return it.eval_jaxpr(call, (), vals, infos)
    return None


def _remat(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    p = eqn.params
    if not _has(p, "jaxpr", "prevent_cse", "policy"):
        return None
    jaxpr = p["jaxpr"]
    closed = jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else None

    def body(*xs: Any) -> list[Any]:
        if closed is not None:
            return it.eval_closed(closed, xs, infos)[0]
        return it.eval_jaxpr(jaxpr, (), xs, infos)[0]

    fn = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])
    outs = fn(*vals)
    return list(outs), _default_infos(outs)


def _scan(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    p = eqn.params
    if not _has(p, "jaxpr", "num_consts", "num_carry", "length", "reverse"):
        return None
    body, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    dts = _carry_dtypes(body.in_avals[nc : nc + nk], init)
    carry_infos = [fresh_info(v) for v in init]
    x_infos = [
        Info(len(np.shape(x)) - 1, i.param, False, size_of(x) // max(p["length"], 1))
        for x, i in zip(xs, infos[nc + nk :], strict=True)
    ]
    body_infos = [*infos[:nc], *carry_infos, *x_infos]
    ctx = it.float8
    threads = _threads_state(it)
    first = len(ctx.seen) if ctx is not None else 0
    states = ctx.state[first:] if threads else []
    # Delayed float8 state of the sites from here on, one copy per iteration:
    # its transpose is a max over iterations (a site's amax over the loop).
    per_iter = [broadcast_max(tuple(states), p["length"])] if threads else []

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        if ctx is not None:
            ctx.restart_at(first)  # the body may be traced more than once
        if threads:
            *x, mine = x
            saved, ctx.state = ctx.state, [*ctx.state[:first], *mine]
        try:
            outs, _ = it.eval_closed(body, [*consts, *carry, *x], body_infos)
        finally:
            if threads:
                ctx.state = saved
        return [cast(o, d) for o, d in zip(outs[:nk], dts, strict=True)], outs[nk:]

    carry, ys = lax.scan(
        step,
        [cast(v, d) for v, d in zip(init, dts, strict=True)],
        [*xs, *per_iter],
        length=p["length"],
        reverse=p["reverse"],
        unroll=p.get("unroll", 1),
    )
    outs = [*carry, *ys]
    return outs, _default_infos(outs)


def _while(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    p = eqn.params
    if not _has(p, "cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"):
        return None
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
    cinfos, binfos = infos[:cn], infos[cn : cn + bn]
    dts = _carry_dtypes(p["body_jaxpr"].in_avals[bn:], init)
    carry_infos = [fresh_info(v) for v in init]

    def cond(carry: list[Any]) -> Any:
        outs, _ = it.eval_closed(
            p["cond_jaxpr"], [*cconsts, *carry], [*cinfos, *carry_infos]
        )
        return outs[0]

    def body(carry: list[Any]) -> list[Any]:
        outs, _ = it.eval_closed(
            p["body_jaxpr"], [*bconsts, *carry], [*binfos, *carry_infos]
        )
        return [cast(o, d) for o, d in zip(outs, dts, strict=True)]

    outs = lax.while_loop(
        cond, body, [cast(v, d) for v, d in zip(init, dts, strict=True)]
    )
    return list(outs), _default_infos(outs)


def _cond(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    if not _has(eqn.params, "branches"):
        return None
    index, ops = vals[0], vals[1:]
    branches = [_retrace(it, b, ops, infos[1:])[0] for b in eqn.params["branches"]]
    dts = []
    for avals in zip(*(b.out_avals for b in branches), strict=True):
        ds = [a.dtype for a in avals]
        dts.append(widest(ds) if all(map(is_castable, ds)) else ds[0])

    def run(closed: Any) -> Callable[..., list[Any]]:
        def branch(*xs: Any) -> list[Any]:
            outs = jcore.jaxpr_as_fun(closed)(*xs)
            return [cast(o, d) for o, d in zip(outs, dts, strict=True)]

        return branch

    outs = lax.switch(index, [run(b) for b in branches], *ops)
    return list(outs), _default_infos(outs)


def _named(fn: Callable[..., Any], jaxpr: Any) -> Callable[..., Any]:
    """``fn`` renamed after the function ``jaxpr`` was traced from (``relu``...),
    so the rebuilt custom-derivative call reads as the original in a jaxpr."""
    debug = getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)
    name = getattr(debug, "func_name", None)
    if isinstance(name, str) and name.isidentifier():
        fn.__name__ = fn.__qualname__ = name
    return fn


def _tangent_zeros(primal: Any) -> Any:
    if jax.numpy.issubdtype(dtype_of(primal), jax.numpy.inexact):
        return jax.numpy.zeros_like(primal)
    return np.zeros(np.shape(primal), jax.dtypes.float0)


def _custom_jvp(
    it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]
) -> Result:
    p = eqn.params
    jvp_fun = custom_jvp_rule(p)
    if jvp_fun is None or not _has(p, "call_jaxpr", "num_consts"):
        return None
    call, nc = p["call_jaxpr"], p["num_consts"]
    consts, primals, pinfos = vals[:nc], vals[nc:], infos[nc:]

    def impl(*xs: Any) -> list[Any]:
        with suspended(it.float8):
            return it.eval_closed(call, [*consts, *xs], [*infos[:nc], *pinfos])[0]

    def jvp(xs: Sequence[Any], ts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        jaxpr, jconsts, out_zeros = jvp_fun.call_wrapped(*[False] * len(xs))
        with suspended(it.float8):
            outs, _ = it.eval_jaxpr(jaxpr, jconsts, [*xs, *ts], [*pinfos, *pinfos])
        n = len(out_zeros)
        ref = jax.eval_shape(impl, *xs)  # the primal function's output dtypes
        out_p = [cast(o, r.dtype) for o, r in zip(outs[:n], ref, strict=True)]
        nonzero = iter(outs[n:])
        out_t = [
            _tangent_zeros(o) if z else _like_tangent(next(nonzero), o)
            for o, z in zip(out_p, out_zeros, strict=True)
        ]
        return out_p, out_t

    fn = jax.custom_jvp(_named(impl, call))
    fn.defjvp(jvp)
    outs = fn(*primals)
    return list(outs), _default_infos(outs)


def _like_tangent(t: Any, primal: Any) -> Any:
    if jax.numpy.issubdtype(dtype_of(primal), jax.numpy.inexact):
        return cast(t, dtype_of(primal))
    return t


def _custom_vjp(
    it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]
) -> Result:
    p = eqn.params
    keys = ("call_jaxpr", "num_consts", "fwd_jaxpr_thunk", "bwd", "out_trees")
    if not _has(p, *keys):
        return None
    call, nc = p["call_jaxpr"], p["num_consts"]
    fwd_thunk, bwd, out_trees = p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    consts, primals, pinfos = vals[:nc], vals[nc:], infos[nc:]
    in_dtypes = [dtype_of(x) for x in primals]
    box: dict[str, Any] = {}

    def impl(*xs: Any) -> list[Any]:
        with suspended(it.float8):
            return it.eval_closed(call, [*consts, *xs], [*infos[:nc], *pinfos])[0]

    def fwd(*xs: Any) -> tuple[list[Any], list[Any]]:
        jaxpr, fconsts = fwd_thunk.call_wrapped(*[True] * len(xs))
        with suspended(it.float8):
            outs, _ = it.eval_jaxpr(jaxpr, fconsts, xs, pinfos)
        out_tree, _, forwards = out_trees()
        n_res = len(outs) - out_tree.num_leaves
        inputs, own = [*consts, *xs], iter(outs[:n_res])
        res_avals, own_avals = [], iter(a for a in _out_avals(jaxpr)[:n_res])
        res = []
        for f in forwards:
            res.append(inputs[f] if f is not None else next(own))
            res_avals.append(call.in_avals[f] if f is not None else next(own_avals))
        box["res_avals"] = res_avals
        ref = jax.eval_shape(impl, *xs)
        prim = [cast(o, r.dtype) for o, r in zip(outs[n_res:], ref, strict=True)]
        return prim, res

    def bwd_rule(res: list[Any], cts: list[Any]) -> tuple[Any, ...]:
        ct_avals = [ct_aval(a) for a in call.out_avals]

        def run_bwd(*args: Any) -> list[Any]:
            return [instantiate_zeros(c) for c in bwd.call_wrapped(*args)]

        closed = trace(run_bwd, [*box["res_avals"], *ct_avals])
        with suspended(it.float8):
            outs, _ = it.eval_closed(closed, [*res, *cts])
        return tuple(
            cast(c, d) if jax.numpy.issubdtype(d, jax.numpy.inexact) else c
            for c, d in zip(outs, in_dtypes, strict=True)
        )

    fn = jax.custom_vjp(_named(impl, call))
    fn.defvjp(fwd, bwd_rule)
    outs = fn(*primals)
    return list(outs), _default_infos(outs)


def _out_avals(jaxpr: Any) -> list[Any]:
    return [v.aval for v in jaxpr.outvars]


def _shard_map(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    p = eqn.params
    keys = ("jaxpr", "mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes")
    if not _has(p, *keys) or shard_map is None:
        return None

    delayed = it.float8 is not None and it.float8.delayed

    def body(*xs: Any) -> tuple[Any, ...]:
        # Delayed float8 state cannot enter a shard_map as a closure: its
        # matmuls run in 16 bits then, when recording sites too (current
        # scaling works per shard).
        with suspended(it.float8 if delayed else None):
            return tuple(it.eval_jaxpr(p["jaxpr"], (), xs, infos)[0])

    fn = shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=p["newly_manual_axes"],
        check_vma=p["check_vma"],
    )
    outs = fn(*vals)
    return list(outs), _default_infos(outs)


# The handler of each construct of ``HIGHER_ORDER`` (a test pins that they
# match); a name missing here fails at import.
BY_CONSTRUCT: dict[str, Callable[..., Result]] = {
    "call": _closed_call,
    "cond": _cond,
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "jit": _jit,
    "remat": _remat,
    "scan": _scan,
    "shard_map": _shard_map,
    "while": _while,
}

# Higher-order primitive name -> handler, for every name of ``HIGHER_ORDER``.
HANDLERS: Mapping[str, Callable[..., Result]] = MappingProxyType(
    {name: BY_CONSTRUCT[construct] for name, construct in HIGHER_ORDER.items()}
)
