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

from jaxscale._autocast.values import Info, dtype_of, fresh_info, is_castable
from jaxscale._jax_private import jit_name

__all__ = ["PREFIX", "intercepting", "is_attention", "run"]

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
# The static arguments of each marked call: n -> (array names, statics).
_CALLS: dict[int, tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]] = {}
_KEYS: dict[Any, int] = {}
_COUNTER = itertools.count()
_LOCK = threading.RLock()
_DEPTH = [0]


def _key_of(names: tuple[str, ...], statics: tuple[tuple[str, Any], ...]) -> int:
    entry = (names, statics)
    with _LOCK:
        if entry not in _KEYS:
            n = next(_COUNTER)
            _KEYS[entry] = n
            _CALLS[n] = entry
        return _KEYS[entry]


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
        key = _key_of(names, statics)
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
    with _LOCK:
        if _DEPTH[0] == 0:
            jax.nn.dot_product_attention = _marked
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                jax.nn.dot_product_attention = _ORIGINAL


def is_attention(eqn: Any) -> bool:
    """A ``jit`` equation made by :func:`_marked`."""
    name = jit_name(eqn)
    if not name.startswith(PREFIX):
        return False
    suffix = name[len(PREFIX) :]
    return suffix.isdigit() and int(suffix) in _CALLS


def run(
    it: Any, eqn: Any, vals: list[Any], infos: list[Info], written: Any
) -> tuple[list[Any], list[Info]] | None:
    """The marked call ``eqn`` (see the module docstring): cuDNN's attention on
    16-bit q, k, v where it applies, else ``written(*vals)``, the call's
    float32 body evaluated by the interpreter's rules; ``None`` to run it as
    any ``jit`` (a float32 autocast, or ``implementation="xla"``)."""
    names, statics = _CALLS[int(jit_name(eqn)[len(PREFIX) :])]
    dtype = np.dtype(it.dtype)
    static = dict(statics)
    asked = static.pop("implementation", None)
    if dtype == np.dtype("float32") or asked == "xla":
        return None
    args = {
        n: it.cast(v, dtype) if n in _CAST and is_castable(dtype_of(v)) else v
        for n, v in zip(names, vals, strict=True)
    }

    def cudnn(*xs: Any) -> Any:
        kw = dict(zip(args, xs, strict=True))
        return _ORIGINAL(**kw, **static, implementation="cudnn")

    xs = list(args.values())
    if asked == "cudnn":  # as asked: jax's error if cuDNN cannot take it
        outs = _flat(cudnn(*xs))
        it.note("attention: cuDNN, as asked")
    elif _cudnn_traces(cudnn, xs):
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
