"""Higher-order primitives under :func:`jaxscale.autocast`.

Each handler evaluates the sub-computations of one higher-order construct with
the interpreter and binds it again, keeping its semantics. What a construct's
parameters mean is asked of :mod:`jaxscale._jax_private` (a scan's
consts/carry/xs split, a ``custom_vjp``'s rules...), never read here:

- ``jit`` is re-bound with its jaxpr re-traced at the new dtypes (shardings,
  donation and the name are kept); a call (``closed_call``, ``eval_jaxpr``) is
  inlined.
- ``scan`` and ``while`` go through ``lax.scan`` / ``lax.while_loop``. A loop carry
  keeps the dtype it was traced with, or the incoming value's dtype if that is
  wider: the carry is cast to it on the way in and after every iteration.
- ``cond`` is re-bound with its branches re-traced (every other parameter, such
  as ``branches_platforms``, kept); each output takes the widest dtype any
  branch gives it.
- ``checkpoint`` (remat) goes through ``jax.checkpoint`` with the same policy.
- ``custom_jvp_call`` and ``custom_vjp_call`` are rebuilt as ``jax.custom_jvp`` /
  ``jax.custom_vjp`` functions whose primal, JVP, forward and backward are the
  original rules' jaxprs evaluated by the interpreter: the custom derivatives are
  kept, and the backward runs in the dtypes its forward used.
- ``shard_map`` goes through ``jax.shard_map`` with the same mesh and specs.
- Any other higher-order primitive, or one whose parameters this JAX version
  changed, is rewritten without knowing its schema (:func:`generic`): each
  sub-jaxpr among its parameters is evaluated by the interpreter with its
  boundary dtypes kept (cast in, cast out), and the primitive is re-bound with
  every other parameter unchanged.

``HANDLERS`` maps each construct of
:data:`jaxscale._jax_private.HIGHER_ORDER_NAMES` (and ``"generic"``) to its
handler. A handler returns ``None`` when the equation's parameters are not the
ones it knows (the interpreter then tries :func:`generic`), and raises
:class:`~jaxscale._autocast.interp.Unrewritable` with the reason when the
construct cannot be rewritten at all (it then runs as traced, with an
:class:`~jaxscale.AutocastWarning` that says why).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from jaxscale._autocast import attention
from jaxscale._autocast.interp import Interpreter, Unrewritable
from jaxscale._autocast.values import (
    Info,
    cast,
    dtype_of,
    floating,
    fresh_info,
    is_castable,
    size_of,
    widest,
)
from jaxscale._jax_private import (
    HIGHER_ORDER_NAMES,
    bind,
    call_body,
    cond_branches,
    ct_aval,
    custom_jvp_parts,
    custom_vjp_parts,
    jit_body,
    opaque_functions,
    rebind,
    remat_parts,
    replace_subjaxprs,
    scan_parts,
    shard_map,
    shard_map_parts,
    subjaxprs,
    trace,
    while_parts,
)

__all__ = ["HANDLERS", "generic"]

Result = tuple[list[Any], list[Info]] | None


def _default_infos(outs: Sequence[Any]) -> list[Info]:
    return [fresh_info(o) for o in outs]


def _param_infos(body: Sequence[Info], outs: Sequence[Any]) -> list[Info]:
    """Fresh infos of ``outs`` but for the body's word on parameters: a value
    computed from parameters and constants alone stays one."""
    return [
        fresh_info(o)._replace(param=b.param, wide=b.wide)
        for b, o in zip(body, outs, strict=True)
    ]


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


def _jit(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    body = jit_body(eqn)
    if body is not None and attention.is_attention(eqn) and not it.enters_owned:

        def written(*xs: Any) -> tuple[list[Any], list[Info]]:
            return it.eval_closed(body, xs, infos)

        fused = attention.run(it, eqn, vals, infos, written)
        if fused is not None:
            return fused
    if body is None:
        return None
    if it.ext.inline_calls:  # inlined: what it reads is the caller's
        return it.eval_closed(body, vals, infos)
    new, out_infos = _retrace(it, body, vals, infos)
    return rebind(eqn, vals, jaxpr=new), out_infos


def _call(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    body = call_body(eqn)
    return None if body is None else it.eval_closed(body, vals, infos)


def _remat(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    parts = remat_parts(eqn)
    if parts is None:
        return None

    def body(*xs: Any) -> list[Any]:
        return it.eval_closed(parts.body, xs, infos)[0]

    fn = jax.checkpoint(body, prevent_cse=parts.prevent_cse, policy=parts.policy)
    outs = fn(*vals)
    return list(outs), _default_infos(outs)


def _scan(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    parts = scan_parts(eqn)
    if parts is None:
        return None
    body, nc, nk, length = parts.body, parts.num_consts, parts.num_carry, parts.length
    consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    dts = _carry_dtypes(body.in_avals[nc : nc + nk], init)
    carry_infos = [fresh_info(v) for v in init]
    x_infos = [
        Info(
            len(np.shape(x)) - 1,
            i.param,
            False,
            size_of(x) // max(length, 1),
            wide=i.wide,
        )
        for x, i in zip(xs, infos[nc + nk :], strict=True)
    ]
    body_infos = [*infos[:nc], *carry_infos, *x_infos]
    loop = it.ext.loop(length)  # an extension's per-iteration inputs, if any
    n_extra = len(loop.xs)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        x, extra = x[: len(x) - n_extra], x[len(x) - n_extra :]
        with loop.body(extra):
            outs, _ = it.eval_closed(body, [*consts, *carry, *x], body_infos)
        return [cast(o, d) for o, d in zip(outs[:nk], dts, strict=True)], outs[nk:]

    carry, ys = lax.scan(
        step,
        [cast(v, d) for v, d in zip(init, dts, strict=True)],
        [*xs, *loop.xs],
        length=length,
        reverse=parts.reverse,
        unroll=parts.unroll,
    )
    outs = [*carry, *ys]
    return outs, _default_infos(outs)


def _while(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    parts = while_parts(eqn)
    if parts is None:
        return None
    cn, bn = parts.cond_nconsts, parts.body_nconsts
    cconsts, bconsts, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
    cinfos, binfos = infos[:cn], infos[cn : cn + bn]
    dts = _carry_dtypes(parts.body.in_avals[bn:], init)
    carry_infos = [fresh_info(v) for v in init]

    def cond(carry: list[Any]) -> Any:
        outs, _ = it.eval_closed(
            parts.cond, [*cconsts, *carry], [*cinfos, *carry_infos]
        )
        return outs[0]

    def body(carry: list[Any]) -> list[Any]:
        outs, _ = it.eval_closed(
            parts.body, [*bconsts, *carry], [*binfos, *carry_infos]
        )
        return [cast(o, d) for o, d in zip(outs, dts, strict=True)]

    outs = lax.while_loop(
        cond, body, [cast(v, d) for v, d in zip(init, dts, strict=True)]
    )
    return list(outs), _default_infos(outs)


def _cast_outs(closed: Any, dts: Sequence[Any]) -> Callable[..., list[Any]]:
    def branch(*xs: Any) -> list[Any]:
        outs = jcore.jaxpr_as_fun(closed)(*xs)
        return [cast(o, d) for o, d in zip(outs, dts, strict=True)]

    return branch


def _cond(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    old = cond_branches(eqn)
    if old is None:
        return None
    index, ops = vals[0], vals[1:]
    branches = [_retrace(it, b, ops, infos[1:])[0] for b in old]
    dts = []
    for avals in zip(*(b.out_avals for b in branches), strict=True):
        ds = [a.dtype for a in avals]
        dts.append(widest(ds) if all(map(is_castable, ds)) else ds[0])
    avals = [jax.typeof(v) for v in ops]
    new = [trace(_cast_outs(b, dts), avals) for b in branches]
    if not any(b.consts for b in new):  # re-bound: every other parameter kept
        outs = rebind(eqn, vals, branches=tuple(new))
    else:  # closes over values (an extension's state): a cond of its own
        outs = lax.switch(index, [jcore.jaxpr_as_fun(b) for b in new], *ops)
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


def _like_tangent(t: Any, primal: Any) -> Any:
    if jax.numpy.issubdtype(dtype_of(primal), jax.numpy.inexact):
        return cast(t, dtype_of(primal))
    return t


def _custom_jvp(
    it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]
) -> Result:
    parts = custom_jvp_parts(eqn)
    if parts is None:
        return None
    call, nc = parts.call, parts.num_consts
    consts, primals, pinfos = vals[:nc], vals[nc:], infos[nc:]
    box: list[list[Info]] = []

    def impl(*xs: Any) -> list[Any]:
        with it.ext.suspended():
            outs, out_infos = it.eval_closed(
                call, [*consts, *xs], [*infos[:nc], *pinfos]
            )
        box.append(out_infos)
        return outs

    def jvp(xs: Sequence[Any], ts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        rule, out_zeros = parts.rule(len(xs))
        with it.ext.suspended():
            # Tangents are not inputs whose gradient leaves a matmul wide: the
            # rule's products on them are transposed by the rule's own terms.
            tinfos = [i._replace(wide=False) for i in pinfos]
            outs, _ = it.eval_closed(rule, [*xs, *ts], [*pinfos, *tinfos])
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
    # What the body says of its outputs: ``softplus`` of a parameter (a
    # ``custom_jvp`` of parameters alone) is a parameter, as ``exp`` of one is.
    return list(outs), _param_infos(box[0], outs) if box else _default_infos(outs)


def _custom_vjp(
    it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]
) -> Result:
    parts = custom_vjp_parts(eqn)
    if parts is None:
        return None
    call, nc = parts.call, parts.num_consts
    consts, primals, pinfos = vals[:nc], vals[nc:], infos[nc:]
    in_dtypes = [dtype_of(x) for x in primals]
    box: dict[str, Any] = {}

    def impl(*xs: Any) -> list[Any]:
        with it.ext.suspended():
            return it.eval_closed(call, [*consts, *xs], [*infos[:nc], *pinfos])[0]

    def fwd(*xs: Any) -> tuple[list[Any], list[Any]]:
        rule = parts.forward(len(xs))
        with it.ext.suspended():
            outs, _ = it.eval_closed(rule, xs, pinfos)
        n_out, forwards = parts.residuals()
        n_res = len(outs) - n_out
        inputs, own = [*consts, *xs], iter(outs[:n_res])
        res_avals, own_avals = [], iter(rule.out_avals[:n_res])
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
        closed = trace(
            lambda *args: parts.backward(args), [*box["res_avals"], *ct_avals]
        )
        with it.ext.suspended():
            outs, _ = it.eval_closed(closed, [*res, *cts])
        return tuple(
            cast(c, d) if jax.numpy.issubdtype(d, jax.numpy.inexact) else c
            for c, d in zip(outs, in_dtypes, strict=True)
        )

    fn = jax.custom_vjp(_named(impl, call))
    fn.defvjp(fwd, bwd_rule)
    outs = fn(*primals)
    return list(outs), _default_infos(outs)


def _shard_map(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    parts = shard_map_parts(eqn)
    if parts is None or shard_map is None:
        return None

    # Values an extension threads cannot enter a shard_map as a closure: they
    # enter as replicated inputs where the extension says so (a sensor's
    # probes, whose cotangents are then summed over the devices), or the body
    # runs without the extension (float8's delayed state: 16 bits there).
    inner = it.ext.manual()
    n_extra = len(inner.xs)

    def body(*xs: Any) -> tuple[Any, ...]:
        xs, extra = xs[: len(xs) - n_extra], xs[len(xs) - n_extra :]
        with inner.body(extra):
            return tuple(it.eval_closed(parts.body, list(xs), infos)[0])

    fn = shard_map(
        body,
        mesh=parts.mesh,
        in_specs=(*parts.in_specs, *[PartitionSpec()] * n_extra),
        out_specs=parts.out_specs,
        axis_names=parts.axes,
        check_vma=parts.check_vma,
    )
    outs = fn(*vals, *inner.xs)
    return list(outs), _default_infos(outs)


def generic(it: Interpreter, eqn: Any, vals: list[Any], infos: list[Info]) -> Result:
    """Any higher-order equation, without knowing its parameters: each sub-jaxpr
    is evaluated by the interpreter with its boundary dtypes kept (its inputs
    cast to the types it was traced with, its outputs cast back), and the
    primitive is re-bound with every other parameter unchanged.

    Raises:
      Unrewritable: the equation stages functions autocast cannot see, has no
        sub-jaxpr, or a rewritten sub-jaxpr closes over values its schema has no
        place for.
    """
    opaque = opaque_functions(eqn)
    if opaque:
        raise Unrewritable(
            f"its parameters {', '.join(map(repr, opaque))} are functions staged "
            "out of autocast's sight, as jax's `jax_scan3`/`jax_custom_vjp3` "
            "flags stage them"
        )
    subs = subjaxprs(eqn)
    if not subs:
        raise Unrewritable("it holds no sub-jaxpr to rewrite")
    new = {}
    for key, index, closed in subs:

        def fn(*xs: Any, closed: Any = closed) -> list[Any]:
            with it.ext.opaque():
                outs, _ = it.eval_closed(closed, xs)
            return [
                cast(o, a.dtype) if is_castable(dtype_of(o)) else o
                for o, a in zip(outs, closed.out_avals, strict=True)
            ]

        new[(key, index)] = trace(fn, closed.in_avals)
    params = replace_subjaxprs(eqn, new)
    if params is None:
        raise Unrewritable(
            "its rewritten sub-computations close over values its parameters "
            "have no place for"
        )
    traced = [v.aval.dtype for v in eqn.invars]
    used = [
        cast(v, t) if floating(dtype_of(v)) and floating(t) else v
        for v, t in zip(vals, traced, strict=True)
    ]
    outs = bind(eqn.primitive, params, used)
    return outs, _default_infos(outs)


# The handler of each construct of ``HIGHER_ORDER_NAMES`` (a test pins that
# they match), and the schema-free rewrite for any other.
HANDLERS: Mapping[str, Callable[..., Result]] = MappingProxyType(
    {
        "call": _call,
        "cond": _cond,
        "custom_jvp": _custom_jvp,
        "custom_vjp": _custom_vjp,
        "generic": generic,
        "jit": _jit,
        "remat": _remat,
        "scan": _scan,
        "shard_map": _shard_map,
        "while": _while,
    }
)
missing = set(HIGHER_ORDER_NAMES.values()) - set(HANDLERS)
if missing:  # pragma: no cover: a construct without a handler fails at import
    raise ImportError(f"no autocast handler for {sorted(missing)}")
del missing
