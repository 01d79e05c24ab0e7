"""``jxs.autocast``: torch-style automatic mixed precision for any JAX function.

The function is traced once to a jaxpr at the dtypes it was written for, then
evaluated by an interpreter that decides each primitive's dtype from a table
(:mod:`jaxscale._autocast_rules`, :mod:`jaxscale._autocast_interp`,
:mod:`jaxscale._autocast_hop`). The decisions are made at trace time; the compiled
program holds only the casts, as if they were written by hand.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._autocast_hop import HANDLERS
from jaxscale._autocast_interp import (
    REGION_PREFIX,
    Interpreter,
    cast,
    dtype_of,
    input_info,
    is_castable,
)
from jaxscale._autocast_rules import resolve_rules

__all__ = ["autocast"]

_DISABLED = f"{REGION_PREFIX}_disabled"


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        dt = None
    if dt not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise ValueError(
            "`dtype` must be a 16-bit floating dtype, `jnp.float16` or "
            f"`jnp.bfloat16`, got {dtype!r}."
        )
    return dt


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_nnx_object(x: Any) -> bool:
    """An NNX module, ``nnx.Rngs``... (never imports flax: such an object exists
    only if the user has imported it)."""
    nnx = sys.modules.get("flax.nnx")
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    return base is not None and isinstance(x, base)


def autocast(
    fun: Callable[..., Any] | None = None,
    dtype: Any = jnp.float16,
    *,
    rules: Mapping[Any, Any] | None = None,
    enabled: bool = True,
) -> Callable[..., Any]:
    """Runs ``fun`` in mixed precision with per-operation dtypes, as torch.autocast.

    Write the model and the loss once, in float32. ``jxs.autocast(fun)`` returns a
    function with ``fun``'s signature that runs matrix multiplications and
    convolutions in ``dtype`` (output in ``dtype``, as torch does), and numerically
    sensitive operations in float32: ``exp``, ``log``, powers, ``rsqrt``, special
    functions, and every sum or product, so softmax, log-softmax, norms and losses
    come out in float32. Everything else runs in its inputs' dtype; an operation
    that needs equal dtypes (``add``, ``concatenate``, ``select_n``...) promotes to
    the widest of them, a scalar (``x * 2.0``) never widens an array, and a
    float32 bias added to a matmul's output stays in ``dtype`` (torch's ``linear``
    includes its bias), so a stack of ``Dense`` layers keeps low-precision
    activations. Integers, booleans, PRNG keys and float64 values are never cast.
    :func:`autocast_rules` returns the table; ``docs/autocast.md`` compares it
    with torch's lists op by op.

    It works on any function that JAX can trace (plain functions, Flax linen and
    NNX models, optax losses): ``fun`` is traced with :func:`jax.make_jaxpr` and the
    jaxpr is evaluated with a cast before each primitive as its rule says, at trace
    time, so under ``jit`` the compiled program is the one you would write by hand.
    ``jit``, ``lax.scan``, ``while_loop``, ``cond``/``switch``, ``jax.checkpoint``,
    ``custom_jvp``/``custom_vjp`` functions (their custom derivatives are kept),
    ``shard_map`` and ``vmap`` (inside or outside) are all handled. A loop carry
    keeps its dtype from one iteration to the next (the traced one, or the
    incoming value's if wider), and ``cond`` branches agree on the widest. Array
    arguments (``jax.Array``, NumPy) are traced; every other leaf of the arguments
    (Python numbers, strings, callables) is passed as a constant. NNX modules
    passed as arguments get their updated state back (BatchNorm statistics, RNG
    counts), in their own dtypes. Outputs come out in the dtypes their last
    operation gave them (logits in ``dtype``, a mean loss in float32), as in torch.

    Differentiate the autocast function, not the other way round: in
    ``jax.grad(jxs.autocast(loss))`` the casts are ordinary ``convert_element_type``
    operations, so gradients come out in the dtypes of the inputs and the backward
    of every operation runs in the dtype of its forward. With float16, scale the
    loss (``jxs.value_and_grad`` with ``jxs.dynamic_scaling``).

    ``enabled=False`` runs ``fun`` exactly as traced (every operation in the dtype
    it was written for, its inputs cast back to them) even inside another
    ``autocast``, like torch's nested ``autocast(enabled=False)``; outside any
    autocast it changes nothing. An ``autocast`` inside another uses its own
    ``dtype`` and ``rules`` for its region.

    Args:
      fun: the function. Without it, ``autocast`` returns a decorator:
        ``@jxs.autocast(dtype=jnp.bfloat16)``.
      dtype: the low-precision dtype, ``jnp.float16`` (default, as torch's CUDA
        autocast) or ``jnp.bfloat16``.
      rules: overrides of the table, from primitive names (``"exp"``, as in
        :func:`jax.make_jaxpr` output) or primitives (``jax.lax.exp_p``) to rule
        names (``"lower"``, ``"float32"``, ``"promote"``, ``"bias"``, ``"keep"``,
        ``"traced"``) or :class:`AutocastRule` members. A primitive that is not in
        the table runs as traced.
      enabled: a Python bool; ``False`` runs ``fun`` at its traced dtypes.

    Returns:
      A function with ``fun``'s signature and output structure.

    Raises:
      ValueError: if ``dtype`` is not float16 or bfloat16, or a rule is unknown
        (see :func:`autocast_rules`).
      TypeError: if ``fun`` is not callable, ``enabled`` is not a bool, or
        ``rules`` is not a mapping.

    Warns:
      AutocastWarning: at trace time, for a higher-order primitive it cannot
        rewrite (run as traced).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def mlp(params, x):
      ...     h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
      ...     return jax.nn.log_softmax(h @ params["w2"])
      >>> params = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 3))}
      >>> x = jnp.ones((2, 4))
      >>> h16 = jxs.autocast(lambda p, x: jax.nn.relu(x @ p["w1"] + p["b1"][None]))
      >>> h16(params, x).dtype  # matmul, bias add and relu in float16
      dtype('float16')
      >>> jxs.autocast(mlp)(params, x).dtype  # log_softmax in float32
      dtype('float32')
      >>> grads = jax.grad(lambda p: jxs.autocast(mlp)(p, x).sum())(params)
      >>> grads["w1"].dtype  # gradients in the parameters' dtype
      dtype('float32')

      Other dtypes and overrides:

      >>> import functools
      >>> bf16 = functools.partial(jxs.autocast, dtype=jnp.bfloat16)
      >>> bf16(lambda a, b: a @ b)(x, params["w1"]).dtype
      dtype(bfloat16)
      >>> jxs.autocast(jnp.exp, rules={"exp": "lower"})(x).dtype
      dtype('float16')

      A region at the traced dtypes:

      >>> @jxs.autocast
      ... def scores(q, k):
      ...     exact = jxs.autocast(lambda q, k: q @ k.T, enabled=False)
      ...     return exact(q, k), q @ k.T
      >>> [s.dtype for s in scores(x, x)]
      [dtype('float32'), dtype('float16')]
    """
    dt = _check_dtype(dtype)
    table = resolve_rules(rules)
    if not isinstance(enabled, bool | np.bool_):
        raise TypeError(
            f"`enabled` must be a Python bool, got {type(enabled).__name__}: "
            "autocast decides at trace time, so it cannot depend on a traced value."
        )
    if fun is None:
        return functools.partial(autocast, dtype=dt, rules=rules, enabled=enabled)
    if not callable(fun):
        raise TypeError(
            f"`fun` must be callable, got {type(fun).__name__}; use "
            "`jxs.autocast(fun)`, `@jxs.autocast` or "
            "`functools.partial(jxs.autocast, dtype=...)`."
        )

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not enabled:
            with jax.named_scope(_DISABLED):
                return fun(*args, **kwargs)
        return _run(fun, Interpreter(dt, table, HANDLERS), args, kwargs)

    return wrapper


def _run(fun: Callable[..., Any], it: Interpreter, args: tuple, kwargs: dict) -> Any:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    modules = [("a", i) for i, a in enumerate(args) if _is_nnx_object(a)]
    modules += [("k", k) for k, v in kwargs.items() if _is_nnx_object(v)]
    shapes: dict[str, Any] = {}

    def flat(*dyn: Any) -> list[Any]:
        full = list(leaves)
        for i, x in zip(dynamic, dyn, strict=True):
            full[i] = x
        a, kw = jax.tree.unflatten(treedef, full)
        out_leaves, shapes["out"] = jax.tree.flatten(fun(*a, **kw))
        shapes["states"] = []
        for where, key in modules:  # their state after `fun` (it may mutate them)
            state_leaves, tree = jax.tree.flatten(
                _nnx_state((a if where == "a" else kw)[key])
            )
            shapes["states"].append((tree, len(state_leaves)))
            out_leaves += state_leaves
        return out_leaves

    flat.__name__ = getattr(fun, "__name__", "fun")
    dyn = [leaves[i] for i in dynamic]
    closed = jax.make_jaxpr(flat)(*dyn)
    with jax.named_scope(f"{REGION_PREFIX}_{it.dtype.name}"):
        outs, _ = it.eval_closed(closed, dyn, [input_info(x) for x in dyn])
    n_out = shapes["out"].num_leaves
    result = jax.tree.unflatten(shapes["out"], outs[:n_out])
    start = n_out
    for (where, key), (tree, n) in zip(modules, shapes["states"], strict=True):
        traced = closed.out_avals[start : start + n]
        new = outs[start : start + n]
        start += n
        module = (args if where == "a" else kwargs)[key]
        _write_back(module, tree, new, traced)
    return result


def _nnx_state(module: Any) -> Any:
    from flax import nnx

    return nnx.state(module)


def _write_back(module: Any, tree: Any, new: list[Any], traced: list[Any]) -> None:
    """Update ``module`` with the state ``fun`` left in its traced copy, each leaf in
    its traced dtype; untouched if nothing changed (no trace-level mutation)."""
    from flax import nnx

    old = jax.tree.leaves(nnx.state(module))
    if all(n is o for n, o in zip(new, old, strict=True)):
        return
    fixed = [
        cast(n, np.dtype(a.dtype)) if is_castable(dtype_of(n)) else n
        for n, a in zip(new, traced, strict=True)
    ]
    nnx.update(module, jax.tree.unflatten(tree, fixed))
