"""``jax.nn.dot_product_attention`` under autocast: fused attention on 16-bit
q, k and v (cuDNN's flash attention where the step is lowered for CUDA).

A float32 function that calls ``jax.nn.dot_product_attention`` is traced in
float32, so jax picks its XLA form there, and asking for
``implementation="cudnn"`` is refused (cuDNN takes 16-bit inputs only). While
:func:`jaxscale.autocast` traces a function (:func:`intercepting`), the name
``jax.nn.dot_product_attention`` resolves to :func:`_marked`, which records the
call as a ``jit`` named ``jaxscale_attention_<n>`` around jax's own float32
computation (so anything that is not autocast, and jax's own transformations,
see exactly what was traced). The interpreter then runs the call
(:func:`run`) on q, k and v (and a bias) rounded to the autocast dtype:

- ``implementation=None`` (the default): cuDNN's fused kernel where the step is
  lowered for CUDA (``lax.platform_dependent``); elsewhere, or everywhere when
  cuDNN cannot take the call (no cuDNN on the tracing host, a head dimension
  or a mask it does not support: jax says so as it traces), the float32 form
  jax traced, run by autocast's rules like any written-out attention;
- ``"cudnn"``: cuDNN, as asked (jax's error if it cannot);
- ``"xla"``: the traced float32 form by autocast's rules, as asked.

The output comes out in the autocast dtype, as a matmul's does. Calls made
through another name (``from jax.nn import dot_product_attention`` executed
before autocast traced, or a function jitted and traced before) run as
written out, by the other rules.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._autocast.fusion import Constants
from jaxscale._autocast.values import Info, dtype_of, fresh_info, is_castable
from jaxscale._jax_private import (
    broadcast_dimensions,
    dot_dimension_numbers,
    jit_body,
    jit_name,
)

__all__ = ["PREFIX", "intercepting", "is_attention", "run", "run_chain"]

PREFIX = "jaxscale_attention_"
_ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(_ORIGINAL)
# The array arguments of jax.nn.dot_product_attention; the others are static.
_ARRAYS = (
    "query",
    "key",
    "value",
    "bias",
    "mask",
    "query_seq_lengths",
    "key_value_seq_lengths",
)
# q, k, v and the bias: rounded to the autocast dtype.
_CAST = frozenset({"query", "key", "value", "bias"})


class _Registry:
    """The static arguments of the calls :func:`_marked` recorded (``n`` ->
    array names and statics, ``n`` in the ``jit``'s name), and how many traces
    are intercepting; one per process, behind a lock."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]]
        self.calls = {}
        self.keys: dict[Any, int] = {}
        self.counter = itertools.count()
        self.lock = threading.RLock()
        self.depth = 0

    def key_of(self, names: tuple[str, ...], statics: tuple) -> int:
        entry = (names, statics)
        with self.lock:
            if entry not in self.keys:
                n = next(self.counter)
                self.keys[entry] = n
                self.calls[n] = entry
            return self.keys[entry]


_REGISTRY = _Registry()


def _marked(*args: Any, **kwargs: Any) -> Any:
    """``jax.nn.dot_product_attention`` as autocast traces it: jax's own
    computation inside a ``jit`` whose name the interpreter recognises."""
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return _ORIGINAL(*args, **kwargs)  # jax's own error
    given = dict(bound.arguments)
    names = tuple(n for n in _ARRAYS if given.get(n) is not None)
    statics = tuple(sorted((n, v) for n, v in given.items() if n not in _ARRAYS))
    arrays = [given[n] for n in names]
    try:
        key = _REGISTRY.key_of(names, statics)
    except TypeError:  # an unhashable static argument: not ours to rewrite
        return _ORIGINAL(*args, **kwargs)
    if not all(isinstance(a, jax.Array | np.ndarray) for a in arrays):
        arrays = [jnp.asarray(a) for a in arrays]
    query = arrays[0]
    if not is_castable(np.dtype(query.dtype)):
        return _ORIGINAL(*args, **kwargs)

    def body(*xs: Any) -> Any:
        return _ORIGINAL(**dict(zip(names, xs, strict=True)), **dict(statics))

    body.__name__ = f"{PREFIX}{key}"
    return jax.jit(body)(*arrays)


@contextlib.contextmanager
def intercepting() -> Iterator[None]:
    """While a function is traced for autocast: ``jax.nn.dot_product_attention``
    is :func:`_marked` (re-entrant; restored on exit)."""
    with _REGISTRY.lock:
        if _REGISTRY.depth == 0:
            jax.nn.dot_product_attention = _marked
        _REGISTRY.depth += 1
    try:
        yield
    finally:
        with _REGISTRY.lock:
            _REGISTRY.depth -= 1
            if _REGISTRY.depth == 0:
                jax.nn.dot_product_attention = _ORIGINAL


def is_attention(eqn: Any) -> bool:
    """A ``jit`` equation made by :func:`_marked`."""
    name = jit_name(eqn)
    if not name.startswith(PREFIX):
        return False
    suffix = name[len(PREFIX) :]
    return suffix.isdigit() and int(suffix) in _REGISTRY.calls


def run(
    it: Any, eqn: Any, vals: list[Any], infos: list[Info], written: Any
) -> tuple[list[Any], list[Info]] | None:
    """The marked call ``eqn`` (see the module docstring): cuDNN's attention on
    16-bit q, k, v where it applies, else ``written(*vals)``, the call's
    float32 body evaluated by the interpreter's rules; ``None`` to run it as
    any ``jit`` (a float32 autocast, or ``implementation="xla"``)."""
    names, statics = _REGISTRY.calls[int(jit_name(eqn)[len(PREFIX) :])]
    dtype = np.dtype(it.dtype)
    static = dict(statics)
    asked = static.pop("implementation", None)
    if dtype == np.dtype("float32") or asked == "xla":
        return None
    args = {
        n: _narrow(it, v, dtype, n == "bias")
        if n in _CAST and is_castable(dtype_of(v))
        else v
        for n, v in zip(names, vals, strict=True)
    }

    def cudnn(*xs: Any) -> Any:
        kw = dict(zip(args, xs, strict=True))
        return _ORIGINAL(**kw, **static, implementation="cudnn")

    xs = list(args.values())
    if asked == "cudnn":  # as asked: jax's error if cuDNN cannot take it
        outs = _flat(cudnn(*xs))
        it.note("attention: cuDNN, as asked")
    elif _may_fuse(it, eqn) and _cudnn_traces(cudnn, xs):
        n = len(xs)

        def default(*ys: Any) -> Any:
            return tuple(written(*ys[n:])[0])

        outs = _flat(
            jax.lax.platform_dependent(
                *xs,
                *vals,
                cuda=lambda *ys: tuple(_flat(cudnn(*ys[:n]))),
                default=default,
            )
        )
        it.note("attention: cuDNN where lowered for CUDA, the rules elsewhere")
    else:
        return written(*vals)
    out_infos = [fresh_info(o)._replace(lowered=dtype_of(o) == dtype) for o in outs]
    return outs, out_infos


def _may_fuse(it: Any, eqn: Any) -> bool:
    """Whether the interpreter's extension lets the call's products run in
    cuDNN's kernel, unseen (a plan whose sites there are not all 16-bit, or a
    sensor, does not: :meth:`~jaxscale._autocast.interp.Extension.may_fuse`)."""
    body = jit_body(eqn)
    return body is None or it.ext.may_fuse(body.jaxpr.eqns)


def _narrow(it: Any, x: Any, dtype: np.dtype, saturating: bool) -> Any:
    """``x`` in ``dtype``; a bias saturated at its finite range (an additive
    mask of ``-1e9`` becomes float16's -65504, not ``-inf``, so a fully masked
    row stays finite, as in float32)."""
    if saturating and dtype_of(x) != dtype:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)
    return it.cast(x, dtype)


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple | list) else [out]


def _cudnn_traces(f: Any, xs: list[Any]) -> bool:
    """Whether jax traces ``f`` (cuDNN's attention) on arguments like ``xs``:
    cuDNN found, and the shapes, dtypes and masks within what it supports."""
    specs = [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)) for x in xs]
    try:
        jax.eval_shape(f, *specs)
    except Exception:  # noqa: BLE001 - jax's refusal, whatever its type
        return False
    return True


def run_chain(
    it: Any,
    chain: Any,
    inputs: dict[Any, tuple[Any, Info]],
    constants: Any,
    written: Any,
) -> tuple[list[Any], list[Info]]:
    """A written-out attention (:class:`jaxscale._autocast.fusion.Chain`) run
    as cuDNN's fused attention on 16-bit q, k, v where the step is lowered for
    CUDA and cuDNN takes it (no mask, or a causal one), else ``written()``: the
    chain's equations by the rules. ``inputs`` maps the chain's inputs to their
    values and provenance; ``constants`` knows their trace-time values."""
    fused = _chain_call(it, chain, inputs, constants)
    if fused is None:
        return written(*[v for v, _ in inputs.values()])
    cudnn, xs = fused
    if not _cudnn_traces(cudnn, xs):
        return written(*[v for v, _ in inputs.values()])
    n = len(xs)
    vals = [v for v, _ in inputs.values()]
    outs = jax.lax.platform_dependent(
        *xs,
        *vals,
        cuda=lambda *ys: (cudnn(*ys[:n]),),
        default=lambda *ys: tuple(written(*ys[n:])[0]),
    )
    it.note("attention: written out, cuDNN's fused kernel where lowered for CUDA")
    out = list(outs)
    return out, [fresh_info(o)._replace(lowered=True) for o in out]


def _chain_call(it: Any, chain: Any, inputs: dict, constants: Any) -> Any:
    """``(f, xs)``: ``f(*xs)`` is the chain's output by cuDNN (xs: q, k, v in
    the autocast dtype), or None when the chain is not one cuDNN can take."""
    dtype = np.dtype(it.dtype)
    if dtype == np.dtype("float32") or not jnp.issubdtype(dtype, jnp.floating):
        return None
    scale = 1.0
    for e in chain.scalings:
        other = [v for v in e.invars if v is not _scaled(chain, e)]
        c = constants.value(other[0]) if len(other) == 1 else None
        if c is None or np.ndim(c) != 0:
            return None
        scale = scale * float(c) if e.primitive.name == "mul" else scale / float(c)
    qv, kv = chain.scores.invars
    vv = chain.out.invars[1 if chain.probs_lhs else 0]
    if any(v not in inputs for v in (qv, kv, vv)):
        return None
    (lc, rc), (lb, rb) = dot_dimension_numbers(chain.scores.params)
    (c0, c1), (b0, b1) = dot_dimension_numbers(chain.out.params)
    vc, vb = (c1, b1) if chain.probs_lhs else (c0, b0)
    q_shape, k_shape = np.shape(inputs[qv][0]), np.shape(inputs[kv][0])
    v_shape = np.shape(inputs[vv][0])
    q_free = [d for d in range(len(q_shape)) if d not in (*lc, *lb)]
    k_free = [d for d in range(len(k_shape)) if d not in (*rc, *rb)]
    v_free = [d for d in range(len(v_shape)) if d not in (*vc, *vb)]
    if len(q_free) != 1 or len(k_free) != 1 or len(v_free) != 1:
        return None
    t, s = q_shape[q_free[0]], k_shape[k_free[0]]
    batch = [int(q_shape[d]) for d in lb]
    flat = int(np.prod(batch, dtype=np.int64))
    causal = False
    if chain.mask is not None:
        keep = _keep(chain, constants, (*batch, t, s))
        if keep is None:
            return None
        if keep.all():
            pass
        elif t == s and (keep == np.tril(np.ones((t, s), bool))).all():
            causal = True
        else:
            return None
    order_q, order_k = (*lb, q_free[0], *lc), (*rb, k_free[0], *rc)
    order_v = (*vb, *vc, v_free[0])
    h, hv = q_shape[lc[0]], v_shape[v_free[0]]
    out_shape = (*batch, t, hv)
    transpose_out = not chain.probs_lhs  # v . p: batch..., H, T

    def cudnn(q: Any, k: Any, v: Any) -> Any:
        q = jnp.transpose(q, order_q).reshape(flat, t, 1, h)
        k = jnp.transpose(k, order_k).reshape(flat, s, 1, h)
        v = jnp.transpose(v, order_v).reshape(flat, s, 1, hv)
        o = _ORIGINAL(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn"
        ).reshape(out_shape)
        if transpose_out:
            o = jnp.swapaxes(o, -1, -2)
        return o

    xs = [it.cast(inputs[x][0], dtype) for x in (qv, kv, vv)]
    if any(not is_castable(dtype_of(x)) for x in xs):
        return None
    return cudnn, xs


def _scaled(chain: Any, e: Any) -> Any:
    """The operand of scaling ``e`` that carries the scores."""
    made = {v for x in chain.eqns for v in x.outvars}
    return next(v for v in e.invars if v in made)


def _keep(chain: Any, constants: Any, shape: tuple) -> Any:
    """Where the chain's mask keeps the scores, as a ``(T, S)`` bool array, or
    None if the mask is not known at trace time or differs across the batch
    dimensions (``shape``: the scores', ``(batch..., T, S)``). The mask is
    read before it is broadcast to the scores' shape, so a causal mask costs
    ``T * S`` booleans at trace time, not the scores' size."""
    e = chain.mask
    if e.primitive.name == "select_n":
        pred, known = e.invars[0], constants
    else:  # a jitted where(c, scores, fill): its select's predicate from c
        c = constants.value(e.invars[0])
        body = jit_body(e)
        if c is None or body is None:
            return None
        inner = body.jaxpr
        (select,) = [x for x in inner.eqns if x.primitive.name == "select_n"]
        known = Constants(
            inner,
            {
                **dict(zip(inner.constvars, body.consts, strict=True)),
                inner.invars[0]: np.asarray(c),
            },
        )
        pred = select.invars[0]
    rank = len(shape)
    dims = tuple(range(rank))
    made = known.producer(pred)
    if made is not None and made.primitive.name == "broadcast_in_dim":
        dims, pred = broadcast_dimensions(made), made.invars[0]
    value = known.value(pred)
    if value is None:
        return None
    value = np.asarray(value, bool)
    if value.ndim != len(dims) or tuple(dims) != tuple(sorted(dims)):
        return None
    full = [1] * rank
    for axis, d in zip(range(value.ndim), dims, strict=True):
        full[d] = value.shape[axis]
    value = value.reshape(full)
    first = value[(slice(0, 1),) * (rank - 2)]
    if not (value == first).all():
        return None
    return np.broadcast_to(first.reshape(first.shape[-2:]), shape[-2:])
